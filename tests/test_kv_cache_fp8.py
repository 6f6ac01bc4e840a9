"""KV pages in float8 e4m3 (kv_cache_dtype "fp8", vLLM's name; "fp8_e4m3" its alias): the setting,
the writers, each reader, and the engine.

Every reader (XLA's attention, the C++ CPU kernel, the Pallas kernels in interpret mode) must give
what the float32 reference gives on the same keys and values rounded to float8 (tight: the pages are
only widened), and stay near the reference on the unrounded values (loose: float8 keeps 3 mantissa
bits). The writers clip to +-448 (float8_e4m3fn has no infinity; a larger value would be NaN).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jaxserve import LLM, SamplingParams
from jaxserve.config.device_defaults import resolve_kv_cache_dtype
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.model_config import ModelConfig, RopeConfig
from jaxserve.ops import cpu_ffi
from jaxserve.ops.attention import FP8_MAX, to_page_dtype, write_kv
from jaxserve.ops.attention_backends import paged_attention
from test_pallas_attention import LAYER, build_case, decode_lengths, ragged_lengths

FP8 = jnp.float8_e4m3fn
needs_kernels = pytest.mark.skipif(cpu_ffi.kernel_error() is not None,
                                   reason=f"the CPU kernel is unavailable: {cpu_ffi.kernel_error()}")


def fp8_case(lengths, *, head_dim=64, page_size=16, group=3, seed=11):
    """build_case's float32 q/k/v and metadata, plus the pages as written in float8 and their widening."""
    q, k, v, md, real_tokens = build_case(lengths, page_size=page_size, head_dim=head_dim, group=group,
                                          dtype="float32", seed=seed)
    k8, v8 = to_page_dtype(k, FP8), to_page_dtype(v, FP8)
    return q, (k, v), (k8, v8), (k8.astype(jnp.float32), v8.astype(jnp.float32)), md, real_tokens


def reference(q, k, v, md, **kw):
    return np.asarray(pk.ragged_paged_attention_reference(q, k, v, LAYER, md.cu_q_lens, md.kv_lens,
                                                          md.block_tables, **kw))


def assert_near_unrounded(out, ref):
    """Loose: float8 keeps 3 mantissa bits (relative rounding error up to 1/16 per element)."""
    assert np.abs(out - ref).max() < 0.3 and np.linalg.norm(out - ref) < 0.04 * np.linalg.norm(ref)


def test_fp8_is_a_setting_with_vllms_names_and_a_quarter_of_float32s_bytes():
    """"fp8" and "fp8_e4m3" resolve to JAX's float8_e4m3fn (the name init_kv_cache and numpy take), one
    byte per element; another float8 flavour is refused naming the choices."""
    for name in ("fp8", "fp8_e4m3", "float8_e4m3fn"):
        assert resolve_kv_cache_dtype(EngineConfig(kv_cache_dtype=name)) == "float8_e4m3fn"
    model = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, num_layers=3, num_heads=4,
                        num_kv_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-5,
                        rope=RopeConfig(theta=1e4), max_position_embeddings=128, tie_word_embeddings=True)
    assert model.kv_bytes_per_token("float8_e4m3fn") * 4 == model.kv_bytes_per_token("float32") == 2 * 3 * 2 * 16 * 4
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e5m2' must be one of .*'fp8'"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


def test_writing_clips_to_448_rounds_to_nearest_and_keeps_subnormals():
    """write_kv (XLA's scatter) into float8 pages: outliers saturate at +-448 instead of becoming NaN."""
    pages = jnp.zeros((1, 2, 4, 1, 8), FP8)
    k = jnp.asarray([[[1e4, -1e4, 448.0, 0.3, 2.0**-9, -2.0**-7, 1.0625, 0.0]]], jnp.float32)
    k_pages, _ = jax.jit(write_kv)(pages, pages, 0, k, k, jnp.asarray([5], jnp.int32))
    row = np.asarray(k_pages[0, 1, 1, 0].astype(jnp.float32))
    np.testing.assert_array_equal(row, [FP8_MAX, -FP8_MAX, 448.0, 0.3125, 2.0**-9, -2.0**-7, 1.0, 0.0])


@pytest.mark.parametrize("lengths", ["ragged", "decode"])
def test_xla_attention_reads_fp8_pages(lengths):
    lengths = {"ragged": ragged_lengths, "decode": decode_lengths}[lengths](16)
    q, exact, pages, widened, md, real_tokens = fp8_case(lengths)
    kw = dict(scale=64 ** -0.5, sliding_window=0, soft_cap=0.0)
    decode_only = all(n <= 1 for n, _ in lengths)
    out = np.asarray(jax.jit(functools.partial(paged_attention, backend="xla", decode_only=decode_only, **kw))(
        q, *pages, LAYER, md))[:real_tokens]
    np.testing.assert_allclose(out, reference(q, *widened, md, **kw)[:real_tokens], atol=2e-5, rtol=1e-5)
    assert_near_unrounded(out, reference(q, *exact, md, **kw)[:real_tokens])


@needs_kernels
@pytest.mark.parametrize("head_dim,group", [(64, 3), (48, 5)])  # the grouped path (vector loads), the general loop
def test_the_cpu_kernel_widens_every_fp8_code_exactly(head_dim, group):
    """One key per row: the output is that key's value row, so each of the 254 finite float8 codes put in
    the value pages comes out as its exact float32 value (normals, subnormals, both zeros)."""
    codes = np.asarray([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)  # 0x7f, 0xff: NaN
    q, _, (k8, v8), _, md, real_tokens = fp8_case([(1, 0)] * 4, head_dim=head_dim, group=group)
    table = np.asarray(md.block_tables)
    v_bytes = np.asarray(v8).view(np.uint8).copy()
    for seq in range(4):  # each row's one value: a run of the codes
        v_bytes[LAYER, table[seq, 0], 0] = np.resize(np.roll(codes, seq * 61), v_bytes.shape[3:])
    v8 = jnp.asarray(v_bytes.view(FP8))
    out = np.asarray(jax.jit(functools.partial(paged_attention, backend="cpu", scale=0.1))(q, k8, v8, LAYER, md))
    expected = np.stack([np.asarray(v8[LAYER, table[seq, 0], 0].astype(jnp.float32)) for seq in range(4)])
    expected = np.repeat(expected, group, axis=1)  # each KV head's value row serves its group's query heads
    np.testing.assert_array_equal(out[:real_tokens], expected)


@needs_kernels
@pytest.mark.parametrize("lengths", ["ragged", "decode"])
def test_the_cpu_kernel_reads_fp8_pages(lengths):
    lengths = {"ragged": ragged_lengths, "decode": decode_lengths}[lengths](16)
    q, exact, pages, widened, md, real_tokens = fp8_case(lengths)
    kw = dict(scale=64 ** -0.5, sliding_window=0, soft_cap=0.0)
    out = np.asarray(jax.jit(functools.partial(paged_attention, backend="cpu", **kw))(q, *pages, LAYER, md))
    np.testing.assert_allclose(out[:real_tokens], reference(q, *widened, md, **kw)[:real_tokens], atol=2e-5,
                               rtol=1e-5)
    assert_near_unrounded(out[:real_tokens], reference(q, *exact, md, **kw)[:real_tokens])
    assert not np.any(out[real_tokens:]), "padding rows must be zeros"


@pytest.mark.parametrize("backend", ["xla", pytest.param("cpu", marks=needs_kernels)])
def test_an_fp8_engine_generates_with_no_compiles_after_warm_up(tiny_model_dir, backend):
    """kv_cache_dtype="fp8" end to end, prompts and decode steps: the pages are float8, a quarter of
    float32's bytes (four times the pages in the same memory), and nothing compiles after warm-up."""
    kw = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, block_size=8, kv_cache_memory_bytes=2**20,
              attention_backend=backend, dtype="float32", forbid_compilation_after_warmup=True)
    llm = LLM(tiny_model_dir("llama"), kv_cache_dtype="fp8", **kw)
    runner = llm.engine.runner
    assert runner.cfg.kv_cache_dtype == "float8_e4m3fn" and [x.dtype for x in runner.kv_cache] == [FP8] * 2
    assert runner.attention_backend == backend
    f32_page_bytes = runner.model_cfg.kv_bytes_per_token("float32") * 8
    assert runner.num_pages == 4 * (2**20 // f32_page_bytes)
    prompts = [{"prompt_token_ids": list(range(1, 20))}, {"prompt_token_ids": [4, 5, 6, 7]}]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]


def test_the_pallas_kernels_take_fp8_pages_and_auto_picks_them_on_a_gpu(caplog):
    """The Pallas kernels read float8 pages (upcast to the bfloat16 queries in the kernel): "auto" on a GPU
    picks them for fp8 pages as for bfloat16 ones, and explicit pallas backends take them. A float32
    engine's fp8 pages are refused on a GPU by name (Hopper has no tf32 product for V's layout): "auto"
    then serves them with XLA's attention and says why; interpret mode still runs them."""
    from jaxserve.ops.attention_backends import resolve_attention_backend

    model = ModelConfig(architecture="llama", vocab_size=64, hidden_size=576, num_layers=2, num_heads=9,
                        num_kv_heads=3, head_dim=64, intermediate_size=128, rms_norm_eps=1e-5,
                        rope=RopeConfig(theta=1e4), max_position_embeddings=128, tie_word_embeddings=True)
    fp8 = EngineConfig(dtype="bfloat16", kv_cache_dtype="fp8")
    assert resolve_attention_backend("auto", model, EngineConfig(dtype="bfloat16"), platform="gpu") == "pallas"
    assert resolve_attention_backend("auto", model, fp8, platform="gpu") == "pallas"
    assert resolve_attention_backend("pallas", model, fp8, platform="gpu") == "pallas"
    assert resolve_attention_backend("pallas-interpret", model, fp8, platform="cpu") == "pallas-interpret"
    fp8_float32 = EngineConfig(dtype="float32", kv_cache_dtype="fp8")
    with caplog.at_level(logging.WARNING, logger="jaxserve.ops.attention_backends"):
        assert resolve_attention_backend("auto", model, fp8_float32, platform="gpu") == "xla"
    assert "float8 KV pages read by float32 queries are not supported on GPU" in caplog.text
    with pytest.raises(ValueError, match="'pallas' cannot run this model: float8 KV pages read by float32"):
        resolve_attention_backend("pallas", model, fp8_float32, platform="gpu")
    assert resolve_attention_backend("pallas-interpret", model, fp8_float32, platform="cpu") == "pallas-interpret"
    pk.check_supported(num_heads=9, num_kv_heads=3, head_dim=64, page_size=16, dtype=FP8, interpret=False)
