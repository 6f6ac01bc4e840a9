"""The engine core: validates requests, then runs steps, each `schedule -> prepare -> launch -> read`.

It owns the scheduler, the page pool and the model runner for one loaded model, the requests it holds
and the step's stages; each stage returns one record (step_records.py). Building a step's rows is
step_prep.py's, reading its tokens into the requests output_processor.py's. Prompts arrive as token
ids (tokenization and chat templates belong to the callers: `llm.py`, the server).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import random
import threading
import time

from jaxserve.runner.compilation import enable_persistent_cache, forbid_compilation, num_compilations
from jaxserve.config import device_defaults
from jaxserve.distributed import multihost
from jaxserve.config.device_defaults import DeviceInfo
from jaxserve.config.engine_config import EngineConfig
from jaxserve.core.detokenizer import IncrementalDetokenizer
from jaxserve.runner.device_batch import ReqIndices
from jaxserve.core.startup import log_engine_shape, log_warmup, quantization_in_use
from jaxserve.log import STARTUP
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.resolve import ResolvedConfig, resolve_config
from jaxserve.parallel.tensor_parallel import request_cpu_devices
from jaxserve.runner.page_pool import PagePool
from jaxserve.core.output_processor import update_requests
from jaxserve.core.prompt_logprobs import build_job, read_job, wants_prompt_logprobs
from jaxserve.core.lora import EngineLoRA, check_lora_request, lora_api
from jaxserve.core.request import Request, RequestStatus
from jaxserve.lora import LoRARequest
from jaxserve.config.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler, SchedulerOutput
from jaxserve.spec_decode.speculative import SpecDecodeStats, NgramProposer
from jaxserve.core.step_prep import fill_token_bitmask, propose_drafts, row_failure_recorder, scheduled_seqs
from jaxserve.core.step_records import STEP_PHASES, LaunchedStep, PreparedStep
from jaxserve.core.structured_output import Grammars
from jaxserve.core.validation import check_sampling_params, checked_prompt
from jaxserve.weights import LoadedModel, load_model

logger = logging.getLogger(__name__)


def _make_proposer(spec, model_cfg, cfg: EngineConfig):
    """speculative_config's proposer, for a target model (its ModelConfig) served with cfg."""
    if spec.method == "ngram":
        return NgramProposer(spec)
    from jaxserve.spec_decode.draft_model import DraftModelProposer  # loads a model: only when asked for

    return DraftModelProposer(spec, model_cfg, cfg)


class LLMEngine:
    def __init__(self, model: LoadedModel, cfg: EngineConfig | ResolvedConfig):
        """cfg: the settings resolved for the model and this machine (`resolve_config`), or an EngineConfig
        resolved here."""
        self.model_cfg = model.config
        self.tokenizer = model.tokenizer
        resolved = cfg if isinstance(cfg, ResolvedConfig) else resolve_config(cfg, model.config, source=model.source)
        self.runner = ModelRunner(self.model_cfg, resolved, model.params, draw=model.draw)
        self.resolved = resolved = self.runner.resolved  # with the pool sized, where it is sized from memory
        self.cfg = cfg = resolved.engine  # every setting a number: those left unset chosen for the device
        self.leader: multihost.Leader | None = None  # set by from_config on a multi-host group's rank 0
        self.model = dataclasses.replace(model, params=None, draw=None)  # the runner holds them, in its own layout
        self.pool = PagePool(self.runner.num_pages, cfg.page_size, cfg.enable_prefix_caching)
        self.lora = EngineLoRA(cfg, self.model_cfg) if cfg.enable_lora else None  # adapters: core/lora.py
        for lora in cfg.lora_modules or ():  # served from the start (LoRAError if one cannot be)
            self.lora.add(lora)
        # Steps mostly of padding are capped only where padding costs compute (`padding_rows_cost`)
        capped_buckets = self.runner.prefill_buckets if resolved.padding_rows_cost else None
        self.scheduler = Scheduler(cfg, self.pool, capped_buckets, self.lora)
        self.requests: dict[str, Request] = {}
        self.grammars = Grammars(model.tokenizer, self.model_cfg.vocab_size)  # structured output, compiled and cached
        self._rng = random.Random(cfg.seed)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.last_schedule = None  # the most recent SchedulerOutput, for tests and debugging
        # Asynchronous scheduling: step N+1 is launched before step N's tokens are read (`_step`)
        self.async_scheduling = resolved.async_scheduling
        # Speculative decoding (speculative.py): drafts proposed for decode rows, verified in the step
        spec = cfg.speculative_config
        self.proposer = _make_proposer(spec, self.model_cfg, cfg) if spec else None
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens) if spec else None
        self.spec_max_batch = resolved.spec_batch_limit
        self._launched: LaunchedStep | None = None  # launched, tokens not read yet (async scheduling)
        # Each running request's row in the device batch, its req_index (model_runner, device_batch.py),
        # keyed by its admission: a preempted request takes a fresh row when it comes back
        self.req_indices = ReqIndices(self.runner.inputs.num_rows)
        self.num_steps = 0  # steps that ran the model
        self.step_seconds = 0.0  # wall time inside those steps: scheduling, the model, detokenizing
        # Of that, per phase: scheduling, building the inputs, launching the step, waiting for its tokens
        # (the device's time the host could not hide), updating requests and detokenizing
        self.phase_seconds = dict.fromkeys(STEP_PHASES, 0.0)
        self._compilations_after_warmup: int | None = None
        logger.debug("max concurrent tokens in the KV pool: %d", self.runner.max_concurrent_tokens)

    @classmethod
    def from_config(cls, model: str | os.PathLike | None, cfg: EngineConfig, *, warmup: bool = True,
                    show_progress: bool = True) -> tuple["LLMEngine", dict | None]:
        """Loads `model` (None: the default model), builds its engine and compiles every bucket: what
        both the offline `LLM` and the server start from. Returns the engine and its warm-up summary
        (None without warm-up). Progress goes to stderr, the engine's shape to the `jaxserve.startup` logger (stderr too)."""
        device_defaults.let_xla_take_the_gpu()  # before JAX starts a GPU
        enable_persistent_cache()
        request_cpu_devices(cfg.tensor_parallel_size // cfg.nnodes)  # on a CPU: this host's share of the mesh
        multihost.initialize(cfg)  # before any other JAX work; nothing for one node
        device = DeviceInfo.local()
        dtype = device_defaults.resolve_dtype(cfg.dtype, device)  # decided once: the weights load in it
        if cfg.node_rank > 0:  # a follower serves the leader's steps until the leader stops, then exits
            multihost.run_follower(model, cfg, dtype, show_progress)
            raise SystemExit(0)
        loaded = load_model(model, dtype, lazy=cfg.tensor_parallel_size > 1, load_format=cfg.load_format,
                            seed=cfg.seed)
        engine = cls(loaded, resolve_config(cfg, loaded.config, device, dtype=dtype, source=loaded.source))
        log_engine_shape(engine.runner, engine.model.source)
        if not warmup:
            return engine, None
        summary = engine.warmup(show_progress)
        log_warmup(summary)
        if cfg.nnodes > 1:
            STARTUP.info("waiting for %d follower(s)", cfg.nnodes - 1)
            engine.leader = multihost.Leader(cfg, multihost.fingerprint(engine.runner))  # checked against each follower's
            engine.runner.on_launch = engine.leader.send_step
        return engine, summary

    def warmup(self, show_progress: bool = True) -> dict:
        summary = self.runner.warmup(show_progress)
        if self.cfg.nnodes == 1:  # a multi-host engine refuses prompt logprobs (validation.py)
            summary["num_prompt_logprob_executables"] = self.runner.warmup_prompt_logprobs(show_progress)
        if hasattr(self.proposer, "warmup"):  # a draft model's buckets
            summary["num_draft_executables"] = self.proposer.warmup(show_progress)
        self._compilations_after_warmup = num_compilations()
        return summary

    @property
    def num_compilations_since_warmup(self) -> int | None:
        if self._compilations_after_warmup is None:
            return None
        return num_compilations() - self._compilations_after_warmup

    def make_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                     priority: int = 0, sample_index: int = 0, lora_request: LoRARequest | None = None,
                     arrival_time: float | None = None) -> Request:
        """Validates a request without queueing it (safe from any thread); raises ValueError naming the problem.
        lora_request: the LoRA adapter it runs with, registered and loaded here if new (LoRAError if it
        cannot be served). arrival_time: when it arrived (time.monotonic; default now), which orders admission."""
        prompt = checked_prompt(prompt_token_ids, priority, self.cfg, self.model_cfg.vocab_size)
        check_lora_request(self.lora, lora_request)
        room = self.cfg.max_model_len - len(prompt)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        with self._lock:
            request_id = f"req-{next(self._ids)}" if request_id is None else request_id
            seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        seed = (seed + sample_index * 0x9E3779B9) % 2**32  # n > 1: each sample its own stream
        check_sampling_params(params, self.model_cfg.vocab_size, self.cfg)  # after the draws: a refused request uses them up
        request = Request(request_id, prompt, params, seed=seed, max_tokens=max_tokens,
                          eos_token_ids=self.model_cfg.eos_token_ids, priority=priority, lora_request=lora_request)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(prompt)
        if self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, params, prompt)
        if params.structured_outputs is not None:
            request.grammar = self.grammars.matcher(params.structured_outputs)
        return request

    def add_request(self, prompt_token_ids: list[int] | Request, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> Request:
        """Validates (unless given a made Request) and queues one request. Call from the engine's thread."""
        request = prompt_token_ids
        if not isinstance(request, Request):
            request = self.make_request(prompt_token_ids, params, request_id, priority, lora_request=lora_request)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)
        return request

    # LoRA adapters, vLLM's calls (core/lora.py); call from the engine's thread
    def add_lora(self, lora: LoRARequest) -> None:  # LoRAError if it cannot be served
        lora_api(self.lora, "add_lora").add(lora)

    def remove_lora(self, name: str) -> bool:  # running requests finish with it; False if unknown
        return lora_api(self.lora, "remove_lora").remove(name)

    def list_loras(self) -> list[LoRARequest]:
        return lora_api(self.lora, "list_loras").list()

    def lora_stats(self) -> dict | None:  # the running and waiting requests' adapters (None: enable_lora off)
        return self.lora and self.lora.stats(self.scheduler.running, self.scheduler.waiting)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None and not request.status.is_finished:
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)

    def fail_request(self, request_id: str, message: str) -> None:
        """Ends one request with finish reason "error" and frees its pages; the others go on."""
        request = self.requests.pop(request_id, None)
        if request is not None and not request.status.is_finished:
            self.scheduler.fail(request, message)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._launched is not None

    def step(self) -> list[Request]:
        """Runs one engine step; returns the requests that got a new token (finished ones included)."""
        if self.cfg.forbid_compilation_after_warmup and self._compilations_after_warmup is not None:
            with forbid_compilation():
                return self._step()
        return self._step()

    def _step(self) -> list[Request]:
        """Schedules, prepares and launches a step, then reads the tokens of a step: the same one, or with
        asynchronous scheduling the one launched before it, so the host's reading, stop checks and
        detokenizing of step N overlap step N+1 on the device (whose decode rows take N's tokens there).
        A step holding structured-output rows is read before the next is scheduled: their grammars
        must see each token before they can say what the next may be."""
        start = time.perf_counter()
        updated = []
        if self._launched is not None and self._launched.has_grammar:
            updated, self._launched = self._read(self._launched), None
        output = self._schedule()
        prepared = self._prepare(output) if output.scheduled else None
        launched = self._launch(prepared) if prepared is not None else None
        if self.async_scheduling:  # read the step launched before this one, and hold this one
            launched, self._launched = self._launched, launched
        if launched is not None:
            updated += self._read(launched)
        if prepared is not None or launched is not None or updated:
            self.step_seconds += time.perf_counter() - start
        return updated + (list(prepared.failed) if prepared is not None else [])

    def _schedule(self) -> SchedulerOutput:
        """Which requests advance this step and by how many tokens; counts the step if any do."""
        clock = time.perf_counter()
        output = self.scheduler.schedule()
        for slot, adapter in self.lora.take_writes() if self.lora else ():  # before the step that reads them
            self.runner.write_lora(slot, adapter.targets)
        self.last_schedule = output
        self._timed("schedule", clock)
        if output.scheduled:
            self.num_steps += 1
        return output

    def _prepare(self, output: SchedulerOutput) -> PreparedStep:
        """Proposes drafts and builds a scheduled step's inputs, then its structured-output token masks.
        A request whose part fails goes into `failed` and runs as an inert greedy row; only a failure
        of the step itself escapes."""
        clock = time.perf_counter()
        failed: dict[Request, str] = {}
        drafts = self._propose(output)
        seqs, rows = scheduled_seqs(output, drafts, self.req_indices, failed)
        with_logprobs = any(r.sampling_params.logprobs is not None for r, _ in output.scheduled)
        with_prompt_logprobs = wants_prompt_logprobs(output)  # its rows need the prefill step's output
        kind, bucket, inputs = self.runner.prepare(seqs, on_row_error=row_failure_recorder(output, rows, failed),
                                                   prefill=with_prompt_logprobs)
        job = build_job(output, [own[0] for own in rows], inputs.md.cu_q_lens,
                        self.runner.prompt_logprob_width(bucket)) if with_prompt_logprobs else None
        clock = self._timed("inputs", clock)
        fill_token_bitmask(self.grammars, output, [own[0] for own in rows], inputs, failed)
        self._timed("grammar", clock)
        return PreparedStep(output, kind, bucket, inputs, rows, drafts, with_logprobs, failed, job)

    def _propose(self, output: SchedulerOutput) -> list[list[int]]:
        """Draft tokens for each scheduled request (`step_prep.propose_drafts`)."""
        return propose_drafts(output, self.proposer, self.cfg, self.pool, self.spec_max_batch)

    def _launch(self, prepared: PreparedStep) -> LaunchedStep:
        """Launches a prepared step without waiting for its tokens and records it as launched; then ends
        the requests that failed preparing it (their rows ran inert; the pages were written as scheduled)."""
        clock = time.perf_counter()
        sampled = self.runner.launch(prepared.kind, prepared.bucket, prepared.inputs)
        prompt_logprobs = None
        if prepared.prompt_logprobs is not None:  # over this step's output, before another step replaces it
            prompt_logprobs = (prepared.prompt_logprobs, self.runner.launch_prompt_logprobs(prepared.prompt_logprobs.job))
        self._timed("launch", clock)
        self.scheduler.advance(prepared.output)
        for request, message in prepared.failed.items():
            self.scheduler.fail(request, message)
            self.requests.pop(request.request_id, None)
        return LaunchedStep(prepared.output, sampled, prepared.with_logprobs, prepared.rows, prepared.drafts,
                            prompt_logprobs)

    def _read(self, launched: LaunchedStep) -> list[Request]:
        """Reads a launched step's tokens (waiting for them), updates its requests and detokenizes."""
        clock = time.perf_counter()
        sampled = self.runner.fetch(launched.sampled, launched.num_rows, launched.with_logprobs)
        if launched.prompt_logprobs is not None:  # in the requests before their first token is delivered
            read_job(*launched.prompt_logprobs)
        clock = self._timed("wait", clock)
        updated = update_requests(self.scheduler, launched, sampled, self.spec_stats)
        for request in updated:
            if request.status.is_finished:
                self.requests.pop(request.request_id, None)
        self._timed("update", clock)
        return updated

    def _timed(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.phase_seconds[phase] += now - since
        return now

    @property
    def model_seconds(self) -> float:
        """Step time spent building inputs, launching the model and waiting for its tokens."""
        return sum(self.phase_seconds[phase] for phase in ("inputs", "launch", "wait"))

    def get_stats(self) -> dict:
        """Counters: prompt tokens computed vs found in the prefix cache, preemptions, pages, compiles,
        the time spent in steps (`step_seconds`) and, of that, in the model (`model_seconds`), and the
        bytes of weights and KV pages each device holds."""
        scheduler, pool = self.scheduler, self.pool
        return {
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "prompt_tokens_computed": scheduler.num_computed_prompt_tokens,
            "prompt_tokens_cached": scheduler.num_cached_prompt_tokens,
            "prefix_cache_queries": pool.num_queried_tokens,
            "prefix_cache_hits": pool.num_hit_tokens,
            "num_preemptions": scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "step_seconds": self.step_seconds,
            "model_seconds": self.model_seconds,
            "phase_seconds": dict(self.phase_seconds),
            "num_pages": pool.num_pages - 1,
            "num_used_pages": pool.num_used_pages,
            "num_cached_pages": pool.num_cached_pages,
            "kv_cache_usage": pool.usage,
            "compilations_since_warmup": self.num_compilations_since_warmup,
            "spec_decode": self.spec_stats.as_dict() if self.spec_stats else None,
            "compiled_shapes": self.runner.compiled_shapes,
            "tensor_parallel_size": self.cfg.tensor_parallel_size,
            "device_weight_bytes": self.runner.device_weight_bytes,  # on each device of the mesh
            "device_kv_cache_bytes": self.runner.device_kv_cache_bytes,
            "quantization": quantization_in_use(self.runner),  # None: float weights
            "kv_cache_dtype": self.cfg.kv_cache_dtype,
            "lora": self.lora_stats(),
        }

