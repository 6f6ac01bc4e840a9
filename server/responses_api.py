"""`POST /v1/responses` (OpenAI's Responses API) and `GET /v1/responses/{id}`, over the chat route's pieces.

A Responses request is turned into the chat request it means (`chat_request`): `instructions` becomes a
system message first, input items become chat messages (a `function_call` an assistant's tool call, a
`function_call_output` a tool message), the flat function tools and `tool_choice` chat's nested ones,
`text.format` a `response_format`. From there it goes the way of /v1/chat/completions: tool calling and its
grammar (`tools.py`), structured output (`structured.py`), the chat template and sampling parameters
(`prompts.py`), admission (`admission.py`), the engine streams (`streaming.py`). Chat's `ChatFormat` reads
the output into text and tool calls, and `responses_output.py` shapes them as Responses items and events.
Errors from those pieces are renamed to the Responses fields (`messages` -> `input`, `response_format` ->
`text.format`).

`store` (OpenAI's default: true) keeps a response in the server's memory: the last `MAX_STORED_RESPONSES`,
the least recently used dropped first, all forgotten at a restart. `previous_response_id` puts a stored
response's conversation (its input, without its instructions, as OpenAI does, and its output) before the
new input; an id the server does not hold is a 404, as in vLLM.
"""

from __future__ import annotations

import collections
import json
import time

from fastapi import APIRouter, Request
from pydantic import TypeAdapter, ValidationError

from server import prompts as edge
from server.admission import ServerState, submit
from server.errors import APIError
from server.protocol import (ChatCompletionRequest, ChatContentPart, ChatMessage, FunctionCall, FunctionDefinition,
                             JsonSchemaFormat, NamedFunction, NamedToolChoice, ResponseFormat, Tool, ToolCall)
from server.responses import ChatFormat
from server.responses_output import ResponseBuilder, cached_tokens, event_stream, new_item_id, whole
from server.responses_protocol import (RESPONSES_REFUSED, FunctionCallItem, FunctionCallOutputItem,
                                       FunctionToolChoice, InputItem, MessageItem, ResponsesRequest)
from server.streaming import collect, submission_stream
from server.tools import chat_constraint, tool_calling

MAX_STORED_RESPONSES = 512
OUTPUT_ITEMS = TypeAdapter(list[InputItem])  # a stored response's output, read back as input
# chat's field names in the errors of the pieces the route shares with /v1/chat/completions
CHAT_PARAMS = {"response_format": "text.format", "max_tokens": "max_output_tokens"}  # and messages[...] -> input


class ResponseStore:
    """Stored responses and their conversations, the last `capacity` of them (least recently used out first)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: collections.OrderedDict[str, tuple[dict, list[ChatMessage]]] = collections.OrderedDict()

    def put(self, response: dict, conversation: list[ChatMessage]) -> None:
        self.entries[response["id"]] = (response, conversation)
        self.entries.move_to_end(response["id"])
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def get(self, response_id: str, param: str | None) -> tuple[dict, list[ChatMessage]]:
        if response_id not in self.entries:
            raise APIError(404, f"Response with id '{response_id}' not found.", param)
        self.entries.move_to_end(response_id)
        return self.entries[response_id]


def responses_router(state: ServerState, tool_call_parser: str | None) -> APIRouter:
    """The Responses routes; `tool_call_parser` as create_app's (tool_choice "auto" needs it)."""
    router = APIRouter()
    store = ResponseStore(MAX_STORED_RESPONSES)

    @router.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request):
        received = time.monotonic()
        lora = edge.check_model(state, body.model)
        for name, why in RESPONSES_REFUSED.items():
            if getattr(body, name) is not None:
                raise APIError(400, f"{name} is not supported by jaxserve ({why})", name)
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
        history = store.get(body.previous_response_id, "previous_response_id")[1] if body.previous_response_id else []
        conversation = history + input_messages(body.input)
        chat = chat_request(body, conversation)
        try:
            calling = tool_calling(chat, tool_call_parser, state.tokenizer)
            constraint = await chat_constraint(state, chat, calling)
            params = edge.sampling_params(chat, chat.max_tokens, None, constraint and constraint.params,
                                          show_special_tokens=bool(calling and calling.parser
                                                                   and calling.parser.show_special_tokens),
                                          defaults=state.sampling_defaults)
            ids = await edge.chat_prompt_ids(state, chat.messages, True, False, calling and calling.tools)
            edge.check_context(state, len(ids), chat.max_tokens, "input")
        except APIError as e:
            raise renamed(e) from None
        fmt = ChatFormat(state.tokenizer, 1, None, calling)
        builder = ResponseBuilder(response_header(body, state.loras.model_name(lora)))

        def on_done(response: dict) -> None:
            if body.store:
                output = OUTPUT_ITEMS.validate_python(response["output"])
                store.put(response, conversation + input_messages(output, check_arguments=False))

        submission = submit(state, [ids], params, body.priority, lora, received)
        try:
            if body.stream:
                return submission_stream(event_stream(state, submission, builder, fmt, len(ids), on_done), submission)
            results = await collect(state, submission, raw)
        except BaseException:
            submission.close()
            raise
        response = whole(builder, fmt, results[0], len(ids), cached_tokens(submission))
        on_done(response)
        return response

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return store.get(response_id, None)[0]

    return router


def input_messages(items: list, check_arguments: bool = True) -> list[ChatMessage]:
    """The input as chat messages: a model's consecutive calls join one assistant message (after its text).
    `check_arguments`: a call's arguments must be JSON text (a stored output's call may have been cut)."""
    messages: list[ChatMessage] = []
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=item.role, content=text_of(item.content)))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=text_of(item.output)))
        else:
            assert isinstance(item, FunctionCallItem), item
            try:
                if check_arguments:
                    json.loads(edge.check_text(item.arguments, f"input[{i}].arguments"))
            except ValueError:
                raise APIError(400, f"input[{i}].arguments is not JSON text", f"input[{i}].arguments") from None
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if messages and messages[-1].role == "assistant":
                messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
    return messages


def text_of(content) -> str | list[ChatContentPart]:
    return content if isinstance(content, str) else [ChatContentPart(text=part.text) for part in content]


def chat_request(body: ResponsesRequest, conversation: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request that `body` means, with `conversation` after its instructions."""
    system = [ChatMessage(role="system", content=body.instructions)] if body.instructions is not None else []
    tools = [Tool(type="function", function=FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict))
        for tool in body.tools or []]
    choice = body.tool_choice
    if isinstance(choice, FunctionToolChoice):
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    text_format = body.text and body.text.format
    # a forced call (required, named) writes no text to format: its grammar is the tools' alone
    forced = bool(tools) and (choice == "required" or isinstance(choice, NamedToolChoice))
    response_format = None
    if text_format is not None and not forced:
        json_schema = None
        if text_format.type == "json_schema":
            if text_format.name is None or text_format.schema_ is None:
                raise APIError(400, "text.format of type json_schema needs a name and a schema", "text.format")
            json_schema = JsonSchemaFormat(name=text_format.name, description=text_format.description,
                                           schema=text_format.schema_, strict=text_format.strict)
        response_format = ResponseFormat(type=text_format.type, json_schema=json_schema)
    sampling = {name: getattr(body, name) for name in (
        "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "priority")}
    try:
        return ChatCompletionRequest(messages=system + conversation, max_tokens=body.max_output_tokens,
                                     tools=tools or None, tool_choice=choice,
                                     parallel_tool_calls=body.parallel_tool_calls, response_format=response_format,
                                     **sampling)
    except ValidationError as e:  # what the Responses fields allow and chat's do not
        error = e.errors()[0]
        raise APIError(400, f"{'.'.join(map(str, error['loc']))}: {error['msg']}", "input") from None


def renamed(e: APIError) -> APIError:
    """An error of the chat pieces, with the Responses names of its fields."""
    message = e.message.replace("response_format", "text.format").replace(".function.", ".")
    param = "input" if e.param and e.param.startswith("messages") else CHAT_PARAMS.get(e.param, e.param)
    return APIError(e.status, message, param, e.headers)


def response_header(body: ResponsesRequest, model: str) -> dict:
    """The response's fields that generating it does not change: its id and the request's settings."""
    tool_choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
    text_format = (body.text and body.text.format) or None
    return {
        "id": new_item_id("resp"), "object": "response", "created_at": int(time.time()), "model": model,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
        "temperature": body.temperature, "top_p": body.top_p,
        "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
        "tools": [tool.model_dump() for tool in body.tools or []],
        "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format else {"type": "text"}},
        "truncation": "disabled", "store": body.store, "background": False, "metadata": body.metadata or {},
        "user": body.user, "error": None, "incomplete_details": None,
    }
