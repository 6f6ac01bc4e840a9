"""The background engine loop: submissions from threads and asyncio, aborts, and a dead loop reported."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine_loop import EngineLoop

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
