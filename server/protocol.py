"""The OpenAI request bodies (and vLLM's extra sampling fields), as pydantic models.

These models are the server's input contract and the source of `/openapi.json`. Ranges that
pydantic can check are declared here; the rest (token ids vs the vocabulary, context length, schemas
and grammars) is checked in `prompts.py`, `structured.py` and `tools.py` against the loaded model.
Responses are built as plain dicts in `responses.py`.

Every model forbids fields it does not declare: a field that would change the output and is not
honoured must not pass silently. `ACCEPTED_WITHOUT_EFFECT` fields are declared because they change
no output; `REFUSED` names OpenAI's and vLLM's fields that jaxserve knows and does not honour, so that
their 400 says why (`errors.py`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

NonEmptyTokens = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Prompt = str | list[str] | NonEmptyTokens | list[NonEmptyTokens]

ACCEPTED_WITHOUT_EFFECT = ("user", "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
                           "prompt_cache_options", "safety_identifier")
REFUSED = {
    "functions": "use tools", "function_call": "use tool_choice", "audio": "jaxserve outputs text only",
    "prediction": "predicted outputs are not supported", "web_search_options": "jaxserve has no web search",
    "reasoning_effort": "the models jaxserve serves take no reasoning effort", "verbosity": "not supported",
    "moderation": "jaxserve does not moderate", "structural_tag": "not supported", "chat_template_kwargs": "not supported",
    "use_beam_search": "beam search is not supported",
}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted without effect: jaxserve pads no chunks


class JsonSchemaFormat(Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # a schema is always held to (OpenAI's strict=true)


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None


class SamplingFields(Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=0, lt=2**32)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    response_format: ResponseFormat | None = None
    # accepted without effect (ACCEPTED_WITHOUT_EFFECT)
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    # SGLang's fields, which sglang-router (and vllm-router) write into every body they forward: accepted
    # at the values that change nothing here (no reasoning parser, no hidden states), refused at others
    no_stop_trim: Literal[False] | None = None
    return_hidden_states: Literal[False] | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    include_reasoning: bool | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    # vLLM's structured output, new and old names (structured.py maps them)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # only llguidance's names: every grammar is compiled with it
    guided_whitespace_pattern: str | None = None


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: the prompt alone (app.py)
    logprobs: int | None = Field(None, ge=0, le=20)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's: per prompt token, its logprob and the top ones
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=1)  # one candidate per choice, as n asks


class ChatContentPart(Strict):
    type: Literal["text"] = "text"
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # Sent back empty by clients that append the SDK's message object to the conversation.
    refusal: None = None
    annotations: Annotated[list, Field(max_length=0)] | None = None
    audio: None = None
    function_call: None = None


class FunctionDefinition(Strict):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # required and named calls are always held to the schema; auto ones never


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's: per prompt token, its logprob and the top ones
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    modalities: list[Literal["text"]] | None = None


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
