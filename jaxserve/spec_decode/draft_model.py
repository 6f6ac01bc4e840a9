"""Speculative decoding's "draft_model" method: a smaller model with the target's vocabulary proposes.

The draft model runs in its own `ModelRunner` (one device, its own compiled buckets) over its own
`PagePool`. Per running request it keeps a page table and the token ids whose K/V those pages hold
(`_DraftSeq`). At each `propose` the draft first catches up: the tokens the target appended since
the last proposal (its accepted drafts, the token after them) overwrite whatever the draft held past
their common prefix, since a rejected draft's K/V is stale. One step feeds every request's catch-up
as ragged rows and samples d1 greedily (a catch-up longer than a step's token budget, a long prompt's
first, feeds its head in steps before); then one decode step per further draft feeds the draft token
the step before sampled, which it takes on the device (`ScheduledSeq.prev_row`), so the host reads
the draft tokens once, after the last step is launched.

Drafts are proposed greedily (argmax): verification accepts a draft exactly when it equals the
target's own draw (speculative.py), so a draft costs nothing in correctness, only in acceptance.
This module does not decide which requests speculate or how many drafts they get (engine.py).
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from jaxserve.config import device_defaults
from jaxserve.config.model_config import ModelConfig
from jaxserve.config.engine_config import EngineConfig
from jaxserve.errors import InvalidParameter
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.page_pool import PagePool
from jaxserve.config.sampling_params import SamplingParams
from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.spec_decode.speculative import ProposalRequest
from jaxserve.runner.step_inputs import ScheduledSeq
from jaxserve.weights import load_model

logger = logging.getLogger(__name__)
_GREEDY = SamplingParams(temperature=0.0)
_PLACEHOLDER = 0  # a draft token still on the device: the step takes it from the previous step's row


@dataclasses.dataclass
class _DraftSeq:
    """One request's share of the draft model, for one admission of it."""

    num_admissions: int
    page_table: list[int] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)  # those whose K/V the pages hold
    # Tokens of the request when last proposed for: the target keeps them, so the draft's K/V of them stays valid
    num_known_tokens: int = 0


def draft_engine_config(spec: SpeculativeConfig, engine_cfg: EngineConfig, model_cfg: ModelConfig,
                        draft_cfg: ModelConfig, max_pool_bytes: int | None = None) -> EngineConfig:
    """The draft runner's settings: the target's limits and buckets on one device, no prefix cache, and
    a pool of max_num_seqs whole sequences or the target pool's tokens, whichever is smaller (the
    draft never holds more tokens than the target, bar the drafts), within max_pool_bytes if given, but
    at least one sequence and a page. Its steps hold at most `disable_by_batch_size` sequences, the most
    the engine speculates for at once."""
    pages_per_seq = engine_cfg.pages_per_seq
    target_pages = engine_cfg.num_kv_pages
    if target_pages is None:  # sized from memory; under tensor parallelism this undercounts: a smaller pool
        target_pages = device_defaults.num_pool_pages(engine_cfg, model_cfg)
    num_pages = min(engine_cfg.max_num_seqs * pages_per_seq, target_pages)
    if max_pool_bytes is not None:
        page_bytes = draft_cfg.kv_bytes_per_token(device_defaults.resolve_kv_cache_dtype(engine_cfg)) * engine_cfg.page_size
        num_pages = min(num_pages, max_pool_bytes // page_bytes)
    max_num_seqs = min(engine_cfg.max_num_seqs, spec.batch_limit)
    return dataclasses.replace(
        engine_cfg, speculative_config=None, tensor_parallel_size=1, nnodes=1, node_rank=0,
        num_kv_pages=max(num_pages, pages_per_seq + 1), kv_cache_memory_bytes=None, async_scheduling=False,
        enable_prefix_caching=False, max_num_seqs=max_num_seqs)


def free_device_bytes() -> int | None:
    """What XLA's allocator may still hand out on this process's first device; None where it does not say (a CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0) if "bytes_limit" in stats else None


class DraftModelProposer:
    """Greedy drafts of `spec.model` for a target of `model_cfg` served with (resolved) `engine_cfg`."""

    def __init__(self, spec: SpeculativeConfig, model_cfg: ModelConfig, engine_cfg: EngineConfig):
        def invalid(message: str) -> InvalidParameter:
            return InvalidParameter("speculative_config", f"speculative_config: {message}")

        try:
            draft = load_model(spec.model, engine_cfg.dtype)
        except (OSError, ValueError) as e:
            raise invalid(f"the draft model {spec.model!r} cannot be loaded: {e}") from e
        cfg = draft.config
        if cfg.vocab_size != model_cfg.vocab_size:
            raise invalid(f"the draft model's vocab_size={cfg.vocab_size} differs from the target's "
                          f"vocab_size={model_cfg.vocab_size}; the draft must share the target's tokenizer")
        if cfg.max_position_embeddings < engine_cfg.max_model_len:
            raise invalid(f"the draft model's context (max_position_embeddings={cfg.max_position_embeddings}) is "
                          f"shorter than max_model_len={engine_cfg.max_model_len}: lower max_model_len")
        # The target's pool took what gpu_memory_utilization grants: the draft's takes at most half of what
        # is left after its weights (the other half: their serving copy's slack and the draft's steps)
        free = free_device_bytes()
        weight_bytes = sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(draft.params))
        max_pool_bytes = None if free is None else max(0, free - weight_bytes) // 2
        self.runner = ModelRunner(cfg, draft_engine_config(spec, engine_cfg, model_cfg, cfg, max_pool_bytes),
                                  draft.params)
        self.pool = PagePool(self.runner.num_pages, self.runner.cfg.page_size, enable_prefix_caching=False)
        self.max_num_seqs = self.runner.cfg.max_num_seqs
        self.seqs: dict[ProposalRequest, _DraftSeq] = {}
        logger.debug("draft model %s: %d layers, hidden %d; its KV cache %d pages of %d tokens", draft.source,
                    cfg.num_layers, cfg.hidden_size, self.runner.num_pages - 1, self.runner.cfg.page_size)

    def warmup(self, show_progress: bool = True) -> int:
        """Compiles the draft's buckets; the number of executables."""
        return self.runner.warmup(show_progress)["num_executables"]

    def propose(self, requests: list[ProposalRequest], limits: list[int]) -> list[list[int]]:
        """Up to limits[i] greedy draft tokens for each request (none where the draft's pool is full)."""
        self._drop_gone()
        drafts: list[list[int]] = [[] for _ in requests]
        todo = [i for i, limit in enumerate(limits) if limit > 0 and self._make_room(requests[i], limit)]
        for start in range(0, len(todo), self.max_num_seqs):
            group = todo[start:start + self.max_num_seqs]
            for i, draft in zip(group, self._propose_group([requests[i] for i in group], [limits[i] for i in group])):
                drafts[i] = draft
        return drafts

    def _drop_gone(self) -> None:
        """Frees the pages of requests no longer running, or running again since a preemption."""
        for request, seq in list(self.seqs.items()):
            if not request.is_running or request.num_admissions != seq.num_admissions:
                self.pool.free(seq.page_table)
                del self.seqs[request]

    def _make_room(self, request: ProposalRequest, limit: int) -> bool:
        """Cuts the request's draft K/V back to its common prefix with the request's tokens and takes the
        pages its catch-up and limit - 1 fed drafts need; False (no drafts now) if too few are free."""
        seq = self.seqs.get(request)
        if seq is None:
            seq = self.seqs[request] = _DraftSeq(request.num_admissions)
        tokens = request.all_token_ids
        assert len(tokens) + limit - 1 <= self.runner.cfg.max_model_len, (request.request_id, len(tokens), limit)
        # Within one admission a request's tokens only grow: what the draft held of the tokens known at the
        # last proposal still holds; past them it held its own drafts, kept up to the first the target rejected
        num_valid = min(seq.num_known_tokens, len(seq.token_ids))
        while num_valid < min(len(seq.token_ids), len(tokens) - 1) and seq.token_ids[num_valid] == tokens[num_valid]:
            num_valid += 1
        del seq.token_ids[num_valid:]
        self.pool.shrink(seq.page_table, num_valid)
        return self.pool.grow(seq.page_table, len(tokens) + limit - 1)

    @staticmethod
    def _row(seq: _DraftSeq, token_ids: list[int], samples: bool = True) -> ScheduledSeq:
        """One catch-up row: token_ids fed after the K/V the draft holds (req_index None: the row written whole)."""
        return ScheduledSeq(token_ids=token_ids, num_computed_tokens=len(seq.token_ids), page_table=seq.page_table,
                            params=_GREEDY, seed=0, samples=samples)

    def _propose_group(self, requests: list[ProposalRequest], limits: list[int]) -> list[list[int]]:
        """The drafts of at most max_num_seqs requests, each with room for them in the pool."""
        seqs = [self.seqs[request] for request in requests]
        tokens = [request.all_token_ids for request in requests]
        # The catch-up's head in steps of at most max_num_batched_tokens (a long prompt, the first time),
        # leaving each request at least its last token, so that one step holds the rest and samples every d1
        budget = self.runner.cfg.max_num_batched_tokens
        while (num_left := sum(len(t) - len(seq.token_ids) for t, seq in zip(tokens, seqs))) > budget:
            room, rows = min(budget, num_left - len(seqs)), []
            for t, seq in zip(tokens, seqs):
                n = min(len(t) - len(seq.token_ids) - 1, room)
                if n > 0:
                    rows.append(self._row(seq, t[len(seq.token_ids):len(seq.token_ids) + n], samples=False))
                    seq.token_ids += rows[-1].token_ids
                    room -= n
            self.runner.execute(rows)
        outputs = [self.runner.execute([self._row(seq, t[len(seq.token_ids):]) for t, seq in zip(tokens, seqs)])]
        # Each further draft: a decode row per request that wants it, fed on the device the draft token
        # its row of the step before sampled. step_rows[j]: the requests (by index) of step j, row by row
        step_rows = [list(range(len(seqs)))]
        for j in range(1, max(limits)):
            row_of = {i: row for row, i in enumerate(step_rows[-1])}
            step_rows.append([i for i, limit in enumerate(limits) if limit > j])
            outputs.append(self.runner.execute([
                ScheduledSeq([_PLACEHOLDER], len(tokens[i]) + j - 1, seqs[i].page_table, _GREEDY, seed=0,
                             prev_row=row_of[i]) for i in step_rows[-1]]))
        sampled = [self.runner.fetch(out, len(rows), with_logprobs=False).token_ids  # [rows]
                   for out, rows in zip(outputs, step_rows)]
        drafts = [[] for _ in seqs]
        for j, rows in enumerate(step_rows):
            for row, i in enumerate(rows):
                drafts[i].append(int(sampled[j][row]))
        for t, seq, draft in zip(tokens, seqs, drafts):
            seq.token_ids[:] = t + draft[:-1]  # every draft but the last was fed
            seq.num_known_tokens = len(t)
        return drafts
