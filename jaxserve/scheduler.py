"""The scheduler: which requests advance this step, and by how many tokens.

vLLM V1's policy: no prefill/decode phases; every request moves `num_computed_tokens` toward
`num_tokens`. Running requests go first (decodes and unfinished prompt chunks), then waiting ones in
arrival order, under the token budget `max_num_batched_tokens` and `max_num_seqs`; a prompt longer
than the budget left is chunked. When pages run out, the most recently admitted running request is
preempted: its pages are freed and it is recomputed later.

Host ints and lists only; the model runner turns the output into device arrays.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxserve.config import EngineConfig
from jaxserve.page_pool import PagePool
from jaxserve.request import Request, RequestStatus


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]]  # (request, number of new tokens this step)
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, cfg: EngineConfig, pool: PagePool):
        self.cfg, self.pool = cfg, pool
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.cfg.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []

        running = list(self.running)
        while running and budget > 0:
            request = running.pop(0)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, request.request_id
            while not self.pool.grow(request.block_table, request.num_computed_tokens + num_new):
                victim = running.pop() if running else request  # most recently admitted first
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new

        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs and not preempted:
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.pool.grow(request.block_table, request.num_computed_tokens + num_new):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
        return SchedulerOutput(scheduled, preempted)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.pool.free(request.block_table)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def update_from_output(self, output: SchedulerOutput, sampled: list[int]) -> list[Request]:
        """Advances each scheduled request; appends its sampled token if its prompt is done.

        Returns the requests that finished this step (their pages already freed).
        """
        finished = []
        for (request, num_new), token in zip(output.scheduled, sampled):
            request.num_computed_tokens += num_new
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prompt chunk that is not the last: its sample is meaningless
            request.output_token_ids.append(int(token))
            if request.check_stop():
                self.finish(request)
                finished.append(request)
        return finished

    def finish(self, request: Request, status: RequestStatus | None = None) -> None:
        if status is not None:
            request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pool.free(request.block_table)
