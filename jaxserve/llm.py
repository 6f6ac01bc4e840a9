"""The offline API, vLLM-style: `LLM(model).generate(prompts, SamplingParams(...))` and `.chat(...)`.

It tokenizes, applies chat templates, feeds the engine, and detokenizes finished requests; it
returns outputs in input order. Engine settings are keyword arguments with vLLM's names.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Sequence

from tqdm.auto import tqdm

from jaxserve.config.engine_config import engine_config_from_kwargs
from jaxserve.config.generation_config import SamplingDefaults, resolve_sampling_defaults
from jaxserve.core.engine import LLMEngine
from jaxserve.core.request import Logprob, Request
from jaxserve.lora import LoRARequest
from jaxserve.config.sampling_params import SamplingParams
from jaxserve.weights import default_model_path

logger = logging.getLogger(__name__)

Prompt = str | dict[str, Any]  # text, or {"prompt_token_ids": [...]} / {"prompt": "..."}


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Per token {token_id: logprob} (sampled token first, then the top alternatives), when asked for.
    logprobs: list[dict[int, float]] | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    # When SamplingParams.prompt_logprobs is set (vLLM's shape): per prompt token, None for the first, then
    # {token_id: Logprob(logprob, rank, decoded_token)}, the prompt's own token first, then the top ones.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class LLM:
    """Loads a model (None = the default SmolLM2-135M-Instruct), compiles its buckets, generates."""

    def __init__(self, model: str | os.PathLike | None = None, *, warmup: bool = True, **engine_kwargs):
        """engine_kwargs: any `EngineConfig` setting by name (vLLM's names), dtype included."""
        cfg = engine_config_from_kwargs(**engine_kwargs)
        # generate() and chat() without sampling params use them (read before the slow load, to fail first)
        self.sampling_defaults: SamplingDefaults = resolve_sampling_defaults(
            cfg.generation_config, cfg.override_generation_config, default_model_path() if model is None else model)
        self.engine, self.warmup_summary = LLMEngine.from_config(model, cfg, warmup=warmup)
        self.config = self.engine.cfg
        self.tokenizer = self.engine.tokenizer
        self._group_error: str | None = None  # a multi-host group's follower gone: every later generate raises
        if self.engine.leader is not None:  # a loss before this line is handed over at once
            self.engine.leader.on_follower_lost = self._follower_lost

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generates for every prompt (str or {"prompt_token_ids": [...]}); outputs in input order.

        `priority` (one int per prompt, lower first) only matters when requests compete for slots, and
        only under scheduling_policy="priority": otherwise a non-zero one is a ValueError (vLLM's rule).
        `lora_request`: the LoRA adapter every prompt runs with, or one per prompt (None: the base model);
        needs enable_lora. A new adapter is loaded on first use.
        """
        self._check_group()
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"got {len(lora_request)} LoRA requests for {len(prompts)} prompts")
        if any(lora_request) and not self.config.enable_lora:
            raise ValueError("lora_request needs enable_lora=True")
        encoded = [self._encode(p) for p in prompts]
        # Validate everything before queueing anything, so a bad prompt leaves nothing behind.
        # n > 1: n requests with their own seeds; the prefix cache shares the prompt's pages.
        groups = []
        for (_, ids), params, prio, lora in zip(encoded, sampling_params, priority, lora_request):
            base = self.engine.make_request(ids, params, priority=prio, lora_request=lora)
            groups.append([base] + [self.engine.make_request(ids, params, f"{base.request_id}-{i}", prio, i, lora)
                                    for i in range(1, params.n)])
        requests = [r for group in groups for r in group]
        for request in requests:
            self.engine.add_request(request)
        self._run(requests, use_tqdm)
        return [self._output(group, text, self.tokenizer) for group, (text, _) in zip(groups, encoded)]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Applies the chat template to one conversation or a list of them, then generates (with
        `lora_request`'s adapters, as `generate`).

        chat_template: a Jinja template to use instead of the model's own (vLLM's argument), for a
        model that ships none (many GGUF files) or to override it."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        template = chat_template or self.tokenizer.chat_template
        if template is None:
            raise ValueError("this model's tokenizer has no chat template: pass chat_template=, or use generate()")
        prompts = [
            self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               chat_template=template)
            for conv in conversations
        ]
        if sampling_params is None:  # the model's max_tokens, else up to the end of the context
            sampling_params = self.sampling_defaults.sampling_params(max_tokens=self.sampling_defaults.max_tokens(None))
        return self.generate([{"prompt": p, "add_special_tokens": False} for p in prompts],
                             sampling_params, use_tqdm, lora_request=lora_request)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() under the model's sampling defaults (`generation_config`, vLLM's method)."""
        return self.sampling_defaults.sampling_params()

    def get_stats(self) -> dict:
        """The engine's counters; see `LLMEngine.get_stats`."""
        return self.engine.get_stats()

    # ----------------------------------------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            text = prompt["prompt"]
            if not text:
                raise ValueError("the prompt is empty")
            return text, self.tokenizer.encode(text, add_special_tokens=prompt.get("add_special_tokens", True))
        raise ValueError(f"a prompt must be a str or a dict with 'prompt' or 'prompt_token_ids', got {prompt!r:.80}")

    def _follower_lost(self, message: str) -> None:
        """A multi-host follower has gone (from the leader's watcher thread): the group cannot step again."""
        self._group_error = message

    def _check_group(self) -> None:
        if self._group_error is not None:
            raise RuntimeError(self._group_error)

    def _run(self, requests: list[Request], use_tqdm: bool) -> None:
        pending = {r.request_id for r in requests if not r.status.is_finished}
        with tqdm(total=len(requests), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while pending:
                self._check_group()
                for request in self.engine.step():
                    if request.status.is_finished and request.request_id in pending:
                        pending.discard(request.request_id)
                        bar.update(1)

    @staticmethod
    def _output(group: list[Request], prompt: str | None, tokenizer=None) -> RequestOutput:
        completions = [
            CompletionOutput(i, r.output_text, list(r.output_token_ids), r.finish_reason, r.stop_reason,
                             r.logprobs if r.sampling_params.logprobs is not None else None)
            for i, r in enumerate(group)
        ]
        return RequestOutput(group[0].request_id, prompt, group[0].prompt_token_ids, completions,
                             prompt_logprobs=decoded_prompt_logprobs(group[0].prompt_logprobs, tokenizer))


def decoded_prompt_logprobs(entries: list[dict[int, Logprob] | None] | None, tokenizer
                            ) -> list[dict[int, Logprob] | None] | None:
    """The engine's prompt logprobs with each token's text (vLLM decodes each token on its own)."""
    if entries is None:
        return None
    decode = (lambda token: tokenizer.decode([token])) if tokenizer is not None else (lambda token: None)  # noqa: E731
    return [None if entry is None else {token: dataclasses.replace(lp, decoded_token=decode(token))
                                        for token, lp in entry.items()} for entry in entries]
