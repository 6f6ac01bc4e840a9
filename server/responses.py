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


MIN_LOGPROB = -9999.0  # what -inf is written as (JSON has no infinity), as vLLM and OpenAI do


class Result:
    """One choice's output so far: the deltas of its stream added up."""

    def __init__(self):
        self.text, self.token_ids, self.logprobs = "", [], []
        self.finish_reason, self.stop_reason = None, None
        self.prompt_logprobs = None  # the engine's (Request.prompt_logprobs), when requested

    def add(self, delta: StreamDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.new_token_ids
        self.logprobs += delta.logprobs or []
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs


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

    def prompt_logprobs(self, entries: list | None) -> list | None:
        """vLLM's `prompt_logprobs`: per prompt token null (the first), else {token id: {logprob, rank,
        decoded_token}}, the prompt's token first."""
        if entries is None:
            return None
        return [None if entry is None else {
            str(token): {"logprob": max(lp.logprob, MIN_LOGPROB), "rank": lp.rank, "decoded_token": self.token_text(token)}
            for token, lp in entry.items()} for entry in entries]

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
    """Completion choices. echo: each prompt's text, prepended to its choices' text ("" without echo); with
    logprobs too, a choice's logprobs cover its prompt's tokens (`prompts`), then its own (the legacy
    completions shape that lm-evaluation-harness reads: the first prompt token's logprob null).
    echo_only (echo with max_tokens 0): the prompt alone, finish_reason "length"."""

    kind = chunk_kind = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, tokenizer, num_choices: int, echo: list[str], n: int, num_logprobs: int | None,
                 prompts: list[list[int]] | None = None, echo_only: bool = False):
        super().__init__(tokenizer, num_choices)
        self.echo, self.n, self.num_logprobs = echo, n, num_logprobs
        self.prompts, self.echo_only = prompts, echo_only
        self.offsets = [0] * num_choices  # text_offset of each choice's next token
        self.echoed = [False] * num_choices  # streams: the prompt's text (and logprobs) went out

    @property
    def echoes_logprobs(self) -> bool:
        return any(self.echo) and self.num_logprobs is not None

    def opening(self, index: int) -> dict | None:
        echo = self.echo[index // self.n]
        if not echo or self.echoes_logprobs:  # echoed logprobs wait for the first delta, which brings them
            return None
        self.echoed[index] = True
        return {"index": index, "text": echo, "logprobs": None, "finish_reason": None}

    def delta_choice(self, index: int, delta: StreamDelta) -> dict | None:
        text, entries, finish_reason = delta.text, delta.logprobs or [], delta.finish_reason
        if self.echo_only:
            text, entries, finish_reason = "", [], "length" if finish_reason is not None else None
        prompt_part = None
        if self.echo[index // self.n] and not self.echoed[index]:
            self.echoed[index] = True
            text, prompt_part = self.echo[index // self.n] + text, delta.prompt_logprobs
        if not (text or finish_reason or entries):
            return None
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = self.logprobs(entries, self.offsets[index], self._prompt_part(index, prompt_part))
            self.offsets[index] += sum(len(t) for t in logprobs["tokens"])
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": None if self.echo_only else delta.stop_reason}

    def whole_choice(self, index: int, result: Result) -> dict:
        own = [] if self.echo_only else result.logprobs
        logprobs = None
        if self.num_logprobs is not None:
            prompt_part = self._prompt_part(index, result.prompt_logprobs) if self.echo[index // self.n] else None
            logprobs = self.logprobs(own, 0, prompt_part)
        choice = {"index": index, "text": self.echo[index // self.n] + ("" if self.echo_only else result.text),
                  "logprobs": logprobs, "finish_reason": "length" if self.echo_only else result.finish_reason,
                  "stop_reason": None if self.echo_only else result.stop_reason}
        if result.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs(result.prompt_logprobs)
        return choice

    def _prompt_part(self, index: int, entries: list | None) -> list[tuple[int, dict[int, float] | None]] | None:
        """(token, {token: logprob}) per prompt token of the choice, for its echoed logprobs: the prompt's
        token and the top `num_logprobs` (the engine computed max(prompt_logprobs, logprobs) of them)."""
        if entries is None:
            return None
        return [(token, None if entry is None else {
            t: lp.logprob for j, (t, lp) in enumerate(entry.items()) if j == 0 or lp.rank <= self.num_logprobs})
            for token, entry in zip(self.prompts[index // self.n], entries)]

    def logprobs(self, entries: list[dict[int, float]], offset: int,
                 prompt_part: list[tuple[int, dict[int, float] | None]] | None = None) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token, entry in [*(prompt_part or []), *((next(iter(entry)), entry) for entry in entries)]:
            text = self.token_text(token)
            offsets.append(offset)
            offset += len(text)
            tokens.append(text)
            token_logprobs.append(None if entry is None else max(entry[token], MIN_LOGPROB))
            top.append(None if entry is None else {self.token_text(t): max(lp, MIN_LOGPROB) for t, lp in entry.items()})
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
    body = fmt.envelope(new_id(fmt.id_prefix), int(time.time()), model, choices, usage(prompts, results))
    if isinstance(fmt, ChatFormat) and results and results[0].prompt_logprobs is not None:
        body["prompt_logprobs"] = fmt.prompt_logprobs(results[0].prompt_logprobs)  # vLLM's: the response's
    return body
