"""One request's failure never touches another (issue: hardening, per-request fault isolation).

Each test breaks one request in one place where the engine thread handles it (detokenizing, its
sampling row, its logprobs, delivering its delta) and checks that it alone ends with finish reason
"error" and its pages freed, while the requests beside it produce exactly the tokens they produce
alone, and the loop stays alive. A failure of the step itself (the model call) still ends the loop.
"""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.core import scheduler as scheduler_module
from jaxserve.core.detokenizer import IncrementalDetokenizer
from jaxserve.core.engine_loop import EngineLoop
from jaxserve.errors import RequestFailed
from jaxserve.core.request import RequestStatus

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
               block_size=8, num_kv_pages=64, forbid_compilation_after_warmup=True)


def _prompt(i: int) -> list[int]:
    return [(11 * i + 3 * j) % 250 for j in range(6 + 2 * i)]


@pytest.fixture(scope="module")
def alone(llm) -> dict[int, list[int]]:
    """Each prompt's greedy tokens when it runs with nothing broken."""
    outs = llm.generate([{"prompt_token_ids": _prompt(i)} for i in range(4)], GREEDY, use_tqdm=False)
    return {i: o.outputs[0].token_ids for i, o in enumerate(outs)}


class _ExplodingDetokenizer:
    """Stands in for a request's detokenizer and raises on its `fail_at`-th token."""

    def __init__(self, fail_at: int):
        self.text, self.hold_back, self.calls, self.fail_at = "", 0, 0, fail_at

    def add(self, token_ids):
        self.calls += 1
        if self.calls >= self.fail_at:
            raise RuntimeError("boom in the detokenizer")
        return None


def _run(engine, requests) -> None:
    for _ in range(200):
        if not engine.has_unfinished:
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def _assert_isolated(engine, requests, broken: int, alone: dict[int, list[int]], message: str) -> None:
    for i, request in enumerate(requests):
        if i == broken:
            assert request.status is RequestStatus.FINISHED_ERROR and request.finish_reason == "error"
            assert request.error == message
            assert request.page_table == []
        else:
            assert request.finish_reason == "length", (i, request.finish_reason)
            assert request.output_token_ids == alone[i], i
    stats = engine.get_stats()
    assert stats["num_used_pages"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_a_detokenizer_failure_ends_that_request_alone(llm, alone):
    engine = llm.engine
    requests = [engine.add_request(_prompt(i), GREEDY) for i in range(4)]
    requests[1].detokenizer = _ExplodingDetokenizer(fail_at=3)
    _run(engine, requests)
    _assert_isolated(engine, requests, 1, alone, "detokenizing its output failed")
    assert len(requests[1].output_token_ids) == 3  # it ran until it failed


def test_a_sampling_row_failure_ends_that_request_alone(llm, alone, monkeypatch):
    """The broken request's row runs inert (its pages' K/V are still written as scheduled)."""
    engine = llm.engine
    poisoned = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, seed=1234)
    fill = engine.runner.inputs.fill_sampling_row

    def fill_or_fail(tensors, row, seq):
        if seq.params is poisoned:
            raise RuntimeError("boom in the sampling row")
        fill(tensors, row, seq)

    monkeypatch.setattr(engine.runner.inputs, "fill_sampling_row", fill_or_fail)
    requests = [engine.add_request(_prompt(i), poisoned if i == 2 else GREEDY) for i in range(4)]
    _run(engine, requests)
    _assert_isolated(engine, requests, 2, alone, "building its sampling row failed")
    assert requests[2].output_token_ids == []


def test_a_logprobs_failure_ends_that_request_alone(llm, alone, monkeypatch):
    engine = llm.engine
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    entry = getattr(scheduler_module, "_logprob_entry")  # fault injection reaches inside on purpose
    calls = []

    def entry_or_fail(sampled, row, num_top):
        calls.append(row)
        if len(calls) == 4:
            raise RuntimeError("boom in the logprobs")
        return entry(sampled, row, num_top)

    monkeypatch.setattr(scheduler_module, "_logprob_entry", entry_or_fail)
    requests = [engine.add_request(_prompt(i), with_logprobs if i == 0 else GREEDY) for i in range(4)]
    _run(engine, requests)
    _assert_isolated(engine, requests, 0, alone, "building its logprobs failed")


def test_the_prefix_cache_stays_correct_after_a_request_fails_mid_prompt(llm, alone, monkeypatch):
    """A request that fails in a step that registered its pages in the prefix cache still had their
    K/V written: a later request sharing that prefix gets the tokens it gets from a cold cache."""
    engine = llm.engine
    engine.pool.reset_prefix_cache()
    shared = [(5 * j + 1) % 250 for j in range(40)]
    cold = llm.generate([{"prompt_token_ids": shared + [9]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine.pool.reset_prefix_cache()
    poisoned = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, seed=99)
    fill = engine.runner.inputs.fill_sampling_row
    monkeypatch.setattr(engine.runner.inputs, "fill_sampling_row",
                        lambda t, i, s: (_ for _ in ()).throw(RuntimeError("boom")) if s.params is poisoned
                        else fill(t, i, s))
    failing = engine.add_request(shared + [7], poisoned)
    _run(engine, [failing])
    assert failing.finish_reason == "error"
    later = engine.add_request(shared + [9], GREEDY)
    _run(engine, [later])
    assert later.num_cached_tokens > 0  # it did reuse the failed request's pages
    assert later.output_token_ids == cold


def test_the_loop_delivers_the_error_to_that_stream_only_and_stays_alive(llm, alone):
    engine_loop = EngineLoop(llm.engine).start()
    try:
        streams = [engine_loop.submit(_prompt(i), GREEDY) for i in range(4)]
        streams[3].request.detokenizer = _ExplodingDetokenizer(fail_at=2)
        results = {}
        for i, stream in enumerate(streams):
            tokens, last = [], None
            for delta in stream:
                tokens += delta.new_token_ids
                last = delta
            results[i] = (tokens, last)
        assert engine_loop.is_alive and engine_loop.error is None
        for i in range(3):
            assert results[i][0] == alone[i] and results[i][1].finish_reason == "length"
        tokens, last = results[3]
        assert last.finish_reason == "error" and isinstance(last.error, RequestFailed)
        assert str(last.error) == "detokenizing its output failed"
        after = engine_loop.submit(_prompt(0), GREEDY)  # a new request is served normally
        assert [t for d in after for t in d.new_token_ids] == alone[0]
    finally:
        engine_loop.shutdown()


def test_a_failure_of_the_step_itself_still_ends_the_loop(llm, monkeypatch):
    engine_loop = EngineLoop(llm.engine).start()
    try:
        monkeypatch.setattr(llm.engine.runner, "launch", lambda *a, **k: (_ for _ in ()).throw(
            RuntimeError("the device is gone")))
        stream = engine_loop.submit(_prompt(0), GREEDY)
        last = list(stream)[-1]
        assert isinstance(last.error, RuntimeError) and not engine_loop.is_alive
    finally:
        engine_loop.shutdown()
        monkeypatch.undo()
        for request_id in list(llm.engine.requests):
            llm.engine.abort_request(request_id)


class _InvalidPrefixOnce:
    """A DecodeStream stand-in that raises tokenizers' "Invalid prefix encountered" once."""

    def __init__(self):
        self.calls = 0

    def step(self, backend, token):
        self.calls += 1
        if self.calls == 2:
            raise Exception("Invalid prefix encountered")
        return f"<{token}>"


def test_an_invalid_prefix_in_the_decode_stream_restarts_it_instead_of_failing(llm):
    """tokenizers' DecodeStream can lose its prefix on some byte sequences; the request goes on."""
    a, b, c = llm.tokenizer.encode("abc", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(llm.tokenizer, SamplingParams(), [a, b])
    detokenizer.add([a])
    detokenizer._stream = _InvalidPrefixOnce()
    detokenizer.add([b, c])  # the second step raises; "c" then comes from a fresh (real) stream
    assert detokenizer.text == f"a<{b}>c"
    other = IncrementalDetokenizer(llm.tokenizer, SamplingParams(), [a, b])
    other._stream = type("Broken", (), {"step": lambda self, _, t: (_ for _ in ()).throw(ValueError("other"))})()
    with pytest.raises(ValueError, match="other"):  # any other error still fails (that request alone)
        other.add([a])
