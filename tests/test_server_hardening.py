"""The HTTP edge under bad and hostile input (issue: hardening), in-process on the tiny random llama.

Each test guards one promise: errors name their field; limits on stop strings, logit_bias entries,
prompt lists and body size; text that is not Unicode is a 400; tokenization and grammar compiles never
run on the event loop; an admission slot comes back however a response ends; the API key is compared in
constant time and guards every route but /health, /version and the chat page; the page carries its CSP
wherever it is served; a JSON body must say it is JSON; `allowed_hosts` checks the Host header; a
priority without the priority policy is a 400; anything unexpected is a 500 in the OpenAI error shape
without internals.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading

import pytest
from fastapi.testclient import TestClient

from jaxserve import LLM

from jaxserve.core import structured_output
from jaxserve.core.engine_loop import EngineLoop
from jaxserve.config.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_STRING_LENGTH, MAX_STOP_STRINGS
from jaxserve.config.sampling_params import StructuredOutputsParams
from server import errors as server_errors
from server.app import CHAT_PAGE_HEADERS, check_allowed_hosts, create_app
from server.errors import INTERNAL_ERROR

API_KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY = 1024 * 1024


@pytest.fixture(scope="module")
def engine_loop(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
              block_size=8, num_kv_pages=64)
    loop = EngineLoop(llm.engine).start()
    yield loop
    loop.shutdown()


@pytest.fixture(scope="module")
def app(engine_loop):
    return create_app(engine_loop, "tiny", api_key=API_KEY, max_queued_requests=4, max_request_body_bytes=MAX_BODY)


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app, headers=AUTH, raise_server_exceptions=False) as c:
        yield c


def _error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["param"] == param, error
    return error


def _completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "hello", "max_tokens": 4, **fields}


@pytest.mark.parametrize("fields, param, words", [
    ({"logit_bias": {str(t): 1.0 for t in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias", "at most"),
    ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop", "at most"),
    ({"stop": "x" * (MAX_STOP_STRING_LENGTH + 1)}, "stop", "characters"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"stop_token_ids": [100_000]}, "stop_token_ids", "outside the vocabulary"),
    ({"logit_bias": {"100000": 1.0}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias", "token ids"),
    ({"min_tokens": 8, "max_tokens": 4}, "min_tokens", "must not exceed"),
    ({"prompt": [[1, 2]] * 9}, "prompt", "more than this server holds"),
    ({"n": 9}, "n", "more than this server holds"),
    ({"prompt": [300_000]}, "prompt", "outside the vocabulary"),
    ({"prompt": "word " * 200}, "prompt", "maximum context length"),
])
def test_errors_name_the_field_at_fault(client, fields, param, words):
    error = _error(client.post("/v1/completions", json=_completion(**fields)), 400, param)
    assert words in error["message"]


def test_a_huge_stop_list_and_logit_bias_are_refused_before_any_work(client):
    """20,000 stop strings and 10,000 logit_bias entries: a 400 each, and the server goes on."""
    _error(client.post("/v1/completions", json=_completion(stop=[f"stop{i}" for i in range(20_000)])), 400, "stop")
    _error(client.post("/v1/completions", json=_completion(logit_bias={str(i): 1 for i in range(10_000)})), 400,
           "logit_bias")
    assert client.post("/v1/completions", json=_completion()).status_code == 200


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\ud800 there"}]}', "messages"),
    ("/v1/completions", '{"prompt": "bad \\udfff", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": "ok", "stop": ["\\ud83d"], "max_tokens": 2}', "stop"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
])
def test_text_that_is_not_unicode_is_a_400_naming_the_field(client, path, body, param):
    """A JSON `\\ud800` escape decodes to a lone surrogate, which no tokenizer can take."""
    response = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert "surrogate" in _error(response, 400, param)["message"]


def test_a_body_over_the_limit_is_a_413_whether_its_length_is_declared_or_not(client):
    big = json.dumps(_completion(prompt="x" * (MAX_BODY + 1)))
    response = client.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert "larger than this server accepts" in _error(response, 413, None)["message"]

    def chunks():  # no Content-Length: the limit applies to the bytes as they arrive
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096].encode()

    response = client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert "larger than this server accepts" in _error(response, 413, None)["message"]
    assert client.post("/v1/completions", json=_completion()).status_code == 200


def test_malformed_bodies_are_400s(client):
    for body in ["{", "[]", "null", '{"prompt": 5}', '{"messages": "hi"}', '{"prompt": "a", "max_tokens": "x"}']:
        for path in ("/v1/completions", "/v1/chat/completions"):
            response = client.post(path, content=body, headers={"Content-Type": "application/json"})
            assert response.status_code == 400, (path, body, response.text)
            assert response.json()["error"]["code"] == 400


class _RecordingTokenizer:
    """Forwards to the real tokenizer and records which thread each call ran on."""

    def __init__(self, tokenizer):
        self._tokenizer, self.threads = tokenizer, []

    def __getattr__(self, name):
        attr = getattr(self._tokenizer, name)
        if name not in ("encode", "apply_chat_template", "decode"):
            return attr

        def call(*args, **kwargs):
            self.threads.append((name, threading.current_thread().name))
            return attr(*args, **kwargs)

        return call


def test_tokenization_and_chat_templates_run_off_the_event_loop(app, client, monkeypatch):
    state = app.state.jaxserve
    recorder = _RecordingTokenizer(state.tokenizer)
    monkeypatch.setattr(state, "tokenizer", recorder)
    assert client.post("/v1/completions", json=_completion(echo=True)).status_code == 200
    assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2}).status_code == 200
    assert client.post("/tokenize", json={"prompt": "hello"}).status_code == 200
    called = {name for name, _ in recorder.threads}
    assert {"encode", "apply_chat_template", "decode"} <= called
    assert all(thread.startswith("jaxserve-tokenize") for _, thread in recorder.threads), recorder.threads


def test_a_prompt_list_over_capacity_is_refused_before_tokenizing(app, client, monkeypatch):
    state = app.state.jaxserve
    recorder = _RecordingTokenizer(state.tokenizer)
    monkeypatch.setattr(state, "tokenizer", recorder)
    _error(client.post("/v1/completions", json=_completion(prompt=["a"] * 100)), 400, "prompt")
    assert recorder.threads == []


def test_a_stream_cancelled_before_its_first_event_gives_its_slot_back(app, engine_loop):
    """The client is gone by the time the response starts: the body generator never runs, and the
    submission must still be closed (its request aborted, its capacity freed)."""
    state = app.state.jaxserve
    body = json.dumps(_completion(stream=True, max_tokens=100, ignore_eos=True)).encode()

    async def one_dropped_stream():
        messages = [{"type": "http.request", "body": body, "more_body": False}, {"type": "http.disconnect"}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            pass

        headers = [(b"content-type", b"application/json"), (b"authorization", AUTH["Authorization"].encode())]
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        await app(scope, receive, send)

    async def main():
        for _ in range(12):  # more than the capacity (4 running + 4 queued): a leak would show as 503s
            await one_dropped_stream()
        return state.num_in_flight, len(state.open_submissions)

    assert asyncio.run(main()) == (0, 0)


def test_the_api_key_is_compared_in_constant_time(client, monkeypatch):
    calls = []
    real = server_errors.hmac.compare_digest
    monkeypatch.setattr(server_errors.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/v1/models").status_code == 200
    assert calls == [(b"Bearer wrong", f"Bearer {API_KEY}".encode()), (f"Bearer {API_KEY}".encode(),) * 2]


def test_an_unexpected_exception_is_a_500_in_the_openai_shape_without_internals(app, client, monkeypatch):
    class Exploding:
        @property
        def source(self):
            raise RuntimeError("secret internal detail")

    monkeypatch.setattr(app.state.jaxserve.engine, "model", Exploding())
    response = client.get("/v1/models")
    error = _error(response, 500, None)
    assert error["message"] == INTERNAL_ERROR and "secret" not in response.text


def test_a_priority_without_the_priority_policy_is_a_400_naming_it(client):
    """The engine runs fcfs (the default): a client may not jump the queue or force preemptions."""
    for path, body in [("/v1/completions", _completion(priority=-1)),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                 "priority": 3})]:
        error = _error(client.post(path, json=body), 400, "priority")
        assert "priority scheduling is not enabled" in error["message"] and "--scheduling-policy" in error["message"]
    assert client.post("/v1/completions", json=_completion(priority=0)).status_code == 200


KEYED_ROUTES = [("GET", "/metrics", None), ("GET", "/server_info", None), ("POST", "/tokenize", {"prompt": "hi"}),
                ("POST", "/detokenize", {"tokens": [104, 105]}), ("GET", "/v1/models", None)]


@pytest.mark.parametrize("method, path, body", KEYED_ROUTES, ids=[path for _, path, _ in KEYED_ROUTES])
def test_the_api_key_guards_every_route_that_tells_or_costs(app, method, path, body):
    with TestClient(app, raise_server_exceptions=False) as keyless:
        _error(keyless.request(method, path, json=body), 401, None)
        wrong = keyless.request(method, path, json=body, headers={"Authorization": "Bearer wrong"})
        _error(wrong, 401, None)
        assert keyless.request(method, path, json=body, headers=AUTH).status_code == 200


def test_probes_the_version_and_the_chat_page_need_no_key(app):
    """/health for probes; the page asks for the key itself and sends it on its /v1 calls."""
    with TestClient(app, raise_server_exceptions=False) as keyless:
        for path in ("/health", "/version", "/", "/static/index.html", "/static/chat.js"):
            assert keyless.get(path).status_code == 200, path
        _error(keyless.get("/no/such/route"), 401, None)  # unknown routes are guarded too: nothing to probe


def test_every_path_that_serves_the_chat_page_sends_its_csp(client):
    page = client.get("/")
    assert page.status_code == 200 and "<html" in page.text.lower()
    served = []
    for path in ("/", "/static/index.html", "/static/", "/static", "/index.html", "/static/./index.html"):
        response = client.get(path)
        if response.status_code == 200 and response.text == page.text:
            served.append(path)
            for name, value in CHAT_PAGE_HEADERS.items():
                assert response.headers.get(name) == value, (path, name, response.headers)
    assert {"/", "/static/index.html"} <= set(served), served


CROSS_SITE_CONTENT_TYPES = [{"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}, {}]


@pytest.mark.parametrize("headers", CROSS_SITE_CONTENT_TYPES, ids=["text/plain", "form", "no-content-type"])
def test_a_json_body_that_does_not_say_it_is_json_is_refused_unparsed(app, client, headers, monkeypatch):
    """A page on another site can send these without a CORS preflight (CSRF, DNS rebinding): the body is
    never parsed as JSON, so the request is a 4xx and nothing reaches the engine."""
    submitted = []

    def submit(*args, **kwargs):
        submitted.append(args)
        raise RuntimeError("the test's engine takes nothing")  # a 503, so a body that got here fails the test

    monkeypatch.setattr(app.state.jaxserve.engine_loop, "submit", submit)
    body = json.dumps(_completion()).encode()
    response = client.post("/v1/completions", content=body, headers=headers)
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    assert response.json()["error"]["code"] == response.status_code and submitted == []


@pytest.fixture(scope="module")
def host_checked(engine_loop):
    app = create_app(engine_loop, "tiny", max_request_body_bytes=MAX_BODY, allowed_hosts=["localhost", "127.0.0.1"])
    with TestClient(app, base_url="http://localhost:8000") as c:
        yield c


def test_a_host_header_outside_allowed_hosts_is_a_400(host_checked):
    """Against DNS rebinding: a page at evil.example that resolves to 127.0.0.1 sends Host: evil.example."""
    for host in ("evil.example", "evil.example:8000", "localhost.evil.example", "testserver"):
        for path in ("/health", "/v1/models", "/"):
            assert host_checked.get(path, headers={"Host": host}).status_code == 400, (host, path)
    for host in ("localhost:8000", "127.0.0.1", "LOCALHOST"):
        assert host_checked.get("/health", headers={"Host": host}).status_code == 200, host


def test_without_allowed_hosts_any_host_is_served(client):
    assert client.get("/health", headers={"Host": "evil.example"}).status_code == 200


@pytest.mark.parametrize("host", ["localhost:8000", "", "*example.com", "a.*.example.com", "::1"])
def test_allowed_hosts_are_names_without_ports(host):
    with pytest.raises(ValueError, match="allowed host"):
        check_allowed_hosts([host])
    check_allowed_hosts(["localhost", "*.example.com", "*", "[::1]"])


def test_a_grammar_evicted_before_admission_is_not_compiled_again_on_the_event_loop(client, monkeypatch):
    """The server compiles a constraint on a tokenizer thread, then admits the request on the event loop;
    with a cache that keeps nothing (as one full of other clients' grammars), admission must not compile."""
    threads = []
    real = StructuredOutputsParams.llguidance_grammar

    def recording(self):
        threads.append(threading.current_thread().name)
        return real(self)

    monkeypatch.setattr(StructuredOutputsParams, "llguidance_grammar", recording)
    monkeypatch.setattr(structured_output, "_CACHE_SIZE", 0)
    for regex in ("(ab){1,3}c", "x[yz]{2}"):  # distinct from any other test's, so each really compiles
        body = _completion(structured_outputs={"regex": regex}, max_tokens=8, temperature=0)
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert re.fullmatch(regex, response.json()["choices"][0]["text"]), response.json()
    assert len(threads) == 2 and all(name.startswith("jaxserve-tokenize") for name in threads), threads
