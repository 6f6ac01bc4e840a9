"""The OpenAI-compatible routes over the background engine loop.

A generation request goes: parse (`protocol.py`) -> validate and tokenize off the event loop
(`prompts.py`) -> admit (`admission.py`) -> read the engine streams whole or as SSE
(`streaming.py`), shaped by the endpoint's `ChoiceFormat` (`responses.py`). Errors everywhere
take one shape (`errors.py`). The engine runs in its own thread (`jaxserve.core.engine_loop`); routes
only submit, read per-request streams and abort. `GET /` serves the chat page (`static/`), a client of
these routes that runs in the browser.

In front of the routes, outermost first: the Host header's check (`--allowed-hosts`, against DNS
rebinding of a keyless local server), the body's size, the API key (`errors.py`). A JSON body must say
so in its Content-Type (FastAPI's `strict_content_type`): a page on another site can send text/plain or
no Content-Type without a CORS preflight, and such a body is never parsed.
"""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.middleware.trustedhost import TrustedHostMiddleware

import jaxserve
from jaxserve.config.generation_config import SamplingDefaults
from jaxserve.core.engine_loop import EngineLoop
from server import prompts as edge
from server.admission import ServerState, Submission, submit
from server.lora import ServedLoRAs, lora_router
from server.errors import APIError, APIKeyMiddleware, BodySizeLimitMiddleware, error_response, install_error_handlers
from server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from server.responses import ChatFormat, ChoiceFormat, CompletionFormat, whole_response
from server.responses_api import responses_router
from server.streaming import collect, sse_response
from server.structured import compile_constraint, requested_constraint
from server.tokenizer_info import tokenizer_info
from server.tool_parsers import PARSERS
from server.tools import chat_constraint, tool_calling

STATIC_DIR = Path(__file__).parent / "static"
# The page loads only its own files (it works offline), and a reply's Markdown can load or run nothing.
CHAT_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "Cache-Control": "no-cache",
}


class ChatPageFiles(StaticFiles):
    """The page's files, each with the page's headers: index.html is a page at /static/index.html too."""

    def file_response(self, *args, **kwargs) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(CHAT_PAGE_HEADERS)
        return response


def check_allowed_hosts(allowed_hosts: list[str]) -> None:
    """Names or addresses as the Host header gives them, without the port; `*.example.com` for subdomains."""
    for host in allowed_hosts:
        if not host or (":" in host and not (host.startswith("[") and host.endswith("]"))):
            raise ValueError(f"allowed host {host!r} must be a name or address without a port "
                             "(an IPv6 address in brackets, as [::1])")
        if "*" in host[1:] or (host.startswith("*") and host != "*" and not host.startswith("*.")):
            raise ValueError(f"allowed host {host!r}: a wildcard is '*' alone or a leading '*.' (*.example.com)")


def create_app(engine_loop: EngineLoop, served_model_name: str, *, max_request_body_bytes: int,
               api_key: str | None = None, max_queued_requests: int = 256, chat_page: bool = True,
               tool_call_parser: str | None = None, allowed_hosts: list[str] | None = None,
               sampling_defaults: SamplingDefaults | None = None,
               enable_tokenizer_info_endpoint: bool = False) -> FastAPI:
    """`tool_call_parser`: the parser of tool_choice="auto" (`tool_parsers.PARSERS`); None refuses "auto".
    `allowed_hosts`: the Host header must name one of them (None: any host). `sampling_defaults`: what a
    request's absent sampling fields take (`generation_config.py`; None: neutral values)."""
    app = FastAPI(title="jaxserve", version=jaxserve.__version__,
                  description="OpenAI-compatible API of the jaxserve inference engine", strict_content_type=True)
    state = ServerState(engine_loop, served_model_name, max_queued_requests)
    state.sampling_defaults = sampling_defaults or SamplingDefaults()  # every route's sampling_params reads it
    state.loras = ServedLoRAs(engine_loop, served_model_name, state.engine.cfg.enable_lora)  # check_model reads it
    state.loras.start()
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ValueError(f"unknown tool_call_parser {tool_call_parser!r}; known: {', '.join(PARSERS)}")
    if allowed_hosts is not None:
        check_allowed_hosts(allowed_hosts)
    app.state.jaxserve = state
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes)  # before auth
    if allowed_hosts is not None:  # outermost; its refusal is Starlette's plain-text 400 "Invalid host header"
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts, www_redirect=False)

    if chat_page:
        app.mount("/static", ChatPageFiles(directory=STATIC_DIR), name="static")

        @app.get("/", include_in_schema=False)
        async def chat():
            return FileResponse(STATIC_DIR / "index.html", headers=CHAT_PAGE_HEADERS)

    @app.get("/health")
    async def health():
        reason = state.unavailable_reason()
        if reason is not None:
            return error_response(503, reason)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": jaxserve.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/server_info")
    async def server_info():  # a router names the replica's model from it (sglang-router's /server_info)
        return {"served_model_name": state.model_name, "max_model_len": state.max_model_len,
                "version": jaxserve.__version__, **state.sampling_defaults.server_info()}

    @app.get("/v1/models")
    async def models():  # the base model, then each LoRA adapter with its parent (lora.py)
        return {"object": "list", "data": state.loras.cards(state.created, state.max_model_len)}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        edge.check_model(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", "prompt")
        if body.messages is not None:
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
            ids = await edge.chat_prompt_ids(state, body.messages, body.add_generation_prompt, False, tools)
        else:
            ids = await edge.encode(state, body.prompt, "prompt", body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    if enable_tokenizer_info_endpoint:  # off by default, as vLLM's: it shows the tokenizer's settings
        @app.get("/tokenizer_info")
        async def get_tokenizer_info():
            return tokenizer_info(state.tokenizer)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        edge.check_model(state, body.model)
        edge.check_token_ids(state, body.tokens, "tokens")
        return {"prompt": await state.run_blocking(state.tokenizer.decode, body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        received = time.monotonic()
        lora = edge.check_model(state, body.model)
        if body.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo: the prompt alone)", "max_tokens")
        echo_only = body.echo and body.max_tokens == 0  # one token is generated, and not shown
        max_tokens = 1 if echo_only else body.max_tokens
        constraint = requested_constraint(body)
        if constraint is not None:
            await compile_constraint(state, constraint)
        params = edge.sampling_params(body, max_tokens, body.logprobs, constraint and constraint.params,
                                      defaults=state.sampling_defaults)
        params = edge.with_prompt_logprobs(params, body.prompt_logprobs, body.logprobs if body.echo else None,
                                           body.stream)
        prompts = await edge.completion_prompts(state, body.prompt, body.n)
        for ids in prompts:
            edge.check_context(state, len(ids), max_tokens, "prompt")
        echo = [await state.run_blocking(state.tokenizer.decode, ids) if body.echo else "" for ids in prompts]
        fmt = CompletionFormat(state.tokenizer, len(prompts) * body.n, echo, body.n, body.logprobs, prompts, echo_only)
        return await _generate(state, raw, body, prompts, params, fmt, lora, received)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        received = time.monotonic()
        lora = edge.check_model(state, body.model)
        max_tokens = body.max_completion_tokens or body.max_tokens
        num_top = (body.top_logprobs or 0) if body.logprobs else None
        calling = tool_calling(body, tool_call_parser, state.tokenizer)
        constraint = await chat_constraint(state, body, calling)
        params = edge.sampling_params(body, max_tokens, num_top, constraint and constraint.params,
                                      show_special_tokens=bool(calling and calling.parser
                                                               and calling.parser.show_special_tokens),
                                      defaults=state.sampling_defaults)
        params = edge.with_prompt_logprobs(params, body.prompt_logprobs, None, body.stream)
        ids = await edge.chat_prompt_ids(state, body.messages, body.add_generation_prompt,
                                         body.continue_final_message, calling and calling.tools)
        edge.check_context(state, len(ids), max_tokens, "messages")
        fmt = ChatFormat(state.tokenizer, body.n, num_top, calling)
        return await _generate(state, raw, body, [ids], params, fmt, lora, received)

    app.include_router(responses_router(state, tool_call_parser))  # /v1/responses: responses_api.py
    if state.loras.enabled:  # /v1/load_lora_adapter and /v1/unload_lora_adapter: lora.py
        app.include_router(lora_router(state.loras))
    return app


async def _generate(state: ServerState, raw: Request, body, prompts: list[list[int]], params,
                    fmt: ChoiceFormat, lora=None, received: float | None = None):
    """Admits the request's sequences (with `lora`'s adapter, if given; received: see `submit`) and
    answers with their output, whole or streamed."""
    submission: Submission = submit(state, prompts, params, body.priority, lora, received)
    try:
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse_response(state, submission, fmt, prompts, include_usage)
        results = await collect(state, submission, raw)
    except BaseException:
        submission.close()
        raise
    return whole_response(fmt, submission.model_name, results, prompts)
