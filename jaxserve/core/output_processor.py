"""Reading a launched step's tokens into its requests.

It owns what happens once a step's sampled tokens are on the host (`update_requests`): a speculating
request keeps its accepted drafts and the token after them (`SpecDecodeStats` counts them), the
scheduler appends the tokens (`Scheduler.update_from_output`: stop ids, EOS, max_tokens), and after
each new token the request's grammar moves past it and its text grows (`on_token`: a complete grammar
or a stop string ends the request, a grammar that refuses the token or a failing detokenizer fails it
alone).

What this module does not own: fetching the tokens from the device (the model runner), the stop checks
on token ids (scheduler.py), nor the incremental decoding itself (detokenizer.py).
"""

from __future__ import annotations

import functools
import logging

from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.step_records import LaunchedStep
from jaxserve.ops.sampling import SamplerOutput
from jaxserve.spec_decode.speculative import SpecDecodeStats, accepted_run

# A request's failure while its tokens are read is the engine's to report: one logger name to filter them by
logger = logging.getLogger("jaxserve.core.engine")


def update_requests(scheduler: Scheduler, launched: LaunchedStep, sampled: SamplerOutput,
                    spec_stats: SpecDecodeStats | None) -> list[Request]:
    """Appends a launched step's tokens, read to the host (`sampled`), to its requests; returns those
    that got one. A speculating request takes its accepted drafts' rows and the one after them."""
    rows = launched.rows
    if any(launched.drafts):
        rows = [own[:accepted_run(draft, [int(sampled.token_ids[r]) for r in own]) + 1]
                for own, draft in zip(launched.rows, launched.drafts)]
        for own, draft in zip(rows, launched.drafts):
            if draft:
                spec_stats.observe(len(draft), len(own) - 1)
    return scheduler.update_from_output(launched.output, sampled, rows, functools.partial(on_token, scheduler))


def on_token(scheduler: Scheduler, request: Request) -> None:
    """After each new token of a request: its grammar moves past it, its text grows (stops checked)."""
    advance_grammar(scheduler, request)
    detokenize(scheduler, request)


def advance_grammar(scheduler: Scheduler, request: Request) -> None:
    """Moves a structured-output request's grammar past its new token; a grammar that is complete
    ends the request ("stop"), one that cannot take the token fails it."""
    if request.grammar is None or request.status is RequestStatus.FINISHED_ERROR:
        return
    token = request.output_token_ids[-1]
    if not request.grammar.accept(token):
        if not request.status.is_finished:  # ended anyway (its length, an EOS) and nothing more is sampled
            scheduler.fail(request, f"the grammar does not allow token {token}: "
                                    f"{request.grammar.error or 'no token was allowed'}")
        return
    if request.grammar.is_terminated and not request.status.is_finished:
        scheduler.finish(request, RequestStatus.FINISHED_STOPPED)


def detokenize(scheduler: Scheduler, request: Request) -> None:
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
        scheduler.fail(request, "detokenizing its output failed")
        return
    if stop is not None and not request.status.is_finished:
        request.stop_reason = stop
        scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
