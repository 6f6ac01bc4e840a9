"""Tool calls in a model's own words (`tool_choice="auto"`): parsers of the formats models write them in.

`--tool-call-parser NAME` picks one (vLLM's names): `hermes` (`<tool_call>{"name", "arguments"}</tool_call>`,
as Hermes and Qwen write them), `llama3_json` (`{"name", "parameters"}` objects separated by `;`, optionally
after `<|python_tag|>`), `mistral` (`[TOOL_CALLS][{"name", "arguments"}, ...]`, or `[TOOL_CALLS]name[ARGS]{...}`
as later Mistral tokenizers write it). A parser turns a whole output into its content (the text before the
first call) and its calls; output that does not parse as calls stays content, whole, as in vLLM.
`AutoReader` does the same to a stream: it sends content until a call may be starting, then holds the
text back and sends each call when it is complete (hermes: at its closing tag; the others: at the end).
"""

from __future__ import annotations

import json
import uuid


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def function_call(name: str, arguments) -> dict:
    """One call in OpenAI's shape; `arguments` as JSON text."""
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call needs a name")
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": text}}


class ToolParser:
    """A model's tool-call format. `markers`: text that starts the calls; `show_special_tokens`: the
    markers are special tokens, so the request is decoded with them (vLLM's adjust_request)."""

    markers: tuple[str, ...] = ()

    def __init__(self, tokenizer):
        special = set(getattr(tokenizer, "all_special_tokens", ()) or ())
        for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
            if getattr(token, "special", False):
                special.add(str(token))
        self.show_special_tokens = any(m in special for m in self.markers)
        eos = getattr(tokenizer, "eos_token", None)
        self.hidden = (eos,) if self.show_special_tokens and eos else ()  # texts of tokens the client never sees

    def call_start(self, text: str) -> int | None:
        """Where the calls start in `text`, or None."""
        found = [i for m in self.markers if (i := text.find(m)) >= 0]
        return min(found) if found else None

    def held_from(self, text: str) -> int:
        """Text from here on may still become a marker: it is not sent as content yet."""
        longest = max((len(m) for m in (*self.markers, *self.hidden)), default=1) - 1
        for start in range(max(0, len(text) - longest), len(text)):
            tail = text[start:]
            if any(m.startswith(tail) for m in (*self.markers, *self.hidden)):
                return start
        return len(text)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, calls) of a whole output; content is None when only calls were written."""
        for hidden in self.hidden:
            text = text.replace(hidden, "")
        start = self.call_start(text)
        if start is None:
            return text, []
        try:
            calls = self.parse_calls(text[start:])
        except (ValueError, KeyError, TypeError, AttributeError):  # not calls after all: the text stays content
            return text, []
        if not calls:
            return text, []
        return text[:start] or None, calls

    def parse_calls(self, text: str) -> list[dict]:
        """The calls in `text`, which starts where `call_start` said; raises ValueError if it holds none."""
        raise NotImplementedError

    def complete_calls(self, text: str) -> list[dict]:
        """The calls in the text so far (from `call_start`) that are already complete; [] = wait for the end."""
        return []


class HermesParser(ToolParser):
    markers = ("<tool_call>",)
    END = "</tool_call>"

    def parse_calls(self, text: str) -> list[dict]:
        calls = []
        for part in text.split(self.markers[0])[1:]:
            body = part.split(self.END, 1)[0].strip()
            obj = json.loads(body)
            calls.append(function_call(obj["name"], obj.get("arguments", {})))
        return calls

    def complete_calls(self, text: str) -> list[dict]:
        closed = text[:text.rfind(self.END) + len(self.END)] if self.END in text else ""
        try:
            return self.parse_calls(closed) if closed else []
        except (ValueError, KeyError, TypeError, AttributeError):
            return []


class Llama3JsonParser(ToolParser):
    markers = ("<|python_tag|>",)

    def call_start(self, text: str) -> int | None:
        tag = super().call_start(text)
        if tag is not None:
            return tag
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("{") else None

    def held_from(self, text: str) -> int:
        return 0 if not text.strip() else super().held_from(text)  # the output may still open with "{"

    def parse_calls(self, text: str) -> list[dict]:
        text = text.removeprefix(self.markers[0])
        decoder, calls, i = json.JSONDecoder(), [], 0
        while True:
            i = len(text) - len(text[i:].lstrip())
            obj, i = decoder.raw_decode(text, i)
            args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
            calls.append(function_call(obj["name"], args))
            rest = text[i:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):
                raise ValueError("text after a tool call")
            i = len(text) - len(rest) + 1


class MistralParser(ToolParser):
    markers = ("[TOOL_CALLS]",)
    ARGS = "[ARGS]"

    def parse_calls(self, text: str) -> list[dict]:
        calls, decoder = [], json.JSONDecoder()
        for part in text.split(self.markers[0])[1:]:
            part = part.strip()
            if part.startswith("["):  # [{"name": ..., "arguments": ...}, ...]
                items, _ = decoder.raw_decode(part)
                calls += [function_call(item["name"], item.get("arguments", {})) for item in items]
                continue
            name, sep, args = part.partition(self.ARGS)
            if not sep:  # name{...}
                name, args = part[:part.index("{")], part[part.index("{"):]
            arguments, _ = decoder.raw_decode(args.strip())
            calls.append(function_call(name.strip(), arguments))
        return calls


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}


class AutoReader:
    """One choice's output under tool_choice="auto", as stream deltas: content, then calls."""

    def __init__(self, parser: ToolParser):
        self.parser, self.text = parser, ""
        self.num_content_sent = 0  # characters of `text` sent as content
        self.start: int | None = None  # where the calls start, once seen
        self.calls: list[dict] = []  # calls sent

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """New content to send and new complete calls, after `text` more output."""
        self.text += text
        if self.start is None:
            self.start = self.parser.call_start(self.text)
            end = self.start if self.start is not None else self.parser.held_from(self.text)
            content = self._content(end)
            if self.start is None:
                return content, []
            return content, self._new(self.parser.complete_calls(self.text[self.start:]))
        return "", self._new(self.parser.complete_calls(self.text[self.start:]))

    def finish(self) -> tuple[str, list[dict]]:
        """What is still held back when the output ends: the remaining calls, or the text as content."""
        _, calls = self.parser.parse(self.text)
        if calls:
            return "", self._new(calls)
        if self.calls:  # calls already sent; what follows them is not content
            return "", []
        return self._content(len(self.text)), []

    def _content(self, end: int) -> str:
        content = self.text[self.num_content_sent:end]
        self.num_content_sent = max(self.num_content_sent, end)
        for hidden in self.parser.hidden:
            content = content.replace(hidden, "")
        return content

    def _new(self, calls: list[dict]) -> list[dict]:
        """Calls not sent yet, as stream deltas (each whole in one)."""
        new = calls[len(self.calls):]
        self.calls += new
        return [{"index": len(self.calls) - len(new) + k, **call} for k, call in enumerate(new)]
