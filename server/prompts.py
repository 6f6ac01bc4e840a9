"""Validation at the edge: from a parsed request body to prompt token ids and `SamplingParams`.

Checks what pydantic cannot (the model name, token ids against the vocabulary, the context length,
text that is not valid Unicode, how many prompts a request may hold) and raises `APIError`s that
name the field. Tokenization and chat templates run on the server's tokenizer threads, never on the
event loop; input the tokenizer or a template cannot take is a 400.
"""

from __future__ import annotations

import dataclasses
import json

from jaxserve.config.generation_config import SamplingDefaults
from jaxserve.lora import LoRARequest
from jaxserve.errors import InvalidParameter
from jaxserve.config.sampling_params import SamplingParams
from jaxserve.config.sampling_params import StructuredOutputsParams
from server.admission import ServerState
from server.errors import APIError
from server.protocol import ChatMessage, SamplingFields


def check_model(state: ServerState, model: str | None) -> LoRARequest | None:
    """The LoRA adapter a request's `model` names (None: the base model); any other name is a 404."""
    return state.loras.resolve(model)


def check_token_ids(state: ServerState, ids: list[int], param: str) -> None:
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {state.vocab_size})", param)


def check_text(text: str, param: str) -> str:
    """Text a tokenizer can take: a JSON string may carry lone surrogates (`"\\ud800"`), which are
    not Unicode characters and cannot be encoded."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} is not valid Unicode text: it holds {text[e.start:e.end]!a} at "
                            f"character {e.start} (a lone surrogate)", param) from None
    return text


async def encode(state: ServerState, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    check_text(text, param)
    try:
        return await state.run_blocking(lambda: state.tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except Exception as e:  # noqa: BLE001 - the tokenizer's own failure on this input
        raise APIError(400, f"the tokenizer cannot take this {param} ({type(e).__name__})", param) from None


async def completion_prompts(state: ServerState, prompt, n: int) -> list[list[int]]:
    """The prompts of a completions request as token ids: a str, a list of str, a list of ids, or a
    list of lists of ids. More prompts than the server holds at once is a 400 before any is tokenized."""
    items = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
    if not items:
        raise APIError(400, "the prompt is empty", "prompt")
    if len(items) * n > state.capacity:
        raise APIError(400, f"the request asks for {len(items) * n} sequences (prompts x n), more than this "
                            f"server holds at once ({state.capacity})", "prompt" if len(items) > 1 else "n")
    prompts = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise APIError(400, "the prompt is empty", "prompt")
            item = await encode(state, item, "prompt")
        if not item:
            raise APIError(400, "the prompt is empty", "prompt")
        check_token_ids(state, item, "prompt")
        prompts.append(list(item))
    return prompts


async def chat_prompt_ids(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
                          continue_final: bool, tools: list[dict] | None = None) -> list[int]:
    """The chat template's prompt; `tools` (OpenAI's tool dicts) go to templates that render them."""
    if state.tokenizer.chat_template is None:
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    conversation = [template_message(i, m) for i, m in enumerate(messages)]

    def render() -> str:
        return state.tokenizer.apply_chat_template(
            conversation, tools=tools or None, tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final, continue_final_message=continue_final)

    try:
        text = await state.run_blocking(render)
    except Exception as e:  # noqa: BLE001 - a template may raise on roles or orderings it does not accept
        raise APIError(400, f"cannot apply the chat template: {e}", "messages") from None
    ids = await encode(state, text, "messages", add_special_tokens=False)
    if not ids:
        raise APIError(400, "the messages render to an empty prompt", "messages")
    return ids


def template_message(index: int, m: ChatMessage) -> dict:
    """One message as Hugging Face chat templates take it: text content (never None, which templates
    would print), an assistant's tool calls with their arguments as a dict, a tool result's call id."""
    content = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
    message = {"role": m.role, "content": check_text(content or "", "messages")}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        message["tool_calls"] = []
        for j, call in enumerate(m.tool_calls):
            field = f"messages[{index}].tool_calls[{j}].function.arguments"
            try:
                arguments = json.loads(check_text(call.function.arguments, field))
            except ValueError:
                raise APIError(400, f"{field} is not JSON text", field) from None
            message["tool_calls"].append({"id": call.id, "type": "function",
                                          "function": {"name": call.function.name, "arguments": arguments}})
    return message


def check_context(state: ServerState, num_prompt: int, max_tokens: int | None, param: str) -> None:
    requested = num_prompt + (max_tokens or 1)
    if requested > state.max_model_len:
        what = f"{num_prompt} in the {param}" + (f", {max_tokens} in the completion" if max_tokens else "")
        raise APIError(400, f"This model's maximum context length is {state.max_model_len} tokens. However, you "
                            f"requested {requested} tokens ({what}). Please reduce the length of the {param} "
                            f"or the completion.", param)


def sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    structured_outputs: StructuredOutputsParams | None = None,
                    show_special_tokens: bool = False, defaults: SamplingDefaults | None = None) -> SamplingParams:
    """The request's sampling fields as `SamplingParams`; their limits (counts of stop strings and
    logit_bias entries included) are checked there, and token ids by the engine at submission.
    `show_special_tokens`: a tool-call parser needs its markers, which are special tokens, in the text.
    `defaults`: what the fields the request leaves out take (the server's `state.sampling_defaults`, from
    the model's generation config; None: neutral values)."""
    defaults = defaults or SamplingDefaults()
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {key[:40]!r}", "logit_bias") from None
    try:
        params = SamplingParams(
            n=body.n, temperature=defaults.get("temperature", body.temperature),
            top_p=defaults.get("top_p", body.top_p), top_k=defaults.get("top_k", body.top_k),
            min_p=defaults.get("min_p", body.min_p), presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=defaults.get("repetition_penalty", body.repetition_penalty),
            seed=body.seed, max_tokens=defaults.max_tokens(max_tokens), min_tokens=body.min_tokens, stop=body.stop,
            stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos, logprobs=logprobs,
            logit_bias=bias or None, skip_special_tokens=body.skip_special_tokens and not show_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output, structured_outputs=structured_outputs,
        )
    except InvalidParameter as e:
        raise APIError.invalid(e) from None
    for stop in params.stop:
        check_text(stop, "stop")
    return params


def with_prompt_logprobs(params: SamplingParams, requested: int | None, echoed: int | None, stream: bool
                         ) -> SamplingParams:
    """`params` asking for the prompt logprobs the body asks for: `prompt_logprobs` (vLLM's field, refused
    in a stream, as vLLM refuses it) and, for completions' echo with logprobs, `echoed` of them (the prompt's
    logprobs lead the choice's)."""
    if requested is not None and stream:
        raise APIError(400, "prompt_logprobs are not available when stream=true", "prompt_logprobs")
    counts = [k for k in (requested, echoed) if k is not None]
    return dataclasses.replace(params, prompt_logprobs=max(counts)) if counts else params
