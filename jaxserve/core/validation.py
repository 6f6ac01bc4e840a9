"""Validating a request at the engine's edge, against the model and the engine's settings.

It owns the checks `LLMEngine.make_request` runs before it builds a `Request`: the prompt (not empty,
inside the vocabulary, shorter than max_model_len), the priority (only under priority scheduling) and
the token ids the sampling params name (stop_token_ids, logit_bias) and what the engine cannot serve
(prompt logprobs on a multi-host engine). Each failure is an
`InvalidParameter` naming the field at fault.

What this module does not own: the ranges `SamplingParams` checks itself (config/sampling_params.py),
nor the HTTP body (server/).
"""

from __future__ import annotations

from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.sampling_params import SamplingParams
from jaxserve.errors import InvalidParameter


def checked_prompt(prompt_token_ids: list[int], priority: int, cfg: EngineConfig, vocab_size: int) -> list[int]:
    """The prompt as a list, once it and the request's priority are valid for the engine."""
    if priority != 0 and cfg.scheduling_policy != "priority":  # else any client could jump the queue
        raise InvalidParameter("priority", f"got priority {priority} but priority scheduling is not enabled "
                                           "(--scheduling-policy priority; offline, scheduling_policy='priority')")
    prompt = list(prompt_token_ids)
    if not prompt:
        raise InvalidParameter("prompt", "the prompt is empty")
    bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise InvalidParameter("prompt", f"prompt token ids {bad[:5]} are outside the vocabulary "
                                         f"[0, {vocab_size})")
    if len(prompt) >= cfg.max_model_len:
        raise InvalidParameter("prompt",
            f"the prompt has {len(prompt)} tokens, but max_model_len is {cfg.max_model_len} "
            f"(at least one token must be left to generate)"
        )
    return prompt


def check_sampling_params(params: SamplingParams, vocab_size: int, cfg: EngineConfig | None = None) -> None:
    """The token ids `params` names are inside the vocabulary, and it asks for nothing the engine (`cfg`)
    does not support."""
    for param, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidParameter(param, f"token ids {bad[:5]} in {param} are outside the vocabulary "
                                          f"[0, {vocab_size})")
    if params.prompt_logprobs is not None and cfg is not None and cfg.nnodes > 1:
        # their executable would have to run on every host of the group, and followers run steps only
        raise InvalidParameter("prompt_logprobs", "prompt_logprobs is not supported on a multi-host engine "
                                                  f"(nnodes={cfg.nnodes})")
