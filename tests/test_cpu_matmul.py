"""The C++ packed-weight matmul for XLA:CPU (`jaxserve/cpu_ffi.py`) against float64 numpy, and the
engine's choice of it. The model-level parity (every family, packed, against Hugging Face) is in
test_model_parity.py."""

from __future__ import annotations

import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import cpu_ffi
from jaxserve.attention_backends import resolve_matmul_backend
from jaxserve.engine_config import EngineConfig
from jaxserve.cpu_ffi import PANEL_WIDTH, PackedWeight, matmul

needs_kernels = pytest.mark.skipif(cpu_ffi.kernel_error() is not None,
                                   reason=f"the CPU kernels are unavailable: {cpu_ffi.kernel_error()}")


def test_the_kernels_build_wherever_a_compiler_is_found():
    """The kernel tests skip where the kernels cannot be built; on a machine with a C++ compiler
    (CI's included) a broken kernel source must fail here instead of skipping them all."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on PATH")
    assert cpu_ffi.kernel_error() is None


@needs_kernels
@pytest.mark.parametrize("k, n", [(1, 1), (33, 47), (33, 48), (33, 49), (64, 320), (576, 960)])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 17, 64])
def test_packed_matmul_matches_numpy(m, k, n):
    """Row counts below, at and past the kernel's 8-row tile; widths below, at and past a 48-column
    panel. Every output element is checked, so a missed tail row or column shows."""
    rng = np.random.default_rng(m * 1000 + n)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((k, n), np.float32)
    packed = PackedWeight.pack(w)
    assert packed.data.shape == (-(-n // PANEL_WIDTH), k, PANEL_WIDTH) and packed.n == n
    out = np.asarray(jax.jit(matmul)(jnp.asarray(x), jax.device_put(packed)))
    expected = x.astype(np.float64) @ w.astype(np.float64)
    assert out.shape == (m, n)
    np.testing.assert_allclose(out, expected, atol=2e-5 * np.sqrt(k), rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("k, inter", [(1, 48), (33, 96), (576, 1536)])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 17, 64])
def test_silu_gated_matmul_matches_numpy(m, k, inter):
    """silu(x @ w_gate) * (x @ w_up) from the packed [w_gate | w_up], against float64 numpy: row counts
    below, at and past the kernel's 8-row tile, and gates from -100 to 100, where a naive
    sigmoid overflows."""
    rng = np.random.default_rng(m * 1000 + inter)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((k, 2 * inter), np.float32)
    x[0, 0] = 100.0 / max(abs(w[0, 0]), 0.1)  # gate 0 of row 0 far out, at 100 and beyond or below -100
    gate, up = np.split(x.astype(np.float64) @ w.astype(np.float64), 2, axis=-1)
    expected = gate * np.exp(-np.logaddexp(0.0, -gate)) * up  # silu, without overflow
    out = np.asarray(jax.jit(cpu_ffi.silu_gated_matmul)(jnp.asarray(x), jax.device_put(PackedWeight.pack(w))))
    assert out.shape == (m, inter)
    np.testing.assert_allclose(out, expected, atol=2e-5 * k, rtol=2e-5)
    unpacked = np.asarray(jax.jit(cpu_ffi.silu_gated_matmul)(jnp.asarray(x), jnp.asarray(w)))  # XLA's path
    np.testing.assert_allclose(unpacked, expected, atol=2e-5 * k, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("rows", [0, 1, 7, 9, 17, 24, 40])
def test_only_the_real_rows_are_multiplied_and_the_padding_rows_are_zeros(rows):
    """`rows` (a step's real tokens, traced) cuts the multiplied rows: those below it come out as
    zeros even where x holds values there, in both kernels; a count past M means all rows."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((24, 96), np.float32)
    w = rng.standard_normal((96, 2 * PANEL_WIDTH), np.float32)
    kept = min(rows, 24)
    expected = x.astype(np.float64) @ w.astype(np.float64)
    expected[kept:] = 0.0
    out = np.asarray(jax.jit(matmul)(jnp.asarray(x), jax.device_put(PackedWeight.pack(w)), jnp.int32(rows)))
    np.testing.assert_allclose(out, expected, atol=1e-4, rtol=1e-5)
    gate, up = np.split(x.astype(np.float64) @ w.astype(np.float64), 2, axis=-1)
    gated_expected = gate / (1.0 + np.exp(-gate)) * up
    gated_expected[kept:] = 0.0
    gated = np.asarray(jax.jit(cpu_ffi.silu_gated_matmul)(jnp.asarray(x), jax.device_put(PackedWeight.pack(w)),
                                                          jnp.int32(rows)))
    np.testing.assert_allclose(gated, gated_expected, atol=1e-4, rtol=1e-5)


@needs_kernels
def test_silu_gated_matmul_keeps_xla_for_halves_that_are_not_whole_panels():
    x = np.random.default_rng(1).standard_normal((3, 8), np.float32)
    w = np.random.default_rng(2).standard_normal((8, 2 * 40), np.float32)
    gate, up = np.split(x @ w, 2, axis=-1)
    out = np.asarray(jax.jit(cpu_ffi.silu_gated_matmul)(jnp.asarray(x), jax.device_put(PackedWeight.pack(w))))
    np.testing.assert_allclose(out, gate / (1.0 + np.exp(-gate)) * up, atol=1e-4, rtol=1e-5)


@needs_kernels
def test_packing_in_jax_and_numpy_agree_and_columns_are_an_embedding_lookup():
    w = np.random.default_rng(0).standard_normal((10, 100), np.float32)
    host, traced = PackedWeight.pack(w), jax.jit(PackedWeight.pack)(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(traced.data), host.data)
    assert not host.data[-1, :, 100 - 2 * PANEL_WIDTH:].any(), "the last panel is padded with zeros"
    ids = jnp.asarray([0, 47, 48, 99, 5])
    np.testing.assert_array_equal(np.asarray(jax.jit(PackedWeight.columns)(traced, ids)), w[:, np.asarray(ids)].T)


@needs_kernels
def test_one_step_calls_the_kernel_from_several_threads_without_mixing_results():
    """Two independent matmuls in one jitted function may run at once on XLA's threads."""
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((5, 96), np.float32) for _ in range(2)]
    ws = [rng.standard_normal((96, 480), np.float32) for _ in range(2)]
    out = jax.jit(lambda a, b, p, q: (matmul(a, p), matmul(b, q)))(*map(jnp.asarray, xs),
                                                                  *map(PackedWeight.pack, ws))
    for got, x, w in zip(out, xs, ws):
        np.testing.assert_allclose(np.asarray(got), x @ w, atol=1e-4, rtol=1e-5)


@needs_kernels
def test_auto_packs_the_weights_for_float32_on_a_cpu_and_keeps_xla_otherwise(caplog):
    f32, bf16 = EngineConfig(dtype="float32"), EngineConfig(dtype="bfloat16")
    assert resolve_matmul_backend("auto", f32, platform="cpu") == "cpu"
    assert resolve_matmul_backend("auto", f32, platform="gpu") == "xla"
    assert resolve_matmul_backend("xla", f32, platform="cpu") == "xla"
    with caplog.at_level(logging.WARNING, logger="jaxserve.attention_backends"):
        assert resolve_matmul_backend("auto", bf16, platform="cpu") == "xla"
    assert "float32" in caplog.text
    with pytest.raises(ValueError, match="matmul_backend='cpu'.*runs on a CPU"):
        resolve_matmul_backend("cpu", f32, platform="gpu")
    with pytest.raises(ValueError, match="matmul_backend"):
        EngineConfig(matmul_backend="blas")
