"""The Pallas kernels reading float8 e4m3 KV pages (kv_cache_dtype "fp8"), in GPU interpret mode on the CPU.

The pages hold build_case's keys and values as the engine writes them (`attention.to_page_dtype`: clipped
to +-448, rounded to nearest), over shuffled pages whose unowned slots hold large garbage. The kernels
copy the float8 tiles into shared memory and upcast each to the queries' dtype before the products.

- Parity with the reference on the same float8 pages (which it widens to float32): an e4m3 value is
  exact in bfloat16 and float32, so the upcast adds no error and the tolerances are those of the same
  kernels on bfloat16 or float32 pages (test_pallas_attention.TOL, keyed by the queries' dtype): float32
  queries (interpret mode) 1e-5, summation order only; bfloat16 queries (the GPU's) 4e-2 max and 1e-2
  relative, from rounding Q, P and the output to bfloat16.
- Closeness to the kernel on bfloat16 pages of the same values: float8 keeps 3 mantissa bits (relative
  error up to 2^-4 a value), so max 0.3 and relative 0.04; outputs are O(1), so a kernel that ignored
  the pages, or read the wrong ones, is far outside it.

Where JAX's default backend is a GPU, the bfloat16-query cases run the compiled kernels instead
(test_pallas_attention.use_interpreter); the float32-query ones skip there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jaxserve.ops.attention import to_page_dtype
from pallas_kernels.interpret import races_found
from test_pallas_attention import LAYER, use_interpreter, build_case, check, decode_lengths, ragged_lengths

FP8 = jnp.float8_e4m3fn
KERNELS = {"ragged": (pk.ragged_paged_attention, pk.ragged_paged_attention_reference, ragged_lengths),
           "decode": (pk.decode_attention, pk.decode_attention_reference, decode_lengths)}


@pytest.fixture(autouse=True)
def _full_precision_float32_dots():
    """The float32 references (and float32-query kernels) at full float32 precision, even on a GPU (TF32)."""
    with jax.default_matmul_precision("highest"):
        yield


def fp8_case(kind, *, head_dim, page_size, group, q_dtype, seed=0):
    """build_case's q (in q_dtype), the float32 keys/values written to float8 pages, and the metadata."""
    lengths = KERNELS[kind][2](page_size)
    num_tokens = len(lengths) + 1 if kind == "decode" else None
    q, k, v, md, _ = build_case(lengths, page_size=page_size, head_dim=head_dim, group=group, dtype="float32",
                                seed=seed, num_tokens=num_tokens)
    return q.astype(q_dtype), (k, v), (to_page_dtype(k, FP8), to_page_dtype(v, FP8)), md


def run(kind, q, pages, md, *, interpret, detect_races=False, **kw):
    kernel = functools.partial(KERNELS[kind][0], interpret=interpret, detect_races=detect_races, **kw)
    extra = dict(num_splits=2) if kind == "decode" else {}
    return jax.jit(functools.partial(kernel, **extra))(q, *pages, LAYER, md.cu_q_lens, md.kv_lens, md.block_tables)


# (kernel, head_dim, page_size, group, sliding_window, soft_cap, q dtype, against bfloat16 pages): GQA 1/3/4/8,
# every head dim (64: float8 rows of 64 bytes, swizzled at that width; 256: two upcast blocks a row), both
# query dtypes; the kernel runs again on bfloat16 pages once per kernel (an interpreted run is slow).
CASES = [
    ("ragged", 64, 16, 4, 0, 0.0, "float32", False),
    ("ragged", 128, 32, 3, 21, 30.0, "bfloat16", True),
    ("ragged", 256, 16, 8, 0, 0.0, "bfloat16", False),
    ("decode", 64, 16, 8, 0, 0.0, "float32", False),
    ("decode", 128, 32, 3, 17, 30.0, "bfloat16", True),
    ("decode", 256, 16, 1, 0, 0.0, "bfloat16", False),
]


@pytest.mark.parametrize("kind,head_dim,page_size,group,window,soft_cap,q_dtype,against_bf16", CASES)
def test_the_kernels_read_fp8_pages_like_the_reference(kind, head_dim, page_size, group, window, soft_cap, q_dtype,
                                                       against_bf16):
    """Ragged prefill chunks and decode rows at the page-edge lengths (several pages and KV tiles a
    sequence, a padded sequence with kv_len 0, padded rows) on float8 pages: the kernel equals the
    reference on the same pages, and stays near the kernel on bfloat16 pages of the same values."""
    q, exact, pages, md = fp8_case(kind, head_dim=head_dim, page_size=page_size, group=group, q_dtype=q_dtype)
    kw = dict(scale=head_dim**-0.5, soft_cap=soft_cap, sliding_window=window)
    interpret = use_interpreter(q_dtype, detect_races=False)
    out = run(kind, q, pages, md, interpret=interpret, **kw)
    assert out.dtype == q.dtype
    reference = KERNELS[kind][1](q, *pages, LAYER, md.cu_q_lens, md.kv_lens, md.block_tables, **kw)
    real_rows = int(md.cu_q_lens[-1])
    what = f"fp8 {kind} D={head_dim} page={page_size} G={group} w={window} cap={soft_cap} q={q_dtype}"
    check(out, reference, real_rows, q_dtype, what)
    if against_bf16:
        bf16_pages = tuple(x.astype(jnp.bfloat16) for x in exact)
        out_bf16 = np.asarray(run(kind, q, bf16_pages, md, interpret=interpret, **kw).astype(jnp.float32))[:real_rows]
        out = np.asarray(out.astype(jnp.float32))[:real_rows]
        err, rel = np.abs(out - out_bf16).max(), np.linalg.norm(out - out_bf16) / np.linalg.norm(out_bf16)
        assert err < 0.3 and rel < 0.04, f"{what}: against bfloat16 pages max |Δ| {err:.2e}, relative {rel:.2e}"
        assert rel > 1e-3, f"{what}: no float8 rounding seen: were the float8 pages read?"


@pytest.mark.parametrize("kind", ["ragged", "decode"])
def test_every_fp8_code_comes_out_exact_in_its_place(kind):
    """One key a sequence: each output row is that key's value row, so the 254 finite float8 codes laid
    across the value rows (normals, subnormals, both zeros, +-448) come out exactly, each in its own
    column: guards the upcast's blocks (head_dim 256: two column blocks a row) and its widening. In
    bfloat16 queries, the GPU's path: every e4m3 value is exact in bfloat16."""
    codes = np.asarray([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)  # 0x7f, 0xff: NaN
    lengths = [(1, 0)] * 4
    q, k, v, md, real_rows = build_case(lengths, page_size=16, head_dim=256, group=4, dtype="float32", seed=3)
    q = q.astype(jnp.bfloat16)
    table = np.asarray(md.block_tables)
    v_bytes = np.asarray(to_page_dtype(v, FP8)).view(np.uint8).copy()
    for seq in range(4):
        v_bytes[LAYER, table[seq, 0], 0] = np.resize(np.roll(codes, seq * 61), v_bytes.shape[3:])
    pages = (to_page_dtype(k, FP8), jnp.asarray(v_bytes.view(FP8)))
    out = np.asarray(run(kind, q, pages, md, interpret=use_interpreter("bfloat16", False), scale=0.1)
                     .astype(jnp.float32))
    expected = np.stack([np.asarray(pages[1][LAYER, table[seq, 0], 0].astype(jnp.float32)) for seq in range(4)])
    expected = np.repeat(expected, 4, axis=1)  # each KV head's value row serves its group's query heads
    assert {448.0, -448.0, 2.0**-9, 0.0} <= set(expected.ravel().tolist())
    np.testing.assert_array_equal(out[:real_rows], expected)


def test_no_races_with_fp8_pages():
    """The race detector finds no unsynchronized access in the ragged kernel on float8 pages: each
    consumer warpgroup's upcast tile, written from registers, read by its products, rewritten for V."""
    q, _, pages, md = fp8_case("ragged", head_dim=64, page_size=16, group=4, q_dtype="float32")
    out = run("ragged", q, pages, md, interpret=True, detect_races=True, scale=0.125)
    assert not races_found()
    reference = pk.ragged_paged_attention_reference(q, *pages, LAYER, md.cu_q_lens, md.kv_lens, md.block_tables,
                                                    scale=0.125)
    check(out, reference, int(md.cu_q_lens[-1]), "float32", "fp8 ragged, races checked")


def test_fp8_pages_are_supported_and_what_is_not_says_why():
    """check_supported takes float8 pages with bfloat16 queries anywhere, float32 queries in interpret
    mode only (Hopper has no tf32 product for V's layout), and refuses other query and page dtypes by
    name. The float8 tiles fit: each kernel's shared memory for them is no more than for bfloat16."""
    ok = dict(num_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=FP8, interpret=False)
    pk.check_supported(**ok)
    pk.check_supported(**{**ok, "q_dtype": jnp.float32, "interpret": True})
    for change, match in [(dict(q_dtype=jnp.float32), "float8 KV pages read by float32 queries"),
                          (dict(q_dtype=jnp.float16), "not float16"),
                          (dict(dtype=jnp.float16), "KV dtype float16 is not supported"),
                          (dict(dtype=jnp.float8_e5m2), "KV dtype float8_e5m2 is not supported")]:
        with pytest.raises(pk.UnsupportedShapeError, match=match):
            pk.check_supported(**{**ok, **change})
    from pallas_kernels import common

    for head_dim in pk.SUPPORTED_HEAD_DIMS:
        for page_size in (16, 128):
            cfg = common.choose_prefill_config(head_dim, page_size, kv_itemsize=1)
            assert cfg == common.choose_prefill_config(head_dim, page_size)
            assert common.prefill_smem_bytes(cfg, head_dim, 2, 1) <= common.prefill_smem_bytes(cfg, head_dim, 2)
            cfg = common.choose_config(head_dim, page_size, decode=True, kv_itemsize=1)
            assert cfg == common.choose_config(head_dim, page_size, decode=True)
            assert common.smem_bytes(cfg, head_dim, 2, True, 1) <= common.smem_bytes(cfg, head_dim, 2, True)
