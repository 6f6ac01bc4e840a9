"""The model runner: scheduled batch -> step inputs (`step_inputs.py`) -> one compiled call.

It owns the params, the KV page array, the shape buckets and the compiled executables (on one device,
or split over a mesh by `tensor_parallel.py`). Two entry
points, both the same step function (forward pass + on-device sampling) compiled per bucket:

  prefill: a ragged batch of prompt chunks and decode rows on one token axis, padded to a
           token-count bucket; attention in query tiles of `prefill_query_tile` rows.
  decode:  one token per sequence, padded to a batch-size bucket; attention tiles of one row.

Every bucket is compiled ahead of time (`warmup`), and `execute` only looks executables up: a
shape outside the buckets is a bug and raises, it never compiles at request time.
This module does not decide what runs (scheduler.py) or when a request ends (engine.py).
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config.buckets import pick_bucket
from jaxserve.config.device_defaults import MemoryUse
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.model_config import ModelConfig
from jaxserve.models.transformer import forward, init_kv_cache, rope_position_tables, serving_params
from jaxserve.ops.sampling import PromptLogprobs, SamplerOutput, sample
from jaxserve.parallel.tensor_parallel import TensorParallel
from jaxserve.runner import compilation, device_batch, lora_slots, prompt_logprobs, step_inputs
from jaxserve.runner.device_batch import BatchState
from jaxserve.runner.resolve import ResolvedConfig, resolve_config, size_pool
from jaxserve.runner.step_inputs import ScheduledSeq, StepInputBuilder, StepInputs
from jaxserve.weights import lazy

logger = logging.getLogger(__name__)


def _bytes_on_first_device(tree) -> int:
    leaves = jax.tree.leaves(tree)
    if not leaves or not hasattr(leaves[0], "addressable_shards"):
        return sum(x.size * x.dtype.itemsize for x in leaves)  # shapes only (check-lowering)
    device = leaves[0].addressable_shards[0].device
    return sum(shard.data.nbytes for x in leaves for shard in x.addressable_shards if shard.device == device)


def _step(params, kv_cache, inputs: StepInputs, *, cfg: ModelConfig, q_tile: int, kv_tile: int,
          attention_backend: str, decode_only: bool = False, sampler_branches: bool = True,
          sampler_kernel: bool = False, return_hidden: bool = False, lora_rank: int | None = None):
    logits, kv_cache, *hidden = forward(
        params, cfg, inputs.token_ids, inputs.positions, kv_cache, inputs.md, inputs.logits_indices,
        q_tile=q_tile, kv_tile=kv_tile, attention_backend=attention_backend, decode_only=decode_only,
        return_hidden=return_hidden, lora_mask=inputs.lora_mask, lora_branches=sampler_branches, lora_rank=lora_rank,
    )
    return sample(logits, inputs.sampling, sampler_branches, sampler_kernel), kv_cache, *hidden


def _batch_step(params, kv_cache, state: BatchState, packed: tuple[jax.Array, jax.Array], *, step: Callable,
                page_size: int, lora: tuple[int, int, bool] | None = None):
    """`step` over the persistent device batch (`device_batch.py`): each sequence's page table and
    sampling settings come from its row there (its req_index), the pages its tokens land in recorded
    first (`record_pages`), a token whose `prev_rows` entry is r >= 0 is the one row r of the previous
    step sampled (asynchronous scheduling: the host has not read it),
    and the sampled tokens go back into the state; lora (max_loras, max_lora_rank, C++ kernel): each token
    runs with its row's adapter slot (lora_slots.py). `packed`: the step's inputs as `step_inputs.pack` gives them. Returns
    (sampler output, kv_cache, state), and the last layer's output [T, hidden] where `step` gives it."""
    inputs = step_inputs.unpack(*packed)
    token_ids = jnp.where(inputs.prev_rows >= 0, state.last_tokens[jnp.maximum(inputs.prev_rows, 0)],
                          inputs.token_ids)
    state = device_batch.record_pages(state, inputs.req_indices, inputs.md.cu_q_lens, inputs.positions,
                                      inputs.md.slot_mapping, page_size)
    block_tables, rows = device_batch.gather(state, inputs.req_indices, inputs.md.kv_lens)
    lora_mask = None if lora is None else lora_slots.step_mask(state.lora_slots[inputs.req_indices],
                                                               inputs.md.cu_q_lens, len(token_ids), *lora)
    sampled, kv_cache, *hidden = step(params, kv_cache, inputs._replace(
        token_ids=token_ids, md=inputs.md._replace(block_tables=block_tables), sampling=rows, lora_mask=lora_mask))
    state = device_batch.append_tokens(state, inputs.req_indices, inputs.md.kv_lens, inputs.samples,
                                       sampled.token_ids, rows)
    return sampled, kv_cache, state, *hidden


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig | ResolvedConfig, params, platform: str | None = None,
                 draw: Callable[[], dict] | None = None):
        """cfg: the engine's resolved settings (`resolve.resolve_config`); given an EngineConfig, they are
        resolved here, for this machine or `platform` ("gpu"/"cpu": check-lowering). draw: params not made
        yet (`LoadedModel.draw`; `params` are their shapes), drawn in the serving layout on the device."""
        resolved = cfg if isinstance(cfg, ResolvedConfig) else resolve_config(cfg, model_cfg, platform=platform)
        self.model_cfg = model_cfg
        # Under tensor parallelism each device runs device_cfg's share of the model (tensor_parallel.py).
        self.parallel = TensorParallel(model_cfg, resolved.layout.tp, resolved.layout) if resolved.layout else None
        self.mesh = self.parallel.mesh if self.parallel else None
        self.device_cfg = resolved.device_model
        self._take(resolved)
        self.params = self._serving_params(params, draw)
        # LoRA adapters: every slot's A and B in params["lora"], each row's slot in the device batch
        self.lora = lora_slots.LoRASlots(model_cfg, self.cfg, self.parallel, self.matmul_backend) if self.cfg.enable_lora else None
        if self.lora:
            self.params = self.lora.attach(self.params)
        # What this process read of LazyTensor params (its devices' slices) out of the whole model's bytes
        self.weight_bytes_read, self.weight_bytes_total = lazy.bytes_read(params), lazy.total_bytes(params)
        # What each device holds (all of it on one device): weights with rope tables and replicated norms
        self.device_weight_bytes = _bytes_on_first_device(self.params)
        step = functools.partial(_step, cfg=model_cfg)
        jit = functools.partial(jax.jit, donate_argnums=(1, 2))
        if self.parallel:
            step, jit = self.parallel.step, self.parallel.jit
        # LoRA through the C++ kernel where the C++ matmul runs (its kernels are built), else XLA's masked dots
        lora_kernel = bool(self.lora) and self.matmul_backend in ("cpu", "cpu-bf16")
        step = functools.partial(step, kv_tile=resolved.kv_tile, attention_backend=self.attention_backend,
                                 sampler_branches=resolved.sampler_branches, sampler_kernel=resolved.sampler_kernel,
                                 **({"lora_rank": self.lora.rank} if lora_kernel else {}))
        lora = (self.lora.max_loras, self.lora.rank, lora_kernel) if self.lora else None

        def batched(**kwargs):
            return functools.partial(_batch_step, step=functools.partial(step, **kwargs), page_size=self.cfg.page_size,
                                     lora=lora)

        # A prefill step also hands out its last layer's output, which prompt logprobs read (prompt_logprobs.py)
        jit_prefill = functools.partial(self.parallel.jit, with_hidden=True) if self.parallel else jit
        self._prefill = jit_prefill(batched(q_tile=self.cfg.prefill_query_tile, return_hidden=True))
        self._decode = jit(batched(q_tile=1, decode_only=True))
        self._write_rows = jax.jit(device_batch.write_rows, donate_argnums=0)
        if self.parallel:
            self._write_rows = self.parallel.jit_replicated(device_batch.write_rows)
        self._row_writers: dict[int, object] = {}  # per update bucket
        self._executables: dict[tuple[str, int], object] = {}
        self._prompt_logprobs = prompt_logprobs.make_fn(model_cfg, self.parallel)
        self._prompt_logprob_executables: dict[int, object] = {}  # per prefill bucket
        self._hidden: tuple[int, jax.Array] | None = None  # the last prefill step's bucket and output
        self.on_launch: Callable[[str, int, StepInputs], None] | None = None  # multihost.Leader.send_step
        # An experiment for the GPU run (benchmarks/gpu_run.py, step section), off unless set: the step's
        # packed inputs put on the device before the call (one device only), the last `hold_staged_inputs`
        # steps' kept alive. On a GPU the call's host phase ("launch") took about the device's step (2.8 of
        # 2.5 ms at batch 1, 1.7B shape, H200): does handing it numpy arrays, or their buffers' reuse, make
        # it wait?
        self.hold_staged_inputs: int | None = None
        self.staged_inputs: collections.deque = collections.deque()
        self.inputs = StepInputBuilder(model_cfg, self.cfg)
        if resolved.num_pages is None:  # the pool takes what the weights and the largest step leave
            # The loader's copy of the weights is alive while the pool is allocated (its owner drops it later).
            loader_bytes = sum(x.nbytes for x in jax.tree.leaves(params)
                               if isinstance(x, jax.Array) and any(d.platform != "cpu" for d in x.devices()))
            self._take(size_pool(resolved, MemoryUse(self.device_weight_bytes + loader_bytes, self._step_bytes())))
            self.inputs = StepInputBuilder(model_cfg, self.cfg)  # max_model_len may be the pool's now
        self.kv_cache = self._init_kv_cache(self.num_pages)
        self.device_kv_cache_bytes = _bytes_on_first_device(self.kv_cache)
        self.batch_state = BatchState(*jax.tree.map(self._replicated, self.inputs.initial_state()))
        logger.debug(
            "KV cache: %d pages of %d tokens (%d max concurrent tokens), %.1f MiB; %s attention, %s matmuls",
            self.num_pages - 1, self.cfg.page_size, self.max_concurrent_tokens,
            self.kv_cache_bytes / 2**20, self.attention_backend, self.matmul_backend,
        )
        if self.parallel:
            logger.debug("tensor parallel over %d devices: %s", self.mesh.size, self.parallel.describe())

    def _take(self, resolved: ResolvedConfig) -> None:
        """Reads the settings off the record (twice when the pool is sized from memory)."""
        self.resolved, self.cfg, self.defaults = resolved, resolved.engine, resolved.chosen
        self.device, self.platform, self.num_pages = resolved.device, resolved.platform, resolved.num_pages
        self.attention_backend, self.matmul_backend = resolved.attention_backend, resolved.matmul_backend
        self.sampler_branches = resolved.sampler_branches
        self.prefill_buckets, self.decode_buckets = list(resolved.prefill_buckets), list(resolved.decode_buckets)

    def _serving_params(self, params, draw: Callable[[], dict] | None = None):
        """forward's layout (per-layer arrays, fused projections; packed for the C++ matmul when
        matmul_backend is "cpu" or "cpu-bf16"), with the rope tables of every position up to max_model_len. On a CPU
        the arrays are sliced as zero-copy numpy views and copied once (a jitted conversion took 3.5-4 s
        to compile and run for the default model); elsewhere the conversion runs on the device. Shapes
        only for check-lowering."""
        leaves = jax.tree.leaves(params)
        packed = self.resolved.packed_dtype
        to_serving = functools.partial(serving_params, self.model_cfg, packed=packed is not None,
                                       packed_dtype=packed or "float32", quantization=self.resolved.quantization,
                                       unquantized_dtype=self.resolved.unquantized_dtype)
        rope = functools.partial(rope_position_tables, self.model_cfg, self.resolved.max_positions)
        if self.parallel:
            return self.parallel.place_params(params, to_serving, rope)
        if draw is not None:  # random weights: drawn and converted in one jit, one copy on the device
            return jax.jit(lambda: to_serving(draw()))() | rope()
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
            return jax.eval_shape(to_serving, params) | jax.eval_shape(rope)
        on_host = [isinstance(x, lazy.LazyTensor) or all(d.platform == "cpu" for d in x.devices()) for x in leaves]
        if all(on_host):  # a LazyTensor too: one device holds it all, so it is read whole
            return jax.tree.map(jnp.asarray, to_serving(jax.tree.map(np.asarray, params))) | rope()
        return jax.jit(to_serving)(params) | rope()

    def describe_weights_read(self) -> str:
        return (f"this process read {self.weight_bytes_read / 2**20:.1f} of the model's "
                f"{self.weight_bytes_total / 2**20:.1f} MiB of weights")

    def _replicated(self, x: np.ndarray) -> jax.Array:
        if self.parallel is None:
            return jnp.asarray(x)
        return self.parallel.replicated(x)

    def _init_kv_cache(self, num_pages: int):
        make = init_kv_cache if self.parallel is None else self.parallel.init_kv_cache
        return make(self.model_cfg, num_pages, self.cfg.page_size, self.cfg.kv_cache_dtype)

    def _step_bytes(self) -> int:
        """The most memory one step needs besides the weights and the KV pages: XLA's memory analysis of
        the largest prefill and decode buckets (temporaries, and outputs other than the pages updated in
        place) plus their inputs. Lowered over a pool of one sequence's pages: the pool is an argument
        updated in place, so its size does not change the rest. Warm-up compiles these two again for the
        real pool (the persistent cache keeps both for the next start). The two compile side by side."""
        self.kv_cache = jax.eval_shape(functools.partial(self._init_kv_cache, self.cfg.pages_per_seq + 1))
        most = 0
        largest = [("prefill", self.prefill_buckets[-1]), ("decode", self.decode_buckets[-1])]
        compiled = compilation.compile_all(lambda key: self.lower(*key), largest, "measuring a step", False)
        for kind, bucket in largest:
            stats = compiled[kind, bucket].memory_analysis()
            if stats is None:  # the platform does not say; the headroom gpu_memory_utilization leaves must do
                logger.warning("XLA gives no memory analysis here: the KV cache leaves no room for a step")
                continue
            inputs = jax.tree.leaves(self._input_shapes(kind, bucket))
            most = max(most, stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
                       + sum(x.size * jnp.dtype(x.dtype).itemsize for x in inputs))
        del self.kv_cache
        return most

    @property
    def kv_cache_bytes(self) -> int:
        return sum(pages.nbytes for pages in self.kv_cache)

    @property
    def max_concurrent_tokens(self) -> int:
        return (self.num_pages - 1) * self.cfg.page_size

    # -- compilation ------------------------------------------------------------------------------

    def _input_shapes(self, kind: str, bucket: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        return step_inputs.packed_shapes(bucket, bucket if kind == "decode" else min(bucket, self.cfg.max_num_seqs))

    def warmup(self, show_progress: bool = True) -> dict:
        """Compiles every bucket of both entry points once; returns a summary."""
        start, hits = time.perf_counter(), compilation.num_cache_hits()
        todo = [("decode", b) for b in self.decode_buckets] + [("prefill", b) for b in self.prefill_buckets]
        todo = [key for key in todo if key not in self._executables]
        self._executables |= compilation.compile_all(lambda key: self.lower(*key), todo, "compiling buckets",
                                                     show_progress)
        for num_updates in self.inputs.update_buckets:  # the device batch's row writers: small, quick to compile
            if num_updates not in self._row_writers:
                self._row_writers[num_updates] = self._write_rows.trace(
                    self._state_shapes(), self.inputs.update_shapes(num_updates)).lower().compile()
        if self.lora:
            self.lora.compile()
        summary = {
            "num_executables": len(self._executables),
            "num_row_writers": len(self._row_writers),
            "prefill_buckets": self.prefill_buckets,
            "decode_buckets": self.decode_buckets,
            "seconds": time.perf_counter() - start,
            "num_cache_hits": compilation.num_cache_hits() - hits,  # loaded from the persistent cache
        }
        logger.debug("compiled %d executables in %.1f s", summary["num_executables"], summary["seconds"])
        return summary

    def compiled_text(self, kind: str, bucket: int) -> str:
        """One warmed-up bucket's executable as XLA compiled it (optimized HLO: its fusions, kernels, GEMMs)."""
        return self._executables[kind, bucket].as_text()

    def lower(self, kind: str, bucket: int, platforms: tuple[str, ...] | None = None):
        """Lowers one bucket's step function ("prefill" or "decode") for this machine or `platforms`."""
        fn = self._decode if kind == "decode" else self._prefill
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (self.params, self.kv_cache))
        # float32 means float32: a GPU's default float32 dot is TF32 (10-bit mantissas), which changed greedy
        # tokens against Hugging Face's float32 on an H100. A CPU computes float32 whatever the setting.
        on_gpu = (platforms or (self.device.platform,))[0] in ("gpu", "cuda")
        precision = "highest" if on_gpu and self.cfg.dtype == "float32" else None
        with jax.default_matmul_precision(precision):
            traced = fn.trace(*shapes, self._state_shapes(), self._input_shapes(kind, bucket))
            return traced.lower(lowering_platforms=platforms) if platforms else traced.lower()

    def _state_shapes(self) -> BatchState:
        return BatchState(*jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.inputs.initial_state()))

    @property
    def compiled_shapes(self) -> list[tuple[str, int]]:
        return sorted(self._executables)

    # -- one step ---------------------------------------------------------------------------------

    def execute(self, seqs: list[ScheduledSeq],
                on_row_error: Callable[[int, Exception], None] | None = None) -> SamplerOutput:
        """Launches one step over the scheduled sequences (`prepare`, then `launch`); returns its (device)
        sampler output. The result is not waited for: callers can do host work while the device runs,
        then read it with `fetch`."""
        return self.launch(*self.prepare(seqs, on_row_error))

    def prepare(self, seqs: list[ScheduledSeq], on_row_error: Callable[[int, Exception], None] | None = None,
                prefill: bool = False) -> tuple[str, int, StepInputs]:
        """The entry point ("prefill" or "decode"), bucket and padded host inputs of one step.
        on_row_error: if given, a sequence whose sampling row cannot be built runs as an inert greedy row
        and is reported (its index and the error) instead of failing the step. prefill: run it as a
        prefill step even if every sequence has one token (prompt logprobs read its output)."""
        assert seqs, "nothing scheduled"
        num_tokens = sum(len(s.token_ids) for s in seqs)
        if not prefill and all(len(s.token_ids) == 1 for s in seqs) and len(seqs) <= self.cfg.max_num_seqs:
            kind, bucket = "decode", pick_bucket(self.decode_buckets, len(seqs))
            num_seqs = bucket
        else:
            kind, bucket = "prefill", pick_bucket(self.prefill_buckets, num_tokens)
            num_seqs = min(bucket, self.cfg.max_num_seqs)
        assert len(seqs) <= num_seqs, (len(seqs), num_seqs)
        return kind, bucket, self.inputs.build(seqs, num_tokens=bucket, num_seqs=num_seqs, on_row_error=on_row_error)

    def launch(self, kind: str, bucket: int, inputs: StepInputs) -> SamplerOutput:
        """Runs one bucket's executable on built inputs (a multi-host follower runs the leader's this
        way); `on_launch`, if set, sees them first (the leader sends them to its followers)."""
        if self.on_launch is not None:
            self.on_launch(kind, bucket, inputs)
        if (kind, bucket) not in self._executables:
            self.warmup(show_progress=False)  # only before warm-up ran; afterwards every key exists
        if inputs.row_updates is not None:
            writer = self._row_writers[len(inputs.row_updates.req_indices)]
            self.batch_state = writer(self.batch_state, inputs.row_updates)
        packed = step_inputs.pack(inputs)
        if self.hold_staged_inputs is not None and self.parallel is None:
            packed = jax.device_put(packed)
            self.staged_inputs.append(packed)
            while len(self.staged_inputs) > self.hold_staged_inputs:
                self.staged_inputs.popleft()
        output, self.kv_cache, self.batch_state, *hidden = self._executables[kind, bucket](
            self.params, self.kv_cache, self.batch_state, packed)
        self._hidden = (bucket, hidden[0]) if hidden else None
        return output

    def write_lora(self, slot: int, targets: dict) -> None:
        """Writes an adapter's matrices (`AdapterWeights.targets`) into device slot `slot` (1..max_loras),
        in place, ordered after the steps launched before it."""
        self.params["lora"] = self.lora.write(self.params["lora"], slot, targets)

    # -- prompt logprobs (prompt_logprobs.py) -------------------------------------------------------

    prompt_logprob_width = staticmethod(prompt_logprobs.job_width)  # of a prefill bucket's job

    def warmup_prompt_logprobs(self, show_progress: bool = True) -> int:
        """Compiles the prompt-logprob executable of every prefill bucket; returns how many there are."""
        self.warmup(show_progress=False)  # nothing left to do once warm-up ran: the prefill steps' outputs
        todo = [b for b in self.prefill_buckets if b not in self._prompt_logprob_executables]
        self._prompt_logprob_executables |= compilation.compile_all(self._lower_prompt_logprobs, todo,
                                                                    "compiling prompt logprobs", show_progress)
        return len(self._prompt_logprob_executables)

    def _lower_prompt_logprobs(self, bucket: int):
        # the prefill step's last layer output: [bucket tokens, hidden] in the activations' dtype (not read from
        # the executable's out_info, which the Pallas interpreter's steps cannot answer)
        hidden = jax.ShapeDtypeStruct((bucket, self.model_cfg.hidden_size), jnp.dtype(self.cfg.dtype))
        float32_on_gpu = self.device.platform in ("gpu", "cuda") and self.cfg.dtype == "float32"
        return prompt_logprobs.lower(self._prompt_logprobs, self.params, hidden, bucket, float32_on_gpu)

    def launch_prompt_logprobs(self, job: np.ndarray) -> PromptLogprobs:
        """Launches the prompt-logprob executable over the last launched step, a prefill step (the job's
        rows are its token rows); returns its (device) output without waiting."""
        assert self._hidden is not None, "prompt logprobs need a prefill step"
        bucket, hidden = self._hidden
        if bucket not in self._prompt_logprob_executables:
            self.warmup_prompt_logprobs(show_progress=False)  # only before warm-up ran
        return self._prompt_logprob_executables[bucket](self.params, hidden, job)

    @staticmethod
    def fetch(output: SamplerOutput, num_seqs: int, with_logprobs: bool) -> SamplerOutput:
        """Copies the sampled tokens (and logprobs only if some row asked) to the host: this process's
        copy, as every device holds them all (over several hosts the array is not all addressable here)."""
        host = lambda a: np.asarray(a.addressable_data(0))[:num_seqs]  # noqa: E731
        if not with_logprobs:
            return SamplerOutput(host(output.token_ids), None, None, None)
        return SamplerOutput(*(host(a) for a in output))
