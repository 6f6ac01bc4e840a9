"""The background engine loop: submissions from threads and asyncio, aborts, a dead loop reported, and
a dead or stuck loop (the step watchdog) ending every request it holds or has queued."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest
from engine_fakes import BlockingStep

from jaxserve import LLM, SamplingParams
from jaxserve.core import engine_loop as engine_loop_module
from jaxserve.core.engine_loop import EngineLoop, EngineStuck

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
               block_size=8, num_kv_pages=64, forbid_compilation_after_warmup=True)


@pytest.fixture
def loop(llm):
    engine_loop = EngineLoop(llm.engine).start()
    yield engine_loop
    engine_loop.shutdown()


def _prompt(i: int) -> list[int]:
    return [(7 * i + j) % 250 for j in range(5 + 3 * i)]


def test_threads_get_the_same_tokens_as_offline_generate(llm):
    """Requests submitted concurrently from threads stream exactly the offline greedy tokens."""
    expected = [o.outputs[0].token_ids for o in
                llm.generate([{"prompt_token_ids": _prompt(i)} for i in range(6)], GREEDY, use_tqdm=False)]
    loop = EngineLoop(llm.engine).start()  # only now: two threads must never step one engine
    results = {}

    def worker(i):
        stream = loop.submit(_prompt(i), GREEDY)
        tokens, reasons = [], []
        for delta in stream:
            tokens += delta.new_token_ids
            reasons.append(delta.finish_reason)
        results[i] = (tokens, reasons[-1])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    loop.shutdown()
    assert {i: r[0] for i, r in results.items()} == dict(enumerate(expected))
    assert all(r[1] == "length" for r in results.values())


def test_asyncio_streams_and_abort_frees_pages(llm, loop):
    """An asyncio caller streams tokens; aborting mid-stream ends it with 'abort' and frees its pages."""

    async def main():
        running_loop = asyncio.get_running_loop()
        long = loop.submit(_prompt(3), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                           loop=running_loop)
        short = loop.submit(_prompt(4), GREEDY, loop=running_loop)
        got = []
        async for delta in long:
            got += delta.new_token_ids
            if len(got) >= 3:
                loop.abort(long.request_id)
            if delta.finish_reason:
                reason = delta.finish_reason
        short_tokens = [t async for d in short for t in d.new_token_ids]
        return got, reason, short_tokens

    got, reason, short_tokens = asyncio.run(main())
    assert reason == "abort" and 3 <= len(got) < 100
    assert len(short_tokens) == 10
    deadline = time.monotonic() + 10
    while llm.engine.has_unfinished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not llm.engine.has_unfinished
    assert llm.engine.pool.num_used_pages == 0


def test_bad_request_fails_at_submit_and_loop_survives(loop):
    """Validation errors reach the submitting caller; the loop keeps serving."""
    with pytest.raises(ValueError, match="empty"):
        loop.submit([], GREEDY)
    tokens = [t for d in loop.submit(_prompt(1), GREEDY) for t in d.new_token_ids]
    assert len(tokens) == 10 and loop.is_alive


def test_dead_loop_is_reported(llm):
    """If a step raises, every open stream gets the error and is_alive turns False (for /health)."""
    engine_loop = EngineLoop(llm.engine).start()
    original = llm.engine.step

    def broken_step():
        raise RuntimeError("device fell over")

    llm.engine.step = broken_step
    try:
        deltas = list(engine_loop.submit(_prompt(2), GREEDY))
        assert isinstance(deltas[-1].error, RuntimeError)
        engine_loop._thread.join(5)
        assert not engine_loop.is_alive
        with pytest.raises(RuntimeError, match="not running"):
            engine_loop.submit(_prompt(2), GREEDY)
    finally:
        llm.engine.step = original
        for request_id in list(llm.engine.requests):
            llm.engine.abort_request(request_id)


# -- a dead or stuck loop leaves nobody waiting (issue 34) --------------------------------------------


def _last_deltas(streams, timeout_s: float) -> list:
    """Each stream's last delta, read on its own thread; None for a stream still open after `timeout_s`."""
    last = [None] * len(streams)

    def read(i):
        for delta in streams[i]:
            last[i] = delta

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(streams))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [None if t.is_alive() else d for t, d in zip(threads, last)]


@pytest.fixture
def blocked_loop(llm, monkeypatch, request):
    """An engine loop whose first step blocks in a `BlockingStep` (request.param: its error, if any);
    yields (loop, step). Afterwards the step is let go and the engine left with no request."""
    step = BlockingStep(getattr(request, "param", None))
    monkeypatch.setattr(llm.engine, "step", step)
    loops = []

    def make(**kwargs):
        loops.append(EngineLoop(llm.engine, **kwargs).start())
        return loops[-1]

    yield make, step
    step.gate.set()
    for engine_loop in loops:
        engine_loop.shutdown()
        engine_loop._thread.join(30)
    for request_id in list(llm.engine.requests):
        llm.engine.abort_request(request_id)


@pytest.mark.parametrize("blocked_loop", [RuntimeError("device fell over")], indirect=True)
def test_a_dying_loop_ends_the_requests_still_queued_too(blocked_loop):
    """A step raises while one request runs and three wait in the command queue (never taken by the
    engine): all four end with the error, none hangs."""
    make, step = blocked_loop
    engine_loop = make()
    streams = [engine_loop.submit(_prompt(0), GREEDY)]
    assert step.entered.wait(60)
    streams += [engine_loop.submit(_prompt(i), GREEDY) for i in range(1, 4)]
    step.gate.set()
    last = _last_deltas(streams, timeout_s=5)
    assert all(d is not None and d.error is not None for d in last), last
    assert all("device fell over" in str(d.error) for d in last)
    assert not engine_loop.is_alive


def test_fail_from_another_thread_ends_the_queued_requests_too(blocked_loop):
    """`fail` (a multi-host follower gone) while the engine thread is blocked in a step: the running
    request and the ones it never took from the queue all end."""
    make, step = blocked_loop
    engine_loop = make()
    streams = [engine_loop.submit(_prompt(0), GREEDY)]
    assert step.entered.wait(60)
    streams += [engine_loop.submit(_prompt(i), GREEDY) for i in range(1, 3)]
    engine_loop.fail("a follower is gone")
    last = _last_deltas(streams, timeout_s=5)
    assert all(d is not None and "a follower is gone" in str(d.error) for d in last), last
    with pytest.raises(RuntimeError, match="not running"):
        engine_loop.submit(_prompt(0), GREEDY)


def test_a_request_queued_as_the_loop_dies_is_not_left_waiting(llm):
    """The loop dies after `submit` checked it was alive and before its request was queued (the loop's
    last drain of the queue missed it): submit notices and refuses, leaving nothing queued."""
    engine_loop = EngineLoop(llm.engine).start()
    original = engine_loop._commands  # fault injection reaches inside on purpose

    class DiesFirst(queue.SimpleQueue):
        def put(self, item):
            engine_loop.fail("died in between")
            super().put(item)

    engine_loop._commands = DiesFirst()
    try:
        with pytest.raises(RuntimeError, match="not running"):
            engine_loop.submit(_prompt(1), GREEDY)
        assert engine_loop._commands.empty()
    finally:
        engine_loop._commands = original
        engine_loop.shutdown()


def test_the_watchdog_declares_a_stuck_step_and_ends_every_request(blocked_loop):
    """A step that never returns (a wedged device): past `iteration_timeout_s` the loop is dead with
    `EngineStuck`, and the running and the queued requests end with it."""
    make, step = blocked_loop
    engine_loop = make(iteration_timeout_s=1.0)
    streams = [engine_loop.submit(_prompt(0), GREEDY)]
    assert step.entered.wait(60)
    streams += [engine_loop.submit(_prompt(i), GREEDY) for i in range(1, 3)]
    last = _last_deltas(streams, timeout_s=60)
    assert all(d is not None and isinstance(d.error, EngineStuck) for d in last), last
    assert "stuck" in str(last[0].error) and "--engine-iteration-timeout-s" in str(last[0].error)
    assert not engine_loop.is_alive and isinstance(engine_loop.error, EngineStuck)


def test_the_derived_iteration_timeout_follows_the_slowest_real_step(llm, monkeypatch):
    """Without a setting the limit is the floor until steps are seen, then a multiple of the slowest."""
    monkeypatch.setattr(engine_loop_module, "ITERATION_TIMEOUT_MULTIPLE", 10**9)
    engine_loop = EngineLoop(llm.engine).start()
    try:
        assert engine_loop.iteration_timeout_s == engine_loop_module.MIN_ITERATION_TIMEOUT_S
        assert len([t for d in engine_loop.submit(_prompt(1), GREEDY) for t in d.new_token_ids]) == 10
        assert engine_loop.iteration_timeout_s > engine_loop_module.MIN_ITERATION_TIMEOUT_S
        assert engine_loop.is_alive
    finally:
        engine_loop.shutdown()
    assert EngineLoop(llm.engine, iteration_timeout_s=2.5).iteration_timeout_s == 2.5
    with pytest.raises(ValueError, match="iteration_timeout_s=0"):
        EngineLoop(llm.engine, iteration_timeout_s=0)
