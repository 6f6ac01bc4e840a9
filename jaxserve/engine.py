"""The engine core: validates requests, then loops `schedule -> execute -> update`.

It owns the scheduler, the page pool and the model runner for one loaded model. Prompts arrive
as token ids (tokenization and chat templates belong to the callers: `llm.py`, the server).
"""

from __future__ import annotations

import itertools
import logging
import random

from jaxserve.config import EngineConfig
from jaxserve.model_runner import ModelRunner, ScheduledSeq
from jaxserve.page_pool import PagePool
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling import SamplingParams
from jaxserve.scheduler import Scheduler
from jaxserve.weights import LoadedModel

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: LoadedModel, cfg: EngineConfig):
        self.model, self.cfg = model, cfg
        self.model_cfg = model.config
        if cfg.max_model_len > self.model_cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len={cfg.max_model_len} exceeds the model's "
                f"max_position_embeddings={self.model_cfg.max_position_embeddings}"
            )
        self.runner = ModelRunner(self.model_cfg, cfg, model.params)
        if self.runner.max_concurrent_tokens < cfg.max_model_len:
            raise ValueError(
                f"the KV page pool holds {self.runner.max_concurrent_tokens} tokens, fewer than "
                f"max_model_len={cfg.max_model_len}: raise num_kv_pages or kv_cache_memory_bytes"
            )
        self.pool = PagePool(self.runner.num_pages, cfg.block_size)
        self.scheduler = Scheduler(cfg, self.pool)
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(cfg.seed)
        self._ids = itertools.count()
        logger.info("max concurrent tokens in the KV pool: %d", self.runner.max_concurrent_tokens)

    def warmup(self, show_progress: bool = True) -> dict:
        return self.runner.warmup(show_progress)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> Request:
        """Validates and queues one request; raises ValueError naming the problem."""
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < self.model_cfg.vocab_size)]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.model_cfg.vocab_size})")
        if len(prompt) >= self.cfg.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens, but max_model_len is {self.cfg.max_model_len} "
                f"(at least one token must be left to generate)"
            )
        room = self.cfg.max_model_len - len(prompt)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        request = Request(request_id, prompt, params, seed=seed, max_tokens=max_tokens,
                          eos_token_ids=self.model_cfg.eos_token_ids)
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None and not request.status.is_finished:
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[Request]:
        """Runs one engine step; returns the requests that finished in it."""
        output = self.scheduler.schedule()
        if not output.scheduled:
            return []
        seqs = [
            ScheduledSeq(
                token_ids=request.all_token_ids[request.num_computed_tokens: request.num_computed_tokens + n],
                num_computed_tokens=request.num_computed_tokens,
                block_table=request.block_table,
                temperature=request.sampling_params.temperature,
                seed=request.seed,
            )
            for request, n in output.scheduled
        ]
        sampled = self.runner.execute(seqs)
        finished = self.scheduler.update_from_output(output, sampled.tolist())
        for request in finished:
            self.requests.pop(request.request_id, None)
        return finished
