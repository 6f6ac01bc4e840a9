"""Preparing a scheduled step on the host: what each request's rows are and what they may sample.

It owns the draft tokens a step proposes (`propose_drafts`), the `ScheduledSeq` of each scheduled
request and of each of its drafts (`scheduled_seqs`: new tokens, a placeholder for a token still on
the device, its row in the device batch (its req_index) and whether that row must be written) and the
structured-output token bitmask of each constrained row that samples (`fill_token_bitmask`). A request whose part fails is
recorded in the step's `failed` and runs as an inert greedy row; the others go on.

What this module does not own: which requests run (scheduler.py), the padded arrays and the device
batch (runner/step_inputs.py, runner/device_batch.py), nor reading the step's tokens (output_processor.py).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.sampling_params import SamplingParams
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import SchedulerOutput
from jaxserve.core.structured_output import Grammars
from jaxserve.runner.device_batch import ReqIndices
from jaxserve.runner.page_pool import PagePool
from jaxserve.runner.step_inputs import ScheduledSeq, StepInputs

# A step's per-request failures are the engine's to report: one logger name to filter them by
logger = logging.getLogger("jaxserve.core.engine")
PLACEHOLDER = 0  # the host's stand-in for a token still on the device (the step reads the real one)
INERT_PARAMS = SamplingParams(temperature=0.0)  # the row of a request that failed before its step


def propose_drafts(output: SchedulerOutput, proposer, cfg: EngineConfig, pool: PagePool,
                   max_batch: int) -> list[list[int]]:
    """Draft tokens for each scheduled request: none unless a proposer is set and the step is all
    decode rows of at most `max_batch` (disable_by_batch_size) sequences. A request speculates unless
    its next token depends on the tokens before it in ways one shared sampling row cannot say (penalties,
    a grammar, min_tokens' banned stop tokens); drafts stop short of max_tokens, fit the largest decode
    bucket with the others' rows, and take pages only where free ones are left (never preempting)."""
    none = [[] for _ in output.scheduled]
    if proposer is None or len(output.scheduled) > max_batch:
        return none
    if not all(n == 1 and request.num_computed_tokens >= len(request.prompt_token_ids)
               for request, n in output.scheduled):
        return none
    room = cfg.max_num_seqs - len(output.scheduled)
    k = cfg.speculative_config.num_speculative_tokens
    eligible = [i for i, (request, _) in enumerate(output.scheduled)
                if request.grammar is None and not request.sampling_params.uses_penalties
                and not request.suppressed_token_ids and request.num_pending_tokens == 0]
    limits = [min(k, output.scheduled[i][0].max_tokens - len(output.scheduled[i][0].output_token_ids) - 1)
              for i in eligible]
    if room <= 0 or not any(limit > 0 for limit in limits):
        return none
    try:
        proposals = proposer.propose([output.scheduled[i][0] for i in eligible], limits)
    except Exception:  # noqa: BLE001 - drafts only save time: the step goes on without them
        logger.exception("the %s proposer failed; this step does not speculate", cfg.speculative_config.method)
        return none
    for i, draft in zip(eligible, proposals):
        request = output.scheduled[i][0]
        draft = list(draft)[:room]
        if draft and pool.grow(request.page_table, request.num_computed_tokens + 1 + len(draft)):
            none[i] = draft
            room -= len(draft)
    return none


def scheduled_seqs(output: SchedulerOutput, drafts: list[list[int]], req_indices: ReqIndices,
                   failed: dict[Request, str]) -> tuple[list[ScheduledSeq], list[list[int]]]:
    """The step's sequences, and per scheduled request its rows among them: its own, then one per draft."""
    seqs, rows = [], []
    for (request, n), draft in zip(output.scheduled, drafts):
        rows.append(list(range(len(seqs), len(seqs) + 1 + len(draft))))
        seq = scheduled_seq(request, n, req_indices, failed)
        # Each draft a decode row of its own at its position, sharing the sequence's req_index (speculative.py)
        seqs += [seq] + [dataclasses.replace(seq, token_ids=[token], num_computed_tokens=seq.num_computed_tokens + 1 + j,
                                             history=None, write_row=False, write_history=False)
                         for j, token in enumerate(draft)]
    return seqs, rows


def scheduled_seq(request: Request, num_new: int, req_indices: ReqIndices, failed: dict[Request, str]
                  ) -> ScheduledSeq:
    start, params = request.num_computed_tokens, request.sampling_params
    # With asynchronous scheduling the last token may still be on the device: a placeholder here
    num_pending = start + num_new - (request.num_tokens - request.num_pending_tokens)
    assert num_pending <= 1 and (num_pending <= 0 or request.num_pending_tokens == 1), request.request_id
    new_tokens = request.token_ids_between(start, start + num_new) + [PLACEHOLDER] * max(num_pending, 0)
    try:
        suppress_ids = request.suppressed_token_ids
        req_index, write_row, write_history = req_indices.place(
            (request, request.num_admissions), (request.num_page_trims, suppress_ids),
            holds_req_index)
        samples = start + num_new == request.num_tokens
        write_row |= samples and request.grammar is not None  # its token bitmask changes every step
        # A request takes its row when admitted, before any token of it is pending: its history is whole
        assert not (write_history and request.num_pending_tokens), request.request_id
        return ScheduledSeq(
            token_ids=new_tokens,
            num_computed_tokens=start,
            page_table=request.page_table,
            params=params,
            seed=request.seed,
            prompt_len=len(request.prompt_token_ids),
            history=request.all_token_ids if params.uses_penalties and write_history else None,
            suppress_ids=suppress_ids,
            prev_row=request.pending_row if num_pending > 0 else None,
            samples=samples,
            req_index=req_index,
            write_row=write_row,
            write_history=write_history,
            lora_slot=request.lora_slot,
        )
    except Exception:  # noqa: BLE001 - one request's failure must not end the others' step
        logger.exception("request %s: preparing its step failed", request.request_id)
        failed.setdefault(request, "preparing its step failed")
        return ScheduledSeq(new_tokens, start, request.page_table, INERT_PARAMS, seed=0,
                            req_index=req_indices.padding_index, write_row=False, write_history=False)


def holds_req_index(key: tuple[Request, int]) -> bool:
    """Whether the device batch's row of (request, admission) is still its: running since then."""
    request, admission = key
    return request.status is RequestStatus.RUNNING and request.num_admissions == admission


def row_failure_recorder(output: SchedulerOutput, rows: list[list[int]], failed: dict[Request, str]
                         ) -> Callable[[int, Exception], None]:
    """`ModelRunner.prepare`'s on_row_error: a row whose sampling row cannot be built fails its request."""
    entry_of_row = [i for i, own in enumerate(rows) for _ in own]

    def row_failed(row: int, error: Exception) -> None:
        request = output.scheduled[entry_of_row[row]][0]
        logger.error("request %s: building its sampling row failed", request.request_id, exc_info=error)
        failed.setdefault(request, "building its sampling row failed")

    return row_failed


def fill_token_bitmask(grammars: Grammars, output: SchedulerOutput, first_rows: list[int], inputs: StepInputs,
                       failed: dict[Request, str]) -> None:
    """Each structured-output row that samples this step gets what its grammar allows next, in its row
    update (such rows are written every step they sample: `scheduled_seq`). first_rows: each
    scheduled request's row (its first, if it speculates: grammar rows never do)."""
    constrained = [(row, request) for row, (request, _) in zip(first_rows, output.scheduled)
                   if request.grammar is not None and inputs.samples[row] and request not in failed]
    if not constrained:  # the common step: no per-row work at all
        return
    updates = inputs.row_updates
    update_of_row = {int(req_index): u for u, req_index in enumerate(updates.req_indices)}
    rows = {update_of_row[int(inputs.req_indices[row])]: request for row, request in constrained}
    bitmask = updates.sampling.token_bitmask  # [U, words]
    try:
        grammars.fill_bitmasks([(request.grammar, u) for u, request in rows.items()], bitmask)
    except Exception:  # noqa: BLE001 - find the rows at fault and fail them; the others go on
        for u, request in rows.items():
            try:
                request.grammar.fill(bitmask, u)
            except Exception:  # noqa: BLE001
                logger.exception("request %s: its grammar's token mask failed", request.request_id)
                failed[request] = "computing its grammar's token mask failed"
                bitmask[u] = -1
