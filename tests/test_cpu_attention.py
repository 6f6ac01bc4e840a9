"""The C++ paged attention for XLA:CPU (`jaxserve/ops/cpu_ffi.py`) against the dense reference.

The kernel computes every row of `paged_attention(backend="cpu")`: decode rows and the rows of
prompt chunks, each over its own causal key range. The ragged cases mix both (chunks with and without
a cached prefix), the decode cases have single rows only; all of them have padding rows and
sequences, shuffled pages, and large values in the slots no sequence owns (a read past kv_len, or
through the wrong page, shows). The backend choice and its fallbacks are checked at the end.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jaxserve.ops import cpu_ffi
from jaxserve.ops.attention import ragged_paged_attention, to_page_dtype
from jaxserve.models.transformer import rope_tables
from jaxserve.ops.attention_backends import (paged_attention, resolve_attention_backend, rope_and_write_kv,
                                              write_kv)
from jaxserve.config.model_config import ModelConfig, RopeConfig
from jaxserve.config.engine_config import EngineConfig
from test_pallas_attention import LAYER, build_case, decode_lengths, ragged_lengths

pytestmark = pytest.mark.skipif(cpu_ffi.kernel_error() is not None,
                                reason=f"the CPU kernel is unavailable: {cpu_ffi.kernel_error()}")

CASES = [  # head_dim, page_size, group (query heads per kv head), sliding window, soft cap; the first four
    # take the kernel's grouped path (head_dim of 2, 4 or 8 vectors, up to 16 registers of queries)
    (64, 16, 3, 0, 0.0),  # SmolLM2's shape
    (64, 32, 4, 19, 30.0),  # a window that cuts into a page, and Gemma's soft cap
    (128, 16, 1, 0, 0.0),  # multi-head attention
    (32, 8, 2, 5, 0.0),
    (48, 16, 5, 7, 0.0),  # no vectorized grouped path for this shape: the kernel's general loop
]


def long_chunk_lengths(page_size: int) -> list[tuple[int, int]]:
    """(q_len, num_cached): prompt chunks long enough for several of the kernel's tiles (a tile holds
    48 // group tokens with AVX-512, 24 // group with AVX2) and a remainder, short runs of rows that
    go one by one, and decode rows between them."""
    return [(1, 40), (100, 0), (37, 150 - page_size), (5, 20), (2, 9), (1, 3), (4, 0)]


LENGTHS = {"ragged": ragged_lengths, "decode": decode_lengths, "long": long_chunk_lengths}


@pytest.mark.parametrize("lengths", ["ragged", "decode", "long"])
@pytest.mark.parametrize("head_dim,page_size,group,window,soft_cap", CASES)
def test_cpu_kernel_matches_the_reference(head_dim, page_size, group, window, soft_cap, lengths):
    lengths = LENGTHS[lengths](page_size)
    q, k, v, md, real_tokens = build_case(lengths, page_size=page_size, head_dim=head_dim, group=group,
                                          dtype="float32", seed=3)
    kw = dict(scale=head_dim ** -0.5, sliding_window=window, soft_cap=soft_cap)
    decode_only = all(n <= 1 for n, _ in lengths)
    attention = jax.jit(functools.partial(paged_attention, backend="cpu", decode_only=decode_only, **kw))
    out = np.asarray(attention(q, k, v, LAYER, md))
    ref = np.asarray(pk.ragged_paged_attention_reference(q, k, v, LAYER, md.cu_q_lens, md.kv_lens, md.block_tables,
                                                         **kw))
    np.testing.assert_allclose(out[:real_tokens], ref[:real_tokens], atol=2e-5, rtol=1e-5)
    assert not np.any(out[real_tokens:]), "padding rows must be zeros"
    xla = np.asarray(jax.jit(functools.partial(ragged_paged_attention, decode_only=decode_only, q_tile=8,
                                               kv_tile=32, **kw))(q, k, v, LAYER, md))
    np.testing.assert_allclose(out, xla, atol=2e-5, rtol=1e-5)  # the engine's two CPU paths agree too


@pytest.mark.parametrize("page_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("head_dim,page_size,group,window,soft_cap", CASES)
def test_narrow_pages_give_what_their_float32_widening_gives(head_dim, page_size, group, window, soft_cap,
                                                             page_dtype):
    """Pages in bfloat16 or float8 e4m3 (kv_cache_dtype): every path of the kernel (grouped, general loop,
    tiles) reads them widened to float32, so its output is the float32 kernel's on the same values, which
    agrees with XLA's attention reading the same pages."""
    kw = dict(scale=head_dim ** -0.5, sliding_window=window, soft_cap=soft_cap)
    attend = {b: jax.jit(functools.partial(paged_attention, backend=b, **kw)) for b in ("cpu", "xla")}
    for lengths in ("ragged", "long"):
        q, k, v, md, real_tokens = build_case(LENGTHS[lengths](page_size), page_size=page_size, head_dim=head_dim,
                                              group=group, dtype="float32", seed=6)
        k16, v16 = to_page_dtype(k, page_dtype), to_page_dtype(v, page_dtype)  # as written: clipped to fp8's range
        out = np.asarray(attend["cpu"](q, k16, v16, LAYER, md))
        widened = np.asarray(attend["cpu"](q, k16.astype(jnp.float32), v16.astype(jnp.float32), LAYER, md))
        np.testing.assert_allclose(out, widened, atol=1e-6, rtol=1e-6, err_msg=lengths)
        xla = np.asarray(attend["xla"](q, k16, v16, LAYER, md))
        np.testing.assert_allclose(out[:real_tokens], xla[:real_tokens], atol=2e-5, rtol=1e-5, err_msg=lengths)
        assert np.abs(out[:real_tokens] - np.asarray(attend["cpu"](q, k, v, LAYER, md))[:real_tokens]).max() > 1e-4


@pytest.mark.parametrize("backend", ["cpu", "cpu-bf16"])
@pytest.mark.parametrize("page_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("head_dim,page_size,group,window,soft_cap", CASES)
def test_a_bfloat16_result_is_the_float32_result_rounded_bit_for_bit(head_dim, page_size, group, window, soft_cap,
                                                                     page_dtype, backend):
    """out_dtype bfloat16 (what a bfloat16 o_proj takes): the kernel rounds each job's rows as it finishes
    them, decode rows and tiles alike, to the bits XLA's conversion of its float32 result gives (no
    float32 subnormal comes out of these cases), padding rows zero."""
    kw = dict(scale=head_dim ** -0.5, sliding_window=window, soft_cap=soft_cap, backend=backend)
    for lengths in ("ragged", "decode", "long"):
        q, k, v, md, real_tokens = build_case(LENGTHS[lengths](page_size), page_size=page_size, head_dim=head_dim,
                                              group=group, dtype="float32", seed=8)
        k, v = to_page_dtype(k, page_dtype), to_page_dtype(v, page_dtype)
        wide = jax.jit(functools.partial(paged_attention, **kw))(q, k, v, LAYER, md)
        rounded = jax.jit(functools.partial(paged_attention, out_dtype=jnp.bfloat16, **kw))(q, k, v, LAYER, md)
        assert wide.dtype == jnp.float32 and rounded.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(rounded).view(np.uint16),
                                      np.asarray(wide.astype(jnp.bfloat16)).view(np.uint16), err_msg=lengths)
        real = np.asarray(rounded, np.float32)
        assert np.any(real[:real_tokens]) and not np.any(real[real_tokens:])


@pytest.mark.parametrize("page_dtype", ["bfloat16", "float8_e4m3fn"])
def test_the_c_page_writer_writes_what_xlas_scatter_writes_in_place(page_dtype):
    """write_kv for bfloat16 or float8 pages under the C++ backends (XLA:CPU would widen the whole pool
    around a scatter in either dtype): the same bits as XLA's scatter (float8: clipped to +-448, ties to
    even, subnormals), only the given slots, into the given layer."""
    rng = np.random.default_rng(2)
    shape = (3, 6, 8, 2, 32)
    k0 = jnp.asarray(rng.standard_normal(shape), page_dtype)
    v0 = jnp.asarray(rng.standard_normal(shape), page_dtype)
    k, v = (jnp.asarray(rng.standard_normal((5, 2, 32)) * 3, jnp.float32) for _ in range(2))
    # float8's edges: past the largest value, ties, subnormals, negative zero
    edges = [1000.0, -1000.0, 448.0, 464.0, 1.0625, 1.1875, 2.0**-8, 3 * 2.0**-10, 2.0**-6 * 0.97, -0.0, 1e-9]
    k = k.at[0, 0, :len(edges)].set(jnp.asarray(edges, jnp.float32))
    slots = jnp.asarray([9, 0, 47, 10, 30], jnp.int32)
    ours = jax.jit(functools.partial(write_kv, backend="cpu"))(k0, v0, 1, k, v, slots)
    xla = jax.jit(functools.partial(write_kv, backend="xla"))(k0, v0, 1, k, v, slots)
    bits = np.uint16 if page_dtype == "bfloat16" else np.uint8
    for a, b, before in zip(ours, xla, (k0, v0)):
        np.testing.assert_array_equal(np.asarray(a).view(bits), np.asarray(b).view(bits))
        assert (np.asarray(a) != np.asarray(before)).reshape(3, -1).any(-1).tolist() == [False, True, False]


@pytest.mark.parametrize("page_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (6, 2, 128)])
def test_the_fused_rope_and_page_writer_rotates_as_specified_and_writes_as_the_writer(page_dtype, heads, kv_heads,
                                                                                     head_dim):
    """rope_and_write_kv (one C++ call under the C++ backends, in place of the qkv slices, apply_rope and
    write_kv): q is the rope's rotation of the halves, each half x1 c - x2 s and x2 c + x1 s as one fused
    multiply-add onto the other product (computed here exactly in float64, rounded once), bit for bit; k
    rotated the same way and v land in the pages as the C++ writer writes them, in the given slots of the
    given layer only; padding rows that share a slot of the dummy page keep the later row's values, as
    the writer does, though rows 16 slots apart go to different threads' work items."""
    rng = np.random.default_rng(7)
    tokens, pages, page_size, layers = 70, 12, 16, 3
    shape = (layers, pages, page_size, kv_heads, head_dim)
    k0 = jnp.asarray(rng.standard_normal(shape), page_dtype)
    v0 = jnp.asarray(rng.standard_normal(shape), page_dtype)
    qkv = (rng.standard_normal((tokens, (heads + 2 * kv_heads) * head_dim)) * 4).astype(np.float32)
    positions = jnp.asarray(rng.integers(0, 8192, tokens), jnp.int32)
    cos, sin = (np.asarray(t) for t in rope_tables(RopeConfig(theta=100000.0).inv_freq(head_dim), positions))
    real = 38  # distinct slots in pages 3-11; the padding rows' slots repeat every 16 in page 0
    slots = np.concatenate([rng.permutation(np.arange(3 * page_size, pages * page_size))[:real],
                            np.arange(tokens - real) % page_size]).astype(np.int32)
    fused = jax.jit(functools.partial(rope_and_write_kv, num_heads=heads))
    q, k_pages, v_pages = fused(k0, v0, 1, qkv, cos, sin, slots)

    def rotated(x):  # [T, n, D] float32: fma(x1, c, -(x2 s)) | fma(x2, c, x1 s), each product rounded to float32
        x1, x2 = np.split(x.astype(np.float32), 2, axis=-1)
        c, s = cos[:, None, :], sin[:, None, :]
        first = x1.astype(np.float64) * c + (-(x2 * s)).astype(np.float64)
        second = x2.astype(np.float64) * c + (x1 * s).astype(np.float64)
        return np.concatenate([first, second], axis=-1).astype(np.float32)

    q_rows, k_rows, v_rows = np.split(qkv, [heads * head_dim, (heads + kv_heads) * head_dim], axis=-1)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint32),
                                  rotated(q_rows.reshape(tokens, heads, head_dim)).view(np.uint32))
    k_rotated = rotated(k_rows.reshape(tokens, kv_heads, head_dim))
    written = jax.jit(functools.partial(write_kv, backend="cpu"))(
        k0, v0, 1, k_rotated, v_rows.reshape(tokens, kv_heads, head_dim), slots)
    bits = np.uint16 if page_dtype == "bfloat16" else np.uint8
    for ours, theirs, before in zip((k_pages, v_pages), written, (k0, v0)):
        np.testing.assert_array_equal(np.asarray(ours).view(bits), np.asarray(theirs).view(bits))
        assert (np.asarray(ours) != np.asarray(before)).reshape(layers, -1).any(-1).tolist() == [False, True, False]


@pytest.mark.parametrize("head_dim,page_size,group,window,soft_cap", CASES[:4])
def test_bf16_products_round_the_prompt_tiles_operands_only(head_dim, page_size, group, window, soft_cap,
                                                            matmul_path):
    """backend "cpu-bf16" (the kernel's bf16_products): on an AVX512-BF16 CPU the prompt tiles multiply
    queries, keys, softmax weights and values rounded to bfloat16 (on AMX tiles where the CPU has them,
    else vdpbf16ps), so they agree with the reference on rounded q, k, v to bfloat16's precision and differ
    from float32's products; over float32 pages, rows attended one by one (decode rows, short runs) are
    float32's exactly. Without the instruction the flag changes nothing."""
    lengths = long_chunk_lengths(page_size)
    q, k, v, md, real_tokens = build_case(lengths, page_size=page_size, head_dim=head_dim, group=group,
                                          dtype="float32", seed=4)
    kw = dict(scale=head_dim ** -0.5, sliding_window=window, soft_cap=soft_cap)
    out = {b: np.asarray(jax.jit(functools.partial(paged_attention, backend=b, **kw))(q, k, v, LAYER, md))
           for b in ("cpu", "cpu-bf16")}
    rows = np.cumsum([0] + [n for n, _ in lengths])
    tiled = np.zeros(len(q), bool)  # rows in runs long enough for tiles (the kernel's kMinTileTokens: 4)
    for (n, _), start in zip(lengths, rows):
        tiled[start:start + n] = n >= 4
    single = ~tiled
    np.testing.assert_array_equal(out["cpu-bf16"][single], out["cpu"][single])
    if not cpu_ffi.bf16_dot_instructions():
        np.testing.assert_array_equal(out["cpu-bf16"], out["cpu"])
        return
    bf16 = lambda x: x.astype(jnp.bfloat16).astype(np.float32)  # noqa: E731
    ref = np.asarray(pk.ragged_paged_attention_reference(bf16(q), bf16(k), bf16(v), LAYER, md.cu_q_lens,
                                                         md.kv_lens, md.block_tables, **kw))
    np.testing.assert_allclose(out["cpu-bf16"][tiled], ref[tiled], atol=2e-2, rtol=2e-2)
    assert np.abs(out["cpu-bf16"][tiled] - out["cpu"][tiled]).max() > 1e-4, "the tiles' products stayed float32"


@pytest.mark.parametrize("backend,page_dtype", [("cpu", "float32"), ("cpu-bf16", "bfloat16")])
def test_a_prompt_rows_output_does_not_depend_on_where_its_chunk_starts(backend, page_dtype):
    """The kernel gives a prompt run's tiles of one KV head to one job, each tile converting only the keys
    the tile before it did not reach. The same 100 tokens attended as one chunk from position 0 and as a
    chunk from position 56 (the first 56 cached) cut their rows into other tiles and jobs; rows 56..99
    must come out bit for bit the same, since each lane's scores, softmax and weighted sum are its own.
    A tile that read another tile's stale keys or values would differ.

    A tile holds 48 lanes with AVX-512 and 24 with AVX2, so 16 or 8 tokens at group 3, and a run's last
    rows short of 4 tokens go one by one, another summation. Both chunks are cut so that no row goes one
    by one at either width (from 52 at AVX2: six tiles of 8), and so that the chunk from 52 starts inside
    a tile of the chunk from 0 at both."""
    page_size, head_dim, group, start = 16, 64, 3, 52
    for tile_tokens in (48 // group, 24 // group):
        assert start % tile_tokens and all((n % tile_tokens) in range(4, tile_tokens) or n % tile_tokens == 0
                                           for n in (100, 100 - start)), tile_tokens
    # (900, 0): enough tiles that a job holds several of them whatever XLA's thread count (8 CPU devices here)
    lengths = [(100, 0), (100 - start, start), (37, 150 - page_size), (1, 40), (64, 0), (2, 9), (900, 0)]
    q, k, v, md, real_tokens = build_case(lengths, page_size=page_size, head_dim=head_dim, group=group,
                                          dtype="float32", seed=7)
    tables, cu = np.asarray(md.block_tables), np.asarray(md.cu_q_lens)
    k, v, q = np.array(k), np.array(v), np.array(q)
    for page in range(-(-100 // page_size)):  # sequence 1's first 100 positions hold sequence 0's keys, values
        k[:, tables[1, page]] = k[:, tables[0, page]]
        v[:, tables[1, page]] = v[:, tables[0, page]]
    q[cu[1]:cu[2]] = q[cu[0] + start:cu[0] + 100]
    attend = jax.jit(functools.partial(paged_attention, backend=backend, scale=head_dim ** -0.5))
    out = np.asarray(attend(jnp.asarray(q), to_page_dtype(jnp.asarray(k), page_dtype),
                            to_page_dtype(jnp.asarray(v), page_dtype), LAYER, md))
    np.testing.assert_array_equal(out[cu[1]:cu[2]], out[cu[0] + start:cu[0] + 100])
    assert np.abs(out[cu[0] + start:cu[0] + 100]).max() > 0.1


def test_a_prompt_tile_whose_later_keys_score_far_above_its_first_keys(matmul_path):
    """cpu-bf16 prompt tiles on AMX take each lane's weights against the largest score of its first 128 keys
    and go over the row again, against its own maximum, where a later score passes that by more than 8. Here
    one key past the first 128 (position 200) is scaled up 40 times, so for some rows its score is more than
    88 above every earlier one: against the first keys' maximum its weight would overflow float32 (a NaN
    row). Every row must still agree with the reference on the same rounded operands."""
    page_size, head_dim, group = 16, 64, 3
    q, k, v, md, real_tokens = build_case([(300, 0)], page_size=page_size, head_dim=head_dim, group=group,
                                          dtype="float32", seed=11)
    tables = np.asarray(md.block_tables)
    k = np.array(k)
    page, slot = tables[0, 200 // page_size], 200 % page_size
    k[LAYER, page, slot] *= 40.0
    q16, k16, v16 = (to_page_dtype(jnp.asarray(x), "bfloat16") for x in (q, k, v))
    scale = head_dim ** -0.5
    keys = np.asarray(k16.astype(jnp.float32))[LAYER][tables[0, np.arange(300) // page_size], np.arange(300) % page_size]
    queries = np.asarray(q16.astype(jnp.float32))[:300].reshape(300, -1, group, head_dim)
    scores = np.einsum("nhgd,khd->nhgk", queries, keys) * scale  # [rows, KV heads, group, keys]
    jump = scores[200:, :, :, 200] - scores[200:, :, :, :128].max(-1)
    assert jump.max() > 90, "the case must be one where the first keys' maximum overflows a later weight"
    attend = jax.jit(functools.partial(paged_attention, backend="cpu-bf16", scale=scale))
    out = np.asarray(attend(q16.astype(jnp.float32), k16, v16, LAYER, md))[:real_tokens]
    ref = np.asarray(pk.ragged_paged_attention_reference(q16.astype(jnp.float32), k16.astype(jnp.float32),
                                                         v16.astype(jnp.float32), LAYER, md.cu_q_lens, md.kv_lens,
                                                         md.block_tables, scale=scale))[:real_tokens]
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=2e-2, rtol=2e-2)


def rounded_decode_reference(q, k_pages, v_pages, md, num_rows, scale, window, soft_cap):
    """Decode rows as cpu-bf16 computes them over bfloat16 pages, in numpy: the scaled query rounded to
    bfloat16, float32 scores and softmax, the numerators rounded to bfloat16 before they weight the values,
    the sum divided by the unrounded numerators' sum."""
    bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    k, v = (np.asarray(x.astype(jnp.float32))[LAYER] for x in (k_pages, v_pages))
    cu, kv_lens, tables = (np.asarray(x) for x in (md.cu_q_lens, md.kv_lens, md.block_tables))
    num_kv_heads, head_dim, page_size = k.shape[2], k.shape[3], k.shape[1]
    out = np.zeros((num_rows, q.shape[1], head_dim), np.float32)
    for seq, n in enumerate(kv_lens):
        for row in range(cu[seq], min(cu[seq + 1], num_rows)):
            pos = np.arange(max(n - window, 0) if window else 0, n)
            if not len(pos):
                continue
            keys, values = (x[tables[seq, pos // page_size], pos % page_size] for x in (k, v))  # [n, KVH, D]
            qs = bf16(np.asarray(q[row]) * scale).reshape(num_kv_heads, -1, head_dim)
            scores = np.einsum("hgd,nhd->hgn", qs, keys)
            if soft_cap:
                scores = soft_cap * np.tanh(scores / soft_cap)
            e = np.exp(scores - scores.max(-1, keepdims=True))
            out[row] = (np.einsum("hgn,nhd->hgd", bf16(e), values) / e.sum(-1)[..., None]).reshape(-1, head_dim)
    return out


def flush_fp8_subnormals(pages):
    """float8 e4m3 pages widened to float32 as cpu-bf16's decode rows read them: the subnormals (under 2^-6 in
    magnitude) as zero."""
    x = np.asarray(pages.astype(jnp.float32))
    return jnp.asarray(np.where(np.abs(x) < 2.0 ** -6, 0.0, x).astype(np.float32))


@pytest.mark.parametrize("page_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("head_dim,page_size,group,window,soft_cap", CASES[:4])
def test_bf16_products_attend_decode_rows_on_narrow_pages_as_they_lie(head_dim, page_size, group, window,
                                                                      soft_cap, page_dtype, matmul_path):
    """cpu-bf16 over bfloat16 or float8 pages: a decode row multiplies the pages' own keys and values (float8
    widened to bfloat16 in the register, exact but for e4m3's subnormals, read as zero) by its query and its
    softmax weights rounded to bfloat16 (vdpbf16ps, or the scores on AMX tiles; float32 sums), so it agrees
    with a reference that rounds the same operands far more closely than rounding moves the result, and
    differs from backend "cpu" (float32 queries and weights) on the same pages. Without the instruction the
    flag changes nothing. The windows of the second and fourth cases start rows at odd keys, whose weights
    are paired key by key rather than once a row."""
    q, k, v, md, real_tokens = build_case(decode_lengths(page_size), page_size=page_size, head_dim=head_dim,
                                          group=group, dtype="float32", seed=8)
    k16, v16 = to_page_dtype(k, page_dtype), to_page_dtype(v, page_dtype)
    kw = dict(scale=head_dim ** -0.5, sliding_window=window, soft_cap=soft_cap)
    out = {b: np.asarray(jax.jit(functools.partial(paged_attention, backend=b, decode_only=True, **kw))(
        q, k16, v16, LAYER, md))[:real_tokens] for b in ("cpu", "cpu-bf16")}
    if not cpu_ffi.bf16_dot_instructions():
        np.testing.assert_array_equal(out["cpu-bf16"], out["cpu"])
        return
    exact = np.asarray(pk.ragged_paged_attention_reference(q, k16.astype(jnp.float32), v16.astype(jnp.float32),
                                                           LAYER, md.cu_q_lens, md.kv_lens, md.block_tables,
                                                           **kw))[:real_tokens]
    np.testing.assert_allclose(out["cpu"], exact, atol=2e-5, rtol=1e-5)
    read = (k16, v16) if page_dtype == "bfloat16" else (flush_fp8_subnormals(k16), flush_fp8_subnormals(v16))
    rounded = rounded_decode_reference(q, *read, md, real_tokens, kw["scale"], window, soft_cap)
    rounding = np.abs(rounded - exact).max()
    assert rounding > 1e-4, "the case must be one where rounding the operands shows"
    assert np.abs(out["cpu-bf16"] - rounded).max() < rounding / 20, (np.abs(out["cpu-bf16"] - rounded).max(), rounding)
    assert np.abs(out["cpu-bf16"] - out["cpu"]).max() > rounding / 2


def test_bf16_products_over_fp8_pages_keep_small_and_large_products():
    """float8 pages under cpu-bf16: the kernel scales the queries and weights up and the sums down by powers of
    two around the widened pages (their values times 2^-120), so neither large queries nor small weights lose
    their products to float32's range: a row whose scaled query reaches 2^12 and whose softmax spreads its
    weight down to 2^-60 gives the reference's result within bfloat16's rounding."""
    if not cpu_ffi.bf16_dot_instructions():
        pytest.skip("needs AVX512-BF16")
    q, k, v, md, real_tokens = build_case(decode_lengths(16), page_size=16, head_dim=64, group=3, dtype="float32",
                                          seed=9)
    k8, v8 = to_page_dtype(k, "float8_e4m3fn"), to_page_dtype(v, "float8_e4m3fn")
    for q_scale in (2.0 ** -8, 1.0, 64.0):  # scores spread over a few units, or over thousands
        big_q = q * q_scale
        attend = jax.jit(functools.partial(paged_attention, backend="cpu-bf16", decode_only=True, scale=0.125))
        out = np.asarray(attend(big_q, k8, v8, LAYER, md))[:real_tokens]
        ref = rounded_decode_reference(big_q, flush_fp8_subnormals(k8), flush_fp8_subnormals(v8), md, real_tokens,
                                       0.125, 0, 0.0)
        assert np.isfinite(out).all() and np.abs(out).max() > 0.1
        np.testing.assert_allclose(out, ref, atol=2e-3, rtol=2e-3, err_msg=f"{q_scale=}")


def test_cpu_kernel_reads_the_layer_it_is_given_inside_a_layer_loop():
    """Called with a traced layer index (here inside a loop over layers), the kernel must give each
    layer's own result, not layer 0's."""
    q, k, v, md, real_tokens = build_case(decode_lengths(16), page_size=16, head_dim=64, group=3,
                                          dtype="float32", seed=5)
    attend = functools.partial(paged_attention, scale=0.125, decode_only=True)

    def per_layer(backend):
        def body(layer, acc):
            return acc.at[layer].set(attend(q, k, v, layer, md, backend=backend))
        return jax.jit(lambda: jax.lax.fori_loop(0, k.shape[0], body, np.zeros((k.shape[0], *q.shape), np.float32)))()

    out, ref = np.asarray(per_layer("cpu")), np.asarray(per_layer("xla"))
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)
    assert np.abs(out[0, :real_tokens] - out[1, :real_tokens]).max() > 0.1  # the layers differ


SMOLLM2_LIKE = ModelConfig(architecture="llama", vocab_size=256, hidden_size=576, intermediate_size=1536,
                           num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                           rope=RopeConfig(theta=10000.0), max_position_embeddings=2048,
                           tie_word_embeddings=True)


def test_auto_picks_the_cpu_kernel_for_float32_on_a_cpu_and_xla_otherwise(caplog):
    f32, bf16 = EngineConfig(dtype="float32"), EngineConfig(dtype="bfloat16")
    assert resolve_attention_backend("auto", SMOLLM2_LIKE, f32, platform="cpu") == "cpu"
    assert resolve_attention_backend("cpu", SMOLLM2_LIKE, f32, platform="cpu") == "cpu"
    assert resolve_attention_backend("xla", SMOLLM2_LIKE, f32, platform="cpu") == "xla"
    with caplog.at_level(logging.WARNING, logger="jaxserve.ops.attention_backends"):
        assert resolve_attention_backend("auto", SMOLLM2_LIKE, bf16, platform="cpu") == "xla"
    assert "float32" in caplog.text
    with pytest.raises(ValueError, match="attention_backend='cpu'.*float32"):
        resolve_attention_backend("cpu", SMOLLM2_LIKE, bf16, platform="cpu")
    with pytest.raises(ValueError, match="attention_backend='cpu'.*runs on a CPU"):
        resolve_attention_backend("cpu", SMOLLM2_LIKE, f32, platform="gpu")


def test_without_a_compiler_auto_falls_back_to_xla_and_says_why(monkeypatch, tmp_path, caplog):
    """No C++ compiler (and nothing built in the cache): `auto` serves with XLA's attention and logs
    the reason; an explicit 'cpu' is refused with it."""
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path))
    cpu_ffi.forget_kernel_error()
    try:
        assert "no C++ compiler ('no-such-compiler'" in cpu_ffi.kernel_error()
        f32 = EngineConfig(dtype="float32")
        with caplog.at_level(logging.WARNING, logger="jaxserve.ops.attention_backends"):
            assert resolve_attention_backend("auto", SMOLLM2_LIKE, f32, platform="cpu") == "xla"
        assert "no C++ compiler" in caplog.text
        with pytest.raises(ValueError, match="no C\\+\\+ compiler"):
            resolve_attention_backend("cpu", SMOLLM2_LIKE, f32, platform="cpu")
    finally:
        cpu_ffi.forget_kernel_error()
        monkeypatch.undo()
        assert cpu_ffi.kernel_error() is None  # built or cached again for the tests that follow


def test_loading_the_kernel_leaves_the_processs_floating_point_mode_alone():
    """GCC links a -ffast-math shared library with code that turns on flush-to-zero for the whole
    process when it loads: every subnormal float in the server (and its tests) would become 0."""
    assert cpu_ffi.kernel_error() is None
    tiny = np.float32(1e-39)  # subnormal in float32
    assert tiny * np.float32(1.0) != 0 and np.finfo(np.float32).smallest_subnormal > 0


def test_the_attention_microbenchmark_builds_causal_cases_and_times_each(tmp_path):
    """benchmarks/bench_cpu_attention.py: a prompt case is one sequence's rows at consecutive positions
    over distinct pages, a decode case one row per sequence; the FLOPs are the causal ones; each case
    asked for gets a time in the JSON it writes, and an unknown case kind is refused by name."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from bench_cpu_attention import HEAD_DIM, HEADS, PAGE, build, main

    rng = np.random.default_rng(0)
    q, k, _, lens, seqs, tables, flop = build("prompt", 5, 30, jnp.float32, rng)
    assert list(np.asarray(lens)) == [31, 32, 33, 34, 35] and not np.asarray(seqs).any()
    assert q.shape == (5, HEADS, HEAD_DIM) and flop == 4 * HEADS * HEAD_DIM * (31 + 32 + 33 + 34 + 35)
    assert tables.shape == (1, -(-35 // PAGE)) and len(set(np.asarray(tables).ravel())) == tables.size
    assert int(np.asarray(tables).max()) < k.shape[1]
    _, _, _, lens, seqs, tables, flop = build("decode", 3, 20, jnp.bfloat16, rng)
    assert list(np.asarray(lens)) == [20] * 3 and list(np.asarray(seqs)) == [0, 1, 2]
    assert len(set(np.asarray(tables).ravel())) == tables.size and flop == 4 * HEADS * HEAD_DIM * 60

    out = tmp_path / "attention.json"
    main(["--cases", "prompt:8:16", "decode:2:20", "--page-dtype", "bfloat16", "--repeats", "1", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["page_dtype"] == "bfloat16"
    assert [r["case"] for r in saved["results"]] == ["prompt:8:16", "decode:2:20"]
    assert all(r["ms"] > 0 and r["gflops"] > 0 for r in saved["results"])
    _, k, _, _, _, _, _ = build("decode", 2, 20, jnp.bfloat16, rng, layers=3)
    assert k.shape[0] == 3
    main(["--cases", "decode:2:20", "--layers", "3", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text())["layers"] == 3
    with pytest.raises(SystemExit, match="--layers must be at least 1"):
        main(["--cases", "decode:2:20", "--layers", "0"])
    with pytest.raises(SystemExit, match="unknown case kind 'chunk'"):
        main(["--cases", "chunk:8:16", "--repeats", "1"])
