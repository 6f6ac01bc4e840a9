"""A real `jaxserve serve` process under shutdown signals and under a storm of hostile traffic.

Shutdown (tiny random llama): SIGTERM stops admission at once (503, /health too), lets in-flight
streams finish within `--shutdown-timeout`, ends the rest with an error event, and exits 0.
A stuck engine (a step blocked for good by the fault-injection hook): past --engine-iteration-timeout-s
/health turns 503, the requests on it end with a 503 error, and the server still stops on SIGINT.
The storm (the default model, whose real byte-level tokenizer meets random tokens at temperature 2):
sampling, dropped streams, huge stop lists, prompts and logit_bias maps, malformed bodies, all at
once; no 5xx, /health 200 throughout, and afterwards a normal request is served and KV usage is 0.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import signal
import subprocess
import threading
import time

import httpx
import pytest

from server_helpers import AUTH, SMALL_FLAGS, metric, metric_samples, parse_sse, run_server
from tiny_models import make_tiny_model

from jaxserve.core.engine_loop import FAULT_HANG_DIR_ENV


@pytest.fixture(scope="module")
def long_tiny_model(tmp_path_factory):
    """The tiny llama with 4,096 positions, for streams that outlast the checks made while they run."""
    directory = tmp_path_factory.mktemp("tiny_llama_4096")
    make_tiny_model("llama", directory, max_position_embeddings=4096)
    return directory


@contextlib.contextmanager
def _sigterm_during_a_long_stream(model_dir, shutdown_timeout: str):
    """Starts a server and a long greedy stream, sends SIGTERM after its first chunk, and yields
    (the server, a function that reads the rest of the stream as (events, ended with [DONE])).
    The tiny model streamed 480 tokens in about 0.3 s, which a fast CPU finished before the checks after
    SIGTERM had run (the drained server then gone: connection reset); 4,000 tokens take seconds, and only a
    zero timeout ends them for sure."""
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True, "temperature": 0}
    long_stream = ["--max-model-len", "4096", "--num-kv-pages", "1040"]  # after SMALL_FLAGS: these win
    with run_server([str(model_dir), *SMALL_FLAGS, *long_stream, "--shutdown-timeout", shutdown_timeout]) as srv:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            srv.proc.send_signal(signal.SIGTERM)
            yield srv, lambda: parse_sse([first, *lines])


def _exit_status_on_its_own(srv) -> int:
    """The drained server's exit status, waited for inside run_server's block: leaving the block sends
    SIGINT to a server still running, and a server still closing down after [DONE] then exits -2."""
    try:
        return srv.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("the server did not exit within 60 s of its drain:\n" + srv.stderr_tail()) from None


def test_sigterm_drains_in_flight_streams_then_exits_0(long_tiny_model):
    with _sigterm_during_a_long_stream(long_tiny_model, "120") as (srv, rest_of_stream):
        time.sleep(0.2)
        refused = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH,
                             timeout=30)
        health = httpx.get(srv.url + "/health", timeout=30)
        events, done = rest_of_stream()
        returncode = _exit_status_on_its_own(srv)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert health.status_code == 503
    assert done and events[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(e["choices"][0]["text"]) > 0 for e in events) > 1
    assert returncode == 0


def test_requests_still_running_at_the_shutdown_timeout_end_with_an_error_event(long_tiny_model):
    with _sigterm_during_a_long_stream(long_tiny_model, "0") as (srv, rest_of_stream):
        events, done = rest_of_stream()
        returncode = _exit_status_on_its_own(srv)
    assert done, "the stream must still end with [DONE]"
    assert sum(e["choices"][0]["finish_reason"] == "length" for e in events if "choices" in e) == 0
    error = events[-1]["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]
    assert returncode == 0


def test_a_stuck_engine_turns_health_503_and_ends_its_requests(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_HANG_DIR_ENV, str(tmp_path))
    results = {}

    def plain():
        results["plain"] = httpx.post(srv.url + "/v1/completions", headers=AUTH, timeout=120,
                                      json={"prompt": "hi", "max_tokens": 4})

    def streamed():
        with httpx.stream("POST", srv.url + "/v1/completions", headers=AUTH, timeout=120,
                          json={"prompt": "hi", "max_tokens": 4, "stream": True}) as response:
            results["streamed"] = parse_sse(response.iter_lines())

    with run_server([str(tiny_model_dir("llama")), *SMALL_FLAGS, "--engine-iteration-timeout-s", "2"]) as srv:
        (tmp_path / f"hang-{srv.proc.pid}").touch()
        threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        health = httpx.get(srv.url + "/health", timeout=30)
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(timeout=60) == 0, srv.stderr_tail()
    assert health.status_code == 503 and "stuck" in health.json()["error"]["message"]
    assert results["plain"].status_code == 503 and "stuck" in results["plain"].json()["error"]["message"]
    events, done = results["streamed"]
    assert done and events[-1]["error"]["code"] == 503 and "stuck" in events[-1]["error"]["message"]


# -------------------------------------------------------------------------------------------------
# the storm


@pytest.fixture(scope="module")
def default_server():
    # The default-model limits of test_server.py's and the notebook's engines (dtype auto), so the executables come
    # from the session's cache once one of them has compiled them.
    with run_server(["--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "128",
                     "--max-queued-requests", "256", "--api-key", AUTH["Authorization"].split()[1],
                     "--max-request-body-bytes", str(8 * 2**20)]) as srv:
        yield srv


class _HealthWatch(threading.Thread):
    """Polls /health until stopped; keeps every status it saw."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.statuses, self.stop = url, [], threading.Event()

    def run(self):
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                self.statuses.append(client.get(self.url + "/health").status_code)
                time.sleep(0.05)


@pytest.mark.default_model
def test_a_storm_of_sampling_drops_and_hostile_bodies_leaves_the_server_healthy(default_server):
    url = default_server.url
    watch = _HealthWatch(url)
    watch.start()
    statuses: list[tuple[str, int]] = []

    def sampled(i: int):
        body = {"messages": [{"role": "user", "content": f"Say something surprising, number {i}."}],
                "temperature": 2.0, "top_k": 0, "max_tokens": 160, "ignore_eos": True, "stream": i % 2 == 0}
        if body["stream"]:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH, timeout=600) as r:
                events, done = parse_sse(r.iter_lines())
                statuses.append(("sampled-stream", r.status_code))
                assert done and all("error" not in e for e in events), events[-1:]
                assert events[-1]["choices"][0]["finish_reason"] == "length"
        else:
            r = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=600)
            statuses.append(("sampled", r.status_code))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] == "length"
            assert r.json()["usage"]["completion_tokens"] == 160

    def dropped(i: int):
        body = {"prompt": f"Tell me about the number {i}.", "max_tokens": 200, "stream": True, "temperature": 1.0}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=600) as r:
            statuses.append(("dropped", r.status_code))
            if i % 2:  # after the first chunk; otherwise before reading anything
                next(r.iter_lines())

    def hostile(kind: str):
        plain = {"prompt": "hello", "max_tokens": 4}
        bodies = {
            "stop list": json.dumps({**plain, "stop": [f"stop{i}" for i in range(20_000)]}),
            "5 MB prompt": json.dumps({**plain, "prompt": "lorem ipsum " * (5 * 2**20 // 12)}),
            "logit_bias": json.dumps({**plain, "logit_bias": {str(i): 1.0 for i in range(10_000)}}),
            "bad json": '{"prompt": "hello", "max_tokens": ',
            "bad types": '{"prompt": {"a": 1}, "max_tokens": [1]}',
            "surrogate": '{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "empty": "",
        }
        path = "/v1/chat/completions" if kind == "surrogate" else "/v1/completions"
        r = httpx.post(url + path, content=bodies[kind], headers={**AUTH, "Content-Type": "application/json"},
                       timeout=600)
        statuses.append((kind, r.status_code))
        assert r.status_code in (400, 413), (kind, r.status_code, r.text[:300])
        assert r.json()["error"]["code"] == r.status_code

    kinds = ["stop list", "5 MB prompt", "logit_bias", "bad json", "bad types", "surrogate", "empty"]
    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        futures = [pool.submit(sampled, i) for i in range(24)]
        futures += [pool.submit(dropped, i) for i in range(120)]
        futures += [pool.submit(hostile, kind) for kind in kinds]
        for future in futures:
            future.result()
    watch.stop.set()
    watch.join(30)

    assert not [s for s in statuses if s[1] >= 500], statuses
    assert watch.statuses and set(watch.statuses) == {200}, sorted(set(watch.statuses))
    answer = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=120, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0,
        "max_tokens": 20})
    assert answer.status_code == 200 and "Paris" in answer.json()["choices"][0]["message"]["content"]
    deadline = time.monotonic() + 30
    while True:
        samples = metric_samples(url)
        usage, running = metric(samples, "jaxserve:kv_cache_usage_perc"), metric(samples, "jaxserve:num_requests_running")
        if (usage, running) == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (usage, running) == (0, 0)
    assert metric(samples, "jaxserve:request_success_total", finished_reason="error") == 0
