"""float8 e4m3 weights (`quantization="fp8"` on a CPU) in the C++ packed matmul, W8A16: the kernel is the
product of the bfloat16-rounded activations and the e4m3 weights to float32's summation error, the weights
widened by moving bits (so e4m3's subnormals are rounded away at packing, and tiny products are kept by
scaling x up by a power of two), its padding rows are zeros, the gated form and its bfloat16 result agree,
packing in numpy and jax agree, an fp8 checkpoint's values are packed as they are, and the engine serves with
it compiling nothing after warm-up. The XLA-side fp8 QuantizedWeight (a GPU's W8A8) has its own tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny_models
from jaxserve import LLM
from jaxserve.ops import cpu_ffi
from jaxserve.ops.packed_matmul import (FP8_SCALE_SHIFT, PANEL_WIDTH, PackedWeight, matmul,
                                        silu_gated_matmul)
from jaxserve.ops.quantized import QuantizedWeight

needs_kernels = pytest.mark.skipif(cpu_ffi.kernel_error() is not None,
                                   reason=f"the CPU kernels are unavailable: {cpu_ffi.kernel_error()}")


def unpacked_fp8(packed: PackedWeight, k: int) -> np.ndarray:
    """The weights [K, panels * PANEL_WIDTH] a fp8 PackedWeight stands for, float64, unpacked and decoded
    independently of the kernel (ml_dtypes' e4m3 -> float, the scale without the kernel's power of two)."""
    panels = packed.data.shape[0]
    pairs = np.asarray(packed.data).astype(np.float64).reshape(panels, k // 2, PANEL_WIDTH, 2).transpose(0, 1, 3, 2)
    q = pairs.reshape(panels, k, PANEL_WIDTH).transpose(1, 0, 2).reshape(k, panels * PANEL_WIDTH)
    return q * np.asarray(packed.scale, np.float64) * 2.0 ** -FP8_SCALE_SHIFT


def bf16(a: np.ndarray) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


@needs_kernels
@pytest.mark.parametrize("k, n", [(2, 1), (32, 47), (64, 96), (576, 960), (1536, 576)])
@pytest.mark.parametrize("m", [1, 8, 9, 17, 33])
def test_fp8_matmul_is_the_product_of_the_e4m3_weights_and_the_bfloat16_activations(m, k, n):
    rng = np.random.default_rng(m * 1000 + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    packed = PackedWeight.pack(w, dtype="fp8")
    assert packed.kind == "fp8" and packed.data.shape == (-(-n // PANEL_WIDTH), k // 2, 2 * PANEL_WIDTH)
    out = np.asarray(jax.jit(matmul)(jnp.asarray(x), jax.device_put(packed)))
    expected = bf16(x) @ unpacked_fp8(packed, k)[:, :n]
    np.testing.assert_allclose(out, expected, atol=1e-5 * np.sqrt(k), rtol=1e-5)
    weights = unpacked_fp8(packed, k)[:, :n]
    assert np.all(np.abs(weights - w) <= np.abs(w) / 16 + np.abs(w).max(axis=0) / 448 / 2**6)  # e4m3's rounding
    if k >= 64:
        assert np.abs(weights - w).max() > 1e-3  # it is quantized: the test above could tell


@needs_kernels
def test_no_product_is_flushed_small_activations_and_small_weights_included():
    """vdpbf16ps reads bfloat16 subnormals as zero and flushes products under float32's normal range. The
    kernel's bfloat16 form of an e4m3 weight is its value times 2^-120, so e4m3's subnormals are rounded at
    packing to 0 or +-2^-6 of the column's scale (the nearest; ties to 0), and x is multiplied by 2^64 in
    the kernel: activations of 1e-12 against weights 2^-6 of their column's scale still give their exact
    products (only those under 2^-70 of the scale, about 1e-21, would be lost; without the 2^64, any under
    2^-6, so 1e-12 x 2^-6 here)."""
    k, n = 64, 48
    w = np.zeros((k, n), np.float32)
    w[0, :] = 448.0  # every column's scale is 1
    w[1, 0], w[1, 1], w[1, 2], w[1, 3] = 2.0**-6, 5 * 2.0**-9, 4 * 2.0**-9, -7 * 2.0**-9  # normal, subnormals
    packed = PackedWeight.pack(w, dtype="fp8")
    weights = unpacked_fp8(packed, k)
    assert weights[1, :4].tolist() == [2.0**-6, 2.0**-6, 0.0, -(2.0**-6)]
    for scale in (1.0, 1e-12):
        x = np.zeros((2, k), np.float32)
        x[:, 1] = scale
        x[1, 0] = scale / 1024
        out = np.asarray(jax.jit(matmul)(jnp.asarray(x), jax.device_put(packed)))
        expected = bf16(x) @ weights
        np.testing.assert_allclose(out[:, :4], expected[:, :4], rtol=1e-6)
        assert out[0, 0] == pytest.approx(scale * 2.0**-6, rel=1e-6)


@needs_kernels
@pytest.mark.parametrize("rows", [0, 5, 9, 24, 33, 40])
def test_fp8_gated_matmul_its_bfloat16_result_and_row_cut(rows):
    """silu(x @ w_gate) * (x @ w_up) from fp8-packed [w_gate | w_up], only the first `rows` rows, zeros below;
    the bfloat16 result is the float32 one rounded to nearest even, as XLA's convert rounds it."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((40, 576)).astype(np.float32)
    w = (rng.standard_normal((576, 4 * PANEL_WIDTH)) / 24).astype(np.float32)
    packed = jax.device_put(PackedWeight.pack(w, dtype="fp8"))
    gate, up = np.split(bf16(x) @ unpacked_fp8(packed, 576), 2, axis=-1)
    expected = gate / (1.0 + np.exp(-gate)) * up
    expected[rows:] = 0.0
    out = np.asarray(jax.jit(silu_gated_matmul)(jnp.asarray(x), packed, jnp.int32(rows)))
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-4)
    rounded = jax.jit(lambda x, w, r: silu_gated_matmul(x, w, r, out_dtype=jnp.bfloat16))(jnp.asarray(x), packed,
                                                                                          jnp.int32(rows))
    assert rounded.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(rounded), np.asarray(jnp.asarray(out).astype(jnp.bfloat16)))
    plain = np.asarray(jax.jit(matmul)(jnp.asarray(x), packed, jnp.int32(rows)))
    assert not plain[rows:].any()


def test_fp8_packing_in_jax_and_numpy_agree_and_columns_are_the_dequantized_embeddings():
    w = np.random.default_rng(0).standard_normal((12, 100)).astype(np.float32)
    host = PackedWeight.pack(w, dtype="fp8")
    traced = jax.jit(lambda a: PackedWeight.pack(a, dtype="fp8"))(jnp.asarray(w))
    for name in ("data", "scale"):
        np.testing.assert_array_equal(np.asarray(getattr(traced, name)), np.asarray(getattr(host, name)))
    ids = jnp.asarray([0, 47, 48, 99, 5])
    looked_up = np.asarray(jax.jit(PackedWeight.columns)(traced, ids))
    np.testing.assert_allclose(looked_up, unpacked_fp8(host, 12)[:, np.asarray(ids)].T, rtol=1e-6)
    np.testing.assert_allclose(looked_up, w[:, np.asarray(ids)].T, rtol=1 / 16, atol=1e-6)
    assert not unpacked_fp8(host, 12)[:, 100:].any(), "the last panel is padded with zeros"


def test_an_fp8_checkpoint_weight_is_packed_as_it_is():
    """A QuantizedWeight of e4m3 values and column scales (an fp8 checkpoint's) packs to the same values and
    scales: nothing is rounded a second time (its subnormals aside, which both sides round the same way)."""
    w = np.random.default_rng(2).standard_normal((96, 70)).astype(np.float32)
    stored = QuantizedWeight.quantize(w, "fp8")
    packed = PackedWeight.from_quantized(stored, dtype="fp8")
    stored_values = np.asarray(stored.data).astype(np.float64) * np.asarray(stored.scale, np.float64)
    np.testing.assert_array_equal(unpacked_fp8(packed, 96)[:, :70], stored_values)
    np.testing.assert_array_equal(np.asarray(packed.data), np.asarray(PackedWeight.pack(w, dtype="fp8").data))


@needs_kernels
def test_the_engine_serves_fp8_weights_and_compiles_nothing_after_warm_up(tiny_model_dir, caplog):
    """quantization="fp8" on a CPU: every weight matrix is packed fp8 (with scales), the LM head kept
    unquantized (bfloat16 where the CPU multiplies it fast, else float32), as vLLM keeps it; the start-up
    line says W8A16 in the C++ matmul; greedy generation runs with compilation forbidden after warm-up and
    mostly agrees with the float32 engine (a tiny random model's margins are small)."""
    kw = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=8, num_kv_pages=40)
    with caplog.at_level("INFO", logger="jaxserve.startup"):
        llm = LLM(tiny_model_dir("llama"), quantization="fp8", forbid_compilation_after_warmup=True, **kw)
    runner = llm.engine.runner
    assert f"weights fp8 (W8A16, the C++ matmul), {runner.device_weight_bytes / 2**20:.1f} MiB" in caplog.text
    assert llm.engine.get_stats()["quantization"] == "fp8"
    assert runner.resolved.packed_dtype == "fp8" and runner.matmul_backend != "xla"
    layers = runner.params["layers"]
    assert all(layer[name].kind == "fp8" for layer in layers for name in ("w_qkv", "wo", "w_gate_up", "w_down"))
    assert runner.params["lm_head"].kind == ("bfloat16" if cpu_ffi.bf16_dot_instructions() else "float32")
    tiny_models.assert_greedy_mostly_agrees_with_float32(llm, tiny_model_dir("llama"), **kw)
