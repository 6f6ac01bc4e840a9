"""Builds paged-attention inputs for tests: page assignment, slot mapping, `AttentionMetadata`.

A test describes one forward call as a list of `SeqChunk`s, one per sequence (the tokens new in this
call, how many of the sequence's tokens are already cached, its block table), and `make_batch` lays
them out the way the model runner does (see the contract in `jaxserve/ops/attention.py`): new tokens
flattened onto one token axis, padding tokens at the end writing into page 0, padded sequences with
q_len 0 and kv_len 0. Nothing here runs the model.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax.numpy as jnp
import numpy as np

from jaxserve.ops.attention import AttentionMetadata


@dataclasses.dataclass(frozen=True)
class SeqChunk:
    token_ids: Sequence[int]  # this call's new tokens
    num_cached: int  # tokens of this sequence already written to its pages
    page_table: Sequence[int]  # its pages, in position order


class Batch(NamedTuple):
    token_ids: jnp.ndarray  # [T] int32
    positions: jnp.ndarray  # [T] int32
    md: AttentionMetadata
    logits_indices: jnp.ndarray  # [T] int32: every row, so a test can compare all positions
    rows: list[np.ndarray]  # per real sequence, its rows on the token axis


def assign_pages(seq_lens: Sequence[int], page_size: int, num_pages: int, seed: int = 0) -> list[list[int]]:
    """Shuffled, non-contiguous pages for each sequence, never page 0 (the reserved dummy page)."""
    pages_needed = [-(-n // page_size) for n in seq_lens]
    assert sum(pages_needed) <= num_pages - 1, f"{num_pages=} is too small for {seq_lens=}"
    pool = (np.random.default_rng(seed).permutation(num_pages - 1) + 1).tolist()
    tables = []
    for n in pages_needed:
        tables.append(pool[:n])
        pool = pool[n:]
    return tables


def slot(page_table: Sequence[int], position: int, page_size: int) -> int:
    return page_table[position // page_size] * page_size + position % page_size


def make_batch(
    chunks: Sequence[SeqChunk],
    *,
    page_size: int,
    pages_per_seq: int,
    num_tokens: int,
    num_seqs: int,
) -> Batch:
    """One forward call's inputs, padded to `num_tokens` rows and `num_seqs` sequences."""
    assert len(chunks) <= num_seqs
    token_ids, positions, slot_mapping, rows = [], [], [], []
    cu_q_lens, kv_lens = [0], []
    block_tables = np.zeros((num_seqs, pages_per_seq), np.int32)
    for s, chunk in enumerate(chunks):
        q_len = len(chunk.token_ids)
        kv_len = chunk.num_cached + q_len
        assert len(chunk.page_table) * page_size >= kv_len, f"sequence {s} needs more pages"
        assert 0 not in chunk.page_table, "page 0 is the dummy page"
        new_positions = range(chunk.num_cached, kv_len)
        rows.append(np.arange(cu_q_lens[-1], cu_q_lens[-1] + q_len))
        token_ids += list(chunk.token_ids)
        positions += list(new_positions)
        slot_mapping += [slot(chunk.page_table, p, page_size) for p in new_positions]
        cu_q_lens.append(cu_q_lens[-1] + q_len)
        kv_lens.append(kv_len)
        block_tables[s, : len(chunk.page_table)] = chunk.page_table
    num_padding = num_tokens - len(token_ids)
    assert num_padding >= 0, f"{len(token_ids)=} tokens do not fit in {num_tokens=}"
    token_ids += [0] * num_padding
    positions += [0] * num_padding
    slot_mapping += [i % page_size for i in range(num_padding)]  # all inside page 0
    cu_q_lens += [cu_q_lens[-1]] * (num_seqs - len(chunks))
    kv_lens += [0] * (num_seqs - len(chunks))
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slot_mapping, jnp.int32),
        cu_q_lens=jnp.asarray(cu_q_lens, jnp.int32),
        kv_lens=jnp.asarray(kv_lens, jnp.int32),
        block_tables=jnp.asarray(block_tables),
    )
    return Batch(
        token_ids=jnp.asarray(token_ids, jnp.int32),
        positions=jnp.asarray(positions, jnp.int32),
        md=md,
        logits_indices=jnp.arange(num_tokens, dtype=jnp.int32),
        rows=rows,
    )
