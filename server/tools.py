"""Tool calling on /v1/chat/completions: what a request's `tools` and `tool_choice` ask for, checked at the edge.

`tool_calling` validates the tool definitions and picks the mode. "none": the tools are only rendered into
the prompt. "auto": the model writes calls in its own format, read by the server's `--tool-call-parser`
(`tool_parsers.py`; without `--enable-auto-tool-choice` it is a 400, as in vLLM). "required" and a named
function are held to a grammar, as vLLM builds it: for "required", a JSON array of
`{"name": <one function>, "parameters": <its schema>}` objects (at most one with parallel_tool_calls
false); for a named function, its parameter schema, which is the call's arguments. `RequiredReader` and
`NamedReader` turn that output into OpenAI's tool calls, streamed as it is generated: a call's id and name
as soon as its name is complete, then its arguments as they come.
"""

from __future__ import annotations

import copy
import dataclasses
import json

from jaxserve.config.sampling_params import StructuredOutputsParams
from server.errors import APIError
from server.protocol import ChatCompletionRequest, NamedToolChoice
from server.structured import Constraint, compile_constraint, requested_constraint
from server.tool_parsers import PARSERS, AutoReader, ToolParser, new_call_id

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclasses.dataclass
class ToolCalling:
    """A request's tool calling: `choice` is "none", "auto", "required" or "named"."""

    choice: str
    tools: list[dict]  # as the chat template takes them
    name: str | None = None  # the named function
    parser: ToolParser | None = None  # "auto"
    parallel: bool = True
    constraint: Constraint | None = None  # "required" and "named": the grammar, from field "tools"

    def reader(self):
        if self.choice == "required":
            return RequiredReader()
        if self.choice == "named":
            return NamedReader(self.name)
        if self.choice == "auto":
            return AutoReader(self.parser)
        return None


def tool_calling(body: ChatCompletionRequest, tool_call_parser: str | None, tokenizer) -> ToolCalling | None:
    """The request's tool calling, or None when it gives no tools; a bad definition or choice is a 400."""
    tools, choice = body.tools or [], body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools: give the functions the model may call", "tool_choice")
        return None
    names = [tool.function.name for tool in tools]
    for i, tool in enumerate(tools):
        if names.index(tool.function.name) != i:
            raise APIError(400, f"tools[{i}].function.name {tool.function.name!r} is also the name of "
                                f"tools[{names.index(tool.function.name)}]; names must differ", "tools")
        schema_type = (tool.function.parameters or {}).get("type", "object")
        if schema_type != "object":
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema of type 'object' (the "
                                f"arguments), got type {schema_type!r}", "tools")
    calling = ToolCalling("auto" if choice is None else "named" if isinstance(choice, NamedToolChoice) else choice,
                          [tool.model_dump(exclude_none=True) for tool in tools], parallel=body.parallel_tool_calls)
    if calling.choice == "auto":
        if tool_call_parser is None:
            raise APIError(400, AUTO_NEEDS_FLAGS, "tool_choice")
        calling.parser = PARSERS[tool_call_parser](tokenizer)
    elif calling.choice == "named":
        calling.name = choice.function.name
        if calling.name not in names:
            raise APIError(400, f"tool_choice names the function {calling.name!r}, which is not in tools "
                                f"({', '.join(map(repr, names))})", "tool_choice")
        schema = tools[names.index(calling.name)].function.parameters or {"type": "object", "properties": {}}
        calling.constraint = Constraint(StructuredOutputsParams(json=schema), "tools")
    elif calling.choice == "required":
        calling.constraint = Constraint(StructuredOutputsParams(json=required_schema(body)), "tools")
    return calling


async def chat_constraint(state, body: ChatCompletionRequest, calling: ToolCalling | None) -> Constraint | None:
    """The grammar a chat request is held to, compiled: its structured output, or its required or named
    tool calls' (a bad function schema named alone first). Both at once is a 400."""
    constraint = requested_constraint(body)
    if calling is not None and calling.constraint is not None:
        if constraint is not None:
            raise APIError(400, f"{constraint.field} cannot be combined with tool_choice {calling.choice!r}, which "
                                "holds the output to the tools' schemas", constraint.field)
        for where, parameters in parameter_constraints(body, calling):
            await compile_constraint(state, parameters, where)
        constraint = calling.constraint
    if constraint is not None:
        await compile_constraint(state, constraint)
    return constraint


def parameter_constraints(body: ChatCompletionRequest, calling: ToolCalling) -> list[tuple[str, Constraint]]:
    """Each function's parameter schema that the grammar will hold, with its place in the request, so that
    a bad one is named alone before the whole grammar is compiled."""
    if calling.choice not in ("required", "named"):
        return []
    return [(f"tools[{i}].function.parameters", Constraint(StructuredOutputsParams(json=tool.function.parameters),
                                                           "tools"))
            for i, tool in enumerate(body.tools)
            if tool.function.parameters and (calling.choice == "required" or tool.function.name == calling.name)]


def required_schema(body: ChatCompletionRequest) -> dict:
    """vLLM's schema for tool_choice="required": an array of calls, each one function's name and parameters.
    Each function's `$defs` move to the root, where their `$ref`s (#/$defs/...) point once nested."""
    items, defs = [], {}
    for i, tool in enumerate(body.tools):
        parameters = copy.deepcopy(tool.function.parameters) or {"type": "object", "properties": {}}
        shared = parameters.pop("$defs", {})
        if not isinstance(shared, dict):
            raise APIError(400, f"tools[{i}].function.parameters.$defs must be an object of schemas", "tools")
        for name, schema in shared.items():
            if defs.setdefault(name, schema) != schema:
                raise APIError(400, f"tools[{i}].function.parameters defines $defs/{name} differently from an "
                                    f"earlier tool; one request's tools must agree on shared definitions", "tools")
        items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                                       "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class NamedReader:
    """tool_choice naming a function: the whole output is that call's arguments."""

    def __init__(self, name: str):
        self.calls = [{"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": ""}}]
        self.header_sent = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.calls[0]["function"]["arguments"] += text
        if not self.header_sent:
            self.header_sent = True
            call = self.calls[0]
            return "", [{"index": 0, "id": call["id"], "type": "function",
                         "function": {"name": call["function"]["name"], "arguments": text}}]
        return "", [{"index": 0, "function": {"arguments": text}}] if text else []

    def finish(self) -> tuple[str, list[dict]]:
        return self.feed("") if not self.header_sent else ("", [])


class RequiredReader:
    """tool_choice="required": reads `[{"name": ..., "parameters": {...}}, ...]` as it grows. A call is sent
    once its name is complete; its arguments are the raw text of its parameters, sent as it arrives."""

    def __init__(self):
        self.text = ""
        self.items: list[dict] = []  # per call: id, name, start/end of its parameters' text, sent chars
        self._depth, self._in_string, self._escape = 0, False, False
        self._state, self._key, self._start = "", None, 0  # in a call object (depth 2): key/colon/value/...

    @property
    def calls(self) -> list[dict]:
        return [{"id": item["id"], "type": "function", "function": {
            "name": item["name"], "arguments": self.text[item["start"]:item["end"]] if item["start"] is not None
            else ""}} for item in self._named()]

    def feed(self, text: str) -> tuple[str, list[dict]]:
        begin = len(self.text)
        self.text += text
        for i in range(begin, len(self.text)):
            self._step(i, self.text[i])
        return "", self._deltas()

    def finish(self) -> tuple[str, list[dict]]:
        """The rest of the calls; output that names no call is sent as content (it was never held to a grammar)."""
        if not self._named():
            return self.text, []
        return "", self._deltas(final=True)

    def _named(self) -> list[dict]:
        named = []
        for item in self.items:  # in order: a call's index must not skip one whose name is not known yet
            if item["name"] is None:
                break
            named.append(item)
        return named

    def _deltas(self, final: bool = False) -> list[dict]:
        limit = len(self.text) if final else len(self.text.rstrip())  # trailing space may end a number
        out = []
        for index, item in enumerate(self._named()):
            delta = {"index": index}
            if not item["sent_header"]:
                item["sent_header"] = True
                delta |= {"id": item["id"], "type": "function", "function": {"name": item["name"], "arguments": ""}}
            if item["start"] is not None:
                end = min(item["end"] if item["end"] is not None else limit, len(self.text))
                fragment = self.text[item["start"] + item["sent"]:end]
                if fragment:
                    item["sent"] += len(fragment)
                    delta.setdefault("function", {})["arguments"] = fragment
            if len(delta) > 1:
                out.append(delta)
        return out

    def _step(self, i: int, c: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if self._depth == 2 and self._state == "key":
                    self._key, self._state = json.loads(self.text[self._start:i + 1]), "colon"
                elif self._depth == 2 and self._state == "value":
                    self._value_done(i + 1)
            return
        if c in " \t\r\n":
            return
        if self._depth == 2 and self._state == "before_value":
            self._state, self._start = "value", i
            if self._key == "parameters":
                self.items[-1]["start"] = i
        if c == '"':
            self._in_string = True
            if self._depth == 2 and self._state == "key":
                self._start = i
        elif c in "[{":
            if self._depth == 1 and c == "{":
                self.items.append({"id": new_call_id(), "name": None, "start": None, "end": None, "sent": 0,
                                   "sent_header": False})
                self._state = "key"
            self._depth += 1
        elif c in "]}":
            if self._depth == 3 and self._state == "value":  # a container value closes
                self._value_done(i + 1)
            elif self._depth == 2 and self._state == "value":  # a number or literal ends with its object
                self._value_done(i)
            self._depth -= 1
        elif self._depth == 2 and c == ":":
            self._state = "before_value"
        elif self._depth == 2 and c == ",":
            if self._state == "value":
                self._value_done(i)
            self._state = "key"

    def _value_done(self, end: int) -> None:
        text = self.text[self._start:end].rstrip()
        if self._key == "parameters":
            self.items[-1]["end"] = self._start + len(text)
        elif self._key == "name":
            try:
                name = json.loads(text)
            except ValueError:
                name = None
            self.items[-1]["name"] = name if isinstance(name, str) and name else None
        self._state = "after_value"
