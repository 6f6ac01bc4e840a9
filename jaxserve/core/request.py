"""A request's state as the engine tracks it: tokens, progress, pages, and why it finished.

Plain Python only: the scheduler and engine read and write these fields, the device never sees them.
"""

from __future__ import annotations

import dataclasses
import enum
import time

from jaxserve.config.sampling_params import SamplingParams
from jaxserve.core.structured_output import GrammarMatcher
from jaxserve.lora import LoRARequest


@dataclasses.dataclass
class Logprob:
    """vLLM's: a token's logprob, its rank in the vocabulary (1: the most likely) and its text (filled in
    by whoever shows it: the engine leaves it None)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # this request failed while being served; the others went on

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # the request's own seed, or one drawn for it by the engine
    max_tokens: int  # sampling_params.max_tokens capped so prompt + output fits max_model_len
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0  # lower runs first; ties go by arrival
    arrival_index: int = 0  # set by the scheduler: the order requests reached it (ties of arrival_time)
    # When the request arrived (time.monotonic): when the HTTP server received it, before tokenizing, else
    # when it was made. Waiting requests are admitted in this order, whatever order their tokenization ended in.
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the pages (or will be, once launched steps end)
    # Tokens sampled by launched steps that the host has not read yet (at most one: with asynchronous
    # scheduling, the host reads a step's tokens after launching the next), and the newest one's row
    num_pending_tokens: int = 0
    pending_row: int = -1
    page_table: list[int] = dataclasses.field(default_factory=list)
    num_page_trims: int = 0  # times rejected drafts' pages were cut from page_table (its pages may differ)
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)  # of the full pages so far
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at (last) admission
    num_admissions: int = 0  # times the scheduler admitted it (more than once after preemptions)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # why it failed, with status FINISHED_ERROR
    # Per output token, when sampling_params.logprobs is set: {token_id: logprob}, sampled token first.
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    # When sampling_params.prompt_logprobs is set, per prompt token: None for the first (nothing precedes
    # it) and for those not computed yet, else {token_id: Logprob}, the prompt's token first, then the top
    # alternatives (core/prompt_logprobs.py); num_prompt_logprobs counts the computed ones.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_prompt_logprobs: int = 0
    detokenizer: object | None = None  # IncrementalDetokenizer, set by the engine
    grammar: GrammarMatcher | None = None  # set by the engine for structured output
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs with (None: the base model)
    lora_slot: int = 0  # the adapter's device slot while it runs (scheduler.py pins it); 0: none held

    @property
    def cache_key(self) -> str | None:
        """What seeds its prefix-cache page hashes besides the tokens (page_pool.py): its adapter."""
        lora = self.lora_request
        return None if lora is None else f"lora\0{lora.lora_name}\0{lora.lora_path}"

    @property
    def output_text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""

    @property
    def suppressed_token_ids(self) -> tuple[int, ...]:
        """EOS and stop ids are banned until min_tokens outputs exist."""
        params = self.sampling_params
        if len(self.output_token_ids) + self.num_pending_tokens >= params.min_tokens:
            return ()
        eos = () if params.ignore_eos else self.eos_token_ids
        return tuple(dict.fromkeys([*eos, *params.stop_token_ids]))

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and some are not computed yet."""
        return self.prompt_logprobs is not None and self.num_prompt_logprobs < len(self.prompt_token_ids) - 1

    @property
    def is_running(self) -> bool:
        return self.status is RequestStatus.RUNNING

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, those still on the device included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        """The tokens the host knows (num_tokens less the pending ones)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building all_token_ids (a step's few tokens of a long context)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None

    def check_stop(self) -> bool:
        """Updates the status after a new output token; True if the request is now finished."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if len(self.output_token_ids) >= params.min_tokens:
            if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
                self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, last
                return True
        if len(self.output_token_ids) >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
