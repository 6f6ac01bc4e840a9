"""--scheduling-policy (vLLM's `scheduling_policy`): a request's priority is honoured only under "priority".
Under the default, "fcfs", a non-zero priority is refused where every request is made
(`LLMEngine.make_request`), offline as over HTTP, so no client can jump the queue or force a preemption.
The ordering itself is tests/test_page_pool.py's; the HTTP 400 is tests/test_server_hardening.py's.
Over HTTP, arrival is the server's receipt of a request, not the end of its tokenization.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import pytest
from fastapi.testclient import TestClient

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine_config import EngineConfig, add_engine_flags, engine_config_from_args
from jaxserve.core.engine_loop import EngineLoop
from server.app import create_app

ENGINE = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, block_size=8, num_kv_pages=32)
PROMPTS = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}]
PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def test_the_flag_takes_vllms_names_and_defaults_to_fcfs():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config_from_args(parser.parse_args([])).scheduling_policy == "fcfs"
    assert engine_config_from_args(parser.parse_args(["--scheduling-policy", "priority"])).scheduling_policy \
        == "priority"
    with pytest.raises(ValueError, match="scheduling_policy='lottery' must be one of"):
        EngineConfig(scheduling_policy="lottery")


def test_offline_priorities_need_the_priority_policy(tiny_model_dir):
    """vLLM's rule and message: a ValueError naming the priority, and nothing is queued."""
    fcfs = LLM(tiny_model_dir("llama"), **ENGINE)
    with pytest.raises(ValueError, match="got priority 1 but priority scheduling is not enabled"):
        fcfs.generate(PROMPTS, PARAMS, use_tqdm=False, priority=[0, 1])
    assert not fcfs.engine.scheduler.has_unfinished and not fcfs.engine.requests
    assert [len(o.outputs[0].token_ids) for o in fcfs.generate(PROMPTS, PARAMS, use_tqdm=False, priority=[0, 0])] \
        == [2, 2]

    ranked = LLM(tiny_model_dir("llama"), **ENGINE, scheduling_policy="priority")
    outputs = ranked.generate(PROMPTS, PARAMS, use_tqdm=False, priority=[1, -1])
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in
                                                         fcfs.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_the_server_admits_by_receipt_whatever_order_tokenization_ends_in(tiny_model_dir, monkeypatch):
    """Two requests waiting together are admitted in the order the server received them, though the first
    one's tokenization (on one of the server's tokenizer threads) ends after the second's; each request's
    arrival_time is its receipt, before tokenizing."""
    llm = LLM(tiny_model_dir("llama"), **{**ENGINE, "max_num_seqs": 1})
    loop = EngineLoop(llm.engine).start()
    app = create_app(loop, "tiny", max_request_body_bytes=1 << 20)
    state = app.state.jaxserve
    first_tokenizing, engine_held = threading.Event(), threading.Event()
    run_blocking = state.run_blocking

    async def slow_for_the_first(fn, *args):  # the first prompt's tokenization ends after the second is queued
        if not first_tokenizing.is_set():
            first_tokenizing.set()
            while state.num_in_flight < 1:
                await asyncio.sleep(0.01)
        return await run_blocking(fn, *args)

    submitted, scheduled = [], []
    submit, schedule = loop.submit, llm.engine.scheduler.schedule

    def recording_submit(prompt_token_ids, *args, **kwargs):
        submitted.append((prompt_token_ids, kwargs["arrival_time"], time.monotonic()))
        return submit(prompt_token_ids, *args, **kwargs)

    def recording_schedule():
        output = schedule()
        scheduled.extend(r.prompt_token_ids for r, _ in output.scheduled if r.num_computed_tokens == 0)
        return output

    monkeypatch.setattr(state, "run_blocking", slow_for_the_first)
    monkeypatch.setattr(loop, "submit", recording_submit)
    monkeypatch.setattr(llm.engine.scheduler, "schedule", recording_schedule)
    try:
        held = loop.call(engine_held.wait)  # the engine thread waits here, so both requests wait together
        with TestClient(app) as client:
            body = {"model": "tiny", "max_tokens": 2, "ignore_eos": True, "temperature": 0}
            responses = {}
            first = threading.Thread(target=lambda: responses.update(
                first=client.post("/v1/completions", json={**body, "prompt": "the first request"})))
            first.start()
            assert first_tokenizing.wait(30)
            second = threading.Thread(target=lambda: responses.update(
                second=client.post("/v1/completions", json={**body, "prompt": [5, 6, 7]})))
            second.start()
            deadline = time.monotonic() + 30
            while len(submitted) < 2:
                assert time.monotonic() < deadline, submitted
                time.sleep(0.01)
            engine_held.set()
            held.result(30)
            first.join(60)
            second.join(60)
        assert [r.status_code for r in (responses["first"], responses["second"])] == [200, 200]
        (second_ids, second_received, _), (first_ids, first_received, first_submitted) = submitted
        assert second_ids == [5, 6, 7] and first_received < second_received < first_submitted
        assert scheduled == [first_ids, second_ids]
    finally:
        engine_held.set()
        loop.shutdown()
