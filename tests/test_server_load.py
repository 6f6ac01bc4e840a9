"""The server under load: many concurrent streams with disconnects, a full queue, and schema fuzzing.

Each server here is a real `jaxserve serve` process on the tiny random llama. The load server's queue
holds every client of the load test, so no request there should be refused; the small server has room
for only four requests (2 running + 2 queued), to see the 503s and to watch long requests get aborted.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from server_helpers import AUTH, SMALL_FLAGS, TINY_FLAGS, metric, metric_samples, parse_sse, run_server

NUM_CLIENTS = 64


@pytest.fixture(scope="module")
def load_server(tiny_model_dir):
    """Room in the queue for every client of the load test, so none of them is refused."""
    with run_server([str(tiny_model_dir("llama")), *TINY_FLAGS, "--max-queued-requests", str(NUM_CLIENTS),
                     "--scheduling-policy", "priority"]) as srv:
        yield srv


def wait_until_idle(url: str, timeout_s: float = 30.0) -> dict:
    """Polls /metrics until nothing runs or waits and no KV page is held; returns the last samples."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = metric_samples(url)
        idle = (metric(samples, "jaxserve:num_requests_running") == 0
                and metric(samples, "jaxserve:num_requests_waiting") == 0
                and metric(samples, "jaxserve:kv_cache_usage_perc") == 0)
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.25)


def assert_error_shape(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == status, error


def test_concurrent_streams_with_disconnects_release_everything(load_server):
    """64 concurrent streams, a third dropped mid-stream: finished ones end with [DONE]; then nothing runs,
    nothing waits and the KV usage gauge is back to 0 (disconnected requests were aborted, pages freed)."""
    url = load_server.url
    rng = random.Random(0)
    plans = []
    for i in range(NUM_CLIENTS):
        chat = i % 2 == 1
        body = {"model": "tiny", "stream": True, "max_tokens": rng.randint(8, 40), "temperature": 1.0, "seed": i,
                "ignore_eos": True}
        body.update({"messages": [{"role": "user", "content": f"client {i} " + "w" * rng.randint(1, 40)}]} if chat
                    else {"prompt": f"client {i} " + "p" * rng.randint(1, 60)})
        disconnect_after = rng.randint(1, 6) if i % 3 == 0 else None
        plans.append(("/v1/chat/completions" if chat else "/v1/completions", body, disconnect_after))

    async def one(client: httpx.AsyncClient, path: str, body: dict, disconnect_after: int | None) -> dict:
        events, done = 0, False
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                return {"status": response.status_code, "text": (await response.aread()).decode()}
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                    break
                if line.startswith("data: "):
                    event = json.loads(line[len("data: "):])
                    assert "error" not in event, event
                    events += 1
                    if disconnect_after is not None and events >= disconnect_after:
                        break  # leaving the block closes the connection mid-stream
        return {"status": 200, "events": events, "done": done}

    async def main() -> list:
        limits = httpx.Limits(max_connections=NUM_CLIENTS, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, *plan) for plan in plans)), timeout=240)

    results = asyncio.run(main())
    assert all(r["status"] == 200 for r in results), [r for r in results if r["status"] != 200][:3]
    for (_, body, disconnect_after), result in zip(plans, results):
        if disconnect_after is None:
            assert result["done"], ("a completed stream did not end with [DONE]", body, result)
            assert result["events"] >= 2
    samples = wait_until_idle(url)
    assert metric(samples, "jaxserve:num_requests_running") == 0
    assert metric(samples, "jaxserve:num_requests_waiting") == 0
    assert metric(samples, "jaxserve:kv_cache_usage_perc") == 0
    assert httpx.get(url + "/health", timeout=30).status_code == 200


@pytest.fixture(scope="module")
def small_server(tiny_model_dir):
    """Room for 2 running + 2 queued requests, and a context long enough for requests of hundreds of steps."""
    with run_server([str(tiny_model_dir("llama")), *SMALL_FLAGS]) as srv:
        yield srv


LONG = 400  # tokens: hundreds of engine steps, far longer than a burst of requests takes to arrive


def test_full_queue_answers_503_with_retry_after(small_server):
    """With max_num_seqs 2 and max_queued_requests 2, a burst of 8 long requests gets 503 + Retry-After in the
    error shape for those beyond the 4 admitted, and every admitted request completes."""
    url = small_server.url
    barrier = threading.Barrier(8)
    results: list = [None] * 8

    def fire(i: int):
        body = {"prompt": f"request {i}", "max_tokens": LONG, "ignore_eos": True, "stream": i % 2 == 0}
        with httpx.Client(base_url=url, headers=AUTH, timeout=180) as client:
            barrier.wait(timeout=60)
            with client.stream("POST", "/v1/completions", json=body) as response:
                response.read()
                results[i] = response

    threads = [threading.Thread(target=fire, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert all(r is not None for r in results), "a client thread did not finish"
    rejected = [r for r in results if r.status_code == 503]
    admitted = [(i, r) for i, r in enumerate(results) if r.status_code != 503]
    assert rejected, "no request was refused"
    assert len(admitted) >= 4, [r.status_code for r in results]
    for response in rejected:
        assert_error_shape(response, 503)
        assert int(response.headers["retry-after"]) > 0
    for i, response in admitted:
        assert response.status_code == 200, response.text
        if i % 2 == 0:
            events, done = parse_sse(response.text.splitlines())
            assert done and events[-1]["choices"][0]["finish_reason"] == "length"
        else:
            assert response.json()["usage"]["completion_tokens"] == LONG
    # the capacity comes back: a new request is admitted once the others are done
    ok = httpx.post(url + "/v1/completions", headers=AUTH, timeout=60, json={"prompt": "again", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    samples = wait_until_idle(url)
    assert metric(samples, "jaxserve:kv_cache_usage_perc") == 0


def test_streaming_client_disconnect_stops_generation(small_server):
    """A streaming client that hangs up on a long request aborts it (vLLM #10806): the engine is idle again
    in well under the time the whole request takes, and its pages are freed."""
    url = small_server.url
    # n=4 fills both running slots and the queue: about two rounds of 480 steps
    body = {"prompt": "hang up on me", "max_tokens": 480, "ignore_eos": True, "n": 4, "stream": True}
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client, \
            httpx.Client(base_url=url, timeout=30) as probe:
        metric_samples(url, probe)  # a warm connection, so a scrape costs milliseconds
        start = time.perf_counter()
        with client.stream("POST", "/v1/completions", json=body) as response:
            _, done = parse_sse(response.iter_lines())
        full_s = time.perf_counter() - start
        assert done
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for number, _line in enumerate(response.iter_lines()):
                if number >= 3:
                    break  # leaving the block closes the connection
        hung_up = time.perf_counter()
        while time.perf_counter() < hung_up + 30:
            samples = metric_samples(url, probe)
            if (metric(samples, "jaxserve:num_requests_running") == 0
                    and metric(samples, "jaxserve:num_requests_waiting") == 0):
                break
        idle_s = time.perf_counter() - hung_up
    # had it run on, the engine would stay busy for about full_s
    assert idle_s < full_s / 2, (idle_s, full_s)
    samples = wait_until_idle(url)
    assert metric(samples, "jaxserve:kv_cache_usage_perc") == 0


def test_non_streaming_client_disconnect_frees_everything(small_server):
    """A non-streaming client that times out and hangs up leaves nothing running and no KV page held
    (whether it is aborted early is test_non_streaming_client_disconnect_aborts_the_request's business)."""
    url = small_server.url
    body = {"prompt": "hang up on me", "max_tokens": LONG, "ignore_eos": True, "n": 2}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(60, read=0.05))
    samples = wait_until_idle(url)
    assert metric(samples, "jaxserve:num_requests_running") == 0
    assert metric(samples, "jaxserve:kv_cache_usage_perc") == 0
    ok = httpx.post(url + "/v1/completions", headers=AUTH, timeout=60, json={"prompt": "again", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_non_streaming_client_disconnect_aborts_the_request(load_server):
    """A non-streaming request whose client hangs up is aborted (vLLM #10806, non-streaming): kept waiting
    behind higher-priority streams for seconds after the hang-up, it must never run once they stop."""
    url = load_server.url
    stop = threading.Event()
    completed, errors = [0] * 16, []

    def background(i: int):  # 16 streams at priority -1 keep all 8 slots and 8 queue places busy
        rng = random.Random(i)
        try:
            with httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:
                for _ in range(500):  # bounded; stopped by the event long before
                    if stop.is_set():
                        return
                    body = {"prompt": f"background {i}", "max_tokens": rng.randint(40, 100), "ignore_eos": True,
                            "stream": True, "priority": -1}
                    with client.stream("POST", "/v1/completions", json=body) as response:
                        assert response.status_code == 200, response.read()
                        _, done = parse_sse(response.iter_lines())
                    assert done
                    completed[i] += 1
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    before = metric_samples(url)
    threads = [threading.Thread(target=background, args=(i,), daemon=True) for i in range(16)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 60
        while metric(metric_samples(url), "jaxserve:num_requests_waiting") < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        body = {"prompt": "hang up on me", "max_tokens": 50, "ignore_eos": True, "n": 4, "priority": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(60, read=0.05))
        time.sleep(2.0)  # several of the server's 0.5 s disconnect polls, while the request can only wait
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors[:3]
    after = wait_until_idle(url)
    finished = (metric(after, "jaxserve:request_success_total", finished_reason="length")
                - metric(before, "jaxserve:request_success_total", finished_reason="length"))
    assert finished == sum(completed), f"{finished - sum(completed)} choices ran after their client had gone"


# ------------------------------------------------------------------------------------------------
# schema fuzzing


OPERATIONS = [("GET", "/health"), ("GET", "/version"), ("GET", "/metrics"), ("GET", "/v1/models"),
              ("GET", "/server_info"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/completions"),
              ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}")]


@pytest.fixture(scope="module")
def api_schema(load_server):
    return schemathesis.openapi.from_url(load_server.url + "/openapi.json")


def test_fuzzed_operations_cover_the_schema(api_schema):
    """The fuzz list below names every operation in /openapi.json (a new endpoint gets fuzzed too)."""
    found = {(result.ok().method.upper(), result.ok().path) for result in api_schema.get_all_operations()}
    assert found == set(OPERATIONS)


FUZZ_CASES = [(method, path, GenerationMode.POSITIVE) for method, path in OPERATIONS] + [
    (method, path, GenerationMode.NEGATIVE) for method, path in OPERATIONS if method == "POST"]  # GETs take no input


@pytest.mark.parametrize("method,path,mode", FUZZ_CASES, ids=[f"{m}-{p}-{g.value}" for m, p, g in FUZZ_CASES])
def test_fuzz_openapi_never_500(api_schema, method, path, mode):
    """Schema-generated requests (valid and invalid) never get a 5xx other than 503 (overload), and every
    error keeps the OpenAI shape."""
    operation = api_schema[path][method]

    @settings(max_examples=30 if mode == GenerationMode.POSITIVE else 15, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        response = case.call(headers=AUTH, timeout=120)
        assert response.status_code < 500, (
            case.method, case.path, case.body, response.status_code, response.text[:500])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) >= {"message", "type", "param", "code"}, error

    fuzz()


def test_server_is_healthy_after_fuzzing(load_server):
    """After the fuzzing (and everything before it) /health is still 200 and nothing is left running."""
    assert httpx.get(load_server.url + "/health", timeout=30).status_code == 200
    samples = wait_until_idle(load_server.url)
    assert metric(samples, "jaxserve:num_requests_running") == 0
    assert metric(samples, "jaxserve:kv_cache_usage_perc") == 0
