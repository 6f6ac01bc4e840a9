"""The engine end to end on a tiny random model: batching invariance, buckets, errors, scheduling."""

from __future__ import annotations

import random

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.runner.compilation import forbid_compilation, num_compilations
from jaxserve.core.engine import LLMEngine
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.buckets import decode_buckets, prefill_buckets
from jaxserve.runner.page_pool import PagePool
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, block_size=8, num_kv_pages=80)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    # Larger attention/embedding weights than the default init, whose greedy output mostly repeats
    # the last token whatever the context, which would hide batching bugs.
    directory = tmp_path_factory.mktemp("context_sensitive_llama")
    make_tiny_model("llama", directory, attention_std=0.3, embedding_std=1.0)
    return LLM(directory, **ENGINE)


def test_from_config_loads_builds_and_warms_up_the_engine_llm_and_server_share(tiny_model_dir, capsys):
    """The one engine factory: the model loaded, max_model_len settled from the model, every bucket
    compiled, and the two start-up lines (KV cache, executables ready) printed; without warm-up
    nothing is compiled and no summary comes back."""
    engine, summary = LLMEngine.from_config(tiny_model_dir("llama"), EngineConfig(**ENGINE))
    runner = engine.runner
    assert summary["num_executables"] == len(runner.prefill_buckets) + len(runner.decode_buckets) > 0
    assert engine.cfg.max_model_len == 128
    err = capsys.readouterr().err
    assert f"KV cache {runner.num_pages - 1} pages x 8 tokens" in err
    assert f"{summary['num_executables']} executables ready" in err

    engine, summary = LLMEngine.from_config(tiny_model_dir("llama"), EngineConfig(num_kv_pages=80), warmup=False)
    assert summary is None and engine.cfg.max_model_len == min(2048, engine.model_cfg.max_position_embeddings)
    assert "executables ready" not in capsys.readouterr().err


def test_the_jaxserve_loggers_level_silences_the_start_up_lines(tiny_model_dir, capsys):
    """The start-up lines go through the `jaxserve` logger: a program that embeds the engine raises its level
    and hears nothing; put back, they are there again."""
    import logging

    jaxserve_logger = logging.getLogger("jaxserve")
    before = jaxserve_logger.level
    try:
        jaxserve_logger.setLevel(logging.WARNING)
        LLMEngine.from_config(tiny_model_dir("llama"), EngineConfig(**ENGINE), show_progress=False)
        assert "jaxserve:" not in capsys.readouterr().err
    finally:
        jaxserve_logger.setLevel(before)
    LLMEngine.from_config(tiny_model_dir("llama"), EngineConfig(**ENGINE), show_progress=False)
    assert "executables ready" in capsys.readouterr().err


def _prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(256) for _ in range(rng.randint(1, 90))]} for _ in range(n)]


def test_alone_equals_batched(llm):
    """Batch invariance: a sequence's greedy tokens don't depend on what else shares its batch."""
    prompts = _prompts(7, seed=1)
    batched = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, together in zip(prompts, batched):
        alone = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == together.outputs[0].token_ids
        assert len(alone.outputs[0].token_ids) == 12


def test_no_compilation_beyond_buckets(tiny_model_dir):
    """Prompts of many lengths in many batch sizes compile exactly the declared buckets, at warm-up."""
    before = num_compilations()
    llm = LLM(tiny_model_dir("llama"), **ENGINE)
    cfg = llm.config
    num_buckets = len(prefill_buckets(cfg)) + len(decode_buckets(cfg))
    assert llm.warmup_summary["num_executables"] == num_buckets
    assert num_compilations() - before <= num_buckets + 8  # + a few tiny eager ops at load time
    after_warmup = num_compilations()
    with forbid_compilation():
        for batch_size in (1, 2, 3, 5, 8, 13):
            params = SamplingParams(temperature=0.7, max_tokens=random.Random(batch_size).randint(1, 20))
            llm.generate(_prompts(batch_size, seed=batch_size), params, use_tqdm=False)
    assert num_compilations() == after_warmup


def test_prompt_errors_name_the_problem(llm):
    """Bad prompts fail at the public edge with a message naming the problem, and leak no pages."""
    free = llm.engine.pool.num_free_pages
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], GREEDY)
    with pytest.raises(ValueError, match=r"200 tokens.*max_model_len is 128"):
        llm.generate([{"prompt_token_ids": [5] * 200}], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [1, 2, 10_000]}], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    # a valid prompt next to a bad one: nothing is queued, nothing leaks
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", ""], GREEDY)
    assert not llm.engine.has_unfinished
    assert llm.engine.pool.num_free_pages == free


def test_generation_stops_at_eos_and_max_model_len(llm):
    """EOS ends a request with finish_reason 'stop'; max_model_len caps output with 'length'."""
    out = llm.generate([{"prompt_token_ids": [3] * 120}], SamplingParams(temperature=0, max_tokens=50,
                                                                          ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
    first = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    stop_id = first.outputs[0].token_ids[0]
    out = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [stop_id] and out.outputs[0].finish_reason == "stop"
    # A stop token's text is left out unless asked for, as in vLLM
    x = llm.tokenizer.encode("x", add_special_tokens=False)[-1]
    forced = dict(temperature=0, max_tokens=5, stop_token_ids=[x], logit_bias={x: 100.0})
    out = llm.generate(["abc"], SamplingParams(**forced), use_tqdm=False)[0].outputs[0]
    kept = llm.generate(["abc"], SamplingParams(**forced, include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == kept.token_ids == [x] and (out.text, kept.text) == ("", llm.tokenizer.decode([x]))
    assert kept.text.strip() == "x"


def test_seeded_sampling_is_reproducible(llm):
    """Same seed, same tokens, alone or batched; a different seed gives different tokens."""
    prompt = {"prompt_token_ids": list(range(40, 60))}
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    batched = llm.generate([prompt] + _prompts(5, seed=3), [params] + [GREEDY] * 5, use_tqdm=False)
    assert batched[0].outputs[0].token_ids == alone
    other = llm.generate([prompt], SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert other != alone


def test_text_prompts_and_chat(llm):
    """Text prompts are tokenized; chat applies the template; outputs come back in input order."""
    outs = llm.generate(["hello", "a longer prompt here"], GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == ["hello", "a longer prompt here"]
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("hello")
    chat = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0]
    assert llm.tokenizer.decode(chat.prompt_token_ids).endswith("<|im_start|>assistant\n")
    assert len(chat.outputs[0].token_ids) == 12


# ------------------------------------------------------------------------------------------------
# Scheduler and page pool with no model at all


def _request(rid: str, num_prompt: int, max_tokens: int = 4, first_token: int = 0, priority: int = 0) -> Request:
    return Request(rid, list(range(first_token, first_token + num_prompt)), SamplingParams(max_tokens=max_tokens),
                   seed=0, max_tokens=max_tokens, priority=priority)


def test_scheduler_chunks_long_prompts_under_the_token_budget():
    """A prompt longer than the budget is split across steps; running decodes are scheduled first."""
    cfg = EngineConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, block_size=8)
    scheduler = Scheduler(cfg, PagePool(64, 8))
    short, long = _request("short", 5), _request("long", 70, first_token=100)
    scheduler.add_request(short)
    out = scheduler.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("short", 5)]
    scheduler.advance(out)  # the step was launched
    scheduler.update_from_output(out, [7])
    scheduler.add_request(long)
    chunks = []
    while long.num_computed_tokens < long.num_tokens:
        out = scheduler.schedule()
        assert out.num_tokens <= 32
        assert ("short", 1) in [(r.request_id, n) for r, n in out.scheduled]  # decode never stalls
        chunks.append(dict((r.request_id, n) for r, n in out.scheduled)["long"])
        scheduler.advance(out)  # the step was launched
        scheduler.update_from_output(out, [7] * len(out.scheduled))
        if short.status.is_finished:
            break
    assert chunks[:2] == [31, 31]


@pytest.mark.parametrize("buckets", [None, [16, 32, 64, 128, 256, 512]])
def test_a_step_that_would_be_mostly_padding_takes_a_smaller_prompt_chunk(buckets):
    """7 decode rows beside a new 256-token prompt would fill a 512-token bucket to 51%: with the
    runner's buckets the scheduler caps the step at 256 and the last 7 prompt tokens join the next
    step's decode rows (14 tokens, a 16 bucket); without buckets it takes all 263 at once."""
    cfg = EngineConfig(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=512, block_size=16)
    scheduler = Scheduler(cfg, PagePool(128, 16), prefill_buckets=buckets)
    decoders = [_request(f"d{i}", 10, max_tokens=50, first_token=10 * i) for i in range(7)]
    for request in decoders:
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.num_tokens == 70  # a 128 bucket, 55% full, but small steps are not capped (weight reads dominate)
    scheduler.advance(out)  # the step was launched
    scheduler.update_from_output(out, [1] * 7)
    prompt = _request("p", 256, max_tokens=4, first_token=300)
    scheduler.add_request(prompt)
    out = scheduler.schedule()
    sizes = {r.request_id: n for r, n in out.scheduled}
    assert all(sizes[r.request_id] == 1 for r in decoders)
    assert sizes["p"] == (249 if buckets else 256) and out.num_tokens == (256 if buckets else 263)
    scheduler.advance(out)  # the step was launched
    scheduler.update_from_output(out, [1] * len(out.scheduled))
    out = scheduler.schedule()
    assert {r.request_id: n for r, n in out.scheduled}.get("p") == (7 if buckets else 1)
    assert prompt.num_computed_tokens + (7 if buckets else 1) == (256 if buckets else 257)


@pytest.mark.parametrize("matmul_backend", ["xla", "cpu"])
def test_the_engine_caps_steps_mostly_of_padding_only_where_padding_costs_compute(tiny_model_dir, matmul_backend):
    """7 decode rows beside a new 128-token prompt fill a 256-token bucket to 53%. Under XLA's dot, which
    multiplies every row of the bucket, the engine caps the step at 128 (the prompt's last 7 tokens wait a
    step); the C++ matmul multiplies only the real rows, so there the prompt goes whole and its first token
    comes a step sooner."""
    engine, _ = LLMEngine.from_config(tiny_model_dir("llama"), EngineConfig(
        max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, block_size=8, num_kv_pages=160,
        matmul_backend=matmul_backend), warmup=False)
    assert engine.resolved.padding_rows_cost == (matmul_backend == "xla")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    decoders = [engine.add_request(list(range(10 * i + 1, 10 * i + 11)), params) for i in range(7)]
    while any(r.num_computed_tokens < 10 for r in decoders):
        engine.step()
    prompt = engine.add_request([100 + i % 200 for i in range(128)], params)
    engine.step()
    sizes = {r.request_id: n for r, n in engine.last_schedule.scheduled}
    assert all(sizes[r.request_id] == 1 for r in decoders)
    assert sizes[prompt.request_id] == (121 if matmul_backend == "xla" else 128)
    assert bool(prompt.output_token_ids) == (matmul_backend == "cpu")


def test_a_capped_step_leaves_a_prompt_beside_many_decode_rows_its_whole_chunk():
    """127 decode rows beside a new 50-token prompt fill a 256-token bucket to 69%: capped at 128, the
    prompt would get one token a step (the decode rows take 127) and its first token would come 50 steps
    late (a batch-128 benchmark on an H200 stopped on it). The cap applies only where the tokens it moves
    fit beside the next step's decode rows, so the prompt goes whole."""
    cfg = EngineConfig(max_model_len=512, max_num_seqs=128, max_num_batched_tokens=2048, block_size=16)
    scheduler = Scheduler(cfg, PagePool(1024, 16), prefill_buckets=[16, 32, 64, 128, 256, 512, 1024, 2048])
    decoders = [_request(f"d{i}", 10, max_tokens=50, first_token=10 * i) for i in range(127)]
    for request in decoders:
        scheduler.add_request(request)
    while not all(r.output_token_ids for r in decoders):  # their prompts (two steps)
        out = scheduler.schedule()
        scheduler.advance(out)  # the step was launched
        scheduler.update_from_output(out, [1] * len(out.scheduled))
    prompt = _request("p", 50, max_tokens=4, first_token=2000)
    scheduler.add_request(prompt)
    out = scheduler.schedule()
    sizes = {r.request_id: n for r, n in out.scheduled}
    assert sizes["p"] == 50 and all(sizes[r.request_id] == 1 for r in decoders) and out.num_tokens == 177


def test_preemption_frees_pages_and_requeues_the_newest():
    """Out of pages, the most recently admitted request is preempted, its pages freed, requeued first."""
    cfg = EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, block_size=4)
    pool = PagePool(6, 4)  # 5 usable pages = 20 tokens
    scheduler = Scheduler(cfg, pool)
    first, second = _request("first", 8, max_tokens=10), _request("second", 8, max_tokens=10, first_token=100)
    scheduler.add_request(first)
    scheduler.add_request(second)
    out = scheduler.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["first", "second"]
    scheduler.advance(out)  # the step was launched
    scheduler.update_from_output(out, [1, 1])  # both now hold 9 tokens: 3 + 3 pages > 5 usable
    out = scheduler.schedule()
    assert out.preempted == [second] and second.status is RequestStatus.PREEMPTED
    assert second.page_table == [] and second.num_computed_tokens == 0
    assert scheduler.waiting[0] is second and scheduler.num_preemptions == 1
    assert [r.request_id for r, _ in out.scheduled] == ["first"]


def _steps_to_first_token(cfg: EngineConfig, arrivals: list[Request]) -> dict[str, int]:
    """Runs the scheduler alone (every sampled token 7); returns the step at which each request got its first."""
    scheduler = Scheduler(cfg, PagePool(256, 8))
    for request in arrivals:
        scheduler.add_request(request)
    first, step = {}, 0
    while scheduler.has_unfinished:
        step += 1
        out = scheduler.schedule()
        assert out.num_tokens <= cfg.max_num_batched_tokens
        scheduler.advance(out)
        for request in scheduler.update_from_output(out, [7] * len(out.scheduled)):
            first.setdefault(request.request_id, step)
    return first


@pytest.mark.parametrize("limits, expected", [
    # A 400-token prompt, first in line, fills 64-token steps: the short ones get their first token with it
    ({}, {"long": 7, "s0": 7, "s1": 7, "s2": 7}),
    # It takes 32 tokens a step; the three short prompts (and the first 8 of their neighbour) fill the rest
    ({"long_prefill_token_threshold": 32}, {"long": 13, "s0": 1, "s1": 1, "s2": 2}),
    # Two prompts a step: the long one in 20-token chunks (4% of 512) beside one short prompt at a time
    ({"max_num_partial_prefills": 2}, {"long": 20, "s0": 1, "s1": 2, "s2": 3}),
])
def test_a_long_prompt_does_not_starve_short_ones_with_vllms_partial_prefill_limits(limits, expected):
    """vLLM's long_prefill_token_threshold / max_num_partial_prefills: counted in steps, a long prompt
    admitted first no longer holds back the short prompts that arrived with it until it is prefilled."""
    cfg = EngineConfig(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, block_size=8, **limits)
    long = _request("long", 400, max_tokens=2, first_token=1000)
    shorts = [_request(f"s{i}", 12, max_tokens=2, first_token=50 * i) for i in range(3)]
    assert _steps_to_first_token(cfg, [long, *shorts]) == expected


def test_at_most_max_long_partial_prefills_long_prompts_prefill_at_once():
    cfg = EngineConfig(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128, block_size=8,
                       long_prefill_token_threshold=40, max_num_partial_prefills=3, max_long_partial_prefills=1)
    scheduler = Scheduler(cfg, PagePool(256, 8))
    for i, n in enumerate([300, 200, 12, 12, 12]):
        scheduler.add_request(_request(f"r{i}", n, first_token=60 * i))
    out = scheduler.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r0", 40), ("r2", 12), ("r3", 12)]
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        EngineConfig(max_num_partial_prefills=2, max_long_partial_prefills=3)
