"""The request body of `POST /v1/responses` (OpenAI's Responses API), as pydantic models.

As on the other routes (`protocol.py`), every model forbids fields it does not declare. The Responses
API's tools are flat (`{"type": "function", "name", "parameters"}`) and its input is a list of items:
messages, a model's earlier `function_call`s and their `function_call_output`s, as the openai SDK and the
OpenAI Agents SDK send a conversation back. `RESPONSES_REFUSED` names the fields jaxserve declares only to
say why it does not honour them; `responses_api.py` refuses them when they are given.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from server.protocol import Strict

RESPONSES_REFUSED = {
    "reasoning": "the models jaxserve serves take no reasoning settings",
    "conversation": "jaxserve keeps no conversations; send the input, or previous_response_id",
    "prompt": "jaxserve has no stored prompt templates; send the input",
    "top_logprobs": "the Responses API of jaxserve returns no logprobs; /v1/chat/completions does",
    "context_management": "not supported",
    "max_tool_calls": "jaxserve has no built-in tools",
}
Status = Literal["in_progress", "completed", "incomplete"]


class TextPart(Strict):
    """Text content: the client's (`input_text`) or a model's earlier output sent back (`output_text`)."""

    type: Literal["input_text", "output_text"]
    text: str
    # sent back with an output_text part as the SDK received it
    annotations: Annotated[list, Field(max_length=0)] | None = None
    logprobs: list | None = None


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: Status | None = None


class FunctionCallItem(Strict):
    """A call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str  # JSON text
    id: str | None = None
    status: Status | None = None


class FunctionCallOutputItem(Strict):
    """The result of a call, sent back by the client."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]
    id: str | None = None
    status: Status | None = None


def _item_kind(item: Any) -> str | None:
    """A message may leave out its type (OpenAI's EasyInputMessage)."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return kind if isinstance(kind, str) else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind, custom_error_type="input_item",
                  custom_error_message="an input item is a message, a function_call or a function_call_output"),
]


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # required and named calls are always held to the schema; auto ones never


class FunctionToolChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema's
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # a schema is always held to


class TextConfig(Strict):
    format: TextFormat | None = None


class ResponsesStreamOptions(Strict):
    include_obfuscation: bool | None = None  # accepted without effect: jaxserve pads no events


class ResponsesRequest(Strict):
    model: str | None = None
    input: Annotated[list[InputItem], Field(min_length=1)]  # or a string: one user message
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    store: bool = True  # kept in the server's memory, a bounded number of responses (responses_api.py)
    previous_response_id: str | None = None
    # accepted at the values that change nothing
    include: Annotated[list[str], Field(max_length=0)] | None = None  # no extra output data to include
    truncation: Literal["disabled"] | None = None  # an input over the context is a 400, never cut
    background: Literal[False] | None = None
    # accepted without effect
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**32)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    priority: int = 0
    # declared only to be refused with a reason (RESPONSES_REFUSED)
    reasoning: Any = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    context_management: Any = None
    max_tool_calls: Any = None

    @field_validator("input", mode="before", json_schema_input_type=str | list[InputItem])
    @classmethod
    def _text_input(cls, value: Any) -> Any:
        """A string input is one user message (so an error in an item is named by the item's place alone)."""
        return [{"role": "user", "content": value}] if isinstance(value, str) else value
