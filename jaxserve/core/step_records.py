"""What one engine step hands from stage to stage.

`LLMEngine.step` is schedule -> prepare -> launch -> read, and each stage returns one record: the
scheduler's `SchedulerOutput`, then a `PreparedStep` (the step's host inputs, not launched yet), then a
`LaunchedStep` (its tokens still on the device), then the requests that got a token. Plain dataclasses,
built once per step. `STEP_PHASES` names the host's timed phases of a step (`LLMEngine.phase_seconds`).

What this module does not own: building the records (engine.py, step_prep.py) or reading a step's
tokens into its requests (output_processor.py).
"""

from __future__ import annotations

import dataclasses

from jaxserve.core.prompt_logprobs import PromptLogprobJob
from jaxserve.core.request import Request
from jaxserve.core.scheduler import SchedulerOutput
from jaxserve.ops.sampling import PromptLogprobs, SamplerOutput
from jaxserve.runner.step_inputs import StepInputs

STEP_PHASES = ("schedule", "inputs", "grammar", "launch", "wait", "update")


@dataclasses.dataclass
class PreparedStep:
    """A scheduled step whose inputs are built on the host and not launched yet."""

    output: SchedulerOutput
    kind: str  # the entry point: "prefill" or "decode"
    bucket: int
    inputs: StepInputs  # padded to the bucket
    # Per scheduled request, its rows (one, or its newest token's and its drafts') and its draft tokens
    rows: list[list[int]]
    drafts: list[list[int]]
    with_logprobs: bool  # some request asked for logprobs: reading the step copies them too
    # Requests whose part of the step failed, with the message for their client. Their rows run as inert
    # greedy rows, so the K/V of their pages (maybe already in the prefix cache) are written as scheduled.
    failed: dict[Request, str]
    prompt_logprobs: PromptLogprobJob | None = None  # its rows whose prompt logprobs requests want


@dataclasses.dataclass
class LaunchedStep:
    """A step whose sampled tokens the host has not read yet."""

    output: SchedulerOutput
    sampled: SamplerOutput  # on the device
    with_logprobs: bool
    rows: list[list[int]]  # as in its PreparedStep
    drafts: list[list[int]]
    prompt_logprobs: tuple[PromptLogprobJob, PromptLogprobs] | None = None  # the job and its (device) output

    @property
    def num_rows(self) -> int:
        return sum(map(len, self.rows))

    @property
    def has_grammar(self) -> bool:
        return any(request.grammar is not None for request, _ in self.output.scheduled)
