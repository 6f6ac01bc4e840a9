"""The C++ packed-weight matmul for XLA:CPU (`jaxserve/ops/cpu_ffi.py`) against float64 numpy, and the
engine's choice of it. The model-level parity (every family, packed, against Hugging Face) is in
test_model_parity.py."""

from __future__ import annotations

import functools
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

from jaxserve.ops import cpu_ffi
from jaxserve.ops.attention_backends import (cpu_half_precision, paired_attention_backend, resolve_matmul_backend,
                                             unquantized_packed_dtype)
from jaxserve.config.engine_config import EngineConfig
from jaxserve.ops.packed_matmul import PANEL_WIDTH, PackedWeight, matmul, silu_gated_matmul

needs_kernels = pytest.mark.skipif(cpu_ffi.kernel_error() is not None,
                                   reason=f"the CPU kernels are unavailable: {cpu_ffi.kernel_error()}")


def test_the_kernels_build_wherever_a_compiler_is_found():
    """The kernel tests skip where the kernels cannot be built; on a machine with a C++ compiler
    (CI's included) a broken kernel source must fail here instead of skipping them all."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on PATH")
    assert cpu_ffi.kernel_error() is None


# One x86 target a family of the code paths the kernels choose at compile time: AVX2 (8 lanes, vpmaddubsw),
# AVX-512 (16 lanes), AVX512-BF16 and VNNI, AMX tiles.
X86_TARGETS = ("haswell", "skylake-avx512", "cooperlake", "sapphirerapids")


@pytest.mark.parametrize("march", X86_TARGETS)
def test_the_kernels_compile_for_every_x86_family_not_only_this_cpu(march):
    """The kernels build with -march=native, so a machine only ever compiles its own paths: an AVX2 path
    that fails to compile for AVX-512 (it once did, an 8-lane intrinsic against 16-lane vectors) would
    pass here on an AVX2 machine and break every AVX-512 one. Each family is compiled here, syntax only."""
    import platform
    import subprocess

    compiler = os.environ.get("CXX", "c++")
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which(compiler) is None:
        pytest.skip("an x86-64 C++ compiler is needed")
    flags = [f"-march={march}" if f == "-march=native" else f for f in cpu_ffi.FLAGS if f != "-shared"]
    command = [compiler, *flags, "-fsyntax-only", "-isystem", jax.ffi.include_dir(), *map(str, cpu_ffi.SOURCES)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if result.returncode != 0 and "bad value" in result.stderr:
        pytest.skip(f"this compiler does not know -march={march}")
    assert result.returncode == 0, result.stderr[-2000:]


@needs_kernels
@pytest.mark.parametrize("k, n", [(1, 1), (33, 47), (33, 48), (33, 49), (64, 320), (576, 960)])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 17, 64, 130])
def test_packed_matmul_matches_numpy(m, k, n):
    """Row counts below, at and past the kernel's tiles (8 rows with AVX-512, 2 with AVX2) and, at 130,
    past two of AVX2's 64-row strips; widths below, at and past a 48-column panel; K within one and
    across several of AVX2's 128-step blocks. Every output element is checked, so a missed tail row or
    column shows."""
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
@pytest.mark.parametrize("m", [1, 3, 8, 9, 17, 64, 130])
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
    out = np.asarray(jax.jit(silu_gated_matmul)(jnp.asarray(x), jax.device_put(PackedWeight.pack(w))))
    assert out.shape == (m, inter)
    np.testing.assert_allclose(out, expected, atol=2e-5 * k, rtol=2e-5)
    unpacked = np.asarray(jax.jit(silu_gated_matmul)(jnp.asarray(x), jnp.asarray(w)))  # XLA's path
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
    gated = np.asarray(jax.jit(silu_gated_matmul)(jnp.asarray(x), jax.device_put(PackedWeight.pack(w)),
                                                          jnp.int32(rows)))
    np.testing.assert_allclose(gated, gated_expected, atol=1e-4, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("m, rows", [(1, 1), (8, 8), (32, 32), (40, 27), (130, 130)])
def test_a_bfloat16_gated_result_is_the_float32_one_as_xla_rounds_it_and_down_takes_it_unconverted(m, rows):
    """With bfloat16 weights, out_dtype bfloat16 has the gated kernel write its result rounded (the input of
    down_proj's bfloat16 matmul): bit for bit the float32 result rounded by XLA's convert, padding rows
    zeros, NaN kept; and the jitted pair gated -> down holds no convert between the two kernel calls."""
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, 576), np.float32)
    w = jax.device_put(PackedWeight.pack(rng.standard_normal((576, 2 * 192), np.float32) * 0.1, 1, jnp.bfloat16))
    x[0, :] = np.nan if m > 1 else x[0, :]  # a NaN row stays NaN
    gated = jax.jit(silu_gated_matmul, static_argnames="out_dtype")
    rounded = np.asarray(gated(jnp.asarray(x), w, jnp.int32(rows), out_dtype=jnp.bfloat16))
    as_xla = np.asarray(gated(jnp.asarray(x), w, jnp.int32(rows)).astype(jnp.bfloat16))
    assert rounded.dtype == jnp.bfloat16 and rounded.shape == (m, 192)
    np.testing.assert_array_equal(rounded.view(np.uint16)[1:], as_xla.view(np.uint16)[1:])
    assert np.isnan(rounded[0].astype(np.float32)).all() == (m > 1)
    assert not rounded[rows:].astype(np.float32).any()
    down = jax.device_put(PackedWeight.pack(rng.standard_normal((192, 96), np.float32), 1, jnp.bfloat16))

    def mlp(x, rows):
        return matmul(silu_gated_matmul(x, w, rows, out_dtype=jnp.bfloat16), down, rows)

    hlo = jax.jit(mlp).lower(jnp.asarray(x), jnp.int32(rows)).compile().as_text()
    # one convert: x rounded for the gated kernel; none between the two calls
    assert "jaxserve_packed_gated_matmul_bf16_out" in hlo and hlo.count(" convert(") == 1, hlo


@needs_kernels
def test_silu_gated_matmul_keeps_xla_for_halves_that_are_not_whole_panels():
    x = np.random.default_rng(1).standard_normal((3, 8), np.float32)
    w = np.random.default_rng(2).standard_normal((8, 2 * 40), np.float32)
    gate, up = np.split(x @ w, 2, axis=-1)
    out = np.asarray(jax.jit(silu_gated_matmul)(jnp.asarray(x), jax.device_put(PackedWeight.pack(w))))
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


def _bf16_rounded(a: np.ndarray) -> np.ndarray:
    return a.astype(jnp.bfloat16).astype(np.float64)


def test_amx_is_used_where_the_cpu_has_it():
    """On a Linux CPU with AMX-BF16 (its cpuinfo flag, and the compiler's macro for it) the bfloat16 matmul
    takes the tile unit: a kernel quietly built without it would run at a fifth of the rate."""
    if cpu_ffi.kernel_error() is not None:
        pytest.skip(f"the CPU kernels are unavailable: {cpu_ffi.kernel_error()}")
    if "amx_bf16" not in cpu_ffi.cpu_features().split() or "__AMX_BF16__" not in cpu_ffi.native_target(
            os.environ.get("CXX", "c++")):
        pytest.skip("no AMX-BF16 on this CPU")
    assert cpu_ffi.amx_in_use()
    x = jnp.ones((40, 64), jnp.float32)
    packed = jax.device_put(PackedWeight.pack(np.ones((64, 100), np.float32), dtype=jnp.bfloat16))
    before = cpu_ffi.amx_blocks()
    np.testing.assert_array_equal(np.asarray(jax.jit(matmul)(x, packed)), 64.0)
    assert cpu_ffi.amx_blocks() - before == 3 * 3  # two whole blocks of 16 rows and one of 8, three panels
    before = cpu_ffi.amx_blocks()
    np.testing.assert_array_equal(np.asarray(jax.jit(matmul)(x[:1], packed)), 64.0)
    assert cpu_ffi.amx_blocks() - before == 3, "one row is a block of tiles too"
    cpu_ffi.set_amx(False)
    try:
        assert not cpu_ffi.amx_in_use()
        before = cpu_ffi.amx_blocks()
        np.testing.assert_array_equal(np.asarray(jax.jit(matmul)(x, packed)), 64.0)
        assert cpu_ffi.amx_blocks() == before
    finally:
        cpu_ffi.set_amx(True)


@needs_kernels
@pytest.mark.parametrize("k, n", [(2, 1), (34, 47), (64, 320), (576, 442), (576, 960)])
@pytest.mark.parametrize("m", [1, 3, 9, 16, 17, 20, 33, 50])
def test_bfloat16_packed_matmul_is_the_product_of_the_rounded_operands(m, k, n, matmul_path):
    """Packed in bfloat16, the kernel multiplies x and w rounded to bfloat16 (exact products) and sums in
    float32: it matches the float64 product of the rounded operands to float32's summation error, far
    closer than to the unrounded product, whatever the CPU's instructions (AMX tiles in blocks of up to 16
    rows where K is a multiple of 32, vdpbf16ps or widening elsewhere). Past 32 rows on AMX tiles a work
    item takes several panels (PanelsPerItem): 442 columns are ten panels, the last of them ten columns
    wide, in an item with the one before it."""
    rng = np.random.default_rng(m * 1000 + n)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((k, n), np.float32)
    packed = PackedWeight.pack(w, dtype=jnp.bfloat16)
    assert packed.data.dtype == jnp.bfloat16 and packed.data.shape == (-(-n // PANEL_WIDTH), k // 2, 2 * PANEL_WIDTH)
    out = np.asarray(jax.jit(matmul)(jnp.asarray(x), jax.device_put(packed)))
    expected = _bf16_rounded(x) @ _bf16_rounded(w)
    np.testing.assert_allclose(out, expected, atol=2e-5 * np.sqrt(k), rtol=1e-5)
    if k >= 64:  # rounding to 8 significant bits shows against float32 operands
        assert np.abs(out - x.astype(np.float64) @ w.astype(np.float64)).max() > 1e-3


def _assert_rows_alone_equal_rows_together(dtype, total: int, cuts: tuple[int, ...]):
    """The last `cut` rows of a call's x give, bit for bit, the last rows of the whole call's product."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((total, 576), np.float32))
    packed = jax.device_put(PackedWeight.pack(rng.standard_normal((576, 960), np.float32), dtype=dtype))
    gated = jax.device_put(PackedWeight.pack(rng.standard_normal((576, 4 * PANEL_WIDTH), np.float32), dtype=dtype))
    for fn, w in ((matmul, packed), (silu_gated_matmul, gated)):
        full = np.asarray(jax.jit(fn)(x, w))
        for rows in cuts:
            np.testing.assert_array_equal(np.asarray(jax.jit(fn)(x[total - rows:], w)), full[total - rows:],
                                          err_msg=f"{fn.__name__}: {rows} rows")


@needs_kernels
def test_a_bfloat16_rows_product_does_not_depend_on_the_rows_beside_it(matmul_path):
    """Every row of a bfloat16 call takes the same instructions (on AMX, the tiles, a block as short as
    one row; elsewhere the vector code), so a row's result is bit for bit the same alone, in a decode
    batch, or among a prompt's rows: a row's matmuls do not depend on which requests share its step."""
    _assert_rows_alone_equal_rows_together(jnp.bfloat16, 40, (1, 3, 8, 17, 39))


@needs_kernels
def test_a_float32_rows_product_does_not_depend_on_the_rows_beside_it():
    """The same for float32 weights: a row's sums run k by k in the same order whether its tile has
    one row or several and whether K is taken whole or, for AVX2's prompt-sized calls, block by block
    in strips of rows (150 rows: three strips)."""
    _assert_rows_alone_equal_rows_together(np.float32, 150, (1, 3, 5, 64, 71, 149))


@needs_kernels
@pytest.mark.parametrize("rows", [0, 5, 9, 24, 33, 40])
def test_bfloat16_gated_matmul_and_row_cut(rows, matmul_path):
    """silu(x @ w_gate) * (x @ w_up) from bfloat16-packed [w_gate | w_up], only the first `rows` rows
    (on AMX: none, a whole 16-row block, blocks and a rest)."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((40, 576), np.float32)
    w = rng.standard_normal((576, 4 * PANEL_WIDTH), np.float32) / 24
    gate, up = np.split(_bf16_rounded(x) @ _bf16_rounded(w), 2, axis=-1)
    expected = gate / (1.0 + np.exp(-gate)) * up
    expected[rows:] = 0.0
    packed = jax.device_put(PackedWeight.pack(w, dtype=jnp.bfloat16))
    out = np.asarray(jax.jit(silu_gated_matmul)(jnp.asarray(x), packed, jnp.int32(rows)))
    np.testing.assert_allclose(out, expected, atol=1e-4, rtol=1e-4)


@needs_kernels
def test_the_gated_silu_of_narrower_weights_is_within_a_hundred_thousandth_of_float64_over_its_range(matmul_path):
    """Under bfloat16 (and int8, fp8) weights the gated kernel's silu takes a cheaper exp and no division
    (SiluForRounding): against float64 within 1e-5 relative for gates from -120 to 120, tiny and zero,
    each gate a weight read back through an identity x, each up 1. Absolutely within 1e-30: below gates of
    about -65 silu is smaller than that, below about -83 smaller than float32's normal numbers."""
    gates = np.concatenate([np.linspace(-120.0, 120.0, 15 * PANEL_WIDTH - 9), [-1e-30, 0.0, 1e-30, -1e-3, 1e-3,
                                                                               -88.5, -87.0, 87.0, 1e-20]])
    gates = gates.reshape(15, PANEL_WIDTH)
    w = np.zeros((32, 2 * PANEL_WIDTH), np.float32)
    w[:15, :PANEL_WIDTH] = gates
    w[:15, PANEL_WIDTH:] = 1.0
    x = np.eye(15, 32, dtype=np.float32)
    gate = _bf16_rounded(gates)
    expected = gate * np.exp(-np.logaddexp(0.0, -gate))  # silu, without overflow
    packed = jax.device_put(PackedWeight.pack(w, dtype=jnp.bfloat16))
    out = np.asarray(jax.jit(silu_gated_matmul)(jnp.asarray(x), packed)).astype(np.float64)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-30)


def test_bfloat16_packing_in_jax_and_numpy_agree_and_columns_are_an_embedding_lookup():
    w = np.random.default_rng(0).standard_normal((10, 100), np.float32)
    host = PackedWeight.pack(w, dtype=jnp.bfloat16)
    traced = jax.jit(functools.partial(PackedWeight.pack, dtype=jnp.bfloat16))(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(traced.data), host.data)
    ids = jnp.asarray([0, 47, 48, 99, 5])
    looked_up = np.asarray(jax.jit(PackedWeight.columns)(traced, ids))
    assert looked_up.dtype == np.float32
    np.testing.assert_array_equal(looked_up, _bf16_rounded(w)[:, np.asarray(ids)].T)
    with pytest.raises(AssertionError, match="K = 9 is odd"):
        PackedWeight.pack(w[:9], dtype=jnp.bfloat16)


@needs_kernels
def test_the_engine_runs_with_bfloat16_packed_weights(tiny_model_dir):
    """matmul_backend="cpu-bf16": every packed matrix is bfloat16 (the rest float32) and the engine
    generates; its greedy tokens are the float32 engine's where the margins allow (not asserted)."""
    llm = LLM(tiny_model_dir("llama"), matmul_backend="cpu-bf16", max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=32, block_size=8, num_kv_pages=24)
    runner = llm.engine.runner
    assert runner.matmul_backend == "cpu-bf16"
    assert runner.attention_backend == "cpu-bf16"  # the attention kernel's prompt tiles in bfloat16 too
    assert runner.cfg.kv_cache_dtype == "bfloat16" and all(x.dtype == jnp.bfloat16 for x in runner.kv_cache)
    leaves = jax.tree.leaves(runner.params, is_leaf=lambda v: isinstance(v, PackedWeight))
    packed = [leaf for leaf in leaves if isinstance(leaf, PackedWeight)]
    assert len(packed) == 4 * runner.model_cfg.num_layers + 1  # the layers' four matrices and the LM head
    assert all(leaf.data.dtype == jnp.bfloat16 for leaf in packed)
    assert all(leaf.dtype == jnp.float32 for leaf in leaves if not isinstance(leaf, PackedWeight))
    prompts = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5, 6, 7]}]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]


@needs_kernels
def test_bfloat16_kv_pages_hold_twice_the_tokens_and_serve_a_float32_engine(tiny_model_dir):
    """kv_cache_dtype="bfloat16" under float32 weights and matmuls: the same memory holds twice the pages,
    the C++ attention reads them, and greedy decoding runs to the requested length."""
    kw = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, block_size=8,
              kv_cache_memory_bytes=2**20)
    f32, bf16 = (LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_dtype=dtype, **kw)
                 for dtype in ("float32", "bfloat16"))
    assert bf16.engine.runner.attention_backend == "cpu" and bf16.engine.runner.matmul_backend == "cpu"
    assert [x.dtype for x in bf16.engine.runner.kv_cache] == [jnp.bfloat16] * 2
    assert bf16.engine.runner.num_pages == 2 * f32.engine.runner.num_pages
    prompts = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5, 6, 7]}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = bf16.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]


@needs_kernels
def test_dtype_auto_is_bfloat16_only_on_a_cpu_with_avx512_bf16_and_only_where_nothing_else_was_asked(
        monkeypatch):
    from jaxserve.config.model_config import ModelConfig
    from jaxserve.runner.resolve import resolve_config
    from tiny_models import hf_config

    monkeypatch.setattr(cpu_ffi, "bf16_dot_instructions", lambda: True)
    auto = EngineConfig()
    assert "AVX512-BF16" in cpu_half_precision(auto, "cpu")
    assert cpu_half_precision(auto, "gpu") is None
    for given in (dict(dtype="float32"), dict(dtype="bfloat16"), dict(matmul_backend="cpu"),
                  dict(matmul_backend="xla"), dict(attention_backend="xla"), dict(quantization="int8")):
        assert cpu_half_precision(EngineConfig(**given), "cpu") is None, given
    model = ModelConfig.from_hf(hf_config("llama"))
    resolved = resolve_config(EngineConfig(max_model_len=64), model, platform="cpu")
    assert (resolved.matmul_backend, resolved.attention_backend, resolved.packed_dtype) == ("cpu-bf16",) * 2 + (
        "bfloat16",)
    assert resolved.engine.kv_cache_dtype == "bfloat16" and resolved.half_precision
    assert not any(c.startswith("dtype ") for c in resolved.chosen)  # the start-up line says it instead
    exact = resolve_config(EngineConfig(dtype="float32", max_model_len=64), model, platform="cpu")
    assert (exact.matmul_backend, exact.engine.kv_cache_dtype, exact.half_precision) == ("cpu", "float32", None)
    monkeypatch.setattr(cpu_ffi, "bf16_dot_instructions", lambda: False)  # an AVX2 CPU
    assert cpu_half_precision(auto, "cpu") is None
    assert resolve_config(EngineConfig(max_model_len=64), model, platform="cpu").matmul_backend == "cpu"


@needs_kernels
def test_auto_packs_the_weights_for_float32_on_a_cpu_and_keeps_xla_otherwise(caplog):
    f32, bf16 = EngineConfig(dtype="float32"), EngineConfig(dtype="bfloat16")
    assert resolve_matmul_backend("auto", f32, platform="cpu") == "cpu"
    assert resolve_matmul_backend("auto", f32, platform="gpu") == "xla"
    assert resolve_matmul_backend("xla", f32, platform="cpu") == "xla"
    with caplog.at_level(logging.WARNING, logger="jaxserve.ops.attention_backends"):
        assert resolve_matmul_backend("auto", bf16, platform="cpu") == "xla"
    assert "float32" in caplog.text
    with pytest.raises(ValueError, match="matmul_backend='cpu'.*runs on a CPU"):
        resolve_matmul_backend("cpu", f32, platform="gpu")
    with pytest.raises(ValueError, match="matmul_backend"):
        EngineConfig(matmul_backend="blas")
    assert resolve_matmul_backend("cpu-bf16", f32, platform="cpu") == "cpu-bf16"
    with pytest.raises(ValueError, match="matmul_backend='cpu-bf16'.*runs on a CPU"):
        resolve_matmul_backend("cpu-bf16", f32, platform="gpu")
    with pytest.raises(ValueError, match="matmul_backend='cpu-bf16'.*float32"):
        resolve_matmul_backend("cpu-bf16", bf16, platform="cpu")
    assert paired_attention_backend("cpu", "cpu-bf16") == "cpu-bf16"
    assert paired_attention_backend("cpu", "cpu") == "cpu" and paired_attention_backend("xla", "cpu-bf16") == "xla"
    # an explicit attention_backend="cpu" keeps the float32 products whatever the matmuls multiply in
    assert paired_attention_backend("cpu", "cpu-bf16", requested="cpu") == "cpu"


@needs_kernels
def test_int8_pairs_bfloat16_attention_products_where_the_cpu_has_avx512_bf16(monkeypatch):
    """int8's activations are rounded to 8 bits in its matmuls, so its attention multiplies the prompt tiles in
    bfloat16 where the CPU does that fast (2026-12-03, AMD EPYC: 1.19x / 1.32x the prefill tokens/s at
    1,024-token prompts), unless attention_backend="cpu" asks for float32 products; without AVX512-BF16 the
    products stay float32."""
    from jaxserve.config.model_config import ModelConfig
    from jaxserve.runner.resolve import resolve_config
    from tiny_models import hf_config

    monkeypatch.setattr(cpu_ffi, "bf16_dot_instructions", lambda: True)
    assert [unquantized_packed_dtype(t) for t in ("int8", "fp8", "bfloat16", None)] == ["bfloat16"] * 2 + [None] * 2
    assert paired_attention_backend("cpu", "cpu", unquantized_dtype="bfloat16") == "cpu-bf16"
    assert paired_attention_backend("cpu", "cpu", requested="cpu", unquantized_dtype="bfloat16") == "cpu"
    assert paired_attention_backend("xla", "cpu", unquantized_dtype="bfloat16") == "xla"
    model = ModelConfig.from_hf(hf_config("llama"))
    int8 = resolve_config(EngineConfig(quantization="int8", max_model_len=64), model, platform="cpu")
    assert (int8.packed_dtype, int8.unquantized_dtype, int8.attention_backend) == ("int8", "bfloat16", "cpu-bf16")
    fp8 = resolve_config(EngineConfig(quantization="fp8", max_model_len=64), model, platform="cpu")
    assert (fp8.packed_dtype, fp8.unquantized_dtype, fp8.attention_backend) == ("fp8", "bfloat16", "cpu-bf16")
    asked = resolve_config(EngineConfig(quantization="int8", attention_backend="cpu", max_model_len=64), model,
                           platform="cpu")
    assert (asked.packed_dtype, asked.attention_backend) == ("int8", "cpu")
    monkeypatch.setattr(cpu_ffi, "bf16_dot_instructions", lambda: False)
    assert [unquantized_packed_dtype(t) for t in ("int8", "fp8", "bfloat16")] == ["float32", "float32", None]
    assert paired_attention_backend("cpu", "cpu", unquantized_dtype="float32") == "cpu"
    avx2 = resolve_config(EngineConfig(quantization="int8", max_model_len=64), model, platform="cpu")
    assert (avx2.packed_dtype, avx2.unquantized_dtype, avx2.attention_backend) == ("int8", "float32", "cpu")
    avx2_fp8 = resolve_config(EngineConfig(quantization="fp8", max_model_len=64), model, platform="cpu")
    assert (avx2_fp8.unquantized_dtype, avx2_fp8.attention_backend) == ("float32", "cpu")


@needs_kernels
def test_the_matmul_microbenchmark_times_every_shape_of_a_layer_for_both_paths(tmp_path):
    """benchmarks/bench_cpu_matmul.py, at two row counts and one repeat: a line per shape and row count,
    the kernel's and XLA's times, in the JSON it writes; with --lm-head, the LM head's shape last."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from bench_cpu_matmul import LM_HEAD, SHAPES, main

    out = tmp_path / "matmul.json"
    main(["--rows", "1", "3", "--repeats", "1", "--dtype", "int8", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["dtype"] == "int8"
    assert [(r["rows"], r["shape"]) for r in saved["results"]] == [(m, s[0]) for m in (1, 3) for s in SHAPES]
    assert all(r["packed_ms"] > 0 and r["xla_ms"] > 0 for r in saved["results"])
    main(["--rows", "2", "--repeats", "1", "--lm-head", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert [(r["shape"], r["k"], r["n"]) for r in saved["results"]] == [*SHAPES, LM_HEAD]
    assert all(r["packed_ms"] > 0 and r["xla_ms"] > 0 for r in saved["results"])
