"""A randomized stateful test of the engine core: requests come, are stepped, aborted, preempted and
failed in any order, and the page pool's and the requests' invariants hold after every action.

Hypothesis drives `EngineMachine` (a `RuleBasedStateMachine`) against one real engine on the tiny
random llama, with a KV pool of 10 pages of 8 tokens: a few requests fill it, so the scheduler
preempts on its own, besides the rule that preempts directly. Each example starts from a fresh pool
and scheduler, so a failing example replays the same way while Hypothesis shrinks it.

Invariants, after every rule:
- every allocatable page (1..num_pages-1) is either free (reference count 0, in the free queue) or
  owned, its reference count the number of running requests whose block table holds it (shared
  prefix pages count once per holder); page 0, the dummy page, is never handed out;
- the prefix cache's hash -> page map and the pool's per-page hashes agree, and a cached page in a
  request's block table carries that request's hash for that position;
- a waiting request holds no pages; a running one holds exactly the pages its computed tokens need;
- every request the test added and did not see end is in the engine, running or waiting, once;
- every request ends exactly once: `step()` returns it finished once (or `abort_request` /
  `fail_request` ended it), its finish reason is "stop", "length", "abort" or "error" and never
  changes, it holds no pages, and `step()` never returns it again;
- when everything has ended (the teardown steps until it has), every page is free and the engine
  reports `kv_cache_usage == 0`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import random
import sys
import time

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine_config import EngineConfig
from jaxserve.runner.page_pool import PagePool
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from tiny_models import EOS_ID, VOCAB_SIZE

MAX_MODEL_LEN, PAGE_SIZE = 64, 8
# 10 pages hold 80 tokens: two or three requests of a few dozen tokens fill them. One prefill bucket
# and one decode bucket keep the warm-up to two compilations.
ENGINE = dict(max_model_len=MAX_MODEL_LEN, block_size=PAGE_SIZE, num_kv_pages=10, max_num_seqs=4,
              max_num_batched_tokens=32, min_prefill_bucket=32, min_decode_bucket=4,
              forbid_compilation_after_warmup=True, scheduling_policy="priority")
FINISH_REASONS = {"stop", "length", "abort", "error"}
MAX_DRAIN_STEPS = 2000
# Derandomized and without a database, so CI runs the same cases every time; one bug reported, shrunk.
SETTINGS = settings(max_examples=50, stateful_step_count=50, deadline=None, derandomize=True, database=None,
                    report_multiple_bugs=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), **ENGINE).engine


class _FailingDetokenizer:
    """Stands in for a request's detokenizer and raises on its next token, as a tokenizer that cannot
    decode the model's output would; `text` and `hold_back` are what the rest of the engine reads."""

    text, hold_back = "", 0

    def add(self, token_ids):
        raise RuntimeError("injected detokenizer failure")


@st.composite
def sampling_params(draw, prompt: list[int], stop_chars: list[str]) -> SamplingParams:
    """Any mix of the settings: greedy or random, truncation, penalties, biases, logprobs, stops.

    Stop ids and stop strings are drawn from the prompt's last tokens: the default-init tiny llama
    tends to repeat its last token, so such stops do fire."""
    max_tokens = draw(st.integers(1, 8))
    greedy = draw(st.booleans())
    stop_ids = draw(st.lists(st.sampled_from(sorted({*prompt[-3:], EOS_ID})), max_size=2))
    stop = draw(st.lists(st.builds(lambda c, n: c * n, st.sampled_from(stop_chars), st.integers(1, 2)),
                         max_size=2)) if stop_chars else []
    return SamplingParams(
        temperature=0.0 if greedy else draw(st.sampled_from([0.5, 1.0, 2.0])),
        top_k=draw(st.sampled_from([0, 1, 5, 50])),
        top_p=draw(st.sampled_from([1.0, 0.9, 0.3])),
        min_p=draw(st.sampled_from([0.0, 0.1])),
        presence_penalty=draw(st.sampled_from([0.0, 0.0, 1.5, -1.0])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.0, 0.5])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3, 0.8])),
        seed=draw(st.integers(0, 2**32 - 1)),  # never drawn by the engine: replays sample the same
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)),
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=draw(st.booleans()),
        include_stop_str_in_output=draw(st.booleans()),
        logprobs=draw(st.none() | st.integers(0, 3)),
        logit_bias=draw(st.none() | st.dictionaries(st.integers(0, VOCAB_SIZE - 1), st.sampled_from([-5.0, 3.0]),
                                                    max_size=3)),
    )


class EngineMachine(RuleBasedStateMachine):
    def __init__(self, engine, stats: collections.Counter):
        super().__init__()
        self.engine, self.stats = engine, stats
        cfg = engine.cfg
        engine.requests.clear()  # what an example that failed left behind
        engine.pool = PagePool(engine.runner.num_pages, cfg.block_size, cfg.enable_prefix_caching)
        engine.scheduler = Scheduler(cfg, engine.pool, engine.runner.prefill_buckets)
        self.live: dict[str, Request] = {}  # added, not yet seen to end
        self.ended: dict[str, tuple[Request, str]] = {}  # request id -> (request, the finish reason seen)
        self.num_outputs: dict[str, int] = {}  # output tokens of each live request after the last step
        self.broken: set[str] = set()  # live requests whose detokenizer raises
        self.prompts: list[list[int]] = []
        self.num_forced_preemptions = 0
        self.request_ids = itertools.count()

    # -- rules ------------------------------------------------------------------------------------

    @rule(data=st.data(), priority=st.integers(-1, 1), copies=st.integers(1, 3))
    def add_request(self, data, priority, copies):
        """A new prompt of 1..max_model_len-1 tokens, often sharing a prefix with an earlier one (a
        page-aligned one, any one, or the whole prompt); `copies` requests of it are added at once, as
        `n > 1` does, so identical prefixes are admitted in one step."""
        rng = random.Random(data.draw(st.integers(0, 2**16), label="token seed"))
        prefix = []
        share = data.draw(st.sampled_from(["none", "pages", "any", "whole"]) if self.prompts else st.just("none"))
        if share != "none":
            earlier = data.draw(st.sampled_from(self.prompts))
            if share == "pages" and len(earlier) >= PAGE_SIZE:
                prefix = earlier[: PAGE_SIZE * data.draw(st.integers(1, len(earlier) // PAGE_SIZE))]
            elif share == "whole":
                prefix = earlier
            else:
                prefix = earlier[: data.draw(st.integers(1, len(earlier)), label="prefix length")]
        length = data.draw(st.integers(max(len(prefix), 1), MAX_MODEL_LEN - 1), label="prompt length")
        prompt = prefix + [rng.randrange(VOCAB_SIZE) for _ in range(length - len(prefix))]
        self.prompts.append(prompt)
        stop_chars = sorted({c for t in prompt[-4:] if (c := self.engine.tokenizer.decode([t])).isalnum()})
        for _ in range(copies):
            params = data.draw(sampling_params(prompt, stop_chars))
            request = self.engine.add_request(prompt, params, f"sm-{next(self.request_ids)}", priority=priority)
            self.live[request.request_id] = request
            self.num_outputs[request.request_id] = 0
            self.stats["added"] += 1

    @rule(num_steps=st.integers(1, 4))
    def step(self, num_steps):
        self.stats["steps in rules"] += num_steps
        for _ in range(num_steps):
            self._step()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        request = self.live[data.draw(st.sampled_from(list(self.live)))]
        self.engine.abort_request(request.request_id)
        assert request.status is RequestStatus.FINISHED_ABORTED, request.status
        self._end(request)

    @precondition(lambda self: any(rid not in self.broken for rid in self.live))
    @rule(data=st.data(), through_the_detokenizer=st.booleans())
    def fail(self, data, through_the_detokenizer):
        """Ends a request with "error": at once through `fail_request`, or on its next token by a
        detokenizer that raises (the engine's per-request fault isolation must end it alone)."""
        request = self.live[data.draw(st.sampled_from([rid for rid in self.live if rid not in self.broken]))]
        if through_the_detokenizer:
            request.detokenizer = _FailingDetokenizer()
            self.broken.add(request.request_id)
            return
        self.engine.fail_request(request.request_id, "injected failure")
        assert request.status is RequestStatus.FINISHED_ERROR and request.error == "injected failure"
        self._end(request)

    @precondition(lambda self: self.engine.scheduler.running)
    @rule(data=st.data())
    def preempt(self, data):
        running = self.engine.scheduler.running
        request = running[data.draw(st.integers(0, len(running) - 1))]
        self.engine.scheduler.preempt(request)
        assert request.status is RequestStatus.PREEMPTED and request.page_table == []
        self.num_forced_preemptions += 1

    @precondition(lambda self: self.ended)
    @rule(data=st.data())
    def end_again(self, data):
        """Aborting or failing a request that already ended changes nothing."""
        request, reason = self.ended[data.draw(st.sampled_from(list(self.ended)))]
        if data.draw(st.booleans()):
            self.engine.abort_request(request.request_id)
        else:
            self.engine.fail_request(request.request_id, "too late")
        assert request.finish_reason == reason

    def teardown(self):
        if sys.exc_info()[0] is not None:
            return  # a rule failed (Hypothesis tears down in a `finally`): report that, not what it left
        for _ in range(MAX_DRAIN_STEPS):
            if not self.engine.has_unfinished:
                break
            self._step()
        else:
            raise AssertionError(f"{len(self.live)} requests still unfinished after {MAX_DRAIN_STEPS} steps")
        self.check_requests()
        self.check_pages()
        assert not self.live and not self.engine.requests, sorted(self.live)
        assert self.engine.pool.num_free_pages == self.engine.pool.num_pages - 1
        assert self.engine.get_stats()["kv_cache_usage"] == 0
        self.stats["forced preemptions"] += self.num_forced_preemptions
        self.stats["natural preemptions"] += self.engine.scheduler.num_preemptions - self.num_forced_preemptions
        self.stats["prefix cache hit tokens"] += self.engine.pool.num_hit_tokens
        for request, reason in self.ended.values():
            self.stats[reason] += 1

    # -- what every step and every end must satisfy -------------------------------------------------

    def _step(self) -> None:
        self.stats["steps"] += 1
        returned = self.engine.step()
        assert len({id(r) for r in returned}) == len(returned), "a request returned twice by one step"
        returned_ids = {r.request_id for r in returned}
        for request in returned:
            request_id = request.request_id
            assert request_id in self.live, f"{request_id} returned by step() after it ended as " \
                                            f"{self.ended[request_id][1] if request_id in self.ended else '?'}"
            grew = len(request.output_token_ids) - self.num_outputs[request_id]
            # A request whose sampling row failed is returned without a token; every other one got one.
            assert grew == 1 or (grew == 0 and request.finish_reason == "error"), (request_id, grew)
            assert len(request.output_token_ids) <= request.max_tokens
            if request_id in self.broken and grew:
                assert request.finish_reason == "error", request.finish_reason
            if request.status.is_finished:
                self._end(request)
            else:
                self.num_outputs[request_id] += grew
        for request_id, request in self.live.items():
            if request_id not in returned_ids:
                assert len(request.output_token_ids) == self.num_outputs[request_id], request_id

    def _end(self, request: Request) -> None:
        """Records the one end of `request` and checks it is a proper one."""
        request_id, reason = request.request_id, request.finish_reason
        assert request_id in self.live, f"{request_id} ended twice (first as {self.ended[request_id][1]})"
        assert reason in FINISH_REASONS, reason
        assert request.page_table == [], (request_id, request.page_table)
        output, params = request.output_token_ids, request.sampling_params
        if reason == "length":
            assert len(output) == request.max_tokens
        elif reason == "stop":
            self.stats["stop " + type(request.stop_reason).__name__] += 1
            if isinstance(request.stop_reason, int):
                assert output[-1] == request.stop_reason and len(output) >= params.min_tokens
                assert request.stop_reason in params.stop_token_ids or (
                    not params.ignore_eos and request.stop_reason in request.eos_token_ids)
            else:
                assert request.stop_reason in params.stop, request.stop_reason
        elif reason == "error":
            assert request.error, request_id
            self.stats["error: " + request.error] += 1
        del self.live[request_id], self.num_outputs[request_id]
        self.broken.discard(request_id)
        self.ended[request_id] = (request, reason)

    @invariant()
    def check_requests(self):
        engine, scheduler = self.engine, self.engine.scheduler
        assert engine.requests.keys() == self.live.keys(), (sorted(engine.requests), sorted(self.live))
        assert all(engine.requests[rid] is request for rid, request in self.live.items())
        queued = [r.request_id for r in scheduler.running + scheduler.waiting]
        assert sorted(queued) == sorted(self.live), (queued, sorted(self.live))
        assert len(scheduler.running) <= engine.cfg.max_num_seqs
        assert all(r.status is RequestStatus.RUNNING for r in scheduler.running)
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in scheduler.waiting)
        keys = [(r.priority, r.arrival_index) for r in scheduler.waiting]
        assert keys == sorted(keys), keys
        for request_id, (request, reason) in self.ended.items():
            assert request.finish_reason == reason, (request_id, reason, request.finish_reason)
            assert request.page_table == [], request_id

    @invariant()
    def check_pages(self):
        pool, scheduler = self.engine.pool, self.engine.scheduler
        owners = collections.Counter()
        for request in scheduler.running:
            table = request.page_table
            assert len(set(table)) == len(table), (request.request_id, table)
            assert 0 < request.num_computed_tokens < request.num_tokens, request.request_id
            assert len(table) == -(-request.num_computed_tokens // PAGE_SIZE), (
                request.request_id, len(table), request.num_computed_tokens)
            owners.update(table)
            for i, page in enumerate(table):  # a cached page holds exactly this request's tokens there
                if pool.page_hashes[page] is not None:
                    assert i < len(request.page_hashes) and pool.page_hashes[page] == request.page_hashes[i]
        for request in scheduler.waiting:
            assert request.page_table == [] and request.num_computed_tokens == 0, request.request_id
        assert owners[0] == 0 and pool.ref_counts[0] == 0 and 0 not in pool._free
        assert pool.page_hashes[0] is None
        for page in range(1, pool.num_pages):
            assert pool.ref_counts[page] == owners[page], (page, pool.ref_counts[page], owners[page])
            assert (page in pool._free) == (owners[page] == 0), page
        assert len(pool._free) == pool.num_pages - 1 - len(owners)
        assert len(pool.ref_counts) == len(pool.page_hashes) == pool.num_pages
        assert {page: h for h, page in pool._cached.items()} == {
            page: h for page, h in enumerate(pool.page_hashes) if h is not None}
        assert self.engine.get_stats()["kv_cache_usage"] == len(owners) / (pool.num_pages - 1)


def test_engine_state_machine(engine, caplog):
    """Adds, steps, aborts, preempts and fails requests in random order; see the module docstring."""
    caplog.set_level(logging.CRITICAL, logger="jaxserve.core.engine")  # the injected failures are logged
    stats = collections.Counter()
    start = time.perf_counter()
    run_state_machine_as_test(lambda: EngineMachine(engine, stats), settings=SETTINGS)
    print(f"{time.perf_counter() - start:.1f} s: {dict(stats)}")
    # The runs reached what the invariants are about: they would hold vacuously otherwise.
    assert stats["natural preemptions"] > 0 and stats["forced preemptions"] > 0
    assert stats["prefix cache hit tokens"] > 0
    assert all(stats[reason] > 0 for reason in FINISH_REASONS), dict(stats)
    assert stats["stop int"] > 0 and stats["stop str"] > 0
    assert stats["error: detokenizing its output failed"] > 0 and stats["error: injected failure"] > 0


def test_preempt_refuses_a_request_that_is_not_running():
    """`Scheduler.preempt` is public: a waiting request cannot be preempted (it would be queued twice)."""
    scheduler = Scheduler(EngineConfig(max_model_len=MAX_MODEL_LEN, block_size=PAGE_SIZE), PagePool(4, PAGE_SIZE))
    request = Request("waiting", [1, 2, 3], SamplingParams(), seed=0, max_tokens=4)
    scheduler.add_request(request)
    with pytest.raises(ValueError, match="'waiting' is not running"):
        scheduler.preempt(request)
    assert scheduler.waiting == [request] and scheduler.num_preemptions == 0
