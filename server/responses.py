"""The OpenAI response shapes of the two generation endpoints, whole and as stream chunks.

One `ChoiceFormat` per endpoint says how a choice looks: its opening chunk (the echoed prompt, the
assistant role), a chunk for a stream delta, a whole choice for a finished result, and its logprobs.
Everything else about a response (ids, usage, the chunk envelope) is shared, so both endpoints go
through one streaming path (`streaming.py`).
"""

from __future__ import annotations

import time
import uuid

from jaxserve.core.engine_loop import StreamDelta


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Result:
    """One choice's output so far: the deltas of its stream added up."""

    def __init__(self):
        self.text, self.token_ids, self.logprobs = "", [], []
        self.finish_reason, self.stop_reason = None, None

    def add(self, delta: StreamDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.new_token_ids
        self.logprobs += delta.logprobs or []
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


def usage(prompts: list[list[int]], results: list[Result]) -> dict:
    """Each prompt counts once, however many choices (n) share it, as in vLLM."""
    prompt_tokens = sum(len(ids) for ids in prompts)
    completion_tokens = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ChoiceFormat:
    """How one endpoint shapes its choices; `kind` and `chunk_kind` are the response objects' names."""

    kind: str
    chunk_kind: str
    id_prefix: str

    def __init__(self, tokenizer, num_choices: int):
        self.tokenizer = tokenizer
        self.num_choices = num_choices

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def envelope(self, rid: str, created: int, model: str, choices: list[dict], usage: dict | None = None,
                 chunk: bool = False) -> dict:
        body = {"id": rid, "object": self.chunk_kind if chunk else self.kind, "created": created, "model": model,
                "choices": choices}
        if chunk or usage is not None:
            body["usage"] = usage
        return body

    def opening(self, index: int) -> dict | None:
        """A choice's first stream chunk, sent before any token, or None."""
        return None

    def delta_choice(self, index: int, delta: StreamDelta) -> dict | None:
        raise NotImplementedError

    def whole_choice(self, index: int, result: Result) -> dict:
        raise NotImplementedError


class CompletionFormat(ChoiceFormat):
    kind = chunk_kind = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, tokenizer, num_choices: int, echo: list[str], n: int, num_logprobs: int | None):
        super().__init__(tokenizer, num_choices)
        self.echo, self.n, self.num_logprobs = echo, n, num_logprobs
        self.offsets = [0] * num_choices  # text_offset of each choice's next token

    def opening(self, index: int) -> dict | None:
        echo = self.echo[index // self.n]
        return {"index": index, "text": echo, "logprobs": None, "finish_reason": None} if echo else None

    def delta_choice(self, index: int, delta: StreamDelta) -> dict | None:
        if not (delta.text or delta.finish_reason or delta.logprobs):
            return None
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = self.logprobs(delta.logprobs or [], self.offsets[index])
            self.offsets[index] += sum(len(t) for t in logprobs["tokens"])
        return {"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason}

    def whole_choice(self, index: int, result: Result) -> dict:
        logprobs = self.logprobs(result.logprobs, 0) if self.num_logprobs is not None else None
        return {"index": index, "text": self.echo[index // self.n] + result.text, "logprobs": logprobs,
                "finish_reason": result.finish_reason, "stop_reason": result.stop_reason}

    def logprobs(self, entries: list[dict[int, float]], offset: int) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for entry in entries:
            (token, logprob), *_ = entry.items()
            text = self.token_text(token)
            offsets.append(offset)
            offset += len(text)
            tokens.append(text)
            token_logprobs.append(logprob)
            top.append({self.token_text(t): lp for t, lp in entry.items()})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


class ChatFormat(ChoiceFormat):
    """Chat choices; with tool calling (`tools.ToolCalling`), each choice's output goes through a reader
    that splits it into content and `tool_calls`."""

    kind, chunk_kind = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, tokenizer, num_choices: int, num_top_logprobs: int | None, tool_calling=None):
        super().__init__(tokenizer, num_choices)
        self.num_top = num_top_logprobs  # None: no logprobs
        self.tool_calling = tool_calling if tool_calling is not None and tool_calling.choice != "none" else None
        self.readers = [self.tool_calling.reader() for _ in range(num_choices)] if self.tool_calling else None

    def opening(self, index: int) -> dict | None:
        # a required or named call has no content at all
        content = None if self.tool_calling and self.tool_calling.choice in ("required", "named") else ""
        return {"index": index, "delta": {"role": "assistant", "content": content}, "logprobs": None,
                "finish_reason": None}

    def delta_choice(self, index: int, delta: StreamDelta) -> dict | None:
        content, calls, finish_reason = delta.text, [], delta.finish_reason
        if self.readers is not None:
            reader = self.readers[index]
            content, calls = reader.feed(delta.text)
            if finish_reason is not None:
                more_content, more_calls = reader.finish()
                content, calls = content + more_content, calls + more_calls
                finish_reason = self._finish_reason(reader, finish_reason)
            calls = [call for call in calls if self.tool_calling.parallel or call["index"] == 0]
        if not (content or calls or finish_reason or delta.logprobs):
            return None
        logprobs = self.logprobs(delta.logprobs or []) if self.num_top is not None else None
        message = ({"content": content} if content else {}) | ({"tool_calls": calls} if calls else {})
        return {"index": index, "delta": message, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": delta.stop_reason}

    def whole_choice(self, index: int, result: Result) -> dict:
        logprobs = self.logprobs(result.logprobs) if self.num_top is not None else None
        message, finish_reason = {"role": "assistant", "content": result.text}, result.finish_reason
        if self.readers is not None:
            reader = self.readers[index]
            content, _ = reader.feed(result.text)
            content += reader.finish()[0]
            calls = reader.calls if self.tool_calling.parallel else reader.calls[:1]
            message = {"role": "assistant", "content": content or None}
            if calls:
                message["tool_calls"] = calls
            finish_reason = self._finish_reason(reader, finish_reason)
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": result.stop_reason}

    @staticmethod
    def _finish_reason(reader, finish_reason: str | None) -> str | None:
        """A generation that ended by itself after calls ends with "tool_calls", as OpenAI's; one cut at
        max_tokens keeps "length" (its last call's arguments are cut too)."""
        return "tool_calls" if reader.calls and finish_reason == "stop" else finish_reason

    def logprobs(self, entries: list[dict[int, float]]) -> dict:
        content = []
        for entry in entries:
            (token, logprob), *_ = entry.items()
            text = self.token_text(token)
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:self.num_top]
            content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()),
                            "top_logprobs": [{"token": (t := self.token_text(tid)), "logprob": lp,
                                              "bytes": list(t.encode())} for tid, lp in ranked]})
        return {"content": content}


def whole_response(fmt: ChoiceFormat, model: str, results: list[Result], prompts: list[list[int]]) -> dict:
    choices = [fmt.whole_choice(i, r) for i, r in enumerate(results)]
    return fmt.envelope(new_id(fmt.id_prefix), int(time.time()), model, choices, usage(prompts, results))
