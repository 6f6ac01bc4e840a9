"""The C++ residual add and RMSNorm (`cpu_ffi.add_rms_norm`, cpu_kernels/residual_norm.cc) against XLA's add
and `transformer.rms_norm`, and the engine's use of it: under bfloat16 matmuls (norm rounded to bfloat16) and
int8 ones (norm in float32) each layer's two adds go with the norms after them into one call; a float32
engine (the exact-parity mode) keeps XLA's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.models import transformer
from jaxserve.models.transformer import rms_norm
from jaxserve.ops import cpu_ffi

pytestmark = pytest.mark.skipif(cpu_ffi.kernel_error() is not None,
                                reason=f"the CPU kernels are unavailable: {cpu_ffi.kernel_error()}")
TARGET = 'custom_call_target="jaxserve_add_rms_norm"'
TARGET_F32 = 'custom_call_target="jaxserve_add_rms_norm_f32"'


def _xla_add_and_norm(h, add, weight, eps, norm_dtype=jnp.bfloat16):
    total = h + add
    return total, rms_norm(total, weight, eps).astype(norm_dtype)


@pytest.mark.parametrize("rows,width", [(1, 576), (37, 576), (512, 576), (5, 40), (3, 7)])
def test_the_fused_add_and_norm_is_xlas_add_and_norm_rounded_to_bfloat16(rows, width):
    """The sum bit for bit; the norm XLA's rounded to bfloat16, but for the odd element whose float32 value
    (its mean summed in another order) lies at a rounding boundary, one bfloat16 step away. Rows over 16 go
    to XLA's threads, widths that are not whole vectors take the scalar tail; a row of zeros takes eps."""
    rng = np.random.default_rng(rows * 1000 + width)
    h = rng.standard_normal((rows, width)).astype(np.float32) * 30
    add = rng.standard_normal((rows, width)).astype(np.float32)
    h[0], add[0] = 0.0, 0.0
    weight = rng.standard_normal(width).astype(np.float32)
    fused = jax.jit(lambda *a: cpu_ffi.add_rms_norm(*a, 1e-5))(h, add, weight)
    xla = jax.jit(lambda *a: _xla_add_and_norm(*a, 1e-5))(h, add, weight)
    assert fused[0].dtype == jnp.float32 and fused[1].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(fused[0]), np.asarray(xla[0]))
    ours, theirs = (np.asarray(x[1]).view(np.uint16).astype(np.int32) for x in (fused, xla))
    assert np.abs(ours - theirs).max() <= 1
    assert (ours != theirs).mean() < 1e-3
    assert not np.asarray(fused[1][0], np.float32).any()  # zeros in, zeros out (signed as the weight)


@pytest.mark.parametrize("rows,width", [(1, 576), (37, 576), (3, 7)])
def test_the_float32_norm_is_xlas_within_a_few_ulps(rows, width):
    """The int8 matmul's input: the sum bit for bit, the norm XLA's float32 one but for the mean's order of
    summation (a relative difference of a few float32 steps)."""
    rng = np.random.default_rng(rows * 7 + width)
    h = rng.standard_normal((rows, width)).astype(np.float32) * 30
    add = rng.standard_normal((rows, width)).astype(np.float32)
    weight = rng.standard_normal(width).astype(np.float32)
    fused = jax.jit(lambda *a: cpu_ffi.add_rms_norm(*a, 1e-5, jnp.float32))(h, add, weight)
    total = h + add
    assert fused[0].dtype == jnp.float32 and fused[1].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(fused[0]), total)
    np.testing.assert_allclose(np.asarray(fused[1]), np.asarray(rms_norm(jnp.asarray(total), weight, 1e-5)),
                               rtol=1e-5, atol=1e-6)


def test_operands_of_other_shapes_are_refused_naming_the_kernel():
    h = jnp.ones((4, 64), jnp.float32)
    with pytest.raises(Exception, match="jaxserve_add_rms_norm: h, add and the results must be"):
        jax.block_until_ready(cpu_ffi.add_rms_norm(h, h, jnp.ones(63, jnp.float32), 1e-5))


def _engine(tiny_model_dir, matmul_backend, **kwargs):
    return LLM(tiny_model_dir("llama"), matmul_backend=matmul_backend, max_model_len=64, max_num_seqs=2,
               max_num_batched_tokens=32, block_size=8, num_kv_pages=24, **kwargs)


def _generate(llm):
    prompts = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5, 6, 7, 8, 9]}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return tokens, [[step[token] for step, token in zip(o.outputs[0].logprobs, ids)] for o, ids in zip(outs, tokens)]


def test_bfloat16_matmuls_take_each_layers_adds_and_norms_in_one_call_and_float32_keeps_xla(
        tiny_model_dir, monkeypatch):
    """cpu-bf16: every step executable calls the kernel twice a layer (the first layer adding zeros), and its tokens and log-probabilities are those of the same engine with XLA's add
    and norm rounded to bfloat16 in the kernel's place. matmul_backend "cpu" (float32 weights, the parity
    mode) never calls it."""
    llm = _engine(tiny_model_dir, "cpu-bf16")
    layers = llm.engine.runner.model_cfg.num_layers
    runner = llm.engine.runner
    for kind, buckets in (("decode", runner.decode_buckets), ("prefill", runner.prefill_buckets)):
        for bucket in buckets:
            assert runner.compiled_text(kind, bucket).count(TARGET) == 2 * layers, (kind, bucket)
    tokens, logprobs = _generate(llm)

    monkeypatch.setattr(transformer.cpu_ffi, "add_rms_norm", _xla_add_and_norm)
    xla_tokens, xla_logprobs = _generate(_engine(tiny_model_dir, "cpu-bf16"))
    assert tokens == xla_tokens
    np.testing.assert_allclose(logprobs, xla_logprobs, atol=2e-2)

    float32 = _engine(tiny_model_dir, "cpu").engine.runner
    assert all(TARGET not in float32.compiled_text("decode", bucket) for bucket in float32.decode_buckets)


def test_int8_matmuls_take_each_layers_adds_and_norms_in_one_float32_call(tiny_model_dir, monkeypatch):
    """--quantization int8: every step executable calls the float32 kernel twice a layer and never XLA's
    bfloat16 one, and its greedy tokens are those of the same engine with XLA's add and norm in its place."""
    llm = _engine(tiny_model_dir, "auto", quantization="int8")
    runner = llm.engine.runner
    for kind, buckets in (("decode", runner.decode_buckets), ("prefill", runner.prefill_buckets)):
        for bucket in buckets:
            text = runner.compiled_text(kind, bucket)
            assert text.count(TARGET_F32) == 2 * runner.model_cfg.num_layers and TARGET not in text, (kind, bucket)
    tokens, logprobs = _generate(llm)

    monkeypatch.setattr(transformer.cpu_ffi, "add_rms_norm", _xla_add_and_norm)
    xla_tokens, xla_logprobs = _generate(_engine(tiny_model_dir, "auto", quantization="int8"))
    assert tokens == xla_tokens
    np.testing.assert_allclose(logprobs, xla_logprobs, atol=2e-2)
