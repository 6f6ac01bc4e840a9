"""Asynchronous scheduling (`async_scheduling`): the engine launches step N+1 before it reads step N's
tokens, and N+1's decode rows take N's tokens on the device. Nothing a client sees may change: every
test runs the same work on an engine with it off and one with it on and compares what comes out
(tokens, text, finish and stop reasons, logprobs), the page pool after (no page leaked, the same prefix
cache entries) and the counters; one test proves the overlap by the order of launches and reads.

The model is the tiny random llama whose greedy tokens depend on the whole context (test_engine_core.py
says why). Stops of every kind are taken from a first greedy run, so each one really fires mid-output.
"""

from __future__ import annotations

import contextlib
import random

import jax
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.runner.resolve import resolve_async_scheduling
from tiny_models import make_tiny_model

MAX_MODEL_LEN, PAGE_SIZE = 256, 8
# Prompts over 32 tokens are chunked; 8 sequences at most.
BASE = dict(max_model_len=MAX_MODEL_LEN, block_size=PAGE_SIZE, forbid_compilation_after_warmup=True,
            max_num_seqs=8, max_num_batched_tokens=32, min_decode_bucket=8)
CONFIGS = {
    "ample": dict(BASE, num_kv_pages=260),
    # The smallest pool the engine takes (max_model_len tokens): the workload below preempts.
    "small": dict(BASE, num_kv_pages=MAX_MODEL_LEN // PAGE_SIZE + 1),
}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama_async")
    make_tiny_model("llama", directory, attention_std=0.3, embedding_std=1.0)
    return directory


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def engines(request, model_dir) -> tuple[LLM, LLM]:
    """(async scheduling off, on), each fresh: every test below gives both the same work."""
    config = CONFIGS[request.param]
    return LLM(model_dir, **config, async_scheduling=False), LLM(model_dir, **config, async_scheduling=True)


def random_prompts(seed: int = 0) -> list[list[int]]:
    """12 prompts of 1..120 tokens, several sharing a 40-token prefix (prefix cache) and several longer
    than the 32-token budget (chunked prefill)."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(256) for _ in range(n)]  # noqa: E731
    shared = ids(40)
    prompts = [shared + ids(rng.randint(1, 60)) for _ in range(5)] + [ids(n) for n in (1, 2, 9, 33, 70, 120)]
    return prompts + [list(shared)]


def _ascii_pair(text: str) -> str | None:
    """Two printable ASCII characters of the text (two byte tokens: a stop string across a token boundary)."""
    for i in range(2, len(text) - 1):
        if text[i].isascii() and text[i].isprintable() and text[i + 1].isascii() and text[i + 1].isprintable():
            return text[i:i + 2]
    return None


def workload(llm: LLM) -> list[tuple[list[int], SamplingParams]]:
    """Every kind of request on the 12 prompts, its stops taken from a first greedy run (with `llm`)."""
    prompts = random_prompts()
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]
    work = []
    for i, (prompt, out) in enumerate(zip(prompts, first)):
        stop_string = _ascii_pair(out.text)
        kinds = [
            greedy,
            SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=i, max_tokens=MAX_TOKENS),
            SamplingParams(temperature=0.7, seed=100 + i, presence_penalty=0.5, frequency_penalty=0.3,
                           repetition_penalty=1.2, max_tokens=MAX_TOKENS),
            SamplingParams(temperature=0.0, stop_token_ids=[out.token_ids[3]], max_tokens=MAX_TOKENS),
            SamplingParams(temperature=0.0, stop_token_ids=[out.token_ids[2]], min_tokens=6, max_tokens=MAX_TOKENS),
            SamplingParams(temperature=0.8, seed=200 + i, logprobs=3, max_tokens=MAX_TOKENS),
            SamplingParams(temperature=1.0, seed=300 + i, n=2, max_tokens=MAX_TOKENS),
            SamplingParams(temperature=0.8, seed=400 + i, logit_bias={out.token_ids[5]: 4.0}, max_tokens=MAX_TOKENS),
            SamplingParams(temperature=0.0, max_tokens=1 + i % 2),  # ends while its next row is in flight
        ]
        if stop_string is not None:
            kinds.append(SamplingParams(temperature=0.0, stop=[stop_string], max_tokens=MAX_TOKENS))
        # The stop id's first greedy appearance is output j: with min_tokens j it stops exactly there
        j = next((k for k in range(3, 16) if out.token_ids.index(out.token_ids[k]) == k), None)
        if j is not None:
            kinds.append(SamplingParams(temperature=0.0, stop_token_ids=[out.token_ids[j]], min_tokens=j,
                                        max_tokens=MAX_TOKENS))
        work += [(prompt, kinds[(i + k) % len(kinds)]) for k in range(3)]
    return work


def _run(llm: LLM, work) -> list:
    """All of the work at once (8 run, the rest wait), every sample of every prompt in input order."""
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt, _ in work], [p for _, p in work],
                           use_tqdm=False)
    return [c for o in outputs for c in o.outputs]


def assert_same_outputs(sync_outputs, async_outputs) -> None:
    assert len(sync_outputs) == len(async_outputs)
    for a, b in zip(sync_outputs, async_outputs):
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (b.token_ids, b.text, b.finish_reason,
                                                                         b.stop_reason)
        assert (a.logprobs is None) == (b.logprobs is None)
        for entry_a, entry_b in zip(a.logprobs or [], b.logprobs or []):
            assert list(entry_a) == list(entry_b)
            assert entry_a == pytest.approx(entry_b, rel=1e-4, abs=1e-5)  # preempted: recomputed as a prompt


def _cached_hashes(llm: LLM) -> set[bytes]:
    return {h for h in llm.engine.pool.page_hashes if h is not None}


def test_outputs_pages_and_counts_are_the_same_with_async_scheduling(engines):
    """Greedy, seeded, penalties, stop ids, min_tokens, stop strings, logprobs, n > 1, logit_bias and
    max_tokens 1 and 2, with chunked prefill and prefix caching, and (small pool) preemption."""
    sync, async_ = engines
    assert (sync.engine.async_scheduling, async_.engine.async_scheduling) == (False, True)
    work = workload(sync)
    assert workload(async_) == work  # the first greedy run agrees too
    sync_outputs, async_outputs = _run(sync, work), _run(async_, work)
    assert_same_outputs(sync_outputs, async_outputs)

    reasons = {(o.finish_reason, type(o.stop_reason).__name__) for o in sync_outputs}
    assert {("length", "NoneType"), ("stop", "int"), ("stop", "str")} <= reasons  # every kind of end happened
    assert any(len(o.token_ids) == 1 for o in sync_outputs)
    for (_, params), out in zip(work, sync_outputs):  # min_tokens ends exactly at the stop id
        if params.n == 1 and params.min_tokens > 0 and out.token_ids.count(params.stop_token_ids[0]) == 1:
            assert out.finish_reason == "stop" and len(out.token_ids) == params.min_tokens + 1
    s, a = sync.get_stats(), async_.get_stats()
    keys = ("prompt_tokens_computed", "prompt_tokens_cached", "prefix_cache_queries", "prefix_cache_hits")
    # (forbid_compilation_after_warmup makes a compile inside a step raise; the counter is process-wide,
    # so only the engine warmed up last can show it)
    assert s["prompt_tokens_cached"] > 0 and a["compilations_since_warmup"] == 0
    assert s["num_used_pages"] == a["num_used_pages"] == 0  # nothing leaked, discarded rows included
    if sync.config.num_kv_pages > 200:  # no preemption: the same pages cached, the same counts
        assert s["num_preemptions"] == a["num_preemptions"] == 0
        assert [s[k] for k in keys] == [a[k] for k in keys]
        assert _cached_hashes(sync) == _cached_hashes(async_)
    else:
        assert s["num_preemptions"] > 0 and a["num_preemptions"] > 0


def test_inputs_put_on_the_device_before_the_call_change_nothing(engines):
    """The GPU run's launch experiment (ModelRunner.hold_staged_inputs): each step's packed inputs put on
    the device before the call, the last 2 steps' kept alive, and no more; the outputs are the same."""
    sync, async_ = engines
    work = workload(sync)
    runner = async_.engine.runner
    runner.hold_staged_inputs = 2
    try:
        staged = _run(async_, work)
        kept = list(runner.staged_inputs)
    finally:
        runner.hold_staged_inputs = None
        runner.staged_inputs.clear()
    assert len(kept) == 2 and all(isinstance(x, jax.Array) for step in kept for x in jax.tree.leaves(step))
    assert_same_outputs(_run(sync, work), staged)


def test_an_abort_mid_stream_ends_the_same_way(engines):
    """A request aborted once it has 3 tokens keeps exactly those 3; the others are untouched, every page
    comes back (its row in flight is discarded, not appended)."""
    runs = []
    for llm in engines:
        engine = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        requests = [engine.add_request(p, params) for p in random_prompts(seed=1)[:6]]
        victim = requests[2]
        while engine.has_unfinished:
            engine.step()
            if len(victim.output_token_ids) >= 3 and not victim.status.is_finished:
                engine.abort_request(victim.request_id)
        assert victim.finish_reason == "abort" and len(victim.output_token_ids) == 3
        assert engine.pool.num_used_pages == 0 and not engine.requests
        runs.append([(r.output_token_ids, r.finish_reason) for r in requests])
    assert runs[0] == runs[1]


@contextlib.contextmanager
def _logged_launches_and_reads(runner):
    """Within it, runner.launch and runner.fetch are wrapped to log, in order, ("launch", i) for the i-th
    step launched and ("read", i) for each read of its tokens; yields (events, launched outputs)."""
    events, launched = [], []
    launch, fetch = runner.launch, runner.fetch

    def logged_launch(*args, **kwargs):
        launched.append(launch(*args, **kwargs))
        events.append(("launch", len(launched) - 1))
        return launched[-1]

    def logged_fetch(output, *args, **kwargs):
        events.append(("read", next(i for i, o in enumerate(launched) if o is output)))
        return fetch(output, *args, **kwargs)

    runner.launch, runner.fetch = logged_launch, logged_fetch
    try:
        yield events, launched
    finally:
        del runner.launch, runner.fetch


def test_async_scheduling_launches_step_n_plus_1_before_reading_step_n(engines):
    """The overlap, proven by order: with it on, every read of a step's tokens but the last comes after
    the next step's launch; with it off, each step is read before the next is launched."""
    results = []
    for llm in engines:
        with _logged_launches_and_reads(llm.engine.runner) as (events, launched):
            params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
            outputs = llm.generate([{"prompt_token_ids": p} for p in random_prompts(seed=2)[:4]], params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outputs])
        order = {event: position for position, event in enumerate(events)}
        num_steps = len(launched)
        assert num_steps > 10 and sorted(order) == sorted([("launch", i) for i in range(num_steps)] +
                                                          [("read", i) for i in range(num_steps)])
        read_before_next_launch = [i for i in range(num_steps - 1) if order["read", i] < order["launch", i + 1]]
        if llm.engine.async_scheduling:
            assert read_before_next_launch == []
        else:
            assert read_before_next_launch == list(range(num_steps - 1))
    assert results[0] == results[1]


def test_async_scheduling_defaults_to_on_for_a_gpu_only():
    assert resolve_async_scheduling(None, "gpu") is True
    assert resolve_async_scheduling(None, "cpu") is False
    assert resolve_async_scheduling(True, "cpu") is True and resolve_async_scheduling(False, "gpu") is False
