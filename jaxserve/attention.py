"""Paged attention in pure JAX: the CPU path, and the reference every Pallas kernel must match.

The KV page array is one preallocated pair of arrays per model,

    k_pages, v_pages: [num_layers, num_pages, page_size, num_kv_heads, head_dim]

sharded (later) on the kv-head axis. Page 0 is reserved: padded token rows write their K/V into it
and nothing ever reads it as a real page. A token's place in the pool is its *slot*,
`page * page_size + offset`.

The metadata follows the ragged paged attention contract (tpu-inference RPA v3): queries of several
sequences are flattened onto one token axis; sequence s owns rows `cu_q_lens[s]:cu_q_lens[s+1]`,
its keys are positions `0:kv_lens[s]` (the cached prefix plus this chunk, already written), read
through `block_tables[s]`. Padded sequences have q_len 0 and kv_len 0. Decode rows are q_len 1.

This module owns the attention math and the K/V write; it does not decide page assignment. The Pallas
GPU kernels in `pallas_kernels/` implement the same contract; `attention_backends.py` picks one.
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


def write_kv(k_pages, v_pages, layer, k, v, slot_mapping):
    """Scatters this step's keys and values [T, num_kv_heads, head_dim] into the pages of `layer`."""
    page_size = k_pages.shape[2]
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    k_pages = k_pages.at[layer, page, offset].set(k.astype(k_pages.dtype))
    v_pages = v_pages.at[layer, page, offset].set(v.astype(v_pages.dtype))
    return k_pages, v_pages


def _query_tiles(cu_q_lens, kv_lens, num_tokens: int, q_block: int):
    """Splits each sequence's query rows into tiles of `q_block` rows that never span two sequences.

    Returns, per tile: its sequence, its token rows [num_tiles, q_block] (num_tokens where padded),
    and the rows' positions. The tile count is a static upper bound; surplus tiles are all padding.
    """
    num_seqs = kv_lens.shape[0]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
    tiles_per_seq = -(-q_lens // q_block)
    cu_tiles = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(tiles_per_seq)])  # [S + 1]
    num_tiles = min(-(-num_tokens // q_block) + num_seqs, num_tokens)
    tile = jnp.arange(num_tiles)
    seq = jnp.clip(jnp.searchsorted(cu_tiles, tile, side="right") - 1, 0, num_seqs - 1)  # [NT]
    first_row = cu_q_lens[seq] + (tile - cu_tiles[seq]) * q_block
    rows = first_row[:, None] + jnp.arange(q_block)[None, :]  # [NT, q_block]
    valid = (tile < cu_tiles[-1])[:, None] & (rows < cu_q_lens[seq + 1][:, None])
    positions = kv_lens[seq][:, None] - q_lens[seq][:, None] + (rows - cu_q_lens[seq][:, None])
    rows = jnp.where(valid, rows, num_tokens)
    return seq, rows, positions, valid


def ragged_paged_attention(
    q,  # [T, num_heads, head_dim]
    k_pages,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v_pages,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    layer,  # int32 scalar
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window=0,  # int32 scalar; 0 means none (may differ per layer, so traced)
    soft_cap: float = 0.0,
    q_block: int = 16,
    kv_block: int = 128,
):
    """Causal attention of each query row over its sequence's paged keys; returns [T, H, D].

    Flash-attention style: query tiles x a loop over key blocks with an online softmax, so memory is
    O(tile x kv_block) and work follows the longest sequence actually present (the loop's trip count
    is traced, not a shape), with no key-length buckets.
    """
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pages.shape[2], k_pages.shape[3]
    group = num_heads // num_kv_heads
    q_block = min(q_block, num_tokens)
    seq, rows, q_pos, valid = _query_tiles(md.cu_q_lens, md.kv_lens, num_tokens, q_block)
    num_tiles = seq.shape[0]
    kv_len = md.kv_lens[seq]  # [NT]

    q_tiles = q.at[rows].get(mode="fill", fill_value=0).astype(jnp.float32) * scale
    q_tiles = q_tiles.reshape(num_tiles, q_block, num_kv_heads, group, head_dim)

    # Key range each tile needs: causal end, sliding-window start.
    last_pos = jnp.max(jnp.where(valid, q_pos, -1), axis=1)  # [NT]
    first_pos = jnp.min(jnp.where(valid, q_pos, jnp.iinfo(jnp.int32).max), axis=1)
    key_end = jnp.minimum(last_pos + 1, kv_len)
    key_start = jnp.where(sliding_window > 0, jnp.maximum(first_pos - sliding_window + 1, 0), 0)
    key_start = jnp.where(key_end > 0, key_start, 0)
    first_block = key_start // kv_block
    num_blocks = jnp.maximum(-(-key_end // kv_block) - first_block, 0)  # [NT]

    def body(j, carry):
        m, l, acc = carry
        key_pos = (first_block + j)[:, None] * kv_block + jnp.arange(kv_block)[None, :]  # [NT, Bk]
        page_idx = jnp.clip(key_pos // page_size, 0, md.block_tables.shape[1] - 1)
        page = jnp.take_along_axis(md.block_tables[seq], page_idx, axis=1)
        k = k_pages[layer, page, key_pos % page_size].astype(jnp.float32)  # [NT, Bk, KVH, D]
        v = v_pages[layer, page, key_pos % page_size].astype(jnp.float32)
        s = jnp.einsum("tqhgd,tkhd->thgqk", q_tiles, k)  # [NT, KVH, G, q_block, Bk]
        if soft_cap:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = (key_pos[:, None, :] <= q_pos[:, :, None]) & (key_pos < kv_len[:, None])[:, None, :]
        mask &= (sliding_window <= 0) | (key_pos[:, None, :] > q_pos[:, :, None] - sliding_window)
        mask &= valid[:, :, None]
        s = jnp.where(mask[:, None, None], s, NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(mask[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("thgqk,tkhd->thgqd", p, v)
        return m_new, l, acc

    shape = (num_tiles, num_kv_heads, group, q_block)
    init = (jnp.full(shape, NEG_INF), jnp.zeros(shape), jnp.zeros(shape + (head_dim,)))
    _, l, acc = jax.lax.fori_loop(0, jnp.max(num_blocks), body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [NT, KVH, G, q_block, D]
    out = out.transpose(0, 3, 1, 2, 4).reshape(num_tiles * q_block, num_heads, head_dim)
    result = jnp.zeros((num_tokens, num_heads, head_dim), q.dtype)
    return result.at[rows.reshape(-1)].set(out.astype(q.dtype), mode="drop")
