"""A dead or stuck engine behind the HTTP server, in-process on the tiny random llama (issue 34).

Guards: when the step fails with requests running and others still queued for the engine thread,
every client gets a final error (a JSON error, or an SSE error event then [DONE]) and the admission
count returns to 0; a step that never returns trips the watchdog, /health turns 503 naming the stuck
engine, and the clients end the same way. The step is a stand-in that blocks on an event, so the
tests know which requests the engine took and which wait in its queue.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from engine_fakes import BlockingStep

from jaxserve import LLM
from jaxserve.core.engine_loop import EngineLoop
from server.app import create_app

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64,
               block_size=8, num_kv_pages=64)


@pytest.fixture
def blocked_server(llm, monkeypatch):
    """make(error, **loop_kwargs) -> (app, step): an app over an engine loop whose first step blocks in a
    `BlockingStep`. Afterwards the step is let go and the engine left with no request."""
    made = []

    def make(error: BaseException | None = None, **loop_kwargs):
        step = BlockingStep(error)
        monkeypatch.setattr(llm.engine, "step", step)
        engine_loop = EngineLoop(llm.engine, **loop_kwargs).start()
        made.append((engine_loop, step))
        return create_app(engine_loop, "tiny", max_queued_requests=8, max_request_body_bytes=2**20), step

    yield make
    for engine_loop, step in made:
        step.gate.set()
        engine_loop.shutdown()
        engine_loop._thread.join(30)
    for request_id in list(llm.engine.requests):
        llm.engine.abort_request(request_id)


async def _request(client: httpx.AsyncClient, stream: bool) -> tuple[int, dict]:
    """One completion; (status, the error it ended with: the JSON body's, or the last SSE event's)."""
    response = await client.post("/v1/completions", json={**BODY, "stream": stream})
    if not stream:
        return response.status_code, response.json().get("error")
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    return response.status_code, json.loads(events[-2]).get("error")


async def _until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _running_and_queued(app, step, client) -> list[asyncio.Task]:
    """Two requests the engine took (its step then blocks on them), then four it has not taken yet;
    returns their tasks once all six are admitted."""
    state = app.state.jaxserve
    tasks = [asyncio.create_task(_request(client, stream=i % 2 == 0)) for i in range(2)]
    await _until(step.entered.is_set)
    tasks += [asyncio.create_task(_request(client, stream=i % 2 == 0)) for i in range(4)]
    await _until(lambda: state.num_in_flight == 6)
    return tasks


def test_a_failed_step_ends_running_and_queued_requests_and_frees_their_slots(blocked_server):
    app, step = blocked_server(RuntimeError("device fell over"))
    state = app.state.jaxserve

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            tasks = await _running_and_queued(app, step, client)
            step.gate.set()  # the step raises: the loop dies
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
            health = await client.get("/health")
        return results, health

    results, health = asyncio.run(main())
    for stream, (status, error) in zip([True, False] * 3, results):
        assert error is not None and error["code"] == 500, results
        assert status == (200 if stream else 500)  # a stream's status went out with its first event
    assert state.num_in_flight == 0 and not state.open_submissions
    assert health.status_code == 503


def test_a_stuck_step_turns_health_503_and_ends_every_request(blocked_server):
    app, step = blocked_server(iteration_timeout_s=2.0)
    state = app.state.jaxserve

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            assert (await client.get("/health")).status_code == 200
            tasks = await _running_and_queued(app, step, client)
            health = await client.get("/health")
            while health.status_code == 200:  # the watchdog's limit is 2 s; bounded by the deadline below
                await asyncio.sleep(0.1)
                health = await client.get("/health")
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
        return results, health

    results, health = asyncio.run(asyncio.wait_for(main(), timeout=120))
    assert health.status_code == 503 and "stuck" in health.json()["error"]["message"]
    for status, error in results:
        assert error is not None and error["code"] == 503 and "stuck" in error["message"], results
    assert state.num_in_flight == 0 and not state.open_submissions
    assert not step.gate.is_set()  # the step is still blocked: nobody waited for it
