"""int8 weights (`quantization="int8"`) in the C++ packed matmul: the kernel is exactly the product of
the quantized operands (x per row, w per column), its padding rows are zeros, the gated form and the
embedding lookup agree, the weights are stored offset by 128, activation groups hold, and the engine serves with
it compiling nothing after warm-up. The XLA-side QuantizedWeight has its own tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

import tiny_models
from jaxserve import LLM
from jaxserve.ops import cpu_ffi
from jaxserve.ops.packed_matmul import PANEL_WIDTH, PackedWeight, int8_group, matmul, silu_gated_matmul
from server.metrics import Metrics

needs_kernels = pytest.mark.skipif(cpu_ffi.kernel_error() is not None,
                                   reason=f"the CPU kernels are unavailable: {cpu_ffi.kernel_error()}")


def unpacked_int8(packed: PackedWeight, k: int) -> np.ndarray:
    """The integer weights q [K, panels * PANEL_WIDTH] a PackedWeight holds (as q + 128), unpacked independently
    of the kernel."""
    panels = packed.data.shape[0]
    quads = np.asarray(packed.data).reshape(panels, k // 4, PANEL_WIDTH, 4).transpose(0, 1, 3, 2)
    offset = quads.reshape(panels, k, PANEL_WIDTH).transpose(1, 0, 2).reshape(k, panels * PANEL_WIDTH)
    return offset.astype(np.int16) - 128


def quantized_product(x: np.ndarray, packed: PackedWeight, n: int) -> np.ndarray:
    """float64 (round(x / sx) * sx) @ (q * scale), x's scales one per group of its row: what W8A8 computes,
    to float32's summation error."""
    m, k = x.shape
    groups = k // int8_group(k)
    xg = x.reshape(m, groups, k // groups)
    absmax = np.abs(xg).max(axis=2, keepdims=True)
    x_scale = np.where(absmax > 0, absmax / np.float32(127), np.float32(1))  # float32, as the kernel rounds
    xq = (np.rint(xg * (np.float32(1) / x_scale)).astype(np.float64) * x_scale).reshape(m, k)
    w = unpacked_int8(packed, k).astype(np.float64) * np.asarray(packed.scale, np.float64)
    return (xq @ w)[:, :n]


@needs_kernels
@pytest.mark.parametrize("k, n", [(4, 1), (32, 47), (64, 96), (576, 442), (576, 960)])
@pytest.mark.parametrize("m", [1, 8, 9, 16, 17, 33, 80])  # 80 x 576: x quantized on the pool's threads
def test_int8_matmul_is_the_product_of_the_quantized_operands(m, k, n, matmul_path):
    """Exact integer sums (AMX's tdpbsud for whole blocks of 16 rows, vpdpbusd, vpmaddubsw, or widened bytes) then two
    scales: the float64 product of the quantized operands to float32's rounding, and within the
    quantization error of the float product."""
    rng = np.random.default_rng(m * 1000 + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    packed = PackedWeight.pack(w, dtype=np.int8)
    assert packed.data.dtype == np.uint8 and packed.data.shape == (-(-n // PANEL_WIDTH), k // 4, 4 * PANEL_WIDTH)
    out = np.asarray(jax.jit(matmul)(jnp.asarray(x), jax.device_put(packed)))
    expected = quantized_product(x, packed, n)
    np.testing.assert_allclose(out, expected, atol=1e-5 * np.sqrt(k), rtol=1e-5)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    assert np.abs(out - exact).max() <= 0.03 * np.abs(exact).max()  # ~1% per operand, not garbage
    if k >= 64:
        assert np.abs(out - exact).max() > 1e-3  # it is quantized: the test above could tell


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3])
def test_int8_products_at_full_scale_do_not_saturate(m, matmul_path):
    """Every operand at +-127 (weights +-1, activations +-1): the sums of a few columns are as large as they
    can be, every product +127 x 127 or every one -127 x 127, and others alternate. 16-bit pair sums of the
    stored bytes (q + 128 = 255 or 1, x = +-127) would saturate there; the kernel's give x @ w exactly."""
    k, n = 576, 96
    rng = np.random.default_rng(m)
    x = np.where(rng.random((m, k)) < 0.5, -1.0, 1.0).astype(np.float32)
    w = np.where(rng.random((k, n)) < 0.5, -1.0, 1.0).astype(np.float32)
    w[:, 0], w[:, 1], w[:, 2] = x[0], -x[0], 1.0  # row 0: +k, -k; column 2: the row's sum
    packed = PackedWeight.pack(w, dtype=np.int8)
    out = np.asarray(jax.jit(matmul)(jnp.asarray(x), jax.device_put(packed)))
    exact = x.astype(np.float64) @ w.astype(np.float64)
    assert exact[0, 0] == k and exact[0, 1] == -k
    np.testing.assert_allclose(out, exact, rtol=1e-5, atol=1e-3)


@needs_kernels
@pytest.mark.parametrize("rows", [0, 5, 9, 24, 33, 40])
def test_int8_gated_matmul_and_row_cut(rows, matmul_path):
    """silu(x @ w_gate) * (x @ w_up) from int8-packed [w_gate | w_up], only the first `rows` rows, zeros below."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((40, 576)).astype(np.float32)
    w = (rng.standard_normal((576, 4 * PANEL_WIDTH)) / 24).astype(np.float32)
    packed = PackedWeight.pack(w, dtype=np.int8)
    gate, up = np.split(quantized_product(x, packed, 4 * PANEL_WIDTH), 2, axis=-1)
    expected = gate / (1.0 + np.exp(-gate)) * up
    expected[rows:] = 0.0
    out = np.asarray(jax.jit(silu_gated_matmul)(jnp.asarray(x), jax.device_put(packed), jnp.int32(rows)))
    np.testing.assert_allclose(out, expected, atol=1e-4, rtol=1e-4)
    plain = np.asarray(jax.jit(matmul)(jnp.asarray(x), jax.device_put(packed), jnp.int32(rows)))
    assert not plain[rows:].any()


@needs_kernels
@pytest.mark.parametrize("m, k, n", [(16, 64, 48), (37, 576, 100), (64, 1536, 576)])
def test_int8_on_amx_tiles_is_bitwise_the_vector_code(m, k, n):
    """AMX's tdpbsud and vpdpbusd give the same integer sums of a group, which both paths then scale into
    float32 in the same order: the outputs are identical, bit for bit, rows past the last 16-row block
    included."""
    if not cpu_ffi.amx_available():
        pytest.skip("the kernels do not use AMX tiles here")
    rng = np.random.default_rng(k)
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    packed = jax.device_put(PackedWeight.pack(rng.standard_normal((k, n)).astype(np.float32), dtype=np.int8))
    outs, blocks = [], []
    for amx in (True, False):
        cpu_ffi.set_amx(amx)
        try:
            before = cpu_ffi.amx_blocks()
            outs.append(np.asarray(jax.jit(matmul)(x, packed)))
            blocks.append(cpu_ffi.amx_blocks() - before)
        finally:
            cpu_ffi.set_amx(True)
    assert blocks == [m // 16 * -(-n // PANEL_WIDTH), 0]  # every whole block on tiles, then none
    np.testing.assert_array_equal(outs[0], outs[1])
    assert np.abs(outs[0]).max() > 1.0


def test_int8_packing_in_jax_and_numpy_agree_and_columns_are_the_dequantized_embeddings():
    w = np.random.default_rng(0).standard_normal((12, 100)).astype(np.float32)
    host = PackedWeight.pack(w, dtype=np.int8)
    traced = jax.jit(lambda a: PackedWeight.pack(a, dtype=np.int8))(jnp.asarray(w))
    for name in ("data", "scale"):
        np.testing.assert_array_equal(np.asarray(getattr(traced, name)), getattr(host, name))
    ids = jnp.asarray([0, 47, 48, 99, 5])
    dequantized = unpacked_int8(host, 12) * host.scale
    looked_up = np.asarray(jax.jit(PackedWeight.columns)(traced, ids))
    np.testing.assert_allclose(looked_up, dequantized[:, np.asarray(ids)].T, rtol=1e-5)
    np.testing.assert_allclose(looked_up, w[:, np.asarray(ids)].T, atol=np.abs(w).max() / 127)
    assert not unpacked_int8(host, 12)[:, 100:].any(), "the last panel is padded with zeros"


def test_int8_weights_are_stored_offset_by_128_and_groups_divide_a_devices_k(monkeypatch):
    """vpdpbusd multiplies unsigned by signed bytes: the weights are the unsigned side, q + 128 in 1..255 (q
    within +-127), the activations int8. A group is the largest of the sizes that divides K (under tensor
    parallelism by rows, a device's block of K), multiples of 64 first where the kernels use AMX tiles,
    else the whole of K; a block holds whole quads of rows."""
    w = np.random.default_rng(1).standard_normal((256, 50)).astype(np.float32)
    packed = PackedWeight.pack(w, dtype=np.int8)
    data = np.asarray(packed.data)
    assert data.dtype == np.uint8 and data.min() >= 1 and (data == 128).any()  # padding columns: q = 0
    q = unpacked_int8(packed, 256)[:, :50]
    np.testing.assert_array_equal(q, np.clip(np.round(w / packed.scale[:50]), -127, 127))
    ks = (576, 1536, 4096, 288, 200, 12, 30)
    monkeypatch.setattr(cpu_ffi, "amx_available", lambda: False)
    assert [int8_group(k) for k in ks] == [96, 128, 128, 96, 200, 12, 30]
    monkeypatch.setattr(cpu_ffi, "amx_available", lambda: True)  # whole AMX tiles of 64 k first
    assert [int8_group(k) for k in ks] == [64, 128, 128, 96, 200, 12, 30]
    with pytest.raises(AssertionError, match="by fours"):
        PackedWeight.pack(w[:12], dtype=np.int8, k_shards=2)


@needs_kernels
def test_one_outlier_channel_coarsens_only_its_group():
    """A channel 100x the others (as LLM activations have) with one scale a row would round every other
    element of the row to a few levels; with a scale per group only its group pays: the kernel's error is
    a fraction of what one scale a row gives the same weights."""
    rng = np.random.default_rng(3)
    assert 1024 // int8_group(1024) == 8  # the outlier's group is an eighth of the row
    x = rng.standard_normal((8, 1024)).astype(np.float32)
    x[:, 7] = 300.0
    w = rng.standard_normal((1024, 96)).astype(np.float32)
    packed = PackedWeight.pack(w, dtype=np.int8)
    out = np.asarray(jax.jit(matmul)(jnp.asarray(x), jax.device_put(packed)))
    w_int8 = unpacked_int8(packed, 1024)[:, :96] * packed.scale[:96]
    row_scale = np.abs(x).max(axis=1, keepdims=True) / 127
    one_scale_a_row = (np.rint(x / row_scale) * row_scale) @ w_int8
    exact = x.astype(np.float64) @ w_int8  # the weights' own rounding is the same in both
    assert np.abs(out - exact).mean() < 0.4 * np.abs(one_scale_a_row - exact).mean()


@needs_kernels
def test_the_engine_serves_int8_weights_and_compiles_nothing_after_warm_up(tiny_model_dir, caplog):
    """quantization="int8" on a CPU: every packed matrix is int8 (with scales), the LM head included, the
    norms stay float32; the start-up line and /metrics say so; greedy generation runs with compilation
    forbidden after warm-up and mostly agrees with the float32 engine (a tiny random model's margins are
    small, so not token for token)."""
    kw = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=8, num_kv_pages=40)
    with caplog.at_level("INFO", logger="jaxserve.startup"):
        llm = LLM(tiny_model_dir("llama"), quantization="int8", forbid_compilation_after_warmup=True, **kw)
    runner = llm.engine.runner
    assert f"weights int8 (W8A8, the C++ matmul), {runner.device_weight_bytes / 2**20:.1f} MiB per device" in caplog.text
    stats = llm.engine.get_stats()
    assert (stats["quantization"], stats["kv_cache_dtype"]) == ("int8", "bfloat16")  # auto: half the bytes
    text = Metrics(SimpleNamespace(stats=stats)).render().decode()
    info = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "jaxserve:weights_info"]
    assert [(s.labels, s.value) for s in info] == [({"quantization": "int8", "kv_cache_dtype": "bfloat16"}, 1)]
    assert runner.resolved.packed_dtype == "int8" and runner.matmul_backend == "cpu"
    leaves = jax.tree.leaves(runner.params, is_leaf=lambda v: isinstance(v, PackedWeight))
    packed = [leaf for leaf in leaves if isinstance(leaf, PackedWeight)]
    assert len(packed) == 4 * runner.model_cfg.num_layers + 1
    assert all(leaf.data.dtype == jnp.uint8 and leaf.scale.dtype == jnp.float32 for leaf in packed)
    tiny_models.assert_greedy_mostly_agrees_with_float32(llm, tiny_model_dir("llama"), **kw)
