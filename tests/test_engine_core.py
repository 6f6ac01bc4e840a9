"""The engine core end to end on the tiny random llama: scheduling choices never change greedy tokens,
the prefix cache saves compute, nothing compiles after warm-up, decodes never stall behind a long
prompt, and the KV page pool follows its memory budget.

The model is the tiny random llama with larger attention and embedding weights: with the default
init its greedy tokens just repeat the last prompt token, which would make every equality below
vacuous (`test_greedy_tokens_depend_on_the_whole_context` guards that). Engines are module-scoped and
share executable shapes where they can (same pool size, same buckets), so the session's persistent
compilation cache turns most of their warm-ups into loads.
"""

from __future__ import annotations

import gc
import random

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config.buckets import pick_bucket
from jaxserve.core.request import RequestStatus
from tiny_models import make_tiny_model

MAX_MODEL_LEN, PAGE_SIZE = 256, 8
BASE = dict(max_model_len=MAX_MODEL_LEN, block_size=PAGE_SIZE, forbid_compilation_after_warmup=True)
# No chunking of any prompt here (all are <= 200 tokens), no preemption (8 x 27 pages <= 259).
AMPLE = dict(BASE, max_num_seqs=8, max_num_batched_tokens=256, min_prefill_bucket=256, min_decode_bucket=8,
             num_kv_pages=260)
# Chunks of at most 16 tokens; 16 sequences so 8 decodes and a long prompt fit together.
CHUNKED = dict(BASE, max_num_seqs=16, max_num_batched_tokens=16, min_decode_bucket=8, num_kv_pages=260)
# The smallest pool the engine accepts: exactly max_model_len tokens. Every bucket (7) is compiled.
SMALL_POOL = dict(BASE, max_num_seqs=8, max_num_batched_tokens=64, num_kv_pages=MAX_MODEL_LEN // PAGE_SIZE + 1)

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny llama whose greedy tokens depend on the whole context (see the module docstring)."""
    directory = tmp_path_factory.mktemp("tiny_llama_context")
    make_tiny_model("llama", directory, attention_std=0.3, embedding_std=1.0)
    return directory


@pytest.fixture(scope="module")
def ample(model_dir):
    return LLM(model_dir, **AMPLE)


@pytest.fixture(scope="module")
def no_prefix_cache(model_dir):
    return LLM(model_dir, **AMPLE, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def chunked(model_dir):
    return LLM(model_dir, **CHUNKED)


@pytest.fixture(scope="module")
def small_pool(model_dir):
    return LLM(model_dir, **SMALL_POOL)


def _random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def _mixed_prompts(seed: int = 0) -> list[dict]:
    """64 prompts of 1..200 tokens; many share long prefixes (page aligned or not), some repeat exactly."""
    rng = random.Random(seed)
    p150, p96, p40 = _random_ids(rng, 150), _random_ids(rng, 96), _random_ids(rng, 40)  # 96 = 12 pages
    prompts = [p150 + _random_ids(rng, rng.randint(1, 50)) for _ in range(12)]
    prompts += [p96 + _random_ids(rng, rng.randint(0, 60)) for _ in range(10)]  # includes p96 itself
    prompts += [p40 + _random_ids(rng, rng.randint(0, 100)) for _ in range(10)]
    prompts += [p96, p40, p150, p150[:8], p150[:9], [7], [7], p96[:95]]
    prompts += [_random_ids(rng, rng.choice([1, 2, 7, 8, 9, 199, 200, rng.randint(1, 200)])) for _ in range(22)]
    prompts += [prompts[3], prompts[20]]  # exact duplicates of earlier prompts
    rng.shuffle(prompts)
    assert len(prompts) == 64 and all(1 <= len(p) <= 200 for p in prompts)
    return [{"prompt_token_ids": p} for p in prompts]


PROMPTS = _mixed_prompts()


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(ample) -> list[list[int]]:
    """Greedy tokens of PROMPTS, all at once, ample pool, no chunking, prefix caching on."""
    before = ample.get_stats()
    tokens = _tokens(ample.generate(PROMPTS, GREEDY, use_tqdm=False))
    after = ample.get_stats()
    assert all(len(t) == MAX_TOKENS for t in tokens)
    assert after["num_preemptions"] == before["num_preemptions"]  # really the no-preemption baseline
    assert after["prompt_tokens_cached"] > before["prompt_tokens_cached"]  # shared prefixes were hit
    return tokens


# ------------------------------------------------------------------------------------------------
# (a) Scheduling and caching choices never change greedy tokens


def test_greedy_tokens_depend_on_the_whole_context(ample, reference):
    """The equality tests below can fail: greedy tokens change with far-back context, not just the last token."""
    rng = random.Random(5)
    contexts = [_random_ids(rng, 100) for _ in range(6)]
    same_last = [{"prompt_token_ids": c + [42]} for c in contexts]
    assert len({tuple(t) for t in _tokens(ample.generate(same_last, GREEDY, use_tqdm=False))}) == 6
    # one token changed 100 positions before the end changes the continuation
    edited = [{"prompt_token_ids": [(c[0] + 1) % 256] + c[1:] + [42]} for c in contexts]
    before = _tokens(ample.generate(same_last, GREEDY, use_tqdm=False))
    after = _tokens(ample.generate(edited, GREEDY, use_tqdm=False))
    assert sum(b != a for b, a in zip(before, after)) >= 3
    # and the reference is no copy of the prompts' last tokens
    assert sum(len(set(t)) > 3 for t in reference) > 48


def test_greedy_tokens_equal_with_prefix_caching_off(reference, no_prefix_cache):
    """Prefix caching is exact: reusing cached K/V pages gives the same tokens as recomputing them."""
    outputs = _tokens(no_prefix_cache.generate(PROMPTS, GREEDY, use_tqdm=False))
    stats = no_prefix_cache.get_stats()
    assert stats["prompt_tokens_cached"] == 0 and stats["prefix_cache_hits"] == 0
    assert stats["num_cached_pages"] == 0
    assert outputs == reference


def test_greedy_tokens_equal_with_small_prefill_chunks(reference, chunked):
    """Chunked prefill is exact: prompts split into 16-token chunks next to decodes give the same tokens."""
    outputs = _tokens(chunked.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert outputs == reference


def test_greedy_tokens_equal_under_preemption(reference, small_pool):
    """Preemption is exact: requests evicted and recomputed (from their cached pages) give the same tokens."""
    before = small_pool.get_stats()["num_preemptions"]
    outputs = _tokens(small_pool.generate(PROMPTS, GREEDY, use_tqdm=False))
    stats = small_pool.get_stats()
    assert stats["num_preemptions"] > before
    assert stats["num_used_pages"] == 0
    assert outputs == reference


def test_greedy_tokens_equal_one_at_a_time(reference, ample):
    """Batch invariance: each prompt alone (its pages now mostly cached) gives the tokens it got batched."""
    for prompt, expected in zip(PROMPTS, reference):
        assert _tokens(ample.generate([prompt], GREEDY, use_tqdm=False)) == [expected]


# ------------------------------------------------------------------------------------------------
# (b) Prefix caching saves the compute


def test_shared_system_prompt_is_computed_once(ample, no_prefix_cache):
    """A second batch sharing a cached 152-token system prompt computes >= 80% fewer prompt tokens."""
    rng = random.Random(2024)
    system = _random_ids(rng, 152)  # 19 full pages
    first = [{"prompt_token_ids": system + _random_ids(rng, rng.randint(1, 4))} for _ in range(8)]
    second = [{"prompt_token_ids": system + _random_ids(rng, rng.randint(1, 4))} for _ in range(8)]
    tails = sum(len(p["prompt_token_ids"]) - 152 for p in second)

    s0 = ample.get_stats()
    ample.generate(first, GREEDY, use_tqdm=False)
    s1 = ample.get_stats()
    second_tokens = _tokens(ample.generate(second, GREEDY, use_tqdm=False))
    s2 = ample.get_stats()

    first_computed = s1["prompt_tokens_computed"] - s0["prompt_tokens_computed"]
    second_computed = s2["prompt_tokens_computed"] - s1["prompt_tokens_computed"]
    assert first_computed >= 152
    assert second_computed <= 0.2 * first_computed, (first_computed, second_computed)
    # exactly: every system-prompt page is found in the cache, every tail token is computed
    assert second_computed == tails
    assert s2["prompt_tokens_cached"] - s1["prompt_tokens_cached"] == 8 * 152
    assert s2["prefix_cache_hits"] - s1["prefix_cache_hits"] == 8 * 152
    assert s2["prefix_cache_queries"] - s1["prefix_cache_queries"] == 8 * 152
    # and the cached pages hold the right K/V: same tokens as computing everything
    assert second_tokens == _tokens(no_prefix_cache.generate(second, GREEDY, use_tqdm=False))


# ------------------------------------------------------------------------------------------------
# (c) Nothing compiles after warm-up, nothing leaks


def _check_pages(engine) -> None:
    """Every page's ref count equals the number of live block tables holding it; page 0 is never held."""
    holders = np.zeros(engine.pool.num_pages, np.int64)
    for request in engine.scheduler.running:
        table = request.page_table
        assert len(set(table)) == len(table) and 0 not in table, table
        np.add.at(holders, table, 1)
    for request in engine.scheduler.waiting:
        assert request.page_table == []
    assert list(holders) == engine.pool.ref_counts
    assert engine.pool.num_used_pages == int((holders > 0).sum())


def _bucket(engine, schedule) -> tuple[str, int]:
    """The executable the runner picks for this schedule (mirrors ModelRunner.execute)."""
    sizes = [n for _, n in schedule.scheduled]
    runner = engine.runner
    if all(n == 1 for n in sizes):
        return "decode", pick_bucket(runner.decode_buckets, len(sizes))
    return "prefill", pick_bucket(runner.prefill_buckets, sum(sizes))


def test_random_workload_compiles_nothing_and_leaks_no_pages(model_dir):
    """Random lengths, batch mixes, max_tokens, temperatures, priorities and aborts: zero compiles after
    warm-up (any compile raises), every bucket used, budgets held, ref counts exact, no page leaked."""
    # its own engine (the compile counter is global), honouring the random priorities
    llm = LLM(model_dir, **SMALL_POOL, scheduling_policy="priority")
    engine, cfg = llm.engine, llm.config
    rng = random.Random(9)
    shared = _random_ids(rng, 120)
    submitted, aborted, used_buckets = [], {}, set()  # aborted: request id -> outputs at the abort
    num_steps = 0

    def add_random_request(short: bool = False):
        kind = rng.random()
        if short:  # a burst of these decodes side by side, filling the large decode buckets
            prompt, max_tokens, ignore_eos = _random_ids(rng, rng.randint(1, 7)), rng.randint(8, 24), True
        else:
            if kind < 0.15:
                prompt = _random_ids(rng, rng.randint(1, 9))
            elif kind < 0.35:
                prompt = shared[: rng.randint(1, 120)] + _random_ids(rng, rng.randint(0, 60))
            elif kind < 0.45:
                prompt = _random_ids(rng, MAX_MODEL_LEN - rng.randint(1, 30))
            else:
                prompt = _random_ids(rng, rng.randint(1, MAX_MODEL_LEN - 1))
            # None = up to max_model_len; only for long prompts, to keep the workload short
            max_tokens = rng.choice([1, rng.randint(1, 24)] + ([None] if len(prompt) > 200 else []))
            ignore_eos = rng.random() < 0.5
        params = SamplingParams(temperature=rng.choice([0.0, 0.0, 0.5, 1.0]),
                                seed=rng.choice([None, rng.randrange(2**32)]),
                                max_tokens=max_tokens, ignore_eos=ignore_eos)
        submitted.append(engine.add_request(prompt, params, priority=rng.randint(0, 2)))

    def step():
        nonlocal num_steps
        engine.step()
        num_steps += 1
        schedule = engine.last_schedule
        if schedule.scheduled:
            assert schedule.num_tokens <= cfg.max_num_batched_tokens
            assert len(schedule.scheduled) <= cfg.max_num_seqs
            used_buckets.add(_bucket(engine, schedule))
        _check_pages(engine)

    for i in range(80):
        if i % 40 == 0:
            for _ in range(8):
                add_random_request(short=True)
        elif rng.random() < 0.3:
            for _ in range(rng.choice([1, 1, 2, 4, 8])):
                add_random_request()
        if engine.requests and rng.random() < 0.12:
            victim = engine.requests[rng.choice(sorted(engine.requests))]
            aborted[victim.request_id] = len(victim.output_token_ids)
            engine.abort_request(victim.request_id)
        step()
    while engine.has_unfinished:
        step()
        assert num_steps < 5_000, "the engine stopped making progress"  # ~400 steps are enough

    stats = llm.get_stats()
    assert stats["compilations_since_warmup"] == 0
    assert stats["num_used_pages"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert all(rc == 0 for rc in engine.pool.ref_counts) and engine.requests == {}
    assert stats["num_preemptions"] > 0 and aborted  # the workload reached those paths
    assert used_buckets == set(stats["compiled_shapes"])  # and every compiled bucket
    for request in submitted:
        if request.request_id in aborted:  # stays aborted, and got no token after the abort
            assert request.status is RequestStatus.FINISHED_ABORTED
            assert len(request.output_token_ids) == aborted[request.request_id]
            continue
        assert request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        assert 1 <= len(request.output_token_ids) <= request.max_tokens
        assert request.num_tokens <= MAX_MODEL_LEN


# ------------------------------------------------------------------------------------------------
# (d) A long prompt never stalls running decodes


def test_long_prompt_is_chunked_around_running_decodes(chunked, ample):
    """While a prompt of 10x the token budget is prefilled, each step still gives all 8 running
    requests one decode token; the prompt advances in chunks that fill only the budget left."""
    engine, budget = chunked.engine, chunked.config.max_num_batched_tokens
    rng = random.Random(11)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    decoders = [engine.add_request(_random_ids(rng, rng.randint(2, 6)), params) for _ in range(8)]
    for _ in range(10):
        engine.step()
        if all(r.output_token_ids for r in decoders):
            break
    assert all(r.output_token_ids and r.num_computed_tokens == r.num_tokens - 1 for r in decoders)

    long_prompt = _random_ids(rng, 10 * budget)
    long = engine.add_request(long_prompt, SamplingParams(temperature=0.0, max_tokens=1))
    chunks = []
    while not long.status.is_finished:
        lengths = [len(r.output_token_ids) for r in decoders]
        engine.step()
        scheduled = {r.request_id: n for r, n in engine.last_schedule.scheduled}
        assert all(scheduled.get(r.request_id) == 1 for r in decoders), scheduled
        assert [len(r.output_token_ids) for r in decoders] == [n + 1 for n in lengths]
        assert engine.last_schedule.num_tokens <= budget
        chunks.append(scheduled[long.request_id])
        assert len(chunks) <= 10 * budget, "the long prompt stopped advancing"
    assert sum(chunks) == len(long_prompt)
    assert len(chunks) >= 10 and max(chunks) <= budget - len(decoders)
    assert all(c == budget - len(decoders) for c in chunks[:-1])  # it takes all the budget left
    # chunking next to decodes gives the prompt the token it gets alone in one piece
    alone = ample.generate([{"prompt_token_ids": long_prompt}], SamplingParams(temperature=0.0, max_tokens=1),
                           use_tqdm=False)
    assert long.output_token_ids == _tokens(alone)[0]

    for request in decoders:
        engine.abort_request(request.request_id)
    assert not engine.has_unfinished and engine.pool.num_used_pages == 0


# ------------------------------------------------------------------------------------------------
# (e) The page pool is the KV memory, sized by the budget


def _page_bytes(llm) -> int:
    cfg = llm.engine.model_cfg
    itemsize = np.dtype(llm.engine.runner.kv_cache[0].dtype).itemsize
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize * llm.config.block_size


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_pool_follows_the_memory_budget(model_dir, dtype):
    """kv_cache_memory_bytes=X gives K/V pages totalling at most X and within one page of it; the pool
    is the only large allocation the engine makes; num_kv_pages overrides the byte budget."""
    budget = 16 * 2**20 + 12_345  # not a whole number of pages
    kwargs = dict(max_model_len=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=32, dtype=dtype,
                  warmup=False)
    gc.collect()
    live_before = sum(x.nbytes for x in jax.live_arrays())
    llm = LLM(model_dir, kv_cache_memory_bytes=budget, num_kv_pages=None, **kwargs)
    gc.collect()
    live_delta = sum(x.nbytes for x in jax.live_arrays()) - live_before
    kv = llm.engine.runner.kv_cache
    page = _page_bytes(llm)
    kv_bytes = sum(x.nbytes for x in kv)
    assert budget - page < kv_bytes <= budget
    num_pages = budget // page
    cfg = llm.engine.model_cfg
    assert len(kv) == 2 and all(
        x.shape == (cfg.num_layers, num_pages, 8, cfg.num_kv_heads, cfg.head_dim) for x in kv)
    assert llm.engine.pool.num_pages == num_pages and llm.get_stats()["num_pages"] == num_pages - 1
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.params))
    assert live_delta <= kv_bytes + param_bytes + 2**20  # no second copy of the cache anywhere

    # num_kv_pages counts the pool's pages, as get_stats()["num_pages"] does; the array adds the dummy page 0.
    fixed = LLM(model_dir, kv_cache_memory_bytes=budget, num_kv_pages=20, **kwargs)
    assert sum(x.nbytes for x in fixed.engine.runner.kv_cache) == 21 * page
    assert fixed.engine.pool.num_pages == 21 and fixed.get_stats()["num_pages"] == 20


def test_kv_budget_too_small_is_refused(model_dir):
    """A byte budget or page count whose pool cannot hold max_model_len tokens fails at start-up, by name."""
    kwargs = dict(max_model_len=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=32, warmup=False)
    with pytest.raises(ValueError, match="max_model_len=64"):
        LLM(model_dir, num_kv_pages=7, **kwargs)  # 56 tokens
    with pytest.raises(ValueError, match="at least 2"):
        LLM(model_dir, kv_cache_memory_bytes=1000, **kwargs)
    LLM(model_dir, num_kv_pages=8, **kwargs)  # exactly 64 tokens: accepted


def test_unmixed_steps_hold_one_kind_and_give_the_same_tokens(model_dir, reference):
    """mixed_batches=False (the A/B switch for the benchmark) never puts prompt chunks beside decode
    rows, and greedy tokens do not depend on it."""
    llm = LLM(model_dir, **AMPLE, mixed_batches=False)
    engine = llm.engine
    requests = [engine.add_request(p["prompt_token_ids"], GREEDY) for p in _mixed_prompts()]
    kinds = []
    while engine.has_unfinished:
        engine.step()
        rows = [n == 1 and r.num_computed_tokens - n >= len(r.prompt_token_ids)
                for r, n in engine.last_schedule.scheduled]
        assert all(rows) or not any(rows), engine.last_schedule.scheduled
        kinds.append(all(rows))
    assert True in kinds and False in kinds
    assert [r.output_token_ids for r in requests] == reference
