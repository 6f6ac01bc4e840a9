"""Prompt logprobs on the host: which token rows of a step a request wants the logprobs of, and reading
the device's answers into the request (`Request.prompt_logprobs`, vLLM's shape).

The logits at position p give prompt token p + 1, so a chunk of positions [start, start + n) yields the
entries of prompt tokens start + 1 .. start + n (none for the last prompt position, whose logits give the
first output token). Chunks are read as they are computed, so chunked prefill needs nothing more; a
request recomputed after a preemption rewrites the same entries, and one whose entries are all in asks
for none. Such a request does not read the prefix cache while it needs them (scheduler.py), as in
vLLM V1: each prompt position it wants must be computed.

What this module does not own: the executable that computes them (runner/prompt_logprobs.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.core.request import Logprob, Request
from jaxserve.core.scheduler import SchedulerOutput
from jaxserve.ops.sampling import PromptLogprobs


@dataclasses.dataclass
class PromptLogprobJob:
    """One step's prompt-logprob rows: the job array the runner takes and where each answer goes."""

    job: np.ndarray  # [2, W] int32: token rows of the step (-1 past the used ones), target token ids
    # (request, its first prompt token index answered, how many, the first of their job rows)
    spans: list[tuple[Request, int, int, int]]

    @property
    def num_rows(self) -> int:
        return sum(count for _, _, count, _ in self.spans)


def wanted_positions(request: Request, num_new: int) -> range:
    """The positions of the request's next `num_new` tokens (from num_computed_tokens) whose logits give a
    prompt token's logprob it still needs."""
    if not request.needs_prompt_logprobs:
        return range(0)
    start = request.num_computed_tokens
    return range(start, max(start, min(start + num_new, len(request.prompt_token_ids) - 1)))


def wants_prompt_logprobs(output: SchedulerOutput) -> bool:
    """Whether any scheduled request wants prompt logprobs from this step (it must then run as a prefill step)."""
    return any(request.needs_prompt_logprobs and wanted_positions(request, n) for request, n in output.scheduled)


def build_job(output: SchedulerOutput, first_rows: list[int], cu_q_lens: np.ndarray, width: int
              ) -> PromptLogprobJob | None:
    """The step's job, before it is advanced: first_rows, each scheduled request's sequence in the step;
    cu_q_lens, where each sequence's tokens start on the step's token axis."""
    rows, targets, spans = [], [], []
    for (request, num_new), seq in zip(output.scheduled, first_rows):
        positions = wanted_positions(request, num_new)
        if not positions:
            continue
        first_row = int(cu_q_lens[seq]) - request.num_computed_tokens  # the token row of position 0
        spans.append((request, positions.start + 1, len(positions), len(rows)))
        rows += [first_row + p for p in positions]
        targets += request.prompt_token_ids[positions.start + 1:positions.stop + 1]
    if not spans:
        return None
    job = np.zeros((2, width), np.int32)
    job[0] = -1
    job[0, :len(rows)], job[1, :len(rows)] = rows, targets
    return PromptLogprobJob(job, spans)


def read_job(job: PromptLogprobJob, output: PromptLogprobs) -> None:
    """Copies a launched job's answers to the host (waiting for them) and writes each request's entries:
    {prompt token: Logprob}, then the top `prompt_logprobs` alternatives."""
    num_rows = job.num_rows
    logprobs, ranks, top_ids, top_logprobs = (np.asarray(a.addressable_data(0))[:num_rows] for a in output)
    for request, first, count, offset in job.spans:
        num_top = request.sampling_params.prompt_logprobs
        for i in range(count):
            row, index = offset + i, first + i
            entry = {request.prompt_token_ids[index]: Logprob(float(logprobs[row]), int(ranks[row]))}
            for rank, (token, logprob) in enumerate(zip(top_ids[row, :num_top].tolist(),
                                                        top_logprobs[row, :num_top].tolist()), 1):
                entry.setdefault(token, Logprob(logprob, rank))
            request.num_prompt_logprobs += request.prompt_logprobs[index] is None
            request.prompt_logprobs[index] = entry
