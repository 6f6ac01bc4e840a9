"""Paged decode attention for Hopper (Mosaic GPU): one query token per sequence, flash-decoding.

A decode step has one row per sequence, so a program per (sequence, KV head) would leave most of a
132-SM GPU idle at small batch and long context. This kernel also splits each sequence's keys into
`num_splits` ranges of whole KV tiles, one program each (grid: sequence x KV head x split); every
program writes its partial output and log-sum-exp, and XLA merges the splits. The query rows of a
program are the GQA group of one KV head (padded to 8), not a prefill tile, so a decode row never
pays for 64 // group tokens of query tiling. `decode_attention_reference` is the plain-jnp statement.
Like the ragged kernel, it reads pages that `write_kv` (XLA) has already written, in bfloat16 or
float8 e4m3 (upcast in the kernel: `common.upcast_tile`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.interpret import interpret_params
from pallas_kernels.common import ROWS

NUM_SMS = 132  # H100/H200 SXM
_MIN_PROGRAMS = 2 * NUM_SMS  # split until about two waves of programs


def default_num_splits(num_seqs: int, num_kv_heads: int, max_kv_tiles: int) -> int:
    """Splits per sequence: enough programs for ~2 waves on the GPU, never more than its KV tiles."""
    return max(1, min(max_kv_tiles, common.cdiv(_MIN_PROGRAMS, num_seqs * num_kv_heads)))


def _kernel(kv_lens_ref, block_tables_ref, scalars_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, q_smem, q_bar,
            *, cfg, page_size, kv_tiles_per_split, scale, soft_cap, interpret):
    seq, kv_head, split = lax.axis_index("seq"), lax.axis_index("kv_head"), lax.axis_index("split")
    layer, window = scalars_ref[0], scalars_ref[1]
    kv_len = kv_lens_ref[seq]  # 0 for padded sequences: no KV tiles, zero output
    pages_per_seq = block_tables_ref.shape[1]
    tk, group_rows = cfg.kv_tile, q_ref.shape[2]
    q_pos = kv_len - 1
    key_start = jnp.where(window > 0, jnp.maximum(q_pos - window + 1, 0), 0)
    first_kv_tile = jnp.maximum(split * kv_tiles_per_split, key_start // tk)
    end_kv_tile = jnp.minimum((split + 1) * kv_tiles_per_split, common.cdiv(kv_len, tk))
    num_kv_tiles = jnp.maximum(end_kv_tile - first_kv_tile, 0)

    # Rows past the group stay unwritten: each row's softmax is its own, and they are never stored.
    # An empty split (most of them, for short contexts) loads nothing but still writes its (zero) part.
    @pl.when(num_kv_tiles > 0)
    def _():
        plgpu.copy_gmem_to_smem(q_ref.at[seq, kv_head], q_smem.at[pl.ds(0, group_rows)], q_bar)
        plgpu.barrier_wait(q_bar)

    def page_of(kv_tile, i):
        return block_tables_ref[seq, jnp.minimum(kv_tile * (tk // page_size) + i, pages_per_seq - 1)]

    def mask_of(key_pos):
        return (key_pos < kv_len) & ((window <= 0) | (key_pos > q_pos - window))

    def loop(*scratch):
        return common.kv_loop(q_smem, k_ref, v_ref, scratch, layer=layer, kv_head=kv_head, page_of=page_of,
                              first_kv_tile=first_kv_tile, num_kv_tiles=num_kv_tiles, mask_of=mask_of, cfg=cfg,
                              page_size=page_size, scale=scale, soft_cap=soft_cap, interpret=interpret)

    head_dim = q_smem.shape[1]
    acc, m, l = pl.run_scoped(loop, *common.kv_scratch(cfg, head_dim, page_size, q_smem.dtype, k_ref.dtype))
    lse = jnp.where(l > 0, m + jnp.log2(jnp.where(l > 0, l, 1.0)), common.NEG_INF)  # base 2
    l = jnp.where(l > 0, l, 1.0)

    def store(o_smem, lse_smem):
        chunk = acc[0].shape[1]
        for c, a in enumerate(acc):
            o_smem[:, pl.ds(c * chunk, chunk)] = a / lax.broadcast_in_dim(l, a.shape, [0])
        lse_smem[...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group_rows)], o_ref.at[seq, kv_head, split])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[seq, kv_head, split])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM((ROWS, head_dim), jnp.float32), plgpu.SMEM((ROWS,), jnp.float32))


def decode_attention(
    q,  # [T, num_heads, head_dim]
    k_pages,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v_pages,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    layer,  # int32 scalar
    cu_q_lens,  # [S + 1] int32; every sequence has q_len 0 or 1
    kv_lens,  # [S] int32
    block_tables,  # [S, pages_per_seq] int32
    *,
    scale: float,
    sliding_window=0,  # int32 scalar, 0 = none
    soft_cap: float = 0.0,
    num_splits: int | None = None,
    interpret: bool = False,
    detect_races: bool = False,
):
    """Attention of each sequence's single new row over its paged keys; returns [T, H, D] in q's dtype.

    Pages in bfloat16 (q is cast to it), or float8 e4m3 (upcast to q's dtype: bfloat16 on a GPU).

    Precondition (the engine's decode step guarantees it): every sequence has at most one query row.
    Sequences with none, and rows that belong to none, give zeros.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs, pages_per_seq = block_tables.shape
    common.check_supported(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           page_size=page_size, dtype=k_pages.dtype, interpret=interpret, q_dtype=q.dtype)
    dtype = common.operand_dtype(k_pages.dtype, q.dtype)  # of Q, P and the K/V the wgmma reads
    group = num_heads // num_kv_heads
    group_rows = -(-group // 8) * 8  # TMA moves whole 8-row tiles of Q
    cfg = common.choose_config(head_dim, page_size, decode=True, kv_itemsize=common.gpu_itemsize(k_pages.dtype))
    max_kv_tiles = common.cdiv(pages_per_seq * page_size, cfg.kv_tile)
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_kv_tiles)
    kv_tiles_per_split = common.cdiv(max_kv_tiles, num_splits)

    is_decode = (cu_q_lens[1:] - cu_q_lens[:-1]) == 1  # [S]
    rows = jnp.where(is_decode, cu_q_lens[:-1], num_tokens)
    q_seq = q.reshape(num_tokens, num_kv_heads, group, head_dim).at[rows].get(mode="fill", fill_value=0)
    q_seq = jnp.pad(q_seq, ((0, 0), (0, 0), (0, group_rows - group), (0, 0))).astype(dtype)
    scalars = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(sliding_window, jnp.int32)])

    kernel = functools.partial(_kernel, cfg=cfg, page_size=page_size, kv_tiles_per_split=kv_tiles_per_split,
                               scale=scale, soft_cap=soft_cap, interpret=bool(interpret))
    entry = lambda *refs: pl.run_scoped(  # noqa: E731
        lambda *scratch: kernel(*refs, *scratch),
        plgpu.SMEM((ROWS, head_dim), dtype, transforms=common.tile_transforms(dtype)),
        plgpu.Barrier(num_arrivals=1),
    )
    o_split, lse_split = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((num_seqs, num_kv_heads, num_splits, group_rows, head_dim), jnp.float32),
                  jax.ShapeDtypeStruct((num_seqs, num_kv_heads, num_splits, ROWS), jnp.float32)),
        grid=(num_seqs, num_kv_heads, num_splits),
        grid_names=("seq", "kv_head", "split"),
        compiler_params=plgpu.CompilerParams(),
        interpret=interpret_params(detect_races=detect_races,
                                   num_tma_copies=common.max_copies_in_flight(cfg, page_size)) if interpret else False,
        kernel_name="paged_decode_attention",
    )(jnp.where(is_decode, kv_lens, 0), block_tables, scalars, q_seq, k_pages, v_pages)

    out = merge_splits(o_split[:, :, :, :group], lse_split[:, :, :, :group])  # [S, KVH, G, D]
    result = jnp.zeros((num_tokens, num_kv_heads, group, head_dim), q.dtype)
    return result.at[rows].set(out.astype(q.dtype), mode="drop").reshape(num_tokens, num_heads, head_dim)


def merge_splits(o_split, lse_split):
    """Combines per-split softmax results: o [S, KVH, NS, G, D] (each normalized), lse [S, KVH, NS, G]
    (base 2; NEG_INF for an empty split) -> [S, KVH, G, D]."""
    lse_max = jnp.max(lse_split, axis=2, keepdims=True)
    weight = jnp.exp2(lse_split - lse_max)  # empty splits weigh 0 unless all are empty (then o is 0)
    weight = weight / jnp.sum(weight, axis=2, keepdims=True)
    return jnp.einsum("shnG,shnGd->shGd", weight, o_split)


def decode_attention_reference(q, k_pages, v_pages, layer, cu_q_lens, kv_lens, block_tables, *, scale: float,
                               sliding_window=0, soft_cap: float = 0.0):
    """Plain jnp, float32: each decode row (the one row of its sequence) against its keys 0:kv_len."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    pages_per_seq = block_tables.shape[1]
    is_decode = (cu_q_lens[1:] - cu_q_lens[:-1]) == 1
    rows = jnp.where(is_decode, cu_q_lens[:-1], num_tokens)
    key_pos = jnp.arange(pages_per_seq * page_size)
    k = k_pages[layer][block_tables[:, key_pos // page_size], key_pos % page_size].astype(jnp.float32)
    v = v_pages[layer][block_tables[:, key_pos // page_size], key_pos % page_size].astype(jnp.float32)
    qs = q.astype(jnp.float32).at[rows].get(mode="fill", fill_value=0).reshape(-1, num_kv_heads, group, head_dim)
    s = jnp.einsum("shgd,skhd->shgk", qs, k) * scale
    if soft_cap:
        s = soft_cap * jnp.tanh(s / soft_cap)
    q_pos = kv_lens - 1
    mask = (key_pos[None] <= q_pos[:, None]) & is_decode[:, None]
    mask &= (sliding_window <= 0) | (key_pos[None] > q_pos[:, None] - sliding_window)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jnp.where(mask[:, None, None], jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("shgk,skhd->shgd", p / jnp.where(denom > 0, denom, 1.0), v)
    result = jnp.zeros((num_tokens, num_kv_heads, group, head_dim), q.dtype)
    return result.at[rows].set(out.astype(q.dtype), mode="drop").reshape(num_tokens, num_heads, head_dim)
