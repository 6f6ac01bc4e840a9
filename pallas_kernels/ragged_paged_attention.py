"""Ragged paged attention for Hopper (Mosaic GPU): prefill chunks and decode rows in one launch.

Queries of many sequences lie on one token axis (`cu_q_lens`); each sequence attends causally over
its cached prefix and its own chunk, read through its block table (the metadata contract of
`jaxserve/ops/attention.py`). XLA cuts the token axis into tiles of 2 x (64 // group) tokens that never
span two sequences and lays each tile out, per KV head, as two blocks of 64 (token, query head) rows;
the kernel runs one program per (tile, KV head), so GQA groups share every K/V page they load. XLA
scatters the tiles back. `ragged_paged_attention_reference` below is the plain-jnp statement of the
same function.

A program is warp-specialized, as FlashAttention-3 and JAX's `attention_mgpu.py` are: three
warpgroups, of which the last (the producer, its registers given to the others) only issues the TMA
copies of K/V pages into a ring of `num_stages` SMEM slots, and the other two (the consumers) each own
one 64-row block (wgmma's M) and run QK^T, the online softmax and PV on it. Each ring slot has a
"full" barrier (its copies landed) and a "free" one (both consumers are done with it: K after QK^T, V
after PV), so copies run ahead of the math by up to `num_stages` tiles and never overwrite a tile in
use. Both consumers step through all of the program's KV tiles in order, to keep the barriers' phases
in step, but each computes only the tiles its own rows can see and passes over the others.

The new K/V are not written here: `jaxserve.ops.attention.write_kv` (an XLA scatter) runs first. A fused
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
from pallas_kernels.common import COMPUTE_WARPGROUPS, ROWS


def _kernel(meta_ref, kv_lens_ref, block_tables_ref, scalars_ref, q_ref, k_ref, v_ref, o_ref, q_smem, p_smem,
            k_smem, v_smem, q_bar, k_full, v_full, k_free, v_free, *upcast_smem, group, cfg, page_size, scale,
            soft_cap, interpret):
    """One program: consumers wg 0 and 1 (rows of tokens [0, 64 // group) and [64 // group, 2 x that) of
    the tile), producer wg 2. upcast_smem: for float8 pages, each consumer's upcast tile."""
    tile, kv_head, wg = lax.axis_index("tile"), lax.axis_index("kv_head"), lax.axis_index("wg")
    layer, window = scalars_ref[0], scalars_ref[1]
    seq, first_pos, num_q = meta_ref[0, tile], meta_ref[1, tile], meta_ref[2, tile]
    kv_len = kv_lens_ref[seq]
    tk, stages = cfg.kv_tile, cfg.num_stages
    wg_tokens = ROWS // group

    kv_tiles = functools.partial(kv_tile_range, kv_len=kv_len, window=window, kv_tile=tk)
    first_kv_tile, num_kv_tiles = kv_tiles(first_pos, num_q)  # the ring steps of every warpgroup

    @pl.when(wg == COMPUTE_WARPGROUPS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")  # the consumers take the register file
        _produce(k_ref, v_ref, k_smem, v_smem, k_full, v_full, k_free, v_free, block_tables_ref,
                 layer=layer, kv_head=kv_head, seq=seq, first_kv_tile=first_kv_tile, num_kv_tiles=num_kv_tiles,
                 cfg=cfg, page_size=page_size)

    @pl.when(wg < COMPUTE_WARPGROUPS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")  # 2 x 128 x 232 + 128 x 40 <= 64K registers
        wg_first_pos = first_pos + wg * wg_tokens
        wg_num_q = jnp.clip(num_q - wg * wg_tokens, 0, wg_tokens)
        lo, hi = consumer_steps((first_kv_tile, num_kv_tiles), kv_tiles(wg_first_pos, wg_num_q))
        q_wg, p_wg = q_smem.at[wg], p_smem.at[wg]  # [ROWS, head_dim], [ROWS, kv_tile]

        @pl.when(wg_num_q > 0)
        def _():
            plgpu.copy_gmem_to_smem(q_ref.at[tile, kv_head, wg], q_wg, q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])

        def pass_over(step, _):  # a tile this warpgroup's rows cannot see: wait (keeps phases) and release
            slot = lax.rem(step, stages)
            for full, free in ((k_full, k_free), (v_full, v_free)):
                plgpu.barrier_wait(full.at[slot])
                plgpu.barrier_arrive(free.at[slot])

        q_pos = wg_first_pos + common.row_iota(interpret, tk) // group  # [ROWS, tk]

        def mask_of(key_pos):
            mask = (key_pos <= q_pos) & (key_pos < kv_len)
            return mask & ((window <= 0) | (key_pos > q_pos - window))

        lax.fori_loop(0, lo, pass_over, None)
        acc, _, l = _consume(q_wg, p_wg, k_smem, v_smem, k_full, v_full, k_free, v_free, lo=lo, hi=hi,
                             first_kv_tile=first_kv_tile, mask_of=mask_of, cfg=cfg, scale=scale, soft_cap=soft_cap,
                             interpret=interpret, upcast=(upcast_smem[0], wg) if upcast_smem else None)
        lax.fori_loop(hi, num_kv_tiles, pass_over, None)

        @pl.when(wg_num_q > 0)
        def _():
            l_safe = jnp.where(l > 0, l, 1.0)
            chunk = acc[0].shape[1]
            for c, a in enumerate(acc):  # this warpgroup's Q tile is free now: stage the output there
                q_wg[:, pl.ds(c * chunk, chunk)] = (a / lax.broadcast_in_dim(l_safe, a.shape, [0])).astype(q_wg.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_wg, o_ref.at[tile, kv_head, wg])
            plgpu.wait_smem_to_gmem(0)


def kv_tile_range(first_pos, num_q, *, kv_len, window, kv_tile):
    """(first, count): the KV tiles that rows at positions first_pos + [0, num_q) can see (causal, window)."""
    key_end = jnp.minimum(first_pos + num_q, kv_len)
    key_start = jnp.where(window > 0, jnp.maximum(first_pos - window + 1, 0), 0)
    first = key_start // kv_tile
    return first, jnp.where(num_q > 0, common.cdiv(key_end, kv_tile) - first, 0)


def consumer_steps(program_range, consumer_range):
    """A consumer's ring steps [lo, hi) within its program's, from their kv_tile_range: it computes those
    and passes over the others (none computed when its rows are padding)."""
    (first, count), (wg_first, wg_count) = program_range, consumer_range
    lo = jnp.where(wg_count > 0, wg_first - first, count)
    return lo, lo + wg_count


def _produce(k_ref, v_ref, k_smem, v_smem, k_full, v_full, k_free, v_free, block_tables_ref, *, layer, kv_head,
             seq, first_kv_tile, num_kv_tiles, cfg, page_size):
    """Fills the ring: step j's K and V copies go to slot j % num_stages once both consumers freed it."""
    tk, stages = cfg.kv_tile, cfg.num_stages
    copies = common.copies_per_kv_tile(tk, page_size)
    rows_per_copy = min(tk, page_size)
    pages_per_seq = block_tables_ref.shape[1]

    def issue(ref, smem, full, step, slot):
        key = (first_kv_tile + step) * tk
        for i in range(copies):
            page = block_tables_ref[seq, jnp.minimum(key // page_size + i, pages_per_seq - 1)]
            src = ref.at[layer, page, pl.ds(key % page_size, rows_per_copy), kv_head, :]
            plgpu.copy_gmem_to_smem(src, smem.at[slot, pl.ds(i * rows_per_copy, rows_per_copy)], full.at[slot])

    @pl.loop(0, num_kv_tiles)
    def _(step):
        slot = lax.rem(step, stages)
        for ref, smem, full, free in ((k_ref, k_smem, k_full, k_free), (v_ref, v_smem, v_full, v_free)):
            pl.when(step >= stages)(lambda free=free: plgpu.barrier_wait(free.at[slot]))
            issue(ref, smem, full, step, slot)

    @pl.loop(jnp.maximum(num_kv_tiles, stages), num_kv_tiles + stages)
    def _(step):  # the last tiles' releases: every phase of a barrier is waited for once (the interpreter
        slot = lax.rem(step, stages)  # checks it); on a GPU this only holds an idle warpgroup until the end
        plgpu.barrier_wait(k_free.at[slot])
        plgpu.barrier_wait(v_free.at[slot])


def _consume(q_smem, p_smem, k_smem, v_smem, k_full, v_full, k_free, v_free, *, lo, hi, first_kv_tile, mask_of,
             cfg, scale, soft_cap, interpret, upcast=None):
    """Online softmax of one warpgroup's Q tile [ROWS, D] over ring steps [lo, hi); returns (acc chunks, m, l),
    m and the exponentials in base 2. Each step frees its K slot after QK^T and its V slot after PV.
    upcast: (tiles, index) of this warpgroup's upcast tile for float8 pages (`common.kv_operand`), else None."""
    head_dim, dtype = q_smem.shape[1], q_smem.dtype
    tk, stages = cfg.kv_tile, cfg.num_stages
    chunk = min(head_dim, 128)  # PV in column chunks: fresh accumulators keep register use bounded
    col = common.layout(lax.broadcasted_iota(jnp.int32, (ROWS, tk), 1), interpret)

    def body(step, carry):
        acc, m, l = carry
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(k_full.at[slot])
        k_tiles, k_index = common.kv_operand(k_smem, slot, upcast)
        if interpret:
            s = lax.dot_general(q_smem[...], k_tiles.at[k_index][...], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        else:
            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_tiles.at[k_index], (1, 0)))
                return acc_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((ROWS, tk), jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])  # reading the accumulator waited for the wgmma
        if soft_cap:
            s = (soft_cap * common.LOG2E) * jnp.tanh(s * (scale / soft_cap))
        else:
            s = s * (scale * common.LOG2E)
        mask = mask_of((first_kv_tile + step) * tk + col)
        s = jnp.where(mask, s, common.NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.where(mask, jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
        l = l * alpha + p.sum(axis=1)
        p_smem[...] = p.astype(dtype)
        plgpu.commit_smem()  # P's generic-proxy stores must be visible to the wgmma below
        plgpu.barrier_wait(v_full.at[slot])
        v_tiles, v_index = common.kv_operand(v_smem, slot, upcast)
        new_acc = []
        for c, a in enumerate(acc):
            def pv(acc_ref, c=c):
                plgpu.wgmma(acc_ref, p_smem, v_tiles.at[v_index, :, pl.ds(c * chunk, chunk)])
                return acc_ref[...]
            pv_c = pl.run_scoped(pv, plgpu.ACC((ROWS, chunk), jnp.float32))
            new_acc.append(a * lax.broadcast_in_dim(alpha, a.shape, [0]) + pv_c)
        plgpu.barrier_arrive(v_free.at[slot])
        return tuple(new_acc), m_new, l

    init = (
        tuple(common.layout(jnp.zeros((ROWS, chunk), jnp.float32), interpret) for _ in range(head_dim // chunk)),
        common.row_layout(jnp.full((ROWS,), common.NEG_INF, jnp.float32), interpret),
        common.row_layout(jnp.zeros((ROWS,), jnp.float32), interpret),
    )
    return lax.fori_loop(lo, hi, body, init)


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
    Pages in bfloat16 (q is cast to it), or float8 e4m3 (upcast to q's dtype: bfloat16 on a GPU).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = k_pages.shape
    kv_dtype = k_pages.dtype
    common.check_supported(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           page_size=page_size, dtype=kv_dtype, interpret=interpret, q_dtype=q.dtype)
    dtype = common.operand_dtype(kv_dtype, q.dtype)  # of Q, P, O and the K/V the wgmma reads
    group = num_heads // num_kv_heads
    wg_tokens = ROWS // group  # tokens per compute warpgroup; a program's tile has COMPUTE_WARPGROUPS of them
    tile_tokens = COMPUTE_WARPGROUPS * wg_tokens
    cfg = common.choose_prefill_config(head_dim, page_size, common.gpu_itemsize(kv_dtype))
    meta, rows = _tiles(cu_q_lens, kv_lens, num_tokens, tile_tokens)
    num_tiles = rows.shape[0]

    q_tiles = q.reshape(num_tokens, num_kv_heads, group, head_dim).at[rows].get(mode="fill", fill_value=0)
    q_tiles = q_tiles.reshape(num_tiles, COMPUTE_WARPGROUPS, wg_tokens, num_kv_heads, group, head_dim)
    q_tiles = q_tiles.transpose(0, 3, 1, 2, 4, 5).reshape(num_tiles, num_kv_heads, COMPUTE_WARPGROUPS,
                                                          wg_tokens * group, head_dim)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, 0), (0, ROWS - wg_tokens * group), (0, 0))).astype(dtype)
    scalars = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(sliding_window, jnp.int32)])

    kernel = functools.partial(_kernel, group=group, cfg=cfg, page_size=page_size, scale=scale,
                               soft_cap=soft_cap, interpret=bool(interpret))

    def skip_empty(meta_ref, *refs):  # surplus tiles of the static bound do no work; XLA drops their rows
        pl.when(meta_ref[2, lax.axis_index("tile")] > 0)(lambda: kernel(meta_ref, *refs))

    t = common.tile_transforms(dtype)
    t_kv = t if kv_dtype == dtype else common.tile_transforms(kv_dtype, head_dim)
    copies = common.copies_per_kv_tile(cfg.kv_tile, page_size)
    ring = (cfg.num_stages, cfg.kv_tile, head_dim)
    upcast = () if kv_dtype == dtype else (  # float8 pages: each consumer's K (then V) tile in bfloat16
        plgpu.SMEM((COMPUTE_WARPGROUPS, cfg.kv_tile, head_dim), dtype, transforms=t),)
    entry = lambda *refs: pl.run_scoped(  # noqa: E731
        lambda *scratch: skip_empty(*refs, *scratch),
        plgpu.SMEM((COMPUTE_WARPGROUPS, ROWS, head_dim), dtype, transforms=t),  # Q, then O, per consumer
        plgpu.SMEM((COMPUTE_WARPGROUPS, ROWS, cfg.kv_tile), dtype, transforms=t),  # P, per consumer
        plgpu.SMEM(ring, kv_dtype, transforms=t_kv),  # K ring
        plgpu.SMEM(ring, kv_dtype, transforms=t_kv),  # V ring
        plgpu.Barrier(num_arrivals=1, num_barriers=COMPUTE_WARPGROUPS),  # Q landed, per consumer
        plgpu.Barrier(num_arrivals=copies, num_barriers=cfg.num_stages),  # K slot full
        plgpu.Barrier(num_arrivals=copies, num_barriers=cfg.num_stages),  # V slot full
        plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=cfg.num_stages),  # K slot free
        plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=cfg.num_stages),  # V slot free
        *upcast,
        collective_axes="wg",
    )
    num_tma_copies = 2 * cfg.num_stages * copies + COMPUTE_WARPGROUPS
    o_tiles = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((num_tiles, num_kv_heads, COMPUTE_WARPGROUPS, ROWS, head_dim), dtype),
        grid=(num_tiles, num_kv_heads),
        grid_names=("tile", "kv_head"),
        num_threads=COMPUTE_WARPGROUPS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(),
        interpret=interpret_params(detect_races=detect_races, num_tma_copies=num_tma_copies) if interpret else False,
        kernel_name="ragged_paged_attention",
    )(meta, kv_lens, block_tables, scalars, q_tiles, k_pages, v_pages)

    o_tiles = o_tiles[:, :, :, : wg_tokens * group].reshape(num_tiles, num_kv_heads, tile_tokens, group, head_dim)
    out = jnp.zeros((num_tokens, num_kv_heads, group, head_dim), q.dtype)
    out = out.at[rows].set(o_tiles.transpose(0, 2, 1, 3, 4).astype(q.dtype), mode="drop")
    return out.reshape(num_tokens, num_heads, head_dim)


def ragged_paged_attention_reference(q, k_pages, v_pages, layer, cu_q_lens, kv_lens, block_tables, *,
                                     scale: float, sliding_window=0, soft_cap: float = 0.0):
    """Plain jnp, float32, no tiling: every row against every key slot of its sequence, masked.

    Memory is O(T x max_kv_len x H), so it is for tests; `jaxserve.ops.attention.ragged_paged_attention`
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
