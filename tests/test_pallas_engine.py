"""The engine with the Pallas kernels: same greedy tokens as XLA, refusal of shapes they cannot take.

The kernels run in GPU interpret mode (`attention_backend="pallas-interpret"`) on a tiny random llama
with head_dim 64 (the tiny test models' head dims of 16 and 32 are below the kernels' minimum) and a
GQA group of 3. Buckets are kept to one per entry point: interpret-mode steps are slow to compile.
Where JAX's default backend is a GPU, the compiled kernels run instead, in bfloat16.
"""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import tiny_models
from jaxserve import LLM, SamplingParams
from jaxserve.cli import main

ON_GPU = jax.default_backend() == "gpu"
ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=16, num_kv_pages=24,
              enable_prefix_caching=True, min_prefill_bucket=32, min_decode_bucket=4)


@pytest.fixture(scope="module")
def llama64_dir(tmp_path_factory):
    """A tiny random llama with head_dim 64 and 6 query heads over 2 KV heads, saved as an HF directory."""
    directory = tmp_path_factory.mktemp("llama_head_dim_64")
    torch.manual_seed(0)
    shape = {**tiny_models.COMMON_CONFIG, "hidden_size": 96, "num_attention_heads": 6, "head_dim": 64}
    config = transformers.LlamaConfig(**shape, tie_word_embeddings=True, rope_theta=10000.0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # larger random weights than the default init: less repetitive greedy text
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    tiny_models.byte_tokenizer().save_pretrained(directory)
    return directory


def _prompts():
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 40, 17, 1)]
    prompts.append(prompts[1][:35] + [7, 8])  # shares two full pages with prompt 1: prefix-cache hits
    return [{"prompt_token_ids": p} for p in prompts]


def _generate(model_dir, backend, dtype="float32"):
    llm = LLM(model_dir, attention_backend=backend, dtype=dtype, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3)
    first = llm.generate(_prompts()[:4], params, use_tqdm=False)
    second = llm.generate(_prompts()[4:], params, use_tqdm=False)  # after prompt 1 finished: cached pages
    return first + second, llm.engine.get_stats()


@pytest.mark.skipif(ON_GPU, reason="on a GPU the compiled kernels are checked instead (next test)")
def test_pallas_interpret_generates_the_same_greedy_tokens_as_xla(llama64_dir):
    """Through the engine, with chunked prefill (a 40-token prompt, a 32-token budget) and prefix caching
    on, the Pallas kernels give XLA's greedy tokens and logprobs: guards the kernels in every layer of the model,
    the decode/prefill dispatch, and the metadata the engine builds for them."""
    xla, xla_stats = _generate(llama64_dir, "xla")
    pallas, pallas_stats = _generate(llama64_dir, "pallas-interpret")
    # Same scheduling, cache hits included. (Not compilations: the GPU interpreter compiles its own
    # small host-side helpers the first time a kernel runs, after warm-up.)
    ignore = ("compilations_since_warmup", "step_seconds", "model_seconds", "phase_seconds")
    assert {k: v for k, v in pallas_stats.items() if k not in ignore} == {k: v for k, v in xla_stats.items()
                                                                           if k not in ignore}
    assert pallas_stats["prompt_tokens_cached"] >= 32
    for a, b in zip(xla, pallas):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lp_a.keys() == lp_b.keys()
            np.testing.assert_allclose(list(lp_a.values()), list(lp_b.values()), atol=1e-4)
    assert len({tuple(r.outputs[0].token_ids) for r in xla}) > 1, "degenerate model: every output the same"


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="interpret mode reads float8 pages with float32 queries, a CPU-only setting")
def test_pallas_interpret_reads_fp8_pages_as_xla_does(llama64_dir):
    """kv_cache_dtype "fp8" through the engine (a chunked 40-token prompt and a short one): the pages are
    float8, written by XLA's clipping writer, and the Pallas kernels reading them give XLA's attention's
    greedy tokens and logprobs on the same pages (both widen them exactly). Slow (about a minute
    interpreted): the default run covers the kernels on fp8 pages (test_pallas_fp8) and the engine's
    steps lowering with them (test_pallas_lowering)."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=3)
    outputs = {}
    for backend in ("xla", "pallas-interpret"):
        llm = LLM(llama64_dir, attention_backend=backend, dtype="float32", kv_cache_dtype="fp8", **ENGINE)
        assert llm.engine.runner.attention_backend == backend
        assert {x.dtype for x in llm.engine.runner.kv_cache} == {jnp.dtype(jnp.float8_e4m3fn)}
        outputs[backend] = llm.generate(_prompts()[:2], params, use_tqdm=False)
    for a, b in zip(outputs["xla"], outputs["pallas-interpret"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lp_a.keys() == lp_b.keys()
            np.testing.assert_allclose(list(lp_a.values()), list(lp_b.values()), atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (the interpreted kernels are checked on CPU above)")
def test_pallas_on_gpu_generates_the_same_greedy_tokens_as_xla(llama64_dir):
    """The compiled kernels inside the engine, in bfloat16, against XLA's attention on the same GPU:
    the same scheduling, the same greedy tokens, logprobs within bfloat16 rounding."""
    xla, xla_stats = _generate(llama64_dir, "xla", dtype="bfloat16")
    pallas, pallas_stats = _generate(llama64_dir, "pallas", dtype="bfloat16")
    timings = ("step_seconds", "model_seconds", "phase_seconds")
    assert {k: v for k, v in pallas_stats.items() if k not in timings} == {
        k: v for k, v in xla_stats.items() if k not in timings}
    assert pallas_stats["compilations_since_warmup"] == 0
    for a, b in zip(xla, pallas):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            top = max(lp_a, key=lp_a.get)
            assert abs(lp_a[top] - lp_b[top]) < 0.1, (lp_a, lp_b)
    assert len({tuple(r.outputs[0].token_ids) for r in xla}) > 1, "degenerate model: every output the same"


def test_unsupported_head_dim_is_refused_at_engine_start(tiny_model_dir):
    """The tiny llama has head_dim 16: an explicit Pallas backend is refused before anything compiles,
    with the reason; the XLA-based backend serves it."""
    for backend in ("pallas-interpret", "pallas"):
        with pytest.raises(ValueError, match=f"attention_backend='{backend}'.*head_dim=16"):
            LLM(tiny_model_dir("llama"), attention_backend=backend, warmup=False, **ENGINE)
    llm = LLM(tiny_model_dir("llama"), attention_backend="auto", dtype="float32", warmup=False, **ENGINE)
    from jaxserve.ops.cpu_ffi import kernel_error

    # On a CPU in float32: XLA with the C++ decode kernel, or plain XLA where no compiler can build it.
    expected = "cpu" if not ON_GPU and kernel_error() is None else "xla"
    assert llm.engine.runner.attention_backend == expected


def test_check_lowering_command(llama64_dir, capsys):
    """`jaxserve check-lowering MODEL --platform cuda` prints one row per bucket with the Pallas kernels
    found in each, and exits 0 when all lowered."""
    main(["check-lowering", str(llama64_dir), "--platform", "cuda", "--dtype", "bfloat16",
          "--attention-backend", "pallas", "--max-model-len", "64", "--max-num-seqs", "2",
          "--max-num-batched-tokens", "16", "--num-kv-pages", "8"])
    out = capsys.readouterr().out
    assert "3 of 3 step functions lowered for cuda" in out
    assert out.count("ragged_paged_attention (wgmma, TMA)") == 1  # prefill bucket 16
    assert out.count("paged_decode_attention (wgmma, TMA)") == 2  # decode buckets 1, 2


def test_check_lowering_command_refuses_an_unsupported_model(tiny_model_dir, capsys):
    """An explicit Pallas backend on a model the kernels cannot take ends with a one-line error, exit 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(["check-lowering", str(tiny_model_dir("llama")), "--attention-backend", "pallas", "--dtype", "bfloat16"])
    assert exit_info.value.code == 2
    assert "head_dim=16" in capsys.readouterr().err
