"""Ragged paged attention for Hopper (Mosaic GPU): prefill chunks and decode rows in one launch.

Queries of many sequences lie on one token axis (`cu_q_lens`); each sequence attends causally over
its cached prefix and its own chunk, read through its block table (the metadata contract of
`jaxserve/attention.py`). XLA cuts the token axis into tiles of 64 // group tokens that never span
two sequences and lays each tile out as 64 (token, query head) rows per KV head; the kernel runs one
program per (tile, KV head), so GQA groups share every K/V page they load. XLA scatters the tiles
back. `ragged_paged_attention_reference` below is the plain-jnp statement of the same function.

The new K/V are not written here: `jaxserve.attention.write_kv` (an XLA scatter) runs first. A fused
write would need every program of a sequence to see the chunk's keys before any program reads them,
a grid-wide ordering one launch cannot give; the scatter moves T x KVH x D values, a small fraction
of what attention reads.
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


def _kernel(meta_ref, kv_lens_ref, block_tables_ref, scalars_ref, q_ref, k_ref, v_ref, o_ref, q_smem, q_bar,
            *, group, cfg, page_size, scale, soft_cap, interpret):
    tile, kv_head = lax.axis_index("tile"), lax.axis_index("kv_head")
    layer, window = scalars_ref[0], scalars_ref[1]
    seq, first_pos, num_q = meta_ref[0, tile], meta_ref[1, tile], meta_ref[2, tile]
    kv_len = kv_lens_ref[seq]
    pages_per_seq = block_tables_ref.shape[1]
    tk = cfg.kv_tile
    key_end = jnp.minimum(first_pos + num_q, kv_len)
    key_start = jnp.where(window > 0, jnp.maximum(first_pos - window + 1, 0), 0)
    first_kv_tile = key_start // tk
    num_kv_tiles = jnp.where(num_q > 0, common.cdiv(key_end, tk) - first_kv_tile, 0)

    plgpu.copy_gmem_to_smem(q_ref.at[tile, kv_head], q_smem, q_bar)
    plgpu.barrier_wait(q_bar)
    q_pos = first_pos + common.row_iota(interpret, tk) // group  # [ROWS, tk]

    def page_of(kv_tile, i):
        return block_tables_ref[seq, jnp.minimum(kv_tile * (tk // page_size) + i, pages_per_seq - 1)]

    def mask_of(key_pos):
        mask = (key_pos <= q_pos) & (key_pos < kv_len)
        return mask & ((window <= 0) | (key_pos > q_pos - window))

    def loop(*scratch):
        return common.kv_loop(q_smem, k_ref, v_ref, scratch, layer=layer, kv_head=kv_head, page_of=page_of,
                              first_kv_tile=first_kv_tile, num_kv_tiles=num_kv_tiles, mask_of=mask_of, cfg=cfg,
                              page_size=page_size, scale=scale, soft_cap=soft_cap, interpret=interpret)

    head_dim = q_smem.shape[1]
    acc, _, l = pl.run_scoped(loop, *common.kv_scratch(cfg, head_dim, page_size, q_smem.dtype))
    l = jnp.where(l > 0, l, 1.0)
    chunk = acc[0].shape[1]
    for c, a in enumerate(acc):  # the Q tile's SMEM is free now: stage the output there
        q_smem[:, pl.ds(c * chunk, chunk)] = (a / lax.broadcast_in_dim(l, a.shape, [0])).astype(q_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[tile, kv_head])
    plgpu.wait_smem_to_gmem(0)


def _tiles(cu_q_lens, kv_lens, num_tokens: int, tile_tokens: int):
    """Per tile: [3, NT] int32 (sequence, position of first token, token count) and the token rows
    [NT, tile_tokens] (num_tokens where padded). NT is a static bound; surplus tiles have 0 tokens."""
    num_seqs = kv_lens.shape[0]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    cu_tiles = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(common.cdiv(q_lens, tile_tokens))])
    num_tiles = min(-(-num_tokens // tile_tokens) + num_seqs, num_tokens)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    # compare_all, not the default loop: a loop outside the kernel would make the GPU wait on the host
    seq = jnp.searchsorted(cu_tiles, tile, side="right", method="compare_all") - 1
    seq = jnp.clip(seq, 0, num_seqs - 1).astype(jnp.int32)
    first_row = cu_q_lens[seq] + (tile - cu_tiles[seq]) * tile_tokens
    num_q = jnp.where(tile < cu_tiles[-1], jnp.clip(cu_q_lens[seq + 1] - first_row, 0, tile_tokens), 0)
    first_pos = kv_lens[seq] - q_lens[seq] + first_row - cu_q_lens[seq]
    offset = jnp.arange(tile_tokens, dtype=jnp.int32)[None, :]
    rows = jnp.where(offset < num_q[:, None], first_row[:, None] + offset, num_tokens)
    return jnp.stack([seq, first_pos, num_q]).astype(jnp.int32), rows


def ragged_paged_attention(
    q,  # [T, num_heads, head_dim]
    k_pages,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v_pages,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    layer,  # int32 scalar
    cu_q_lens,  # [S + 1] int32
    kv_lens,  # [S] int32
    block_tables,  # [S, pages_per_seq] int32
    *,
    scale: float,
    sliding_window=0,  # int32 scalar, 0 = none
    soft_cap: float = 0.0,
    interpret: bool = False,
    detect_races: bool = False,
):
    """Causal attention of every query row over its sequence's paged keys; returns [T, H, D] in q's dtype.

    Rows outside every sequence (padding) come back as zeros. See the module docstring for the tiling.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = k_pages.shape
    dtype = k_pages.dtype
    common.check_supported(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           page_size=page_size, dtype=dtype, interpret=interpret)
    group = num_heads // num_kv_heads
    tile_tokens = ROWS // group
    cfg = common.choose_config(head_dim, page_size, decode=False)
    meta, rows = _tiles(cu_q_lens, kv_lens, num_tokens, tile_tokens)
    num_tiles = rows.shape[0]

    q_tiles = q.reshape(num_tokens, num_kv_heads, group, head_dim).at[rows].get(mode="fill", fill_value=0)
    q_tiles = q_tiles.transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, tile_tokens * group, head_dim)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, ROWS - tile_tokens * group), (0, 0))).astype(dtype)
    scalars = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(sliding_window, jnp.int32)])

    kernel = functools.partial(_kernel, group=group, cfg=cfg, page_size=page_size, scale=scale,
                               soft_cap=soft_cap, interpret=bool(interpret))

    def skip_empty(meta_ref, *refs):  # surplus tiles of the static bound do no work; XLA drops their rows
        pl.when(meta_ref[2, lax.axis_index("tile")] > 0)(lambda: kernel(meta_ref, *refs))
    entry = lambda *refs: pl.run_scoped(  # noqa: E731
        lambda *scratch: skip_empty(*refs, *scratch),
        plgpu.SMEM((ROWS, head_dim), dtype, transforms=common.tile_transforms(dtype)),
        plgpu.Barrier(num_arrivals=1),
    )
    o_tiles = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((num_tiles, num_kv_heads, ROWS, head_dim), dtype),
        grid=(num_tiles, num_kv_heads),
        grid_names=("tile", "kv_head"),
        compiler_params=plgpu.CompilerParams(),
        interpret=interpret_params(detect_races=detect_races,
                                   num_tma_copies=common.max_copies_in_flight(cfg, page_size)) if interpret else False,
        kernel_name="ragged_paged_attention",
    )(meta, kv_lens, block_tables, scalars, q_tiles, k_pages, v_pages)

    o_tiles = o_tiles[:, :, : tile_tokens * group].reshape(num_tiles, num_kv_heads, tile_tokens, group, head_dim)
    out = jnp.zeros((num_tokens, num_kv_heads, group, head_dim), q.dtype)
    out = out.at[rows].set(o_tiles.transpose(0, 2, 1, 3, 4).astype(q.dtype), mode="drop")
    return out.reshape(num_tokens, num_heads, head_dim)


def ragged_paged_attention_reference(q, k_pages, v_pages, layer, cu_q_lens, kv_lens, block_tables, *,
                                     scale: float, sliding_window=0, soft_cap: float = 0.0):
    """Plain jnp, float32, no tiling: every row against every key slot of its sequence, masked.

    Memory is O(T x max_kv_len x H), so it is for tests; `jaxserve.attention.ragged_paged_attention`
    is the production XLA path with the same contract.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    num_seqs, pages_per_seq = block_tables.shape
    row = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, row, side="right") - 1, 0, num_seqs - 1)  # [T]
    valid = row < cu_q_lens[-1]
    q_pos = kv_lens[seq] - (cu_q_lens[seq + 1] - row)  # [T]
    key_pos = jnp.arange(pages_per_seq * page_size)  # [K]
    pages = block_tables[seq][:, key_pos // page_size]  # [T, K]
    k = k_pages[layer][pages, key_pos % page_size].astype(jnp.float32)  # [T, K, KVH, D]
    v = v_pages[layer][pages, key_pos % page_size].astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    s = jnp.einsum("thgd,tkhd->thgk", qg, k) * scale
    if soft_cap:
        s = soft_cap * jnp.tanh(s / soft_cap)
    mask = (key_pos[None] <= q_pos[:, None]) & valid[:, None]
    mask &= (sliding_window <= 0) | (key_pos[None] > q_pos[:, None] - sliding_window)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    p = jnp.where(mask[:, None, None], p, 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("thgk,tkhd->thgd", p / jnp.where(denom > 0, denom, 1.0), v)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
