"""A step's inputs: the scheduled sequences (host ints and lists) -> the numpy arrays of one bucket.

The scheduler hands over one `ScheduledSeq` per sequence; `StepInputBuilder.build` lays them out
the way the compiled step reads them (the ragged attention contract of `attention.py`: new tokens
flattened on one token axis, `cu_q_lens`, `kv_lens`, the KV slot of each token), everything padded to
the bucket: padding tokens write into the dummy page 0, padding sequences have no tokens. Each
sequence's page table and sampling settings live on the device in its row of the persistent batch
(`device_batch.py`): the step names each sequence's row (its `req_index`), and carries `RowUpdates`
only for the rows whose state changed (`ScheduledSeq.write_row`). `model_runner.py` then hands the arrays to the executable;
nothing here touches a device.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.ops.attention import AttentionMetadata
from jaxserve.config.model_config import ModelConfig
from jaxserve.runner.device_batch import RowUpdates
from jaxserve.config.engine_config import EngineConfig
from jaxserve.ops.sampling import SamplingTensors
from jaxserve.config.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, SamplingParams

DUMMY_PAGE = 0


@dataclasses.dataclass
class ScheduledSeq:
    """One sequence's share of a step, as the scheduler hands it over (host ints and lists)."""

    token_ids: list[int]  # the new tokens of this step
    num_computed_tokens: int  # tokens already in the KV pages
    page_table: list[int]  # page ids, covering num_computed_tokens + len(token_ids)
    params: SamplingParams
    seed: int
    prompt_len: int = 0
    history: list[int] | None = None  # all token ids so far, only when penalties are on
    suppress_ids: tuple[int, ...] = ()  # ids banned this step (EOS and stop ids before min_tokens)
    # Asynchronous scheduling: the last of token_ids is a placeholder for the token row prev_row of the
    # previous step sampled, which the host has not read yet (the step takes it on the device)
    prev_row: int | None = None
    samples: bool = True  # its sampled token is real (not a prompt chunk short of the prompt's end)
    # Its row in the device batch, and what of that row to write first (its settings and page table;
    # its history too, when it takes the row: `history`, if penalties are on, or nothing).
    # req_index None: its index in the step, everything written.
    req_index: int | None = None
    write_row: bool = True
    write_history: bool = True
    lora_slot: int = 0  # the device slot of its LoRA adapter (runner/lora_slots.py); 0: the base model


class StepInputs(NamedTuple):
    token_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    # slot_mapping [T], cu_q_lens [S+1], kv_lens [S]; block_tables [S, P] None on the host: the step
    # gathers them from the device batch
    md: AttentionMetadata
    logits_indices: np.ndarray  # [S] int32, each sequence's last row
    sampling: SamplingTensors | None  # [S] rows: None on the host, gathered on the device likewise
    prev_rows: np.ndarray  # [T] int32: r >= 0 = this token is the one row r of the previous step sampled
    req_indices: np.ndarray | None = None  # [S] int32: each sequence's row in the device batch
    samples: np.ndarray | None = None  # [S] bool: the row's sampled token is real
    row_updates: RowUpdates | None = None  # written before the step (not an input of its executable)
    lora_mask: np.ndarray | None = None  # [T, S * r]: built on the device from the rows' adapter slots (ops/lora.py)


def pack(inputs: StepInputs) -> tuple[np.ndarray, np.ndarray]:
    """A step's nine small host arrays as the two its executable takes: per token [T, 4] (token_ids,
    positions, slot_mapping, prev_rows) and per sequence [S + 1, 5] (cu_q_lens, then kv_lens,
    logits_indices, req_indices, samples, each padded by one). On a GPU every host array an executable
    takes is its own host-to-device copy; the H100's numpy inputs cost about 3 ms a step (11.6 against
    8.7 ms per replay with the inputs already on the device).

    Fields are columns, not rows: a row of a row-major array is a contiguous run that XLA:GPU hands to a
    custom call as an address inside the array, and the Pallas kernels' Mosaic GPU calls refuse an input
    not aligned to 256 bytes (kv_lens, row 1 of a [5, S + 1] array, failed so on an H200). A column is
    strided, so XLA copies it into an aligned buffer of its own (`pallas_kernels.lowering.misaligned_views`
    checks the lowered steps)."""
    md, num_seqs = inputs.md, len(inputs.md.kv_lens)
    tokens = np.stack([inputs.token_ids, inputs.positions, md.slot_mapping, inputs.prev_rows], axis=1)
    seqs = np.zeros((num_seqs + 1, 5), np.int32)
    seqs[:, 0] = md.cu_q_lens
    for column, values in enumerate((md.kv_lens, inputs.logits_indices, inputs.req_indices, inputs.samples), 1):
        seqs[:num_seqs, column] = values
    return tokens.astype(np.int32), seqs


def unpack(tokens: jax.Array, seqs: jax.Array) -> StepInputs:
    """`pack`'s inverse, inside the step (sampling and page tables come from the device batch)."""
    num_seqs = seqs.shape[0] - 1
    return StepInputs(token_ids=tokens[:, 0], positions=tokens[:, 1],
                      md=AttentionMetadata(tokens[:, 2], seqs[:, 0], seqs[:num_seqs, 1], None),
                      logits_indices=seqs[:num_seqs, 2], sampling=None, prev_rows=tokens[:, 3],
                      req_indices=seqs[:num_seqs, 3], samples=seqs[:num_seqs, 4] != 0)


def packed_shapes(num_tokens: int, num_seqs: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    return jax.ShapeDtypeStruct((num_tokens, 4), jnp.int32), jax.ShapeDtypeStruct((num_seqs + 1, 5), jnp.int32)


class StepInputBuilder:
    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig):
        self.model_cfg, self.cfg = model_cfg, engine_cfg
        # logit_bias entries, plus EOS and stop ids suppressed before min_tokens
        self.bias_width = MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + len(model_cfg.eos_token_ids)

    @property
    def bitmask_words(self) -> int:
        return -(-self.model_cfg.vocab_size // 32)

    @property
    def num_rows(self) -> int:
        """Rows of the device batch: one per sequence a step can hold, and the padding rows' last."""
        return self.cfg.max_num_seqs + 1

    @property
    def update_buckets(self) -> list[int]:
        """Row updates are padded to a power of two (one small executable each, compiled at warm-up)."""
        return [1 << i for i in range((self.cfg.max_num_seqs - 1).bit_length() + 1)]

    def initial_state(self) -> tuple[np.ndarray, SamplingTensors, np.ndarray, np.ndarray | None]:
        """The device batch's host arrays (`device_batch.BatchState`): every row inert (the base model)."""
        return (np.full((self.num_rows, self.cfg.pages_per_seq), DUMMY_PAGE, np.int32),
                self.empty_sampling(self.num_rows), np.zeros(self.cfg.max_num_seqs, np.int32),
                np.zeros(self.num_rows, np.int32) if self.cfg.enable_lora else None)

    def shapes(self, num_tokens: int, num_seqs: int) -> StepInputs:
        """ShapeDtypeStructs of a bucket's inputs, for compiling it."""
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        return StepInputs(
            token_ids=i32(num_tokens),
            positions=i32(num_tokens),
            md=AttentionMetadata(i32(num_tokens), i32(num_seqs + 1), i32(num_seqs), None),
            logits_indices=i32(num_seqs),
            sampling=None,
            prev_rows=i32(num_tokens),
            req_indices=i32(num_seqs),
            samples=jax.ShapeDtypeStruct((num_seqs,), jnp.bool_),
        )

    def update_shapes(self, num_updates: int) -> RowUpdates:
        """ShapeDtypeStructs of `num_updates` row updates, for compiling their writer."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self._empty_updates(num_updates))

    def _empty_updates(self, num_updates: int) -> RowUpdates:
        return RowUpdates(np.full(num_updates, self.num_rows, np.int32),  # out of range: dropped
                          np.full((num_updates, self.cfg.pages_per_seq), DUMMY_PAGE, np.int32),
                          self.empty_sampling(num_updates), np.full(num_updates, -1, np.int32),
                          np.zeros(num_updates, np.int32) if self.cfg.enable_lora else None)

    def empty_sampling(self, num_seqs: int) -> SamplingTensors:
        """Host arrays for `num_seqs` inert rows (greedy, everything off)."""
        f32 = lambda value: np.full(num_seqs, value, np.float32)  # noqa: E731
        return SamplingTensors(
            temperature=f32(0.0), top_k=np.zeros(num_seqs, np.int32), top_p=f32(1.0), min_p=f32(0.0),
            presence_penalty=f32(0.0), frequency_penalty=f32(0.0), repetition_penalty=f32(1.0),
            seeds=np.zeros(num_seqs, np.uint32), positions=np.zeros(num_seqs, np.int32),
            bias_ids=np.full((num_seqs, self.bias_width), self.model_cfg.vocab_size, np.int32),
            bias_values=np.zeros((num_seqs, self.bias_width), np.float32),
            history=np.full((num_seqs, self.cfg.max_model_len), -1, np.int32),
            prompt_lens=np.zeros(num_seqs, np.int32), want_logprobs=np.zeros(num_seqs, np.bool_),
            token_bitmask=np.full((num_seqs, self.bitmask_words), -1, np.int32),
        )

    def build(self, seqs: list[ScheduledSeq], num_tokens: int, num_seqs: int,
              on_row_error: Callable[[int, Exception], None] | None = None) -> StepInputs:
        """The inputs of `seqs`, padded to num_tokens tokens and num_seqs sequences, with the updates of
        the rows that changed. on_row_error: a sequence whose row cannot be built runs in the inert
        padding row and is reported, instead of raising."""
        page_size = self.cfg.page_size
        token_ids = np.zeros(num_tokens, np.int32)
        positions = np.zeros(num_tokens, np.int32)
        slot_mapping = np.arange(num_tokens, dtype=np.int32) % page_size + DUMMY_PAGE * page_size
        cu_q_lens = np.zeros(num_seqs + 1, np.int32)
        kv_lens = np.zeros(num_seqs, np.int32)
        prev_rows = np.full(num_tokens, -1, np.int32)
        req_indices = np.full(num_seqs, self.num_rows - 1, np.int32)
        samples = np.zeros(num_seqs, np.bool_)
        writes = [i for i, s in enumerate(seqs) if s.write_row or s.req_index is None]
        updates = self._empty_updates(next(b for b in self.update_buckets if b >= len(writes))) if writes else None
        row = 0
        for i, s in enumerate(seqs):
            n = len(s.token_ids)
            if n == 1:  # a decode row: plain ints (numpy's per-call cost is most of a row's time)
                pos = s.num_computed_tokens
                token_ids[row], positions[row] = s.token_ids[0], pos
                slot_mapping[row] = s.page_table[pos // page_size] * page_size + pos % page_size
            else:
                pos = np.arange(s.num_computed_tokens, s.num_computed_tokens + n, dtype=np.int32)
                token_ids[row:row + n] = s.token_ids
                positions[row:row + n] = pos
                pages = np.asarray(s.page_table, np.int32)[pos // page_size]
                slot_mapping[row:row + n] = pages * page_size + pos % page_size
            kv_lens[i] = s.num_computed_tokens + n
            samples[i] = s.samples
            if s.prev_row is not None:
                prev_rows[row + n - 1] = s.prev_row
            req_indices[i] = i if s.req_index is None else s.req_index
            row += n
            cu_q_lens[i + 1] = row
        for u, i in enumerate(writes):
            try:
                self.fill_update(updates, u, seqs[i], int(req_indices[i]))
            except Exception as e:  # noqa: BLE001 - handed to the caller, or re-raised
                if on_row_error is None:
                    raise
                for field, inert in zip(jax.tree.leaves(updates), jax.tree.leaves(self._empty_updates(1))):
                    field[u] = inert[0]
                req_indices[i] = self.num_rows - 1
                on_row_error(i, e)
        cu_q_lens[len(seqs) + 1:] = row
        logits_indices = np.maximum(cu_q_lens[1:] - 1, 0)
        md = AttentionMetadata(slot_mapping, cu_q_lens, kv_lens, None)
        return StepInputs(token_ids, positions, md, logits_indices, None, prev_rows, req_indices, samples, updates)

    def fill_update(self, updates: RowUpdates, u: int, s: ScheduledSeq, req_index: int) -> None:
        """Update u: sequence s's settings and page table, for the row `req_index` (its history if it takes
        the row)."""
        updates.req_indices[u] = req_index
        updates.block_tables[u, :len(s.page_table)] = s.page_table
        self.fill_sampling_row(updates.sampling, u, s)
        if updates.lora_slots is not None:
            updates.lora_slots[u] = s.lora_slot
        if s.write_history or s.req_index is None:
            updates.history_lens[u] = 0 if s.history is None else len(s.history)

    def fill_sampling_row(self, t: SamplingTensors, i: int, s: ScheduledSeq) -> None:
        """Row i of the sampling arrays from sequence s's parameters."""
        p = s.params
        top_k = min(p.top_k, self.model_cfg.vocab_size)  # any larger k keeps the whole vocabulary
        t.temperature[i], t.top_k[i], t.top_p[i], t.min_p[i] = p.temperature, top_k, p.top_p, p.min_p
        t.presence_penalty[i], t.frequency_penalty[i] = p.presence_penalty, p.frequency_penalty
        t.repetition_penalty[i], t.seeds[i] = p.repetition_penalty, s.seed
        t.want_logprobs[i] = p.logprobs is not None
        bias = dict(p.logit_bias or {})
        for token in s.suppress_ids:
            bias[token] = -np.inf
        if bias:
            t.bias_ids[i, : len(bias)] = list(bias)
            t.bias_values[i, : len(bias)] = list(bias.values())
        t.prompt_lens[i] = s.prompt_len
        if s.history is not None:
            t.history[i, : len(s.history)] = s.history
