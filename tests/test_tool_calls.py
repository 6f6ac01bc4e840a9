"""Tool calls read from model text, with no model: the auto parsers (hermes, llama3_json, mistral), the
readers of required and named calls, and the stream deltas they make, which the openai SDK's own
accumulator must assemble into the same calls as the whole response."""

from __future__ import annotations

import json
import random

import pytest
from openai.lib.streaming._deltas import accumulate_delta

from server.tool_parsers import PARSERS, AutoReader
from server.tools import NamedReader, RequiredReader


class Tokenizer:
    """What a parser reads from a tokenizer: its special tokens and EOS."""

    def __init__(self, special=(), eos="</s>"):
        self.all_special_tokens, self.eos_token, self.added_tokens_decoder = list(special), eos, {}


def parse(name: str, text: str, tokenizer=None):
    return PARSERS[name](tokenizer or Tokenizer()).parse(text)


def calls_of(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("name,text,content,expected", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ("hermes", 'Let me look.\n<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
               '<tool_call>{"name": "b", "arguments": {}}</tool_call>', "Let me look.\n", [("a", {"x": 1}), ("b", {})]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": "é"}}', None, [("a", {"x": "é"})]),  # cut before </tool_call>
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": [2]}}', None,
     [("a", {"x": 1}), ("b", {"y": [2]})]),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]', None,
     [("a", {"x": 1}), ("b", {})]),
    ("mistral", 'Sure. [TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b{"y": 2}', "Sure. ", [("a", {"x": 1}), ("b", {"y": 2})]),
])
def test_parsers_read_calls_and_the_content_before_them(name, text, content, expected):
    got_content, calls = parse(name, text)
    assert got_content == content
    assert calls_of(calls) == expected
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)


@pytest.mark.parametrize("name,text", [
    ("hermes", "The capital of France is Paris."),
    ("hermes", "<tool_call>not json</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("llama3_json", "Paris is the capital of France."),
    ("llama3_json", '{"name": "a", "parameters": {}} and then some text'),
    ("llama3_json", '{"answer": 42}'),
    ("mistral", "No tools needed."),
    ("mistral", "[TOOL_CALLS] not json"),
])
def test_text_that_is_not_a_call_stays_content(name, text):
    assert parse(name, text) == (text, [])


def stream(reader, text: str, rng: random.Random) -> tuple[str, list[dict]]:
    """Feeds `text` in random pieces; the content sent and the calls as the SDK's accumulator builds them."""
    acc, content, cuts = {}, "", sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 12)))
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        piece, calls = reader.feed(text[a:b])
        content += piece
        if calls:
            acc = accumulate_delta(acc, {"tool_calls": calls})
    piece, calls = reader.finish()
    content += piece
    if calls:
        acc = accumulate_delta(acc, {"tool_calls": calls})
    return content, acc.get("tool_calls", [])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("name,text", [
    ("hermes", 'I will call it.\n<tool_call>{"name": "a", "arguments": {"x": "<tool"}}</tool_call>\n'
               '<tool_call>{"name": "b", "arguments": {}}</tool_call>'),
    ("hermes", "Just text, with a < and <tool but no call."),
    ("llama3_json", '  {"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'),
    ("llama3_json", "  Plain {text}."),
    ("mistral", 'Hm [TOOL_CALLS][{"name": "a", "arguments": {"q": "]"}}]'),
])
def test_auto_stream_assembles_to_the_whole_parse(name, text, seed):
    """Streamed content and calls (assembled by the openai SDK's accumulator) equal the whole output's parse,
    and content never carries part of a marker."""
    whole_content, whole_calls = parse(name, text)
    content, calls = stream(AutoReader(PARSERS[name](Tokenizer())), text, random.Random(seed))
    assert content == (whole_content or "")
    assert calls_of(calls) == calls_of(whole_calls)


def test_hermes_stream_sends_each_call_when_it_closes():
    reader = AutoReader(PARSERS["hermes"](Tokenizer()))
    assert reader.feed("Sure.<tool_") == ("Sure.", [])
    assert reader.feed('call>{"name": "a", "arguments": {}}') == ("", [])
    content, calls = reader.feed("</tool_call>\n<tool_call>")
    assert content == "" and [c["function"]["name"] for c in calls] == ["a"] and calls[0]["index"] == 0
    _, calls = reader.feed('{"name": "b", "arguments": {"k": 1}}</tool_call>')
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(1, "b")]
    assert reader.finish() == ("", [])


def test_special_token_markers_are_decoded_and_eos_hidden():
    """A marker that is a special token (Mistral's [TOOL_CALLS]) needs skip_special_tokens off; then the EOS
    text the detokenizer adds is no content."""
    parser = PARSERS["mistral"](Tokenizer(special=["[TOOL_CALLS]", "</s>"]))
    assert parser.show_special_tokens and not PARSERS["hermes"](Tokenizer(special=["</s>"])).show_special_tokens
    assert parser.parse("Hello.</s>") == ("Hello.", [])
    reader = AutoReader(parser)
    assert stream(reader, "Hello there.</s>", random.Random(0)) == ("Hello there.", [])


REQUIRED = ('[\n  {"name": "get_weather", "parameters": {"city": "Par\\"is", "days": [1, {"a": "}"}]}},'
            ' {"parameters": {"q": 3}, "name": "search"}, {"name": "noop", "parameters": 7 }\n]')


@pytest.mark.parametrize("seed", range(8))
def test_required_reader_streams_arguments_as_they_come(seed):
    """The required array's calls: the name once complete (a call whose parameters come first waits for it),
    the arguments as raw JSON text; streamed pieces assemble to the whole reading, which parses."""
    whole = RequiredReader()
    whole.feed(REQUIRED)
    whole.finish()
    expected = [("get_weather", {"city": 'Par"is', "days": [1, {"a": "}"}]}), ("search", {"q": 3}), ("noop", 7)]
    assert calls_of(whole.calls) == expected
    content, calls = stream(RequiredReader(), REQUIRED, random.Random(seed))
    assert content == "" and calls_of(calls) == expected
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls)


def test_required_reader_sends_the_header_before_the_arguments_end():
    reader = RequiredReader()
    _, calls = reader.feed('[{"name": "f", "parameters": {"text": "hel')
    assert calls == [{"index": 0, "id": calls[0]["id"], "type": "function",
                      "function": {"name": "f", "arguments": '{"text": "hel'}}]
    assert reader.feed('lo"}}]')[1] == [{"index": 0, "function": {"arguments": 'lo"}'}}]


def test_required_output_with_no_call_is_content():
    reader = RequiredReader()
    assert reader.feed("I cannot")[1] == [] and reader.finish() == ("I cannot", []) and reader.calls == []


def test_named_reader_output_is_the_arguments():
    reader = NamedReader("f")
    content, calls = reader.feed('{"a"')
    assert content == "" and calls[0]["function"] == {"name": "f", "arguments": '{"a"'} and "id" in calls[0]
    assert reader.feed(": 1}") == ("", [{"index": 0, "function": {"arguments": ": 1}"}}])
    assert reader.finish() == ("", [])
    assert calls_of(reader.calls) == [("f", {"a": 1})]


# A template that prints what a tools-aware template reads: the tools, an assistant's calls with their
# arguments as a mapping (HF's convention), a tool result's call id.
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}|{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }} city={{ c.function.arguments.city }}{% endfor %}"
    "{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}|{% endfor %}")


def test_tools_and_calls_reach_the_chat_template():
    """Tools render through the template; an earlier call's JSON arguments reach it as a dict and a null
    content as an empty string; a tool result keeps its call id."""
    import asyncio

    from server.prompts import chat_prompt_ids
    from server.protocol import ChatMessage
    from tiny_models import byte_tokenizer

    class State:
        tokenizer = byte_tokenizer()

        async def run_blocking(self, fn, *args):
            return fn(*args)

    State.tokenizer.chat_template = TOOLS_TEMPLATE
    messages = [ChatMessage(role="user", content="Weather?"),
                ChatMessage(role="assistant", content=None, tool_calls=[
                    {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]),
                ChatMessage(role="tool", tool_call_id="c1", content="sunny")]
    tools = [{"type": "function", "function": {"name": "get_weather"}}, {"type": "function", "function": {"name": "add"}}]
    ids = asyncio.run(chat_prompt_ids(State(), messages, False, False, tools))
    assert State.tokenizer.decode(ids) == ("TOOLS get_weather,add|user: Weather?|"
                                           "assistant:  CALL get_weather city=Paris|tool: sunny FOR c1|")
