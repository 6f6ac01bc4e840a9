"""The engine core: validates requests, then loops `schedule -> execute -> update`.

It owns the scheduler, the page pool and the model runner for one loaded model. Prompts arrive
as token ids (tokenization and chat templates belong to the callers: `llm.py`, the server).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import random
import threading
import time

from jaxserve.ops.attention_backends import matmul_hint
from jaxserve.runner.compilation import enable_persistent_cache, forbid_compilation, num_compilations
from jaxserve.config import device_defaults
from jaxserve.distributed import multihost
from jaxserve.config.device_defaults import DeviceInfo
from jaxserve.config.engine_config import EngineConfig
from jaxserve.core.detokenizer import IncrementalDetokenizer
from jaxserve.runner.device_batch import Slots
from jaxserve.errors import InvalidParameter
from jaxserve.log import STARTUP
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.step_inputs import ScheduledSeq, StepInputs
from jaxserve.parallel.tensor_parallel import request_cpu_devices
from jaxserve.runner.page_pool import PagePool
from jaxserve.core.request import Request, RequestStatus
from jaxserve.ops.sampling import SamplerOutput
from jaxserve.config.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler, SchedulerOutput
from jaxserve.config.speculative import DEFAULT_DISABLE_BY_BATCH_SIZE
from jaxserve.spec_decode.speculative import SpecDecodeStats, NgramProposer, accepted_run
from jaxserve.core.structured_output import Grammars
from jaxserve.weights import LoadedModel, load_model

logger = logging.getLogger(__name__)
STEP_PHASES = ("schedule", "inputs", "grammar", "launch", "wait", "update")
_PLACEHOLDER = 0  # the host's stand-in for a token still on the device (the step reads the real one)
_INERT_PARAMS = SamplingParams(temperature=0.0)  # the row of a request that failed before its step


def resolve_async_scheduling(setting: bool | None, platform: str, speculative: bool = False) -> bool:
    """Unset: on where the device runs apart from the host (a GPU); a CPU's host work and XLA share the cores.
    Speculative decoding proposes from the tokens read: it runs synchronously."""
    return setting if setting is not None else platform == "gpu" and not speculative


def _make_proposer(spec, model_cfg, cfg: EngineConfig):
    """speculative_config's proposer, for a target model (its ModelConfig) served with cfg."""
    if spec.method == "ngram":
        return NgramProposer(spec)
    from jaxserve.spec_decode.draft_model import DraftModelProposer  # loads a model: only when asked for

    return DraftModelProposer(spec, model_cfg, cfg)


@dataclasses.dataclass
class _LaunchedStep:
    """A step whose sampled tokens the host has not read yet."""

    output: SchedulerOutput
    sampled: SamplerOutput  # on the device
    with_logprobs: bool
    # Per scheduled request, its rows (one, or its newest token's and its drafts') and its draft tokens
    rows: list[list[int]]
    drafts: list[list[int]]

    @property
    def has_grammar(self) -> bool:
        return any(request.grammar is not None for request, _ in self.output.scheduled)


class LLMEngine:
    def __init__(self, model: LoadedModel, cfg: EngineConfig):
        self.model_cfg = model.config
        self.tokenizer = model.tokenizer
        self.runner = ModelRunner(self.model_cfg, cfg, model.params, draw=model.draw)
        self.cfg = cfg = self.runner.cfg  # every setting a number: those left unset chosen for the device
        self.leader: multihost.Leader | None = None  # set by from_config on a multi-host group's rank 0
        self.model = dataclasses.replace(model, params=None, draw=None)  # the runner holds them, in its own layout
        self.pool = PagePool(self.runner.num_pages, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(cfg, self.pool, self.runner.prefill_buckets)
        self.requests: dict[str, Request] = {}
        self.grammars = Grammars(model.tokenizer, self.model_cfg.vocab_size)  # structured output, compiled and cached
        self._rng = random.Random(cfg.seed)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.last_schedule = None  # the most recent SchedulerOutput, for tests and debugging
        # Asynchronous scheduling: step N+1 is launched before step N's tokens are read (`_step`)
        self.async_scheduling = resolve_async_scheduling(cfg.async_scheduling, self.runner.platform,
                                                         cfg.speculative_config is not None)
        # Speculative decoding (speculative.py): drafts proposed for decode rows, verified in the step
        spec = cfg.speculative_config
        self.proposer = _make_proposer(spec, self.model_cfg, cfg) if spec else None
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens) if spec else None
        self.spec_max_batch = (spec.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE) if spec else 0
        self._launched: _LaunchedStep | None = None  # launched, tokens not read yet (async scheduling)
        # Each running request's slot in the device batch (model_runner, device_batch.py), keyed by its
        # admission: a preempted request takes a fresh slot when it comes back
        self.slots = Slots(self.runner.inputs.num_slots)
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
        multihost.initialize(cfg)  # before any other JAX work; nothing for one node
        request_cpu_devices(cfg.tensor_parallel_size // cfg.nnodes)
        dtype = device_defaults.resolve_dtype(cfg.dtype, DeviceInfo.local())  # "auto": the device's
        if cfg.node_rank > 0:  # a follower serves the leader's steps until the leader stops, then exits
            multihost.run_follower(model, dataclasses.replace(cfg, dtype=dtype), show_progress)
            raise SystemExit(0)
        engine = cls(load_model(model, dtype, lazy=cfg.tensor_parallel_size > 1, load_format=cfg.load_format,
                                seed=cfg.seed), cfg)
        runner = engine.runner
        if runner.defaults:
            STARTUP.info("defaults for %s (%s): %s", runner.device.kind, device_defaults.kind_defaults(runner.device).why,
                         ", ".join(runner.defaults))
        if hint := matmul_hint(cfg.matmul_backend, runner.matmul_backend):
            STARTUP.info("%s", hint)
        STARTUP.info(f"{engine.model_cfg.architecture} from {engine.model.source}; KV cache {runner.num_pages - 1} "
                     f"pages x {engine.cfg.block_size} tokens = {runner.max_concurrent_tokens} max concurrent tokens "
                     f"({runner.kv_cache_bytes / 2**20:.0f} MiB)")
        if runner.mesh is not None:
            STARTUP.info(f"tensor parallel over {runner.mesh.size} {runner.mesh.devices.flat[0].platform} devices "
                         f"({runner.parallel.describe()}); per device: weights "
                         f"{runner.device_weight_bytes / 2**20:.1f} MiB, KV cache "
                         f"{runner.device_kv_cache_bytes / 2**20:.1f} MiB; {runner.describe_weights_read()}")
        if not warmup:
            return engine, None
        summary = engine.warmup(show_progress)
        STARTUP.info(f"{summary['num_executables']} executables ready in {summary['seconds']:.1f} s, "
                     f"{summary['num_cache_hits']} from the compilation cache (prefill token buckets "
                     f"{summary['prefill_buckets']}, decode batch buckets {summary['decode_buckets']})")
        if cfg.nnodes > 1:
            STARTUP.info("waiting for %d follower(s)", cfg.nnodes - 1)
            engine.leader = multihost.Leader(cfg, multihost.fingerprint(runner))  # checked against each follower's
            engine.runner.on_launch = engine.leader.send_step
        return engine, summary

    def warmup(self, show_progress: bool = True) -> dict:
        summary = self.runner.warmup(show_progress)
        if hasattr(self.proposer, "warmup"):  # a draft model's buckets
            summary["num_draft_executables"] = self.proposer.warmup(show_progress)
        self._compilations_after_warmup = num_compilations()
        return summary

    @property
    def num_compilations_since_warmup(self) -> int | None:
        if self._compilations_after_warmup is None:
            return None
        return num_compilations() - self._compilations_after_warmup

    def make_request(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str | None = None, priority: int = 0, sample_index: int = 0) -> Request:
        """Validates a request without queueing it (safe from any thread); raises ValueError naming the problem."""
        if priority != 0 and self.cfg.scheduling_policy != "priority":  # else any client could jump the queue
            raise InvalidParameter("priority", f"got priority {priority} but priority scheduling is not enabled "
                                               "(--scheduling-policy priority; offline, scheduling_policy='priority')")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise InvalidParameter("prompt", "the prompt is empty")
        bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < self.model_cfg.vocab_size)]
        if bad:
            raise InvalidParameter("prompt", f"prompt token ids {bad[:5]} are outside the vocabulary "
                                             f"[0, {self.model_cfg.vocab_size})")
        if len(prompt) >= self.cfg.max_model_len:
            raise InvalidParameter("prompt",
                f"the prompt has {len(prompt)} tokens, but max_model_len is {self.cfg.max_model_len} "
                f"(at least one token must be left to generate)"
            )
        room = self.cfg.max_model_len - len(prompt)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        with self._lock:
            request_id = f"req-{next(self._ids)}" if request_id is None else request_id
            seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        seed = (seed + sample_index * 0x9E3779B9) % 2**32  # n > 1: each sample its own stream
        for param, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
            bad = [t for t in ids if not 0 <= t < self.model_cfg.vocab_size]
            if bad:
                raise InvalidParameter(param, f"token ids {bad[:5]} in {param} are outside the vocabulary "
                                              f"[0, {self.model_cfg.vocab_size})")
        if params.prompt_logprobs is not None:
            raise InvalidParameter("prompt_logprobs", "prompt_logprobs is not supported yet")
        request = Request(request_id, prompt, params, seed=seed, max_tokens=max_tokens,
                          eos_token_ids=self.model_cfg.eos_token_ids, priority=priority)
        if self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, params, prompt)
        if params.structured_outputs is not None:
            request.grammar = self.grammars.matcher(params.structured_outputs)
        return request

    def add_request(self, prompt_token_ids: list[int] | Request, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0) -> Request:
        """Validates (unless given a made Request) and queues one request. Call from the engine's thread."""
        request = prompt_token_ids
        if not isinstance(request, Request):
            request = self.make_request(prompt_token_ids, params, request_id, priority)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)
        return request

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
        """Schedules and launches a step, then reads the tokens of a step: the same one, or with
        asynchronous scheduling the one launched before it, so the host's reading, stop checks and
        detokenizing of step N overlap step N+1 on the device (whose decode rows take N's tokens there).
        A step holding structured-output rows is read before the next is scheduled: their grammars
        must see each token before they can say what the next may be."""
        start = time.perf_counter()
        updated = []
        if self._launched is not None and self._launched.has_grammar:
            updated, self._launched = self._read(self._launched), None
        launched, failed = self._launch()
        for request, message in failed.items():  # their rows ran inert; the pages were written as scheduled
            self.scheduler.fail(request, message)
            self.requests.pop(request.request_id, None)
        launched_now = launched
        if self.async_scheduling:
            launched, self._launched = self._launched, launched
        if launched is not None:
            updated += self._read(launched)
        if launched is not None or launched_now is not None or failed or updated:
            self.step_seconds += time.perf_counter() - start
        return updated + list(failed)

    def _launch(self) -> tuple[_LaunchedStep | None, dict[Request, str]]:
        """Schedules the next step and launches it without waiting; (None, {}) if nothing is scheduled.
        Per-request failures are returned, to be applied once the step is out: a failing request still
        runs as an inert greedy row, so the K/V of its pages (maybe already in the prefix cache) are
        written as scheduled. Only a failure of the step itself escapes."""
        clock = time.perf_counter()
        output = self.scheduler.schedule()
        self.last_schedule = output
        clock = self._timed("schedule", clock)
        if not output.scheduled:
            return None, {}
        self.num_steps += 1
        failed: dict[Request, str] = {}
        drafts = self._propose(output)
        seqs, rows = [], []
        for (request, n), draft in zip(output.scheduled, drafts):
            rows.append(list(range(len(seqs), len(seqs) + 1 + len(draft))))
            seq = self._scheduled_seq(request, n, failed)
            # Each draft a decode row of its own at its position, sharing the sequence's slot (speculative.py)
            seqs += [seq] + [dataclasses.replace(seq, token_ids=[token], num_computed_tokens=seq.num_computed_tokens + 1 + j,
                                                 history=None, write_row=False, write_history=False)
                             for j, token in enumerate(draft)]
        entry_of_row = [i for i, own in enumerate(rows) for _ in own]
        with_logprobs = any(r.sampling_params.logprobs is not None for r, _ in output.scheduled)

        def row_failed(row: int, error: Exception) -> None:
            request = output.scheduled[entry_of_row[row]][0]
            logger.error("request %s: building its sampling row failed", request.request_id, exc_info=error)
            failed.setdefault(request, "building its sampling row failed")

        kind, bucket, inputs = self.runner.prepare(seqs, on_row_error=row_failed)
        clock = self._timed("inputs", clock)
        self._fill_token_bitmask(output, [own[0] for own in rows], inputs, failed)
        clock = self._timed("grammar", clock)
        sampled = self.runner.launch(kind, bucket, inputs)
        self._timed("launch", clock)
        self.scheduler.advance(output)
        return _LaunchedStep(output, sampled, with_logprobs, rows, drafts), failed

    def _propose(self, output: SchedulerOutput) -> list[list[int]]:
        """Draft tokens for each scheduled request: none unless speculation is on and the step is all
        decode rows of at most `disable_by_batch_size` sequences. A request speculates unless its next
        token depends on the tokens before it in ways one shared sampling row cannot say (penalties, a
        grammar, min_tokens' banned stop tokens); drafts stop short of max_tokens, fit the largest decode
        bucket with the others' rows, and take pages only where free ones are left (never preempting)."""
        none = [[] for _ in output.scheduled]
        if self.proposer is None or len(output.scheduled) > self.spec_max_batch:
            return none
        if not all(n == 1 and request.num_computed_tokens >= len(request.prompt_token_ids)
                   for request, n in output.scheduled):
            return none
        room = self.cfg.max_num_seqs - len(output.scheduled)
        k = self.cfg.speculative_config.num_speculative_tokens
        eligible = [i for i, (request, _) in enumerate(output.scheduled)
                    if request.grammar is None and not request.sampling_params.uses_penalties
                    and not request.suppressed_token_ids and request.num_pending_tokens == 0]
        limits = [min(k, output.scheduled[i][0].max_tokens - len(output.scheduled[i][0].output_token_ids) - 1)
                  for i in eligible]
        if room <= 0 or not any(limit > 0 for limit in limits):
            return none
        try:
            proposals = self.proposer.propose([output.scheduled[i][0] for i in eligible], limits)
        except Exception:  # noqa: BLE001 - drafts only save time: the step goes on without them
            logger.exception("the %s proposer failed; this step does not speculate",
                             self.cfg.speculative_config.method)
            return none
        for i, draft in zip(eligible, proposals):
            request = output.scheduled[i][0]
            draft = list(draft)[:room]
            if draft and self.pool.grow(request.block_table, request.num_computed_tokens + 1 + len(draft)):
                none[i] = draft
                room -= len(draft)
        return none

    def _read(self, launched: _LaunchedStep) -> list[Request]:
        """Reads a launched step's tokens (waiting for it), updates its requests and detokenizes."""
        clock = time.perf_counter()
        sampled = self.runner.fetch(launched.sampled, sum(map(len, launched.rows)), launched.with_logprobs)
        clock = self._timed("wait", clock)
        rows = launched.rows
        if any(launched.drafts):  # each takes its accepted drafts' rows and the one after
            rows = [own[:accepted_run(draft, [int(sampled.token_ids[r]) for r in own]) + 1]
                    for own, draft in zip(launched.rows, launched.drafts)]
            for own, draft in zip(rows, launched.drafts):
                if draft:
                    self.spec_stats.observe(len(draft), len(own) - 1)
        updated = self.scheduler.update_from_output(launched.output, sampled, rows, self._on_token)
        for request in updated:
            if request.status.is_finished:
                self.requests.pop(request.request_id, None)
        self._timed("update", clock)
        return updated

    def _on_token(self, request: Request) -> None:
        """After each new token of a request: its grammar moves past it, its text grows (stops checked)."""
        self._advance_grammar(request)
        self._detokenize(request)

    def _fill_token_bitmask(self, output: SchedulerOutput, first_rows: list[int], inputs: StepInputs,
                            failed: dict[Request, str]) -> None:
        """Each structured-output row that samples this step gets what its grammar allows next, in its row
        update (such rows are written every step they sample: `_scheduled_seq`). first_rows: each
        scheduled request's row (its first, if it speculates: grammar rows never do)."""
        constrained = [(row, request) for row, (request, _) in zip(first_rows, output.scheduled)
                       if request.grammar is not None and inputs.samples[row] and request not in failed]
        if not constrained:  # the common step: no per-row work at all
            return
        updates = inputs.row_updates
        update_of_slot = {int(slot): u for u, slot in enumerate(updates.slots)}
        rows = {update_of_slot[int(inputs.row_slots[row])]: request for row, request in constrained}
        bitmask = updates.sampling.token_bitmask  # [U, words]
        try:
            self.grammars.fill_bitmasks([(request.grammar, u) for u, request in rows.items()], bitmask)
        except Exception:  # noqa: BLE001 - find the rows at fault and fail them; the others go on
            for u, request in rows.items():
                try:
                    request.grammar.fill(bitmask, u)
                except Exception:  # noqa: BLE001
                    logger.exception("request %s: its grammar's token mask failed", request.request_id)
                    failed[request] = "computing its grammar's token mask failed"
                    bitmask[u] = -1

    def _advance_grammar(self, request: Request) -> None:
        """Moves a structured-output request's grammar past its new token; a grammar that is complete
        ends the request ("stop"), one that cannot take the token fails it."""
        if request.grammar is None or request.status is RequestStatus.FINISHED_ERROR:
            return
        token = request.output_token_ids[-1]
        if not request.grammar.accept(token):
            if not request.status.is_finished:  # ended anyway (its length, an EOS) and nothing more is sampled
                self.scheduler.fail(request, f"the grammar does not allow token {token}: "
                                             f"{request.grammar.error or 'no token was allowed'}")
            return
        if request.grammar.is_terminated and not request.status.is_finished:
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)

    def _timed(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.phase_seconds[phase] += now - since
        return now

    @property
    def model_seconds(self) -> float:
        """Step time spent building inputs, launching the model and waiting for its tokens."""
        return sum(self.phase_seconds[phase] for phase in ("inputs", "launch", "wait"))

    def _scheduled_seq(self, request: Request, num_new: int, failed: dict[Request, str]) -> ScheduledSeq:
        start, params = request.num_computed_tokens, request.sampling_params
        # With asynchronous scheduling the last token may still be on the device: a placeholder here
        num_pending = start + num_new - (request.num_tokens - request.num_pending_tokens)
        assert num_pending <= 1 and (num_pending <= 0 or request.num_pending_tokens == 1), request.request_id
        new_tokens = request.token_ids_between(start, start + num_new) + [_PLACEHOLDER] * max(num_pending, 0)
        try:
            suppress_ids = request.suppressed_token_ids
            slot, write_row, write_history = self.slots.place(
                (request, request.num_admissions), (len(request.block_table), request.num_page_trims, suppress_ids),
                self._holds_slot)
            samples = start + num_new == request.num_tokens
            write_row |= samples and request.grammar is not None  # its token bitmask changes every step
            # A request takes its slot when admitted, before any token of it is pending: its history is whole
            assert not (write_history and request.num_pending_tokens), request.request_id
            return ScheduledSeq(
                token_ids=new_tokens,
                num_computed_tokens=start,
                block_table=request.block_table,
                params=params,
                seed=request.seed,
                prompt_len=len(request.prompt_token_ids),
                history=request.all_token_ids if params.uses_penalties and write_history else None,
                suppress_ids=suppress_ids,
                prev_row=request.pending_row if num_pending > 0 else None,
                samples=samples,
                slot=slot,
                write_row=write_row,
                write_history=write_history,
            )
        except Exception:  # noqa: BLE001 - one request's failure must not end the others' step
            logger.exception("request %s: preparing its step failed", request.request_id)
            failed.setdefault(request, "preparing its step failed")
            return ScheduledSeq(new_tokens, start, request.block_table, _INERT_PARAMS, seed=0,
                                slot=self.slots.padding_slot, write_row=False, write_history=False)

    @staticmethod
    def _holds_slot(key: tuple[Request, int]) -> bool:
        """Whether the device batch's slot of (request, admission) is still its: running since then."""
        request, admission = key
        return request.status is RequestStatus.RUNNING and request.num_admissions == admission

    def _detokenize(self, request: Request) -> None:
        """Decodes the request's newest token; a stop string finishes the request, a failure fails it.
        A stop token (EOS, stop_token_ids) adds no text unless include_stop_str_in_output, as in vLLM
        (with skip_special_tokens=False its text would otherwise end the output)."""
        if request.detokenizer is None or request.status is RequestStatus.FINISHED_ERROR:
            return
        new = request.output_token_ids[-1:]
        if (request.status is RequestStatus.FINISHED_STOPPED and isinstance(request.stop_reason, int)
                and not request.sampling_params.include_stop_str_in_output):
            new = []
        try:
            stop = request.detokenizer.add(new)
        except Exception:  # noqa: BLE001 - model output can be any token sequence
            logger.exception("request %s: detokenizing its output failed", request.request_id)
            self.scheduler.fail(request, "detokenizing its output failed")
            return
        if stop is not None and not request.status.is_finished:
            request.stop_reason = stop
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)

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
        }
