"""The persistent device batch: each running sequence's per-row state lives on the device, in the row
at its `req_index` (vLLM's name for a request's row of its persistent batch).

A step's rows change little from one step to the next: the same requests, the same sampling settings,
a page table that gains a page every `page_size` tokens. So the sampling settings, seeds, logit-bias
rows, page tables (`block_tables`) and penalty histories sit in `BatchState`, one row per running
sequence (plus one inert row for padding), carried and donated from step to step like the KV pages.
The host writes only rows that changed (`RowUpdates`, applied by `write_rows` before the step: a newly
placed sequence, a page table cut back, EOS unbanned at min_tokens) and a penalty history only when a
sequence takes a row; the step records the page each of its tokens lands in (`record_pages`), so a page
table that grows needs no row write, gathers its rows by req_index (`gather`) and appends each sampled
token to its row's history itself (`append_tokens`), so the host never sends a history again. It also keeps
the step's sampled tokens (`last_tokens`), which asynchronous scheduling feeds to the next step.

`ReqIndices` is the host's side: which sequence holds which row, and what of its row the device has.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.ops.sampling import SamplingTensors


class BatchState(NamedTuple):
    """Per row (req_index), on the device; row num_rows - 1 is the inert row of padding (greedy, dummy pages)."""

    block_tables: jax.Array  # [num_rows, pages_per_seq] int32: each row's page table
    sampling: SamplingTensors  # [num_rows] rows (`positions` unused: each step gives its own)
    last_tokens: jax.Array  # [max_num_seqs] int32: the latest step's sampled tokens, by row
    lora_slots: jax.Array | None = None  # [num_rows] int32: each row's LoRA adapter slot (0: none); enable_lora only


class RowUpdates(NamedTuple):
    """Rows to write before a step, padded to a bucket of U rows: `req_indices` [U] (num_rows for
    padding, dropped), the rows' page tables [U, P] and sampling settings [U]. A row's history is written
    only where `history_lens` [U] >= 0: its first history_lens entries are the tokens so far, the rest -1."""

    req_indices: np.ndarray
    block_tables: np.ndarray
    sampling: SamplingTensors
    history_lens: np.ndarray
    lora_slots: np.ndarray | None = None  # [U] int32: the rows' LoRA adapter slots (enable_lora only)


def write_rows(state: BatchState, updates: RowUpdates) -> BatchState:
    """`state` with the updated rows written (donated, so in place)."""
    req_indices = updates.req_indices

    def put(table, rows):
        return table.at[req_indices].set(rows, mode="drop")

    sampling = jax.tree.map(put, state.sampling._replace(history=None), updates.sampling._replace(history=None))
    keep = (updates.history_lens < 0)[:, None]
    current = state.sampling.history[jnp.minimum(req_indices, state.sampling.history.shape[0] - 1)]
    history = put(state.sampling.history, jnp.where(keep, current, updates.sampling.history))
    lora_slots = None if state.lora_slots is None else put(state.lora_slots, updates.lora_slots)
    return state._replace(block_tables=put(state.block_tables, updates.block_tables),
                          sampling=sampling._replace(history=history), lora_slots=lora_slots)


def record_pages(state: BatchState, req_indices, cu_q_lens, positions, slot_mapping, page_size: int) -> BatchState:
    """Writes the page each of the step's tokens lands in into its row's page table: the token at
    position p of step row s (rows by `cu_q_lens`) goes to slot `slot_mapping`, so page slot // page_size
    is column p // page_size of row req_indices[s]. A page table's new page thus reaches the device with
    the first token written into it, and a grown table costs no row write (the attention reads no page
    before a token lands in it). Padding tokens, past cu_q_lens[-1], and the padding row are left alone."""
    tables = state.block_tables
    num_rows = tables.shape[0]
    tokens = jnp.arange(slot_mapping.shape[0], dtype=cu_q_lens.dtype)
    # compare_all: no while loop (on a GPU each of its iterations would wait on the host)
    step_rows = jnp.searchsorted(cu_q_lens[1:], tokens, side="right", method="compare_all")
    step_rows = jnp.minimum(step_rows, req_indices.shape[0] - 1)
    rows = req_indices[step_rows]
    rows = jnp.where((tokens < cu_q_lens[-1]) & (rows < num_rows - 1), rows, num_rows)  # out of range: dropped
    return state._replace(block_tables=tables.at[rows, positions // page_size].set(slot_mapping // page_size,
                                                                                    mode="drop"))


def gather(state: BatchState, req_indices, kv_lens) -> tuple[jax.Array, SamplingTensors]:
    """The step's page tables [S, P] and sampling rows [S] (step row i from device row req_indices[i])."""
    sampling = jax.tree.map(lambda table: table[req_indices], state.sampling)
    return state.block_tables[req_indices], sampling._replace(positions=kv_lens)


def append_tokens(state: BatchState, req_indices, kv_lens, appends, sampled, rows: SamplingTensors) -> BatchState:
    """Records the step's sampled tokens [S]: in `last_tokens`, and at position kv_len of the history of
    each penalty row whose token is real (`appends`: not a prompt chunk short of the prompt's end)."""
    uses_penalties = (rows.presence_penalty != 0) | (rows.frequency_penalty != 0) | (rows.repetition_penalty != 1)
    history = state.sampling.history
    cols = jnp.where(appends & uses_penalties, kv_lens, history.shape[1])  # out of range: dropped
    history = history.at[req_indices, cols].set(sampled, mode="drop")
    return state._replace(sampling=state.sampling._replace(history=history),
                          last_tokens=jax.lax.dynamic_update_slice(state.last_tokens, sampled, (0,)))


@dataclasses.dataclass
class _Held:
    req_index: int
    version: Hashable  # what the device's row was written from


class ReqIndices:
    """The host's map of the device batch's rows: `place` gives each scheduled sequence its row (its
    req_index) and says whether the row (and its history) must be written. Rows of sequences gone
    (finished, preempted) are taken back when a new one needs a row; the last row is padding's and never
    given out."""

    def __init__(self, num_rows: int):
        self.padding_index = num_rows - 1
        self._free = list(range(num_rows - 1))[::-1]
        self._held: dict[Hashable, _Held] = {}

    @property
    def num_held(self) -> int:
        return len(self._held)

    def place(self, key: Hashable, version: Hashable, is_live) -> tuple[int, bool, bool]:
        """(req_index, write the row, write its history) for the sequence `key` whose row is now `version`.
        is_live(key): whether a held row's sequence still runs (others' rows may be taken back)."""
        held = self._held.get(key)
        if held is not None:
            changed = held.version != version
            held.version = version
            return held.req_index, changed, False
        if not self._free:
            for gone in [k for k in self._held if not is_live(k)]:
                self._free.append(self._held.pop(gone).req_index)
        assert self._free, "more running sequences than rows of the device batch"
        self._held[key] = _Held(self._free.pop(), version)
        return self._held[key].req_index, True, True

    def release(self, key: Hashable) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self._free.append(held.req_index)
