"""Structured output and tool calling over HTTP (issue 21), end to end: one real `jaxserve serve` of the
default model (SmolLM2-135M-Instruct, greedy) with `--enable-auto-tool-choice --tool-call-parser hermes`,
driven by the unmodified openai client. Every constrained output is checked against its schema with
`jsonschema` (or its regex / choices), streamed and whole; bad schemas, grammars and tool definitions are
400s naming the field, after which the server answers normally; unknown fields are 400s.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from server_helpers import run_server

pytestmark = pytest.mark.default_model

SERVER_ARGS = ["--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "128",
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 120}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Adds two integers", "strict": True,
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                                    "b": {"type": "integer", "minimum": -999, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population: int = Field(ge=0, le=100_000_000)  # bounded: an integer's digits could run to max_tokens


@pytest.fixture(scope="module")
def server():
    with run_server(SERVER_ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def chat(http, **body) -> httpx.Response:
    return http.post("/v1/chat/completions", json={**GREEDY, "messages": ASK_WEATHER, **body})


def assert_400(response: httpx.Response, param: str, *words: str) -> str:
    assert response.status_code == 400, (response.status_code, response.text)
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error["message"]


def assert_valid_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-"), call
        assert call.function.name in names, call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# ------------------------------------------------------------------------------------------------
# structured output


def test_parse_gives_the_pydantic_object(client):
    """`client.chat.completions.parse(response_format=<pydantic model>)` sends OpenAI's strict json_schema;
    the reply parses into the model."""
    out = client.chat.completions.parse(response_format=City, messages=[
        {"role": "user", "content": "Give the name, country and population of the capital of France."}], **GREEDY)
    city = out.choices[0].message.parsed
    assert isinstance(city, City), out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_validates(client, stream):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40},
                                               "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "What is the capital of Italy?"}]
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            messages=messages, response_format=fmt, stream=True, **GREEDY) if c.choices)
    else:
        text = client.chat.completions.create(messages=messages, response_format=fmt, **GREEDY).choices[0].message.content
    jsonschema.validate(json.loads(text), schema)


def test_response_format_json_object_is_an_object(client):
    out = client.chat.completions.create(response_format={"type": "json_object"}, messages=[
        {"role": "user", "content": "Give a person's name and age as a JSON object."}], **GREEDY)
    assert isinstance(json.loads(out.choices[0].message.content), dict), out.choices[0].message.content


@pytest.mark.parametrize("extra", [{"structured_outputs": {"regex": r"[A-Z][a-z]+, [0-9]{4}"}},
                                   {"guided_regex": r"[A-Z][a-z]+, [0-9]{4}"}])
def test_regex_via_extra_body(client, extra):
    out = client.chat.completions.create(messages=[{"role": "user", "content": "Name a city and a year."}],
                                         extra_body=extra, **GREEDY)
    assert re.fullmatch(r"[A-Z][a-z]+, [0-9]{4}", out.choices[0].message.content), out.choices[0].message.content


@pytest.mark.parametrize("extra", [{"structured_outputs": {"choice": ["sunny", "rainy", "snowy"]}},
                                   {"guided_choice": ["sunny", "rainy", "snowy"]}])
def test_choice_via_extra_body(client, extra):
    out = client.chat.completions.create(messages=ASK_WEATHER, extra_body=extra, **GREEDY)
    assert out.choices[0].message.content in ("sunny", "rainy", "snowy"), out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"


def test_completions_take_structured_output_too(client):
    out = client.completions.create(model=MODEL, prompt="The year the Eiffel Tower was built:", max_tokens=20,
                                    temperature=0, extra_body={"guided_regex": r" ?[0-9]{4}"})
    assert re.fullmatch(r" ?[0-9]{4}", out.choices[0].text), out.choices[0].text


# ------------------------------------------------------------------------------------------------
# tool calls


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_validate(client, parallel):
    out = client.chat.completions.create(messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=parallel, **GREEDY)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    assert_valid_calls(choice.message.tool_calls)
    if not parallel:
        assert len(choice.message.tool_calls) == 1


def test_required_tool_calls_stream_through_the_sdk_helper(client):
    """The openai SDK's `chat.completions.stream` assembles the streamed calls (and parses strict tools'
    arguments); they equal the whole response's."""
    whole = client.chat.completions.create(messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", **GREEDY)
    with client.chat.completions.stream(messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", **GREEDY) as s:
        events = [event.type for event in s]
        final = s.get_final_completion()
    assert "tool_calls.function.arguments.delta" in events
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message.tool_calls)
    assert [(c.function.name, c.function.parsed_arguments) for c in choice.message.tool_calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.choices[0].message.tool_calls]


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_arguments_validate(client, stream):
    choice = {"type": "function", "function": {"name": "add"}}
    messages = [{"role": "user", "content": "What is 2 plus 3?"}]
    if stream:
        with client.chat.completions.stream(messages=messages, tools=TOOLS, tool_choice=choice, **GREEDY) as s:
            out = s.get_final_completion()
    else:
        out = client.chat.completions.create(messages=messages, tools=TOOLS, tool_choice=choice, **GREEDY)
    assert out.choices[0].finish_reason == "tool_calls"
    calls = out.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "add"
    assert_valid_calls(calls, names=("add",))


def test_auto_answers_with_content_or_valid_calls(client):
    """With the hermes parser a greedy reply is either text or calls to the given tools, never a marker."""
    out = client.chat.completions.create(messages=ASK_WEATHER, tools=TOOLS, **{**GREEDY, "max_tokens": 40}).choices[0]
    if out.message.tool_calls:
        assert out.finish_reason == "tool_calls"
        assert_valid_calls(out.message.tool_calls)
    else:
        assert out.message.content and "<tool_call>" not in out.message.content


def test_tool_none_renders_tools_but_reads_no_calls(client):
    out = client.chat.completions.create(messages=ASK_WEATHER, tools=TOOLS, tool_choice="none",
                                         **{**GREEDY, "max_tokens": 16}).choices[0]
    assert out.message.tool_calls is None and out.message.content


def test_conversation_with_calls_and_results_continues(client):
    """An assistant turn with tool_calls (content null) and a tool result, as the SDK sends them back."""
    first = client.chat.completions.create(messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", **GREEDY)
    message = first.choices[0].message
    messages = [*ASK_WEATHER, message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"} for call in message.tool_calls]
    out = client.chat.completions.create(messages=messages, tools=TOOLS, tool_choice="none",
                                         **{**GREEDY, "max_tokens": 16})
    assert out.choices[0].message.content


# ------------------------------------------------------------------------------------------------
# errors: 400s naming the field, and the server goes on


BAD_OBJECT = {"type": "object", "properties": {"a": {"type": "nonsense"}}}


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_OBJECT}}},
     "response_format", ["nonsense"]),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "guided_json",
     ["missing"]),
    ({"guided_regex": "(unclosed"}, "guided_regex", ["regex"]),
    ({"guided_grammar": "start: foo ::= ["}, "guided_grammar", ["grammar"]),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", ["regex", "choice"]),
    ({"structured_outputs": {"backend": "xgrammar", "regex": "a"}}, "structured_outputs.backend", ["unknown"]),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", ["guided_json"]),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"json_object": True}}, "structured_outputs",
     ["response_format"]),
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend", ["llguidance"]),
    ({"guided_whitespace_pattern": " ", "guided_regex": "a"}, "guided_whitespace_pattern", ["JSON"]),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": BAD_OBJECT}}],
      "tool_choice": "required"}, "tools", ["tools[1].function.parameters", "nonsense"]),
    ({"tools": [WEATHER, WEATHER]}, "tools", ["get_weather", "tools[1]"]),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name", []),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools",
     ["object"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", ["nope"]),
    ({"tool_choice": "required"}, "tool_choice", ["tools"]),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     ["tool_choice"]),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments", ["JSON"]),
    ({"frobnicate": 1}, "frobnicate", ["unknown field"]),
    ({"functions": [{"name": "f"}]}, "functions", ["tools"]),
    ({"reasoning_effort": "high"}, "reasoning_effort", ["not supported"]),
    ({"messages": [{"role": "user", "content": "hi", "cache_control": {}}]}, "messages.0.cache_control",
     ["unknown field"]),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}, "stream": True},
     "stream_options.continuous_usage_stats", ["unknown field"]),
])
def test_bad_requests_are_400_naming_the_field(http, body, param, words):
    assert_400(chat(http, **body), param, *words)


def test_completions_refuse_bad_grammars_and_unknown_fields(http):
    base = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    assert_400(http.post("/v1/completions", json={**base, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": BAD_OBJECT}}}), "response_format", "nonsense")
    assert_400(http.post("/v1/completions", json={**base, "best_of": 3}), "best_of")
    assert_400(http.post("/v1/completions", json={**base, "tools": [WEATHER]}), "tools", "unknown field")


def test_fields_without_effect_are_accepted(client):
    out = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], model=MODEL, temperature=0,
                                         max_tokens=4, user="u1", store=False, metadata={"k": "v"},
                                         service_tier="auto", prompt_cache_key="k", safety_identifier="s",
                                         modalities=["text"])
    assert out.choices[0].message.content


def test_server_answers_after_bad_schemas(client, http):
    for _ in range(2):
        assert_400(chat(http, guided_json=BAD_OBJECT), "guided_json")
        assert_400(chat(http, tools=[{"type": "function", "function": {"name": "f", "parameters": BAD_OBJECT}}],
                        tool_choice="required"), "tools")
    assert http.get("/health").status_code == 200
    out = client.chat.completions.create(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                         model=MODEL, temperature=0, max_tokens=32)
    assert "Paris" in out.choices[0].message.content
