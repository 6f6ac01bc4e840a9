"""Paged attention in pure JAX (the XLA backend, any platform), and the reference the C++ and
Pallas kernels must match.

The KV page array is one preallocated pair of arrays per model,

    k_pages, v_pages: [num_layers, num_pages, page_size, num_kv_heads, head_dim]

split by KV head under tensor parallelism (`tensor_parallel.py`). Page 0 is reserved: padded token
rows write their K/V into it and nothing ever reads it as a real page. A token's place in the pool is
its *slot*, `page * page_size + offset`.

The metadata follows the ragged paged attention contract (tpu-inference RPA v3): queries of several
sequences are flattened onto one token axis; sequence s owns rows `cu_q_lens[s]:cu_q_lens[s+1]`,
its keys are positions `0:kv_lens[s]` (the cached prefix plus this chunk, already written), read
through `block_tables[s]`. Padded sequences have q_len 0 and kv_len 0. Decode rows are q_len 1.

This module owns the attention math and the K/V write; it does not decide page assignment. The C++
kernel of `cpu_ffi.py` and the Pallas GPU kernels in `pallas_kernels/` implement the same contract;
`attention_backends.py` picks one and is the only module that calls them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so fully masked rows give zeros rather than NaNs


class AttentionMetadata(NamedTuple):
    slot_mapping: jax.Array  # [T] int32, where each token's K/V is written
    cu_q_lens: jax.Array  # [S + 1] int32
    kv_lens: jax.Array  # [S] int32
    block_tables: jax.Array  # [S, pages_per_seq] int32


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value; it has no infinity, and the cast of a larger value is NaN


def to_page_dtype(x, dtype):
    """Keys or values in the pages' dtype: rounded to nearest; for float8 e4m3 pages (scale 1.0) clipped
    to +-FP8_MAX first, so that an outlier saturates rather than becoming NaN."""
    if jnp.dtype(dtype) == jnp.float8_e4m3fn:
        x = jnp.clip(x.astype(jnp.float32), -FP8_MAX, FP8_MAX)
    return x.astype(dtype)


def write_kv(k_pages, v_pages, layer, k, v, slot_mapping):
    """Scatters this step's keys and values [T, num_kv_heads, head_dim] into the pages of `layer`."""
    page_size = k_pages.shape[2]
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    k_pages = k_pages.at[layer, page, offset].set(to_page_dtype(k, k_pages.dtype))
    v_pages = v_pages.at[layer, page, offset].set(to_page_dtype(v, v_pages.dtype))
    return k_pages, v_pages


def _gather_pages(pages, layer, page_ids):
    """Whole pages [..., num_pages_gathered] -> keys or values [..., num_keys, num_kv_heads, head_dim].

    Gathering page-sized slabs (page_size x KVH x D contiguous values) rather than single tokens keeps
    the copy few and large, which is what the CPU's memory system rewards.
    """
    gathered = pages[layer, page_ids]  # [..., num_pages_gathered, page_size, KVH, D]
    return gathered.reshape(*page_ids.shape[:-1], -1, *pages.shape[3:]).astype(jnp.float32)


def _key_range(first_pos, last_pos, kv_len, sliding_window, kv_tile: int):
    """First key tile and number of key tiles that queries at positions [first_pos, last_pos] need."""
    key_end = jnp.minimum(last_pos + 1, kv_len)
    key_start = jnp.where(sliding_window > 0, jnp.maximum(first_pos - sliding_window + 1, 0), 0)
    key_start = jnp.where(key_end > 0, key_start, 0)
    first_key_tile = key_start // kv_tile
    return first_key_tile, jnp.maximum(-(-key_end // kv_tile) - first_key_tile, 0)


def _online_softmax_step(carry, s, mask, v, out_spec: str):
    """One key tile of flash attention: masked scores s [..., k] and values v -> updated (m, l, acc)."""
    m, l, acc = carry
    s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    return m_new, l * alpha + p.sum(axis=-1), acc * alpha[..., None] + jnp.einsum(out_spec, p, v)


def _decode_row_attention(q, k_pages, v_pages, layer, md: AttentionMetadata, *, scale, sliding_window, soft_cap,
                          kv_tile: int, group_size: int = 8):
    """Attention of the rows of single-row sequences (decode rows): [S, H, D], zero for other sequences.

    Decode rows are compacted to the front and taken `group_size` at a time, in a loop whose trip count
    is the number of groups present (padding sequences and prompt chunks cost nothing here); inside a
    group the rows are vectorized over a loop on key tiles as long as the group's longest sequence.
    """
    num_seqs = md.kv_lens.shape[0]
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pages.shape[2], k_pages.shape[3]
    pages_per_key_tile = kv_tile // page_size
    group_size = min(group_size, num_seqs)
    is_row = (md.cu_q_lens[1:] - md.cu_q_lens[:-1]) == 1  # [S]
    order = jnp.argsort(~is_row, stable=True)  # decode rows first
    num_groups = -(-jnp.sum(is_row) // group_size)
    order = jnp.pad(order, (0, -num_seqs % group_size), constant_values=num_seqs)
    tables = jnp.pad(md.block_tables, ((0, 1), (0, pages_per_key_tile)))  # row S and reads past the end: page 0
    kv_lens = jnp.pad(md.kv_lens, (0, 1))
    rows = jnp.pad(jnp.clip(md.cu_q_lens[1:] - 1, 0, num_tokens - 1), (0, 1))
    is_row = jnp.pad(is_row, (0, 1))
    group = num_heads // num_kv_heads

    def one_group(g, out):
        seqs = jax.lax.dynamic_slice_in_dim(order, g * group_size, group_size)  # [Gs]; S = padding
        seqs = jnp.where(is_row[seqs], seqs, num_seqs)
        q_rows = (q[rows[seqs]].astype(jnp.float32) * scale).reshape(group_size, num_kv_heads, group, head_dim)
        pos = kv_lens[seqs] - 1  # [Gs]
        first_key_tile, num_key_tiles = _key_range(pos, pos, kv_lens[seqs], sliding_window, kv_tile)
        group_tables = tables[seqs]

        def body(j, carry):
            tile_index = first_key_tile + j  # [Gs]
            page_idx = tile_index[:, None] * pages_per_key_tile + jnp.arange(pages_per_key_tile)[None, :]
            page_ids = jnp.take_along_axis(group_tables, jnp.minimum(page_idx, tables.shape[1] - 1), axis=1)
            k = _gather_pages(k_pages, layer, page_ids)  # [Gs, Bk, KVH, D]
            v = _gather_pages(v_pages, layer, page_ids)
            s = jnp.einsum("shgd,skhd->shgk", q_rows, k)  # [Gs, KVH, G, Bk]
            if soft_cap:
                s = soft_cap * jnp.tanh(s / soft_cap)
            key_pos = tile_index[:, None] * kv_tile + jnp.arange(kv_tile)[None, :]  # [Gs, Bk]
            mask = (key_pos <= pos[:, None]) & (j < num_key_tiles)[:, None]
            mask &= (sliding_window <= 0) | (key_pos > pos[:, None] - sliding_window)
            return _online_softmax_step(carry, s, mask[:, None, None, :], v, "shgk,skhd->shgd")

        shape = (group_size, num_kv_heads, group)
        init = (jnp.full(shape, NEG_INF), jnp.zeros(shape), jnp.zeros(shape + (head_dim,)))
        _, l, acc = jax.lax.fori_loop(0, jnp.max(num_key_tiles), body, init)
        result = (acc / jnp.where(l > 0, l, 1.0)[..., None]).reshape(group_size, num_heads, head_dim)
        return out.at[seqs].set(result, mode="drop")

    return jax.lax.fori_loop(0, num_groups, one_group, jnp.zeros((num_seqs, num_heads, head_dim)))


def _chunk_attention(q, k_pages, v_pages, layer, md: AttentionMetadata, *, scale, sliding_window, soft_cap,
                     q_tile: int, kv_tile: int):
    """Attention of the rows of sequences with more than one query row (prompt chunks): [T, H, D].

    Tiles of q_tile query rows never span two sequences. A loop runs over the tiles that exist in this
    step (a traced trip count: padding costs nothing) and, inside, over the key tiles that tile
    needs, so the work follows sum(q_len x kv_len) of the chunks, not the padded shapes. Rows of
    single-row sequences are left zero (the last-row path computes them).
    """
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pages.shape[2], k_pages.shape[3]
    pages_per_key_tile = kv_tile // page_size
    q_lens = md.cu_q_lens[1:] - md.cu_q_lens[:-1]
    tiles_per_seq = jnp.where(q_lens > 1, -(-q_lens // q_tile), 0)
    cu_tiles = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(tiles_per_seq)])  # [S + 1]
    q_pad = jnp.pad(q.astype(jnp.float32) * scale, ((0, q_tile), (0, 0), (0, 0)))  # slices never clamp
    tables = jnp.pad(md.block_tables, ((0, 0), (0, pages_per_key_tile)))
    group = num_heads // num_kv_heads

    def tile(i, out):
        seq = jnp.searchsorted(cu_tiles, i, side="right") - 1
        first_row = md.cu_q_lens[seq] + (i - cu_tiles[seq]) * q_tile
        num_rows = jnp.minimum(q_tile, md.cu_q_lens[seq + 1] - first_row)
        first_pos = md.kv_lens[seq] - q_lens[seq] + (first_row - md.cu_q_lens[seq])
        q_pos = first_pos + jnp.arange(q_tile)  # [Bq]
        first_key_tile, num_key_tiles = _key_range(first_pos, first_pos + num_rows - 1, md.kv_lens[seq],
                                             sliding_window, kv_tile)
        q_rows = jax.lax.dynamic_slice_in_dim(q_pad, first_row, q_tile).reshape(q_tile, num_kv_heads, group,
                                                                                  head_dim)
        table = tables[seq]

        def key_tile(j, carry):
            tile_index = first_key_tile + j
            page_ids = jax.lax.dynamic_slice_in_dim(table, tile_index * pages_per_key_tile, pages_per_key_tile)
            k = _gather_pages(k_pages, layer, page_ids)  # [Bk, KVH, D]
            v = _gather_pages(v_pages, layer, page_ids)
            s = jnp.einsum("qhgd,khd->hgqk", q_rows, k)  # [KVH, G, Bq, Bk]
            if soft_cap:
                s = soft_cap * jnp.tanh(s / soft_cap)
            key_pos = tile_index * kv_tile + jnp.arange(kv_tile)
            mask = key_pos[None, :] <= q_pos[:, None]
            mask &= (sliding_window <= 0) | (key_pos[None, :] > q_pos[:, None] - sliding_window)
            return _online_softmax_step(carry, s, mask, v, "hgqk,khd->hgqd")

        shape = (num_kv_heads, group, q_tile)
        init = (jnp.full(shape, NEG_INF), jnp.zeros(shape), jnp.zeros(shape + (head_dim,)))
        _, l, acc = jax.lax.fori_loop(0, num_key_tiles, key_tile, init)
        result = (acc / jnp.where(l > 0, l, 1.0)[..., None]).transpose(2, 0, 1, 3).reshape(q_tile, num_heads, head_dim)
        old = jax.lax.dynamic_slice_in_dim(out, first_row, q_tile)
        keep = (jnp.arange(q_tile) < num_rows)[:, None, None]
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, result, old), first_row, 0)

    out = jax.lax.fori_loop(0, cu_tiles[-1], tile, jnp.zeros((num_tokens + q_tile, num_heads, head_dim)))
    return out[:num_tokens]


def ragged_paged_attention(
    q,  # [T, num_heads, head_dim]
    k_pages,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v_pages,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    layer,  # int32 scalar
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window=0,  # int or int32 scalar; 0 means none (the model passes each layer's own)
    soft_cap: float = 0.0,
    q_tile: int = 16,
    kv_tile: int = 128,
    decode_only: bool = False,
):
    """Causal attention of each query row over its sequence's paged keys; returns [T, H, D].

    Two flash-attention passes with an online softmax: decode rows (single-row sequences), vectorized
    a group of sequences at a time, and the tiles of multi-row chunks; both loop over only the groups,
    query tiles and key tiles that exist. decode_only (every sequence has at most one row) skips the
    second. Memory is O(q_tile x kv_tile); there are no key-length buckets.
    """
    num_tokens = q.shape[0]
    page_size = k_pages.shape[2]
    kv_tile = -(-kv_tile // page_size) * page_size  # whole pages
    kwargs = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, kv_tile=kv_tile)
    decode_rows = _decode_row_attention(q, k_pages, v_pages, layer, md, **kwargs)  # [S, H, D]
    if decode_only:
        out = jnp.zeros(q.shape, jnp.float32)
    else:
        out = _chunk_attention(q, k_pages, v_pages, layer, md, q_tile=min(q_tile, num_tokens), **kwargs)
    q_lens = md.cu_q_lens[1:] - md.cu_q_lens[:-1]
    rows = jnp.where(q_lens == 1, md.cu_q_lens[1:] - 1, num_tokens)  # other sequences' rows are dropped
    return out.at[rows].set(decode_rows, mode="drop").astype(q.dtype)
