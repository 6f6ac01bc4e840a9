"""POST /v1/responses (issue 38) end to end: one real `jaxserve serve` of the tiny random llama, greedy, driven
by the unmodified openai SDK and by the OpenAI Agents SDK's default model (`OpenAIResponsesModel`).

The route is the chat route's pieces under other names, so each output is checked against the same request
sent to /v1/chat/completions (same text, same finish, same prompt tokens), and every response and stream
event is validated against the SDK's own pydantic types (which the SDK's parser does not do by itself).
Forced tool calls and text.format schemas are checked with `jsonschema`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from server_helpers import API_KEY, AUTH, SMALL_FLAGS, run_server

SERVER_ARGS = [*SMALL_FLAGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
GREEDY = {"model": "tiny", "temperature": 0}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                                                           "unit": {"type": "string", "enum": ["C", "F"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
VERDICT = {"type": "object", "properties": {"sunny": {"type": "boolean"}, "city": {"enum": ["Paris", "Tokyo"]}},
           "required": ["sunny", "city"], "additionalProperties": False}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with run_server([str(tiny_model_dir("llama")), *SERVER_ARGS]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


def create(http, **body) -> dict:
    """The whole response, validated against the SDK's Response type."""
    response = http.post("/v1/responses", json={**GREEDY, **body})
    assert response.status_code == 200, response.text
    Response.model_validate(response.json())
    return response.json()


def stream(http, **body) -> list[dict]:
    """The events of a streamed response, each SSE `event:` line checked against its data's type and the
    data validated against the SDK's event types."""
    events = []
    with http.stream("POST", "/v1/responses", json={**GREEDY, **body, "stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                assert event["type"] == kind, (kind, event)
                EVENTS.validate_python(event)
                events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def chat(http, messages: list[dict], **body) -> dict:
    response = http.post("/v1/chat/completions", json={**GREEDY, "messages": messages, **body})
    assert response.status_code == 200, response.text
    return response.json()


def assert_400(response: httpx.Response, param: str, *words: str) -> None:
    assert response.status_code == 400, (response.status_code, response.text)
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == 400, error
    for word in words:
        assert word in error["message"], error


def assert_like_chat(response: dict, reply: dict) -> None:
    """The same text, token counts and finish as /v1/chat/completions gave for the same request."""
    assert response["output"][0]["content"][0]["text"] == reply["choices"][0]["message"]["content"]
    usage = response["usage"]
    assert usage["input_tokens"] == reply["usage"]["prompt_tokens"]
    assert usage["output_tokens"] == reply["usage"]["completion_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    cut = reply["choices"][0]["finish_reason"] == "length"
    assert response["status"] == ("incomplete" if cut else "completed")
    assert response["incomplete_details"] == ({"reason": "max_output_tokens"} if cut else None)


# ------------------------------------------------------------------------------------------------
# text


def test_string_input_answers_as_chat_does(client, http):
    """The SDK parses the response; its output_text is the chat route's reply to one user message."""
    out = client.responses.create(input="Say hi.", max_output_tokens=12, **GREEDY)
    assert out.id.startswith("resp_") and out.object == "response" and out.model == "tiny"
    assert [item.type for item in out.output] == ["message"]
    assert out.output[0].role == "assistant" and out.output[0].content[0].annotations == []
    assert_like_chat(out.model_dump(), chat(http, [{"role": "user", "content": "Say hi."}], max_tokens=12))
    assert out.output_text == out.output[0].content[0].text


def test_messages_and_instructions_are_the_chat_conversation(http):
    """instructions is a system message first; input_text/output_text parts and every role are read."""
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a city."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Paris.", "annotations": []}]},
             {"role": "user", "content": "Another?"}]
    messages = [{"role": "system", "content": "You answer questions."}, {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "Name a city."}, {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "Another?"}]
    out = create(http, input=items, instructions="You answer questions.", max_output_tokens=10)
    assert out["instructions"] == "You answer questions."
    assert_like_chat(out, chat(http, messages, max_tokens=10))


def test_stream_events_build_the_whole_response(http):
    """The event sequence of a text response; the deltas add up to the text of the whole response, and the
    last event carries the same response with its usage."""
    body = {"input": "Tell me a story.", "max_output_tokens": 16}
    whole = create(http, **body)
    events = stream(http, **body)
    kinds = [e["type"] for e in events]
    final = "response.incomplete" if whole["status"] == "incomplete" else "response.completed"
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", final]
    text = whole["output"][0]["content"][0]["text"]
    assert deltas and "".join(e["delta"] for e in deltas) == text
    assert events[-4]["text"] == text and events[-2]["item"]["content"][0]["text"] == text
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    last = events[-1]["response"]
    counts = {k: v for k, v in last["usage"].items() if k != "input_tokens_details"}
    assert counts == {k: v for k, v in whole["usage"].items() if k != "input_tokens_details"}
    # the same prompt was just served, so its full pages come from the prefix cache
    assert 0 < last["usage"]["input_tokens_details"]["cached_tokens"] < counts["input_tokens"]
    assert last["status"] == whole["status"]
    assert last["output"] == [events[-2]["item"]] and last["id"] == events[0]["response"]["id"]


def test_sdk_stream_parses_every_event(client):
    """client.responses.create(stream=True), unmodified: typed events, ending with the full response."""
    events = list(client.responses.create(input="Hi", max_output_tokens=8, stream=True, **GREEDY))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == text and events[-1].response.usage.output_tokens > 0


# ------------------------------------------------------------------------------------------------
# tools and structured output


def function_calls(response: dict) -> list[dict]:
    assert response["output"] and all(item["type"] == "function_call" for item in response["output"]), response
    for call in response["output"]:
        assert call["call_id"].startswith("call_") and call["id"].startswith("fc_") and call["status"] == "completed"
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), WEATHER["parameters"])
    return response["output"]


@pytest.mark.parametrize("tool_choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_forced_call_is_a_function_call_item_fitting_the_schema(client, tool_choice):
    out = client.responses.create(input="Weather in Paris?", tools=[WEATHER], tool_choice=tool_choice,
                                  parallel_tool_calls=False, max_output_tokens=96, **GREEDY)
    assert out.status == "completed", out
    assert len(function_calls(out.model_dump())) == 1 and out.output_text == ""
    assert out.tool_choice == (tool_choice if isinstance(tool_choice, str) else out.tool_choice)
    assert out.tools[0].name == "get_weather" and out.parallel_tool_calls is False


def test_forced_call_streams_its_arguments(http):
    body = {"input": "Weather in Tokyo?", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 96}
    [call] = function_calls(create(http, **body))
    events = stream(http, **body)
    kinds = [e["type"] for e in events]
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * len(deltas),
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    added, done, item_done = events[2]["item"], events[-3], events[-2]["item"]
    assert added["type"] == "function_call" and added["name"] == "get_weather" and added["arguments"] == ""
    assert "".join(deltas) == done["arguments"] == item_done["arguments"] == call["arguments"]
    assert done["item_id"] == added["id"] == item_done["id"]
    assert events[-1]["response"]["output"] == [item_done]


@pytest.mark.parametrize("streamed", [False, True])
def test_text_format_json_schema_output_validates(http, streamed):
    body = {"input": "Is it sunny in Paris?", "max_output_tokens": 64,
            "text": {"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}}}
    response = stream(http, **body)[-1]["response"] if streamed else create(http, **body)
    assert response["status"] == "completed" and response["text"]["format"]["name"] == "verdict"
    jsonschema.validate(json.loads(response["output"][0]["content"][0]["text"]), VERDICT)


def test_json_object_format_is_an_object(http):
    out = create(http, input="Some JSON, please.", max_output_tokens=48, text={"format": {"type": "json_object"}})
    text = out["output"][0]["content"][0]["text"]
    if out["status"] == "completed":  # an open object may run to the limit
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")


def test_calls_and_their_outputs_are_sent_back_as_the_chat_conversation(http):
    """function_call and function_call_output items are an assistant's tool_calls and tool messages."""
    arguments = '{"city": "Paris", "unit": "C"}'
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments,
              "id": "fc_1", "status": "completed"},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 C and sunny"}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    out = create(http, input=items, tools=[WEATHER], tool_choice="none", max_output_tokens=8)
    assert_like_chat(out, chat(http, messages, tools=[{"type": "function", "function": {
        k: v for k, v in WEATHER.items() if k != "type"}}], tool_choice="none", max_tokens=8))


# ------------------------------------------------------------------------------------------------
# store and previous_response_id


def test_previous_response_id_continues_the_stored_conversation(client, http):
    first = client.responses.create(input="Name a city.", instructions="Be brief.", max_output_tokens=6, **GREEDY)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = create(http, input="And another?", previous_response_id=first.id, max_output_tokens=6)
    assert second["previous_response_id"] == first.id
    # the earlier instructions are not carried over, as in OpenAI's API
    messages = [{"role": "user", "content": "Name a city."}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And another?"}]
    assert_like_chat(second, chat(http, messages, max_tokens=6))


def test_unstored_and_unknown_responses_are_404(http):
    unstored = create(http, input="Hi", max_output_tokens=2, store=False)
    for rid in (unstored["id"], "resp_nope"):
        response = http.post("/v1/responses", json={**GREEDY, "input": "Hi", "previous_response_id": rid})
        assert response.status_code == 404 and response.json()["error"]["param"] == "previous_response_id"
        assert rid in response.json()["error"]["message"]
        assert http.get(f"/v1/responses/{rid}").status_code == 404


# ------------------------------------------------------------------------------------------------
# refusals


@pytest.mark.parametrize("body,param,words", [
    ({"frobnicate": 1}, "frobnicate", ["unknown field"]),
    ({"reasoning": {"effort": "high"}}, "reasoning", ["not supported"]),
    ({"include": ["message.output_text.logprobs"]}, "include", []),
    ({"background": True}, "background", []),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice", ["nope"]),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "tools": [WEATHER]},
     "tool_choice.FunctionToolChoice.function", ["unknown field"]),
    ({"tool_choice": "required"}, "tool_choice", ["tools"]),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", []),
    ({"tools": [WEATHER, WEATHER]}, "tools", ["tools[1].name"]),
    ({"tools": [{**WEATHER, "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}],
      "tool_choice": "required"}, "tools", ["tools[0].parameters", "nonsense"]),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format",
     ["nonsense"]),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", ["schema"]),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0", ["message, a function_call"]),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.message.content.list[TextPart].0.image_url", ["input_text"]),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{no"}]}, "input[0].arguments",
     ["JSON"]),
    ({"input": []}, "input", []),
    ({"max_output_tokens": 10_000}, "input", ["maximum context length"]),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options", ["stream"]),
])
def test_bad_requests_are_400_naming_the_field(http, body, param, words):
    assert_400(http.post("/v1/responses", json={**GREEDY, "input": "Hi", **body}), param, *words)


def test_input_that_is_not_unicode_is_400(http):
    """A lone surrogate, which JSON can carry and no tokenizer can encode."""
    body = json.dumps({**GREEDY, "input": "\ud800"})
    assert_400(http.post("/v1/responses", content=body, headers={"Content-Type": "application/json"}), "input",
               "Unicode")


# ------------------------------------------------------------------------------------------------
# the OpenAI Agents SDK


@pytest.mark.parametrize("streamed", [False, True])
def test_agents_sdk_runs_an_agent_with_a_tool_to_completion(server, streamed):
    """Runner.run with the SDK's default Responses model: turn 1 must call the tool (tool_choice required, one
    call), turn 2 (tool_choice reset to auto) gets the call and its output back as input items and answers in
    the agent's output type, a schema short enough that even a random model's answer ends within the cap."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}."

    class Verdict(BaseModel):
        sunny: bool

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                      output_type=Verdict, model=OpenAIResponsesModel(model="tiny", openai_client=client),
                      model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                                   max_tokens=96))
        if not streamed:
            return await Runner.run(agent, "Is it sunny in Paris?", max_turns=3)
        result = Runner.run_streamed(agent, "Is it sunny in Paris?", max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert len(calls) == 1 and calls[0] in ("Paris", "Tokyo")
    assert isinstance(result.final_output, Verdict)
    assert [r.usage.output_tokens > 0 for r in result.raw_responses] == [True, True]
    assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item",
                                                        "message_output_item"]
