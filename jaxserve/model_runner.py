"""The model runner: scheduled batch (host lists) -> numpy -> device arrays -> one compiled call.

It owns the params, the KV page array, the shape buckets and the compiled executables. Two entry
points, both the same step function (forward pass + on-device sampling) compiled per bucket:

  prefill: a ragged batch of prompt chunks and decode rows on one token axis, padded to a
           token-count bucket; attention in query tiles of `prefill_query_tile` rows.
  decode:  one token per sequence, padded to a batch-size bucket; attention tiles of one row.

Every bucket is compiled ahead of time (`warmup`), and `execute` only looks executables up: a
shape outside the buckets is a bug and raises, it never compiles at request time.
This module does not decide what runs (scheduler.py) or when a request ends (engine.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxserve import compilation
from jaxserve.attention import AttentionMetadata
from jaxserve.attention_backends import resolve_attention_backend, resolve_matmul_backend
from jaxserve.config import ModelConfig
from jaxserve.engine_config import EngineConfig
from jaxserve.models.transformer import (forward, init_kv_cache, kv_bytes_per_token, rope_position_tables,
                                         serving_params)
from jaxserve.sampling import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, SamplerOutput, SamplingParams, SamplingTensors, sample

logger = logging.getLogger(__name__)
DUMMY_PAGE = 0


def _powers_of_two(lo: int, hi: int) -> list[int]:
    buckets, size = [], lo
    while size < hi:
        buckets.append(size)
        size *= 2
    return buckets + [hi]


def prefill_buckets(cfg: EngineConfig) -> list[int]:
    """Token counts: powers of two from min_prefill_bucket up to max_num_batched_tokens."""
    return _powers_of_two(cfg.min_prefill_bucket, cfg.max_num_batched_tokens)


def decode_buckets(cfg: EngineConfig) -> list[int]:
    """Batch sizes: powers of two from min_decode_bucket up to max_num_seqs."""
    return _powers_of_two(min(cfg.min_decode_bucket, cfg.max_num_seqs), cfg.max_num_seqs)


def pick_bucket(buckets: list[int], size: int) -> int:
    assert size <= buckets[-1], f"{size=} exceeds the largest bucket {buckets[-1]}"
    return next(b for b in buckets if b >= size)


@dataclasses.dataclass
class ScheduledSeq:
    """One sequence's share of a step, as the scheduler hands it over (host ints and lists)."""

    token_ids: list[int]  # the new tokens of this step
    num_computed_tokens: int  # tokens already in the KV pages
    block_table: list[int]  # page ids, covering num_computed_tokens + len(token_ids)
    params: SamplingParams
    seed: int
    prompt_len: int = 0
    history: list[int] | None = None  # all token ids so far, only when penalties are on
    suppress_ids: tuple[int, ...] = ()  # ids banned this step (EOS and stop ids before min_tokens)


class StepInputs(NamedTuple):
    token_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    md: AttentionMetadata  # slot_mapping [T], cu_q_lens [S+1], kv_lens [S], block_tables [S, P]
    logits_indices: np.ndarray  # [S] int32, each sequence's last row
    sampling: SamplingTensors  # [S] rows


def _step(params, kv_cache, inputs: StepInputs, *, cfg: ModelConfig, q_tile: int, kv_tile: int,
          attention_backend: str, decode_only: bool = False):
    logits, kv_cache = forward(
        params, cfg, inputs.token_ids, inputs.positions, kv_cache, inputs.md, inputs.logits_indices,
        q_tile=q_tile, kv_tile=kv_tile, attention_backend=attention_backend, decode_only=decode_only,
    )
    return sample(logits, inputs.sampling), kv_cache


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, params, platform: str | None = None):
        """platform: resolve the attention backend for "gpu"/"cpu" instead of this machine (check-lowering)."""
        engine_cfg = engine_cfg.for_model(model_cfg.max_position_embeddings)
        self.model_cfg, self.cfg = model_cfg, engine_cfg
        self.attention_backend = resolve_attention_backend(engine_cfg.attention_backend, model_cfg, engine_cfg,
                                                           platform)
        self.matmul_backend = resolve_matmul_backend(engine_cfg.matmul_backend, engine_cfg, platform)
        self.params = self._serving_params(params)
        self.num_pages = self._num_pages()
        self.kv_cache = init_kv_cache(model_cfg, self.num_pages, engine_cfg.block_size, engine_cfg.dtype)
        self.prefill_buckets = prefill_buckets(engine_cfg)
        self.decode_buckets = decode_buckets(engine_cfg)
        step = functools.partial(_step, cfg=model_cfg, kv_tile=min(engine_cfg.kv_tile, engine_cfg.max_model_len),
                                 attention_backend=self.attention_backend)
        self._prefill = jax.jit(functools.partial(step, q_tile=engine_cfg.prefill_query_tile), donate_argnums=1)
        self._decode = jax.jit(functools.partial(step, q_tile=1, decode_only=True), donate_argnums=1)
        self._executables: dict[tuple[str, int], object] = {}
        # logit_bias entries, plus EOS and stop ids suppressed before min_tokens
        self.bias_width = MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + len(model_cfg.eos_token_ids)
        logger.info(
            "KV cache: %d pages of %d tokens (%d max concurrent tokens), %.1f MiB; %s attention, %s matmuls",
            self.num_pages - 1, engine_cfg.block_size, self.max_concurrent_tokens,
            self.kv_cache_bytes / 2**20, self.attention_backend, self.matmul_backend,
        )

    def _serving_params(self, params):
        """forward's layout (per-layer arrays, fused projections; packed for the C++ matmul when
        matmul_backend is "cpu"), with the rope tables of every position up to max_model_len. On a CPU
        the arrays are sliced as zero-copy numpy views and copied once (a jitted conversion took 3.5-4 s
        to compile and run for the default model); elsewhere the conversion runs on the device. Shapes
        only for check-lowering."""
        leaves = jax.tree.leaves(params)
        to_serving = functools.partial(serving_params, self.model_cfg, packed=self.matmul_backend == "cpu")
        rope = functools.partial(rope_position_tables, self.model_cfg, self.cfg.max_model_len)
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
            return jax.eval_shape(to_serving, params) | jax.eval_shape(rope)
        if all(device.platform == "cpu" for x in leaves for device in x.devices()):
            return jax.tree.map(jnp.asarray, to_serving(jax.tree.map(np.asarray, params))) | rope()
        return jax.jit(to_serving)(params) | rope()

    def _num_pages(self) -> int:
        """Pages in the array: the pool's pages plus the dummy page 0."""
        if self.cfg.num_kv_pages is not None:
            return self.cfg.num_kv_pages + 1
        per_page = kv_bytes_per_token(self.model_cfg, self.cfg.dtype) * self.cfg.block_size
        num_pages = self.cfg.kv_cache_memory_bytes // per_page
        if num_pages < 2:
            raise ValueError(
                f"kv_cache_memory_bytes={self.cfg.kv_cache_memory_bytes} holds {num_pages} pages of "
                f"{per_page} bytes; at least 2 are needed"
            )
        return int(num_pages)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(pages.nbytes for pages in self.kv_cache)

    @property
    def max_concurrent_tokens(self) -> int:
        return (self.num_pages - 1) * self.cfg.block_size

    # -- compilation ------------------------------------------------------------------------------

    def _input_shapes(self, kind: str, bucket: int) -> StepInputs:
        num_tokens = bucket
        num_seqs = bucket if kind == "decode" else min(bucket, self.cfg.max_num_seqs)
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        return StepInputs(
            token_ids=i32(num_tokens),
            positions=i32(num_tokens),
            md=AttentionMetadata(i32(num_tokens), i32(num_seqs + 1), i32(num_seqs),
                                 i32(num_seqs, self.cfg.pages_per_seq)),
            logits_indices=i32(num_seqs),
            sampling=jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self._empty_sampling(num_seqs)),
        )

    def _empty_sampling(self, num_seqs: int) -> SamplingTensors:
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
        )

    def warmup(self, show_progress: bool = True) -> dict:
        """Compiles every bucket of both entry points once; returns a summary."""
        start, hits = time.perf_counter(), compilation.num_cache_hits()
        todo = [("decode", b) for b in self.decode_buckets] + [("prefill", b) for b in self.prefill_buckets]
        todo = [key for key in todo if key not in self._executables]
        for kind, bucket in tqdm(todo, desc="compiling buckets", unit="exe", disable=not show_progress):
            self._executables[kind, bucket] = self.lower(kind, bucket).compile()
        summary = {
            "num_executables": len(self._executables),
            "prefill_buckets": self.prefill_buckets,
            "decode_buckets": self.decode_buckets,
            "seconds": time.perf_counter() - start,
            "num_cache_hits": compilation.num_cache_hits() - hits,  # loaded from the persistent cache
        }
        logger.info("compiled %d executables in %.1f s", summary["num_executables"], summary["seconds"])
        return summary

    def lower(self, kind: str, bucket: int, platforms: tuple[str, ...] | None = None):
        """Lowers one bucket's step function ("prefill" or "decode") for this machine or `platforms`."""
        fn = self._decode if kind == "decode" else self._prefill
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (self.params, self.kv_cache))
        traced = fn.trace(*shapes, self._input_shapes(kind, bucket))
        return traced.lower(lowering_platforms=platforms) if platforms else traced.lower()

    @property
    def compiled_shapes(self) -> list[tuple[str, int]]:
        return sorted(self._executables)

    # -- one step ---------------------------------------------------------------------------------

    def execute(self, seqs: list[ScheduledSeq],
                on_row_error: Callable[[int, Exception], None] | None = None) -> SamplerOutput:
        """Launches one step over the scheduled sequences; returns its (device) sampler output.

        The result is not waited for: callers can do host work while the device runs, then read it
        with `fetch`. on_row_error: if given, a sequence whose sampling row cannot be built runs as an
        inert greedy row and is reported (its index and the error) instead of failing the step.
        """
        assert seqs, "nothing scheduled"
        num_tokens = sum(len(s.token_ids) for s in seqs)
        if all(len(s.token_ids) == 1 for s in seqs) and len(seqs) <= self.cfg.max_num_seqs:
            kind, bucket = "decode", pick_bucket(self.decode_buckets, len(seqs))
            num_seqs = bucket
        else:
            kind, bucket = "prefill", pick_bucket(self.prefill_buckets, num_tokens)
            num_seqs = min(bucket, self.cfg.max_num_seqs)
        assert len(seqs) <= num_seqs, (len(seqs), num_seqs)
        inputs = self._build_inputs(seqs, num_tokens=bucket, num_seqs=num_seqs, on_row_error=on_row_error)
        if (kind, bucket) not in self._executables:
            self.warmup(show_progress=False)  # only before warm-up ran; afterwards every key exists
        output, self.kv_cache = self._executables[kind, bucket](self.params, self.kv_cache, inputs)
        return output

    @staticmethod
    def fetch(output: SamplerOutput, num_seqs: int, with_logprobs: bool) -> SamplerOutput:
        """Copies the sampled tokens (and logprobs only if some row asked) to the host."""
        if not with_logprobs:
            return SamplerOutput(np.asarray(output.token_ids)[:num_seqs], None, None, None)
        return SamplerOutput(*(np.asarray(a)[:num_seqs] for a in output))

    def _build_inputs(self, seqs: list[ScheduledSeq], num_tokens: int, num_seqs: int,
                      on_row_error: Callable[[int, Exception], None] | None = None) -> StepInputs:
        page_size = self.cfg.block_size
        token_ids = np.zeros(num_tokens, np.int32)
        positions = np.zeros(num_tokens, np.int32)
        slot_mapping = np.arange(num_tokens, dtype=np.int32) % page_size + DUMMY_PAGE * page_size
        cu_q_lens = np.zeros(num_seqs + 1, np.int32)
        kv_lens = np.zeros(num_seqs, np.int32)
        block_tables = np.full((num_seqs, self.cfg.pages_per_seq), DUMMY_PAGE, np.int32)
        sampling = self._empty_sampling(num_seqs)
        row = 0
        for i, s in enumerate(seqs):
            n = len(s.token_ids)
            pos = np.arange(s.num_computed_tokens, s.num_computed_tokens + n, dtype=np.int32)
            table = np.asarray(s.block_table, np.int32)
            token_ids[row:row + n] = s.token_ids
            positions[row:row + n] = pos
            slot_mapping[row:row + n] = table[pos // page_size] * page_size + pos % page_size
            block_tables[i, : len(table)] = table
            kv_lens[i] = s.num_computed_tokens + n
            try:
                self._fill_sampling_row(sampling, i, s)
            except Exception as e:  # noqa: BLE001 - handed to the caller, or re-raised
                if on_row_error is None:
                    raise
                for field, inert in zip(sampling, self._empty_sampling(1)):
                    field[i] = inert[0]
                on_row_error(i, e)
            row += n
            cu_q_lens[i + 1] = row
        cu_q_lens[len(seqs) + 1:] = row
        logits_indices = np.maximum(cu_q_lens[1:] - 1, 0)
        sampling.positions[:] = kv_lens
        md = AttentionMetadata(slot_mapping, cu_q_lens, kv_lens, block_tables)
        return StepInputs(token_ids, positions, md, logits_indices, sampling)

    def _fill_sampling_row(self, t: SamplingTensors, i: int, s: ScheduledSeq) -> None:
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
        if s.history is not None:
            t.history[i, : len(s.history)] = s.history
            t.prompt_lens[i] = s.prompt_len
