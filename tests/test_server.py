"""The OpenAI-compatible server end to end: a real `jaxserve serve` process driven by the `openai` client.

One module-scoped server on the tiny random llama (byte tokenizer, vocab 320) with small limits serves
most tests; tests that may kill or reconfigure a server start their own. Greedy outputs of the tiny
random model repeat one character, so tests that need varied text sample with a seed and a
`logit_bias` that leaves only the letters a-z.
"""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import openai
import pytest

from server_helpers import API_KEY, AUTH, SMALL_FLAGS, TINY_FLAGS, metric, metric_samples, parse_sse, run_server

MAX_MODEL_LEN = int(TINY_FLAGS[TINY_FLAGS.index("--max-model-len") + 1])
SERVER_ARGS = [*TINY_FLAGS, "--max-queued-requests", "8", "--allowed-hosts", "127.0.0.1"]
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
FULL_LENGTH = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with run_server([str(tiny_model_dir("llama")), *SERVER_ARGS]) as srv:
        yield srv


@pytest.fixture(scope="module")
def url(server) -> str:
    return server.url


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def letters_only(http) -> dict[str, float]:
    """A logit_bias that leaves only the tokens of a-z, so sampled text is plain varied ASCII."""
    keep = set(http.post("/tokenize", json={"prompt": "abcdefghijklmnopqrstuvwxyz"}).json()["tokens"])
    assert len(keep) == 26
    return {str(t): -100.0 for t in range(320) if t not in keep}


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """The OpenAI error shape with `status`; returns the inner error object."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["code"] == status, error
    if param is not None:
        assert error["param"] is not None and param in error["param"], error
    return error


def stream_completion(client, **kwargs) -> tuple[dict[int, str], dict[int, str], list]:
    """Text and finish_reason per choice index of a streamed completion, plus every chunk."""
    texts, reasons, chunks = {}, {}, []
    for chunk in client.completions.create(stream=True, **kwargs):
        chunks.append(chunk)
        for choice in chunk.choices:
            assert choice.index not in reasons, "a chunk after the choice's finish_reason"
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks


def stream_chat(client, **kwargs) -> tuple[dict[int, str], dict[int, str], list]:
    texts, reasons, chunks = {}, {}, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        chunks.append(chunk)
        for choice in chunk.choices:
            assert choice.index not in reasons, "a chunk after the choice's finish_reason"
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks


# ------------------------------------------------------------------------------------------------
# generation through the openai client


@pytest.mark.parametrize("prompt", ["hello", "The quick brown fox", "1 2 3 4"])
def test_completion_stream_equals_non_stream_greedy(client, prompt):
    """Greedy completions: the joined SSE deltas equal the non-streamed text; 'length' only in the last chunk."""
    args = dict(model="tiny", prompt=prompt, max_tokens=20, temperature=0, extra_body=FULL_LENGTH)
    full = client.completions.create(**args)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 20
    texts, reasons, chunks = stream_completion(client, **args)
    assert texts == {0: full.choices[0].text}
    assert reasons == {0: "length"}
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_stream_equals_non_stream_greedy(client):
    """Greedy chat: the joined SSE content deltas equal the non-streamed message; role comes first."""
    args = dict(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0, extra_body=FULL_LENGTH)
    full = client.chat.completions.create(**args)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 20
    texts, reasons, chunks = stream_chat(client, **args)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert texts == {0: full.choices[0].message.content}
    assert reasons == {0: "length"}


def test_n_choices_have_indexes_and_differ_when_sampled(client):
    """n=3: three choices indexed 0..2, different at temperature 1, and the same streamed or not (seeded)."""
    args = dict(model="tiny", prompt="hello", max_tokens=12, temperature=1.0, seed=11, n=3, extra_body=FULL_LENGTH)
    full = client.completions.create(**args)
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert len({c.text for c in full.choices}) == 3
    assert full.usage.completion_tokens == 3 * 12
    texts, reasons, _ = stream_completion(client, **args)
    assert texts == {c.index: c.text for c in full.choices}
    assert reasons == {0: "length", 1: "length", 2: "length"}

    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=11,
                                          n=3, extra_body=FULL_LENGTH)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert len({c.message.content for c in chat.choices}) == 3


def test_greedy_n_choices_are_identical(client):
    """n=3 at temperature 0: every choice is the greedy text of n=1."""
    one = client.completions.create(model="tiny", prompt="abc", max_tokens=10, temperature=0)
    three = client.completions.create(model="tiny", prompt="abc", max_tokens=10, temperature=0, n=3)
    assert [c.text for c in three.choices] == [one.choices[0].text] * 3


def test_seed_reproducibility(client):
    """The same seed at temperature 1 gives the same text (and a different seed a different one)."""
    args = dict(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=1.0, extra_body=FULL_LENGTH)
    first = client.completions.create(seed=1234, **args).choices[0].text
    second = client.completions.create(seed=1234, **args).choices[0].text
    other = client.completions.create(seed=4321, **args).choices[0].text
    assert first == second
    assert first != other
    chat_args = dict(model="tiny", messages=MESSAGES, max_tokens=16, temperature=1.0, seed=99, extra_body=FULL_LENGTH)
    assert client.chat.completions.create(**chat_args).choices[0].message.content == \
        client.chat.completions.create(**chat_args).choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_output_before_it(client, letters_only, stream):
    """A stop string taken from the middle of an output ends the output right before it, finish_reason 'stop'."""
    args = dict(model="tiny", prompt="hello", max_tokens=30, temperature=1.0, seed=5,
                extra_body={"ignore_eos": True, "logit_bias": letters_only})
    text = client.completions.create(**args).choices[0].text
    assert len(text) == 30 and text.isalpha() and text.islower(), text
    stop = text[12:15]
    expected = text[: text.index(stop)]
    if stream:
        texts, reasons, _ = stream_completion(client, stop=[stop, "#never#"], **args)
        got, reason = texts.get(0, ""), reasons[0]
    else:
        choice = client.completions.create(stop=[stop, "#never#"], **args).choices[0]
        got, reason = choice.text, choice.finish_reason
        assert choice.model_extra.get("stop_reason") == stop
    assert got == expected
    assert reason == "stop"


def test_chat_stop_string(client, letters_only):
    """Chat honours a single stop string, streamed and not, with the same text."""
    args = dict(model="tiny", messages=MESSAGES, max_tokens=30, temperature=1.0, seed=8,
                extra_body={"ignore_eos": True, "logit_bias": letters_only})
    text = client.chat.completions.create(**args).choices[0].message.content
    stop = text[10:12]
    full = client.chat.completions.create(stop=stop, **args).choices[0]
    assert full.message.content == text[: text.index(stop)]
    assert full.finish_reason == "stop"
    texts, reasons, _ = stream_chat(client, stop=stop, **args)
    assert texts.get(0, "") == full.message.content and reasons == {0: "stop"}


def test_stop_token_ids_finish_with_stop(client, http):
    """A stop_token_id that greedy decoding produces ends the request with 'stop' and that id as stop_reason."""
    text = client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0).choices[0].text
    token = http.post("/tokenize", json={"prompt": text[0]}).json()["tokens"][0]
    choice = client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0,
                                       extra_body={"stop_token_ids": [token]}).choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra.get("stop_reason") == token


def test_completion_logprobs(client):
    """Completions logprobs=3: tokens, token_logprobs, top_logprobs per generated token; greedy picks the top."""
    args = dict(model="tiny", prompt="hello", max_tokens=8, temperature=0, logprobs=3, extra_body=FULL_LENGTH)
    full = client.completions.create(**args)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == full.usage.completion_tokens == 8
    assert "".join(lp.tokens) == full.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0.0
        # keys are token texts: distinct byte tokens may decode alike and merge, so <= 3 (+1 sampled)
        assert 1 <= len(top) <= 4 and token in top
        assert top[token] == pytest.approx(logprob) and logprob == pytest.approx(max(top.values()))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    tokens, logprobs = [], []
    for chunk in client.completions.create(stream=True, **args):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                logprobs += choice.logprobs.token_logprobs
    assert tokens == lp.tokens
    assert logprobs == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_chat_logprobs(client):
    """Chat logprobs=True, top_logprobs=2: one content entry per token with token/logprob/2 ranked alternatives."""
    args = dict(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
                extra_body=FULL_LENGTH)
    full = client.chat.completions.create(**args)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 8
    assert "".join(entry.token for entry in content) == full.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 2
        ranked = [alt.logprob for alt in entry.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the sampled is the best
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed += [entry.token for entry in choice.logprobs.content]
    assert streamed == [entry.token for entry in content]


def test_usage_counts_match_tokenize(client, http):
    """usage.prompt_tokens equals /tokenize's count (prompt and chat messages); completion_tokens the generated."""
    prompt = "Count these tokens, please: héllo wörld"
    count = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=7, temperature=0, logprobs=0,
                                    extra_body=FULL_LENGTH)
    assert out.usage.prompt_tokens == count
    assert out.usage.completion_tokens == 7 == len(out.choices[0].logprobs.tokens)
    assert out.usage.total_tokens == count + 7

    chat_count = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                          extra_body=FULL_LENGTH)
    assert chat.usage.prompt_tokens == chat_count
    assert chat.usage.completion_tokens == 6
    assert chat.usage.total_tokens == chat_count + 6


def test_finish_reason_length_at_max_tokens(client):
    """Without ignore_eos, a request that runs into max_tokens finishes with 'length' and exactly max_tokens."""
    out = client.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 4


def test_default_completion_max_tokens_is_16(client):
    """Completions without max_tokens generate 16 tokens (OpenAI's default)."""
    out = client.completions.create(model="tiny", prompt="abc", temperature=0, extra_body=FULL_LENGTH)
    assert out.usage.completion_tokens == 16


def test_chat_default_max_tokens_is_the_rest_of_the_context(client, http):
    """Chat without max_tokens may generate up to the end of the context (max_model_len - prompt)."""
    count = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, extra_body=FULL_LENGTH)
    assert out.usage.completion_tokens == MAX_MODEL_LEN - count
    assert out.choices[0].finish_reason == "length"


def test_outputs_do_not_depend_on_concurrency(client):
    """Greedy and seeded outputs are the same sent one by one or all at once (vLLM #5898)."""
    prompts = [f"prompt number {i} " + "z" * (3 * i) for i in range(8)]
    args = [dict(model="tiny", prompt=p, max_tokens=12, extra_body=FULL_LENGTH,
                 **({"temperature": 0} if i % 2 else {"temperature": 1.0, "seed": i})) for i, p in enumerate(prompts)]
    alone = [client.completions.create(**a).choices[0].text for a in args]
    together: list = [None] * len(args)

    def send(i: int):
        together[i] = client.completions.create(**args[i]).choices[0].text

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert together == alone


def test_stream_include_usage_adds_a_final_usage_chunk(client):
    """stream_options.include_usage: one last chunk with choices [] and the usage of the non-streamed request."""
    args = dict(model="tiny", prompt="hello", max_tokens=9, temperature=0, extra_body=FULL_LENGTH)
    full = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == \
        full.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})
    assert all(chunk.usage is None for chunk in chunks[:-1])

    chat_args = dict(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0, extra_body=FULL_LENGTH)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **chat_args))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 5


def test_stream_ends_with_done(http):
    """Raw SSE: every event is `data: {json}` and the stream ends with `data: [DONE]`."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 5, "stream": True, "temperature": 0}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events, done = parse_sse(response.iter_lines())
    assert done
    assert events and all(e["object"] == "text_completion" for e in events)


def test_token_id_prompts(client):
    """prompt=[ids] and prompt=[[ids], [ids]]: token prompts are accepted, one choice per prompt, in order."""
    single = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4, temperature=0)
    assert single.usage.prompt_tokens == 3
    assert len(single.choices) == 1
    other = client.completions.create(model="tiny", prompt=[40, 41, 42, 43], max_tokens=4, temperature=0)
    both = client.completions.create(model="tiny", prompt=[[1, 2, 3], [40, 41, 42, 43]], max_tokens=4,
                                     temperature=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [single.choices[0].text, other.choices[0].text]
    assert both.usage.prompt_tokens == 7
    assert both.usage.completion_tokens == 8


def test_list_of_string_prompts(client):
    """prompt=[str, str]: one choice per prompt, each the same as sending it alone."""
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=4, temperature=0).choices[0].text
             for p in ("abc", "xyz")]
    both = client.completions.create(model="tiny", prompt=["abc", "xyz"], max_tokens=4, temperature=0)
    assert [c.text for c in both.choices] == alone


def test_echo_prepends_the_prompt(client):
    """echo=True: the completion text starts with the prompt."""
    plain = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0).choices[0].text
    echoed = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "hello" + plain


def test_models_lists_the_served_name(client):
    """/v1/models lists exactly the --served-model-name."""
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].model_extra.get("max_model_len") == MAX_MODEL_LEN


def test_tokenize_detokenize_round_trip(http):
    """/tokenize then /detokenize gives back the text (ASCII and multi-byte characters)."""
    for text in ("Hello, world!", "héllo wörld ∑ 🚀", "line\nbreak\ttab"):
        tokenized = http.post("/tokenize", json={"prompt": text}).json()
        assert tokenized["count"] == len(tokenized["tokens"]) > 0
        assert tokenized["max_model_len"] == MAX_MODEL_LEN
        assert http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json() == {"prompt": text}


def test_version(http):
    """/version answers the package version."""
    import jaxserve

    assert http.get("/version").json() == {"version": jaxserve.__version__}


# ------------------------------------------------------------------------------------------------
# errors: status + OpenAI error shape, and the server survives them

OUT_OF_RANGE = [
    ("temperature", -1), ("temperature", 3), ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2),
    ("presence_penalty", 3), ("frequency_penalty", 3), ("presence_penalty", -3), ("repetition_penalty", 0),
    ("max_tokens", 0), ("n", 0), ("seed", -1),
]


@pytest.mark.parametrize("name,value", OUT_OF_RANGE)
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_out_of_range_parameter_is_400(http, endpoint, name, value):
    """Every sampling parameter out of its range -> 400 naming the parameter, on both endpoints."""
    body = {"model": "tiny", "max_tokens": 2, name: value}
    body.update({"prompt": "hi"} if endpoint == "/v1/completions" else {"messages": MESSAGES})
    assert_error(http.post(endpoint, json=body), 400, name)


def test_logprobs_above_the_cap_are_400(http):
    """Completions logprobs=21 and chat top_logprobs=21 -> 400."""
    assert_error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 21}), 400, "logprobs")
    assert_error(http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "logprobs": True,
                                                         "top_logprobs": 21}), 400, "top_logprobs")


def test_openai_client_raises_bad_request(client):
    """The openai client sees 400 as BadRequestError with the parameter in the error body."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=-1)
    assert e.value.status_code == 400
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, top_p=1.5)
    assert e.value.status_code == 400


def test_unknown_model_is_404(client, http):
    """A model other than the served one -> 404 NotFoundError, on both endpoints."""
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.status_code == 404
    assert_error(e.value.response, 404, "model")
    assert_error(http.post("/v1/chat/completions", json={"model": "nope", "messages": MESSAGES}), 404, "model")


def test_context_overflow_is_400_with_both_numbers(http):
    """prompt + max_tokens > max_model_len -> 400 whose message names the limit and the requested total."""
    prompt_len = http.post("/tokenize", json={"prompt": "abcdefghij" * 10}).json()["count"]
    error = assert_error(http.post("/v1/completions", json={"prompt": "abcdefghij" * 10, "max_tokens": 50}), 400)
    assert str(MAX_MODEL_LEN) in error["message"] and str(prompt_len + 50) in error["message"]
    error = assert_error(http.post("/v1/completions", json={"prompt": "x" * 300, "max_tokens": 1}), 400)
    assert str(MAX_MODEL_LEN) in error["message"] and "300" in error["message"]
    chat = [{"role": "user", "content": "y" * 200}]
    error = assert_error(http.post("/v1/chat/completions", json={"messages": chat}), 400)
    assert str(MAX_MODEL_LEN) in error["message"]
    chat_len = http.post("/tokenize", json={"messages": chat}).json()["count"]
    assert str(chat_len) in error["message"]


def test_malformed_json_is_400(http):
    """A body that is not JSON -> 400, not 422 or 500."""
    response = http.post("/v1/completions", content=b'{"prompt": "hi", ', headers={"content-type": "application/json"})
    assert_error(response, 400)
    assert_error(http.post("/v1/chat/completions", content=b"not json", headers={"content-type": "application/json"}),
                 400)


@pytest.mark.parametrize("endpoint,body,param", [
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "abc"}, "max_tokens"),
    ("/v1/completions", {"prompt": [1.5, 2]}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": "x"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": "hot"}, "temperature"),
])
def test_wrong_types_are_400(http, endpoint, body, param):
    """Fields of the wrong type (or missing) -> 400 naming the field (vLLM answers 400, not FastAPI's 422)."""
    assert_error(http.post(endpoint, json=body), 400, param)


@pytest.mark.parametrize("prompt", ["", [], [""], [[1, 2], []]])
def test_empty_prompt_is_400(http, prompt):
    """Empty prompts ("" / [] / [""] / an empty token list) -> 400."""
    assert_error(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}), 400, "prompt")


@pytest.mark.parametrize("prompt", [[99999], [1, 320], [[1, 2], [99999]]])
def test_out_of_vocabulary_ids_are_400(http, prompt):
    """Token ids outside [0, vocab_size) -> 400 (never reach the device)."""
    assert_error(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}), 400, "prompt")


def test_out_of_vocabulary_logit_bias_and_detokenize_are_400(http):
    """logit_bias keys and /detokenize tokens outside the vocabulary -> 400."""
    assert_error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logit_bias": {"5000": 1}}),
                 400, "logit_bias")
    assert_error(http.post("/detokenize", json={"tokens": [1, 5000]}), 400, "tokens")


def test_unknown_fields_are_400_naming_them(http):
    """A field the server does not know (or knows and does not honour) is refused, not ignored."""
    error = assert_error(http.post("/v1/completions", json={"prompt": "hi", "best_of_n": 2}), 400, "best_of_n")
    assert "unknown field" in error["message"]
    error = assert_error(http.post("/v1/chat/completions", json={"messages": MESSAGES, "prediction": {}}), 400,
                         "prediction")
    assert "not supported" in error["message"]


def test_auto_tool_choice_needs_the_server_flags(http):
    """Tools default to tool_choice "auto", which needs --enable-auto-tool-choice (vLLM's rule)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for choice in ({}, {"tool_choice": "auto"}):
        error = assert_error(http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": tools, **choice}),
                             400, "tool_choice")
        assert "--enable-auto-tool-choice" in error["message"]


def test_stream_options_without_stream_is_400(http):
    """stream_options without stream=true -> 400 on both endpoints."""
    options = {"include_usage": True}
    assert_error(http.post("/v1/completions", json={"prompt": "hi", "stream_options": options}), 400, "stream_options")
    assert_error(http.post("/v1/chat/completions", json={"messages": MESSAGES, "stream_options": options}), 400,
                 "stream_options")


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions")])
def test_missing_or_wrong_api_key_is_401(url, method, path):
    """/v1/* without the key or with a wrong one -> 401 in the error shape."""
    body = {"prompt": "hi", "messages": MESSAGES, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.request(method, url + path, json=body if method == "POST" else None, headers=headers,
                                 timeout=30)
        assert_error(response, 401)


def test_openai_client_with_a_wrong_key_raises_authentication_error(url):
    """The openai client with a wrong key gets AuthenticationError (401)."""
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401


def test_health_and_version_need_no_key_and_the_rest_does(url):
    """/health and /version answer without the API key (probes carry none); /metrics, /server_info,
    /tokenize and /detokenize tell or cost as much as /v1, so they need it as /v1 does."""
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert httpx.get(url + "/version", timeout=30).status_code == 200
    for method, path, body in [("GET", "/metrics", None), ("GET", "/server_info", None),
                               ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [104]})]:
        assert httpx.request(method, url + path, json=body, timeout=30).status_code == 401, path
        assert httpx.request(method, url + path, json=body, headers=AUTH, timeout=30).status_code == 200, path


def test_a_host_not_in_allowed_hosts_is_refused(url):
    """--allowed-hosts 127.0.0.1: a request naming another host (a DNS-rebound name) is a 400, /health too."""
    assert httpx.get(url + "/health", headers={"Host": "evil.example"}, timeout=30).status_code == 400
    assert httpx.get(url + "/v1/models", headers={**AUTH, "Host": "evil.example:8000"}, timeout=30).status_code == 400
    assert httpx.get(url + "/v1/models", headers=AUTH, timeout=30).status_code == 200


def test_server_still_serves_after_bad_requests(client, http):
    """A burst of bad requests leaves the server healthy and answering normal requests."""
    bad_bodies = [{"prompt": "hi", "temperature": -1}, {"prompt": [99999]}, {"prompt": ""}, {"prompt": 5},
                  {"prompt": "x" * 300}, {"prompt": "hi", "model": "nope"}, {"prompt": "hi", "n": 0},
                  {"prompt": "hi", "stream_options": {"include_usage": True}}]
    for body in bad_bodies:
        assert 400 <= http.post("/v1/completions", json=body).status_code < 500
    assert http.post("/v1/completions", content=b"{", headers={"content-type": "application/json"}).status_code == 400
    assert http.get("/health").status_code == 200
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5


def test_huge_top_k_is_rejected_and_does_not_kill_the_engine(tiny_model_dir):
    """top_k = 2**31 must be a 400 (or be clamped to the vocabulary), never a dead engine."""
    with run_server([str(tiny_model_dir("llama")), *SMALL_FLAGS]) as srv:  # its own server, in case it dies
        response = httpx.post(srv.url + "/v1/completions", headers=AUTH, timeout=60,
                              json={"prompt": "hi", "max_tokens": 2, "top_k": 2**31})
        healthy = httpx.get(srv.url + "/health", timeout=30).status_code
        assert response.status_code in (200, 400), response.text
        assert healthy == 200, srv.stderr_tail(2000)


# ------------------------------------------------------------------------------------------------
# metrics and responsiveness


def test_metrics_counters_match_the_requests_sent(client, http, url):
    """Prompt/generation token counters, successes by reason, TTFT/ITL/e2e counts move by exactly our requests."""
    greedy = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0).choices[0].text
    stop_id = http.post("/tokenize", json={"prompt": greedy[0]}).json()["tokens"][0]
    before = metric_samples(url)
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total"]:
        assert ("jaxserve:" + name, ()) in before, name

    usages = []
    for prompt, max_tokens in (("first prompt", 5), ("second, longer prompt", 7)):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                        extra_body=FULL_LENGTH)
        assert out.choices[0].finish_reason == "length"
        usages.append(out.usage)
    chunks = list(client.completions.create(model="tiny", prompt="streamed", max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=FULL_LENGTH))
    usages.append(chunks[-1].usage)
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0,
                                          extra_body=FULL_LENGTH)
    assert chat.choices[0].finish_reason == "length"
    usages.append(chat.usage)
    stopped = client.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0,
                                        extra_body={"stop_token_ids": [stop_id]})
    assert stopped.choices[0].finish_reason == "stop"
    usages.append(stopped.usage)
    assert http.post("/v1/completions", json={"prompt": "hi", "temperature": -1}).status_code == 400  # not counted
    after = metric_samples(url)

    def delta(name, **labels):
        return metric(after, "jaxserve:" + name, **labels) - metric(before, "jaxserve:" + name, **labels)

    assert delta("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("request_success_total", finished_reason="length") == 4
    assert delta("request_success_total", finished_reason="stop") == 1
    assert delta("time_to_first_token_seconds_count") == len(usages)
    assert delta("e2e_request_latency_seconds_count") == len(usages)
    assert delta("inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for u in usages)
    assert metric(after, "jaxserve:num_requests_running") == 0
    assert metric(after, "jaxserve:num_requests_waiting") == 0
    assert metric(after, "jaxserve:kv_cache_usage_perc") == 0
    assert after[("jaxserve:compilations_since_warmup", ())] == 0  # present: the server warmed up
    # one request at a time: a step per generated token at least, and the model's time inside the steps'
    assert delta("engine_steps_total") >= sum(u.completion_tokens for u in usages)
    assert delta("engine_step_seconds_total") >= delta("engine_model_seconds_total") > 0


def test_health_answers_fast_while_the_engine_is_busy(client, url):
    """GET /health answers within 100 ms (median) while long streaming generations keep the engine busy."""
    stop = threading.Event()
    errors = []

    def generate(i: int):
        try:
            for _ in range(50):  # bounded; stopped by the event long before
                if stop.is_set():
                    return
                stream = client.completions.create(model="tiny", prompt="x" * (10 + i), max_tokens=100,
                                                   temperature=1.0, seed=i, stream=True, extra_body=FULL_LENGTH)
                for _chunk in stream:
                    pass
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=generate, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    latencies, busy = [], 0
    try:
        with httpx.Client(base_url=url, timeout=30) as probe:
            deadline = time.monotonic() + 60
            while metric(metric_samples(url), "jaxserve:num_requests_running") == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            for _ in range(10):
                busy += metric(metric_samples(url), "jaxserve:num_requests_running") > 0
                start = time.perf_counter()
                response = probe.get("/health")
                latencies.append(time.perf_counter() - start)
                assert response.status_code == 200
                time.sleep(0.02)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    assert busy >= 5, "the engine was not busy while /health was timed"
    assert statistics.median(latencies) < 0.1, latencies


# ------------------------------------------------------------------------------------------------
# the default model


@pytest.mark.default_model
def test_default_model_knows_the_capital_of_france():
    """`jaxserve serve` with no model serves SmolLM2-135M-Instruct, which answers 'Paris' at temperature 0."""
    args = ["--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "128"]
    with run_server(args) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        [model] = client.models.list().data
        out = client.chat.completions.create(model=model.id, temperature=0, max_tokens=32,
                                             messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in out.choices[0].message.content, out.choices[0].message.content
