"""The scheduler: which requests advance this step, and by how many tokens.

vLLM V1's policy: no prefill/decode phases; every request moves `num_computed_tokens` toward
`num_tokens`. Running requests go first (decodes and unfinished prompt chunks), then waiting ones in
arrival order (`Request.arrival_time`, the HTTP server's receipt: two requests tokenized side by side keep
their order; under scheduling_policy "priority": (priority, arrival) order), under the token budget
`max_num_batched_tokens` and `max_num_seqs`; a prompt longer than the budget left is chunked, so a long
prompt never stalls running decodes. At admission the prefix cache supplies the longest cached run of
full pages. When pages run out, the running request admitted most recently (under "priority": with the
lowest priority, then most recently admitted) is preempted: its pages are freed (they stay cached) and
it is recomputed later.

Host ints and lists only; the model runner turns the output into device arrays.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
from typing import Callable

from jaxserve.config.engine_config import EngineConfig
from jaxserve.core.lora import EngineLoRA
from jaxserve.runner.page_pool import PagePool
from jaxserve.core.request import Request, RequestStatus
from jaxserve.ops.sampling import SamplerOutput

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]]  # (request, number of new tokens this step)
    preempted: list[Request]
    samples: list[bool] = dataclasses.field(default_factory=list)  # per row, set by `advance`

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


# Steps smaller than this are not capped: their cost is mostly reading the weights, not the padded rows.
MIN_CAPPED_BUCKET = 128


def _needs_prefill(request: Request) -> bool:
    """More than a decode row: prompt tokens left, or several tokens to recompute after preemption."""
    return (request.num_tokens - request.num_computed_tokens > 1
            or request.num_computed_tokens < len(request.prompt_token_ids))


def _last_token_pending(request: Request) -> bool:
    """Its token on the device is its max_tokens-th: a row for the next one would be discarded."""
    num_outputs = len(request.output_token_ids) + request.num_pending_tokens
    return request.num_pending_tokens > 0 and num_outputs >= request.max_tokens


class _PartialPrefills:
    """One step's prompts being prefilled, under vLLM's limits: at most max_num_partial_prefills of them,
    of which at most max_long_partial_prefills long ones (more than `threshold` prompt tokens left, each
    taking at most `threshold` tokens a step)."""

    def __init__(self, cfg: EngineConfig, threshold: int):
        self.max_all, self.max_long, self.threshold = cfg.max_num_partial_prefills, cfg.max_long_partial_prefills, threshold
        self.num_all = self.num_long = 0

    def _is_long(self, request: Request) -> bool:
        return 0 < self.threshold < request.num_tokens - request.num_computed_tokens

    @property
    def room(self) -> bool:
        return self.max_all is None or self.num_all < self.max_all

    def admits(self, request: Request) -> bool:
        if not _needs_prefill(request) and request.status is RequestStatus.RUNNING:
            return True  # a decode row
        return self.room and not (self._is_long(request) and self.num_long >= self.max_long)

    def chunk(self, request: Request) -> int:
        """The most tokens the request may take this step."""
        left = request.num_tokens - request.num_computed_tokens
        return min(left, self.threshold) if self._is_long(request) else left

    def add(self, request: Request) -> None:
        if _needs_prefill(request) or request.status is not RequestStatus.RUNNING:
            self.num_all += 1
            self.num_long += self._is_long(request)


class Scheduler:
    def __init__(self, cfg: EngineConfig, pool: PagePool, prefill_buckets: list[int] | None = None,
                 lora: EngineLoRA | None = None):
        """prefill_buckets: the token counts prompt steps are padded to (the model runner's), where a
        padded row costs what a real one does; with them, a step that would be mostly padding takes fewer
        prompt tokens (see `_token_budget`). None where padding costs little (the C++ matmul multiplies a
        step's real rows only): there the cap's extra step delays the prompt's first token by more than the
        padding costs the step. lora: the engine's LoRA adapters (core/lora.py), whose device slots admission
        pins (enable_lora)."""
        self.cfg, self.pool, self.lora = cfg, pool, lora
        self.prefill_buckets = sorted(prefill_buckets or [])
        # vLLM's partial-prefill limits: a prompt with more than `long_threshold` tokens left is long (0: none is)
        self.long_threshold = cfg.long_prefill_token_threshold or (
            cfg.max_model_len * 4 // 100 if (cfg.max_num_partial_prefills or 1) > 1 and cfg.max_model_len else 0)
        # fcfs: every request ranks the same, so arrival alone orders them (a Request made without the
        # engine's check may still carry a priority)
        self._uses_priority = cfg.scheduling_policy == "priority"
        self.waiting: list[Request] = []  # sorted by `_waiting_key`
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self.num_computed_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0
        self._arrivals = itertools.count()

    def add_request(self, request: Request) -> None:
        request.arrival_index = next(self._arrivals)
        self._enqueue(request)

    def _rank(self, request: Request) -> int:
        return request.priority if self._uses_priority else 0

    def _waiting_key(self, request: Request) -> tuple[int, float, int]:
        return self._rank(request), request.arrival_time, request.arrival_index

    def _enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self._waiting_key)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        # Higher priority first (stable, so equal priorities keep admission order): the victims
        # taken from the tail are then the lowest-priority, most recently admitted requests.
        self.running.sort(key=self._rank)
        if self.cfg.mixed_batches:
            return self._schedule(None)
        # Unmixed steps: a prompt step whenever a prompt is pending, else (or if none fits) decodes.
        prompt_step = any(map(_needs_prefill, self.running)) or (
            bool(self.waiting) and len(self.running) < self.cfg.max_num_seqs)
        output = self._schedule(prompt_step)
        if prompt_step and not output.scheduled and not output.preempted:
            output = self._schedule(False)
        return output

    def _schedule(self, prompt_step: bool | None) -> SchedulerOutput:
        """prompt_step None: mixed; True: only prompt chunks (and admissions); False: only decode rows."""
        budget = self._token_budget(prompt_step)
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        prefills = _PartialPrefills(self.cfg, self.long_threshold)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if ((prompt_step is not None and _needs_prefill(request) != prompt_step) or _last_token_pending(request)
                    or not prefills.admits(request)):
                i += 1
                continue
            num_new = min(prefills.chunk(request), budget)
            assert num_new > 0, request.request_id
            while not self.pool.grow(request.page_table, request.num_computed_tokens + num_new):
                # Victims come from this request and those not yet scheduled this step: pages of a
                # scheduled request may already be registered in the prefix cache before computing.
                victim = max(self.running[i:], key=lambda r: (self._rank(r), self.running.index(r)))
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                self._cache_pages(request, request.num_computed_tokens + num_new)
                scheduled.append((request, num_new))
                prefills.add(request)
                budget -= num_new
                i += 1
                continue
            break

        j = 0  # waiting requests in order; a long prompt over the limit lets the shorter ones after it go first
        while (j < len(self.waiting) and budget > 0 and len(self.running) < self.cfg.max_num_seqs and not preempted
               and prompt_step is not False and prefills.room):
            request = self.waiting[j]
            if not prefills.admits(request) or not self._acquire_lora(request):  # no slot for its adapter: it waits
                j += 1
                continue
            if not self._admit(request, min(prefills.chunk(request), budget)):
                self._release_lora(request)
                break
            self.waiting.pop(j)
            num_new = min(prefills.chunk(request), budget)
            scheduled.append((request, num_new))
            prefills.add(request)
            budget -= num_new
        return SchedulerOutput(scheduled, preempted)

    def _token_budget(self, prompt_step: bool | None) -> int:
        """max_num_batched_tokens, or the next bucket down when this step's demand would fill less than
        3/4 of its padded bucket: 7 decode rows beside a 256-token prompt would run a 512-token step
        for 263 tokens; capped at 256, the last 7 prompt tokens ride along the next step's decode rows.
        Only where they fit there (the prompt tokens left over plus the decode rows within the smaller
        bucket): 127 decode rows beside a 50-token prompt, capped at 128, would leave the prompt one token
        a step for 50 steps. (The demand is estimated before admission: a prefix-cache hit can only make
        it smaller.) Not where the engine gives no buckets (the C++ matmul, which multiplies only the real
        rows): there 31 decode rows beside a 256-token prompt reached its first token in 93.0 ms as one
        512-token step of 287 rows, against 109.4 ms capped (a 256-token step, then 62 rows), the same work
        (every decode row two tokens on) taking 114.8 against 109.4 ms (the default model, a 2-core Zen 5)."""
        budget = self.cfg.max_num_batched_tokens
        if prompt_step is False or not self.prefill_buckets:
            return budget
        running = [r for r in self.running if prompt_step is None or _needs_prefill(r)]
        admissible = self.waiting[: max(self.cfg.max_num_seqs - len(self.running), 0)]
        demand = min(budget, sum(r.num_tokens - r.num_computed_tokens for r in running + admissible))
        padded = bisect.bisect_left(self.prefill_buckets, demand)
        if padded == 0 or padded == len(self.prefill_buckets):
            return budget
        lower, upper = self.prefill_buckets[padded - 1], self.prefill_buckets[padded]
        num_decode_rows = sum(not _needs_prefill(r) for r in running)
        left_over = demand - lower  # prompt tokens the cap moves to the next step
        if demand * 4 < upper * 3 and left_over + num_decode_rows <= lower and lower >= MIN_CAPPED_BUCKET:
            return lower
        return budget

    def _admit(self, request: Request, budget: int) -> bool:
        """Takes cached prefix pages and new pages for the first chunk; False (no change) if out of pages."""
        request.page_hashes = self.pool.page_hashes_of(request.all_token_ids, request.page_hashes, request.cache_key)
        max_cached_pages = (request.num_tokens - 1) // self.pool.page_size  # leave >= 1 token to compute
        if request.needs_prompt_logprobs:  # each prompt position must be computed (vLLM V1 does the same)
            max_cached_pages = 0
        counters = self.pool.num_queried_tokens, self.pool.num_hit_tokens
        cached = self.pool.lookup(request.page_hashes, max_cached_pages)
        request.page_table, request.num_computed_tokens = cached, len(cached) * self.pool.page_size
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        if not self.pool.grow(request.page_table, request.num_computed_tokens + num_new):
            self.pool.free(request.page_table)
            request.num_computed_tokens = 0
            self.pool.num_queried_tokens, self.pool.num_hit_tokens = counters  # it will ask again
            return False
        if request.status is RequestStatus.WAITING:  # first admission: count the prompt's cache use
            num_prompt = len(request.prompt_token_ids)
            request.num_cached_tokens = min(request.num_computed_tokens, num_prompt)
            self.num_cached_prompt_tokens += request.num_cached_tokens
            self.num_computed_prompt_tokens += num_prompt - request.num_cached_tokens
        request.status = RequestStatus.RUNNING
        request.num_admissions += 1
        self.running.append(request)
        self._cache_pages(request, request.num_computed_tokens + num_new)
        return True

    def _acquire_lora(self, request: Request) -> bool:
        """Pins a device slot holding the request's adapter (none for the base model); False if none is free."""
        if request.lora_request is None:
            return True
        slot = self.lora.acquire(request.lora_request)
        request.lora_slot = slot or 0
        return slot is not None

    def _release_lora(self, request: Request) -> None:
        if request.lora_slot:
            self.lora.release(request.lora_request)
            request.lora_slot = 0

    def _cache_pages(self, request: Request, num_tokens: int) -> None:
        """Registers the pages this step fills (their tokens are known once scheduled)."""
        full = num_tokens // self.pool.page_size
        if full > len(request.page_hashes):
            request.page_hashes = self.pool.page_hashes_of(request.all_token_ids[: full * self.pool.page_size],
                                                           request.page_hashes, request.cache_key)
        self.pool.cache_full_pages(request.page_table[:full], request.page_hashes[:full])

    def preempt(self, request: Request) -> None:
        """Sends a running request back to the waiting queue, as running out of pages does: its pages
        are freed (they stay cached) and it is recomputed when admitted again. Call between steps."""
        if request not in self.running:
            raise ValueError(f"request {request.request_id!r} is not running ({request.status.value})")
        self._preempt(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.pool.free(request.page_table)
        self._release_lora(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self._enqueue(request)
        self.num_preemptions += 1

    def advance(self, output: SchedulerOutput) -> None:
        """Records that `output`'s step was launched: its tokens count as computed, and each sequence
        that reached its end will sample a token, pending until `update_from_output` reads it (with
        asynchronous scheduling, after the next step is scheduled: that step's row feeds on it)."""
        for row, (request, num_new) in enumerate(output.scheduled):
            request.num_computed_tokens += num_new
            samples = request.num_computed_tokens == request.num_tokens
            if samples:
                request.num_pending_tokens += 1
                request.pending_row = row
            output.samples.append(samples)

    def update_from_output(self, output: SchedulerOutput, sampled: SamplerOutput | list[int],
                           rows: list[list[int]] | None = None,
                           on_token: Callable[[Request], None] | None = None) -> list[Request]:
        """Appends each sampled token of an advanced step to its request, then checks stops.

        `sampled` is the host SamplerOutput (or a plain list of token ids). rows: per scheduled request,
        the rows whose tokens it takes, in order (default: its own row; a speculating request takes its
        accepted drafts' rows and the row after them, and its computed tokens move past the drafts).
        on_token(request) runs after each token (and its stop checks), and may finish the request: its
        later tokens are then dropped. Returns the requests that got tokens; finished ones have their
        pages freed. A request that finished while the step ran (a stop found in the step before, an
        abort) has its rows discarded.
        """
        assert len(output.samples) == len(output.scheduled), "advance() the output first"
        tokens = getattr(sampled, "token_ids", sampled)
        updated = []
        for i, ((request, _), samples) in enumerate(zip(output.scheduled, output.samples)):
            if not samples:
                continue  # a prompt chunk that is not the last: its sample is meaningless
            request.num_pending_tokens -= 1
            if request.status.is_finished:
                continue
            updated.append(request)
            own_rows = [i] if rows is None else rows[i]
            for row in own_rows:
                if not self._append(request, sampled, tokens, row, on_token):
                    break
            else:
                if request.status is RequestStatus.RUNNING:
                    request.num_computed_tokens += len(own_rows) - 1  # the accepted drafts' K/V are written
                    # Pages that held only rejected drafts go back; the table may regrow with other pages
                    request.num_page_trims += self.pool.shrink(request.page_table, request.num_tokens)
                    self._cache_known_pages(request)
        return updated

    def _append(self, request: Request, sampled, tokens, row: int, on_token) -> bool:
        """Appends row's token to the request; False if the request is finished now."""
        request.output_token_ids.append(int(tokens[row]))
        if request.sampling_params.logprobs is not None:
            try:
                request.logprobs.append(_logprob_entry(sampled, row, request.sampling_params.logprobs))
            except Exception:  # noqa: BLE001 - one request's failure must not end the others' step
                logger.exception("request %s: building its logprobs failed", request.request_id)
                self.fail(request, "building its logprobs failed")
                return False
        if request.check_stop():
            self.finish(request)
        if on_token is not None:
            on_token(request)
        return not request.status.is_finished

    def _cache_known_pages(self, request: Request) -> None:
        """Registers pages that the token just read completed: scheduling left them out while it was pending."""
        num_known = min(request.num_computed_tokens, request.num_tokens - request.num_pending_tokens)
        if num_known // self.pool.page_size > len(request.page_hashes):
            self._cache_pages(request, num_known)

    def fail(self, request: Request, message: str) -> None:
        """Ends one request with finish reason "error" (pages freed); `message` is for its client."""
        request.error = message
        self.finish(request, RequestStatus.FINISHED_ERROR)

    def finish(self, request: Request, status: RequestStatus | None = None) -> None:
        if status is not None:
            request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pool.free(request.page_table)
        self._release_lora(request)


def _logprob_entry(sampled, row: int, num_top: int) -> dict[int, float]:
    entry = {int(sampled.token_ids[row]): float(sampled.logprobs[row])}
    for token, logprob in zip(sampled.top_ids[row][:num_top], sampled.top_logprobs[row][:num_top]):
        entry.setdefault(int(token), float(logprob))
    return entry
