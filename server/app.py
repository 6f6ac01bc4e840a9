"""The OpenAI-compatible HTTP layer: FastAPI routes over the background engine loop.

This module owns request parsing and validation against the loaded model, the OpenAI response and
SSE chunk shapes, back-pressure, client disconnects and error bodies. The engine runs in its own
thread (`jaxserve.engine_loop`); handlers only submit, read per-request streams and abort.
Every error is `{"error": {"message", "type", "param", "code"}}`; a bad request never gets a 500.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxserve
from jaxserve.engine_loop import EngineLoop, RequestStream, StreamDelta
from jaxserve.sampling import SamplingParams
from server.metrics import Metrics, RequestTimer
from server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, SamplingFields,
                             TokenizeRequest)

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                422: "BadRequestError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": param,
                      "code": status}}


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None):
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


class _APIKeyMiddleware:
    """Requires `Authorization: Bearer KEY` on /v1/*. Plain ASGI, not BaseHTTPMiddleware, which would
    hide client disconnects from the handlers (and so keep abandoned requests running)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            if dict(scope["headers"]).get(b"authorization", b"") != self.expected:
                response = error_response(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ServerState:
    def __init__(self, engine_loop: EngineLoop, served_model_name: str, max_queued_requests: int):
        self.engine_loop = engine_loop
        self.engine = engine_loop.engine
        self.tokenizer = self.engine.tokenizer
        self.model_name = served_model_name
        self.max_model_len = self.engine.cfg.max_model_len
        self.vocab_size = self.engine.model_cfg.vocab_size
        self.capacity = self.engine.cfg.max_num_seqs + max_queued_requests
        self.num_in_flight = 0  # touched only from the event loop
        self.metrics = Metrics(self.engine)
        self.created = int(time.time())


def create_app(engine_loop: EngineLoop, served_model_name: str, *, api_key: str | None = None,
               max_queued_requests: int = 256) -> FastAPI:
    app = FastAPI(title="jaxserve", version=jaxserve.__version__,
                  description="OpenAI-compatible API of the jaxserve inference engine")
    state = ServerState(engine_loop, served_model_name, max_queued_requests)
    app.state.jaxserve = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: "
                            f"{err.get('msg')}" for err in errors[:5])
        return error_response(400, message or "invalid request", ".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health():
        if not state.engine_loop.is_alive:
            return error_response(503, f"the engine loop is not running: {state.engine_loop.error!r}")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": jaxserve.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "jaxserve",
            "root": state.engine.model.source, "max_model_len": state.max_model_len,
        }]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        _check_model(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", "prompt")
        if body.messages is not None:
            ids = _chat_prompt_ids(state, body.messages, body.add_generation_prompt, False)
        else:
            ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _check_model(state, body.model)
        _check_token_ids(state, body.tokens, "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        _check_model(state, body.model)
        if body.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs needs prompt logprobs, which jaxserve does not support yet",
                           "echo")
        prompts = _completion_prompts(state, body.prompt)
        params = _sampling_params(state, body, body.max_tokens, body.logprobs)
        for ids in prompts:
            _check_context(state, len(ids), body.max_tokens, "prompt")
        streams = _submit(state, prompts, params, body)
        kind = "text_completion"
        echo = [state.tokenizer.decode(ids) if body.echo else "" for ids in prompts]
        if body.stream:
            return _sse(_stream_completion(state, body, streams, prompts, echo, kind), streams)
        results = await _collect(state, streams, raw)
        choices = [{"index": i, "text": echo[i // body.n] + r.text,
                    "logprobs": _completion_logprobs(state, r.logprobs) if body.logprobs is not None else None,
                    "finish_reason": r.finish_reason, "stop_reason": r.stop_reason}
                   for i, r in enumerate(results)]
        return {"id": _id("cmpl"), "object": kind, "created": int(time.time()), "model": state.model_name,
                "choices": choices, "usage": _usage(prompts, results)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        _check_model(state, body.model)
        ids = _chat_prompt_ids(state, body.messages, body.add_generation_prompt, body.continue_final_message)
        max_tokens = body.max_completion_tokens or body.max_tokens
        _check_context(state, len(ids), max_tokens, "messages")
        num_top = (body.top_logprobs or 0) if body.logprobs else None
        params = _sampling_params(state, body, max_tokens, num_top)
        streams = _submit(state, [ids], params, body)
        if body.stream:
            return _sse(_stream_chat(state, body, streams, ids), streams)
        results = await _collect(state, streams, raw)
        choices = [{"index": i, "message": {"role": "assistant", "content": r.text},
                    "logprobs": _chat_logprobs(state, r.logprobs, num_top) if body.logprobs else None,
                    "finish_reason": r.finish_reason, "stop_reason": r.stop_reason}
                   for i, r in enumerate(results)]
        return {"id": _id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
                "model": state.model_name, "choices": choices, "usage": _usage([ids], results)}

    return app


# ------------------------------------------------------------------------------------------------
# validation at the edge


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}", "model")


def _check_token_ids(state: ServerState, ids: list[int], param: str) -> None:
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {state.vocab_size})", param)


def _completion_prompts(state: ServerState, prompt) -> list[list[int]]:
    items = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
    if not items:
        raise APIError(400, "the prompt is empty", "prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise APIError(400, "the prompt is empty", "prompt")
            item = state.tokenizer.encode(item)
        if not item:
            raise APIError(400, "the prompt is empty", "prompt")
        _check_token_ids(state, item, "prompt")
        prompts.append(list(item))
    return prompts


def _chat_prompt_ids(state: ServerState, messages, add_generation_prompt: bool, continue_final: bool) -> list[int]:
    if state.tokenizer.chat_template is None:
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    conversation = []
    for m in messages:
        content = m.content if isinstance(m.content, str) or m.content is None else \
            "".join(part.text for part in m.content)
        conversation.append({"role": m.role, "content": content or ""})
    try:
        text = state.tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt and not continue_final,
            continue_final_message=continue_final)
    except Exception as e:  # a template may raise on roles or orderings it does not accept
        raise APIError(400, f"cannot apply the chat template: {e}", "messages") from None
    ids = state.tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise APIError(400, "the messages render to an empty prompt", "messages")
    return ids


def _check_context(state: ServerState, num_prompt: int, max_tokens: int | None, param: str) -> None:
    requested = num_prompt + (max_tokens or 1)
    if requested > state.max_model_len:
        what = f"{num_prompt} in the {param}" + (f", {max_tokens} in the completion" if max_tokens else "")
        raise APIError(400, f"This model's maximum context length is {state.max_model_len} tokens. However, you "
                            f"requested {requested} tokens ({what}). Please reduce the length of the {param} "
                            f"or the completion.", param)


def _sampling_params(state: ServerState, body: SamplingFields, max_tokens: int | None,
                     logprobs: int | None) -> SamplingParams:
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    _check_token_ids(state, list(bias) + list(body.stop_token_ids or []), "logit_bias")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
    try:
        return SamplingParams(
            n=body.n, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
            min_p=body.min_p or 0.0, presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            seed=body.seed, max_tokens=max_tokens, min_tokens=body.min_tokens, stop=body.stop,
            stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos, logprobs=logprobs,
            logit_bias=bias or None, skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
        )
    except ValueError as e:
        raise APIError(400, str(e), str(e).split(" ")[0]) from None


# ------------------------------------------------------------------------------------------------
# submission, back-pressure, collection


class Submission(list):
    """The streams of one HTTP request; `close()` aborts unfinished ones and releases capacity, once."""

    def __init__(self, state: ServerState, streams: list[RequestStream]):
        super().__init__(streams)
        self.state, self.closed = state, False
        state.num_in_flight += len(streams)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for stream in self:
            if not stream.request.status.is_finished:
                self.state.engine_loop.abort(stream.request_id)
        self.state.num_in_flight -= len(self)


def _submit(state: ServerState, prompts: list[list[int]], params: SamplingParams,
            body: SamplingFields) -> Submission:
    count = len(prompts) * params.n
    if count > state.capacity:
        raise APIError(400, f"the request asks for {count} sequences (prompts x n), more than this server "
                            f"holds at once ({state.capacity})", "n")
    if state.num_in_flight + count > state.capacity:
        raise APIError(503, f"the server is at capacity ({state.capacity} requests in flight); retry shortly",
                       headers={"Retry-After": "1"})
    if not state.engine_loop.is_alive:
        raise APIError(503, "the engine is not running")
    loop = asyncio.get_running_loop()
    base = uuid.uuid4().hex[:16]
    streams = []
    try:
        for p, ids in enumerate(prompts):
            for i in range(params.n):
                streams.append(state.engine_loop.submit(ids, params, f"{base}-{p}-{i}", body.priority, loop, i))
    except (ValueError, RuntimeError) as e:
        for stream in streams:
            state.engine_loop.abort(stream.request_id)
        status = 400 if isinstance(e, ValueError) else 503
        raise APIError(status, str(e), "prompt" if status == 400 else None) from None
    state.metrics.prompt_tokens.inc(sum(len(ids) for ids in prompts) * params.n)
    return Submission(state, streams)


class _Result:
    def __init__(self):
        self.text, self.token_ids, self.logprobs = "", [], []
        self.finish_reason, self.stop_reason = None, None

    def add(self, delta: StreamDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.new_token_ids
        self.logprobs += delta.logprobs or []
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


async def _merged(state: ServerState, streams: Submission) -> AsyncIterator[tuple[int, StreamDelta]]:
    """Deltas of several streams as they come, tagged with the stream's index; aborts leftovers on exit."""
    queue: asyncio.Queue = asyncio.Queue()
    timers = [RequestTimer(state.metrics) for _ in streams]

    async def pump(index: int, stream: RequestStream):
        async for delta in stream:
            await queue.put((index, delta))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    open_streams = set(range(len(streams)))
    try:
        while open_streams:
            index, delta = await queue.get()
            if delta is None:
                open_streams.discard(index)
                continue
            timers[index].tokens(len(delta.new_token_ids))
            if delta.error is not None:
                raise delta.error
            if delta.finish_reason is not None:
                timers[index].finished(delta.finish_reason)
            yield index, delta
    finally:
        for task in tasks:
            task.cancel()
        streams.close()


async def _collect(state: ServerState, streams: Submission, raw: Request) -> list[_Result]:
    """Waits for every stream; a client that disconnects first aborts them all (pages freed)."""
    results = [_Result() for _ in streams]

    async def gather():
        async for index, delta in _merged(state, streams):
            results[index].add(delta)

    work = asyncio.create_task(gather())
    try:
        while not work.done():
            done, _ = await asyncio.wait({work}, timeout=0.5)
            if not done and await raw.is_disconnected():
                work.cancel()
                break
        await work
    except asyncio.CancelledError:
        raise APIError(499, "client disconnected") from None
    except ValueError as e:
        raise APIError(400, str(e)) from None
    except Exception as e:  # noqa: BLE001 - one request's failure must not take the server down
        raise APIError(500, f"the request failed: {e!r}") from None
    finally:
        streams.close()
    return results


# ------------------------------------------------------------------------------------------------
# responses


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _usage(prompts: list[list[int]], results) -> dict:
    prompt_tokens = sum(len(ids) for ids in prompts)
    completion_tokens = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _token_text(state: ServerState, token: int) -> str:
    return state.tokenizer.decode([token])


def _completion_logprobs(state: ServerState, entries: list[dict[int, float]], offset: int = 0) -> dict:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        (token, logprob), *_ = entry.items()
        text = _token_text(state, token)
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        token_logprobs.append(logprob)
        top.append({_token_text(state, t): lp for t, lp in entry.items()})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_logprobs(state: ServerState, entries: list[dict[int, float]], num_top: int) -> dict:
    content = []
    for entry in entries:
        (token, logprob), *_ = entry.items()
        text = _token_text(state, token)
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:num_top]
        content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": (t := _token_text(state, tid)), "logprob": lp,
                                          "bytes": list(t.encode())} for tid, lp in ranked]})
    return {"content": content}


def _sse(events: AsyncIterator[dict], submission: Submission) -> StreamingResponse:
    async def body():
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # also when the client disconnects before the first event
            submission.close()

    return StreamingResponse(body(), media_type="text/event-stream")


async def _stream_completion(state, body: CompletionRequest, streams, prompts, echo, kind) -> AsyncIterator[dict]:
    rid, created = _id("cmpl"), int(time.time())
    results = [_Result() for _ in streams]
    offsets = [0] * len(streams)

    def chunk(choices, usage=None):
        return {"id": rid, "object": kind, "created": created, "model": state.model_name, "choices": choices,
                "usage": usage}

    try:
        for i in range(len(streams)):
            if echo[i // body.n]:
                yield chunk([{"index": i, "text": echo[i // body.n], "logprobs": None, "finish_reason": None}])
        async for i, delta in _merged(state, streams):
            results[i].add(delta)
            if not (delta.text or delta.finish_reason or delta.logprobs):
                continue
            logprobs = None
            if body.logprobs is not None:
                logprobs = _completion_logprobs(state, delta.logprobs or [], offsets[i])
                offsets[i] += sum(len(t) for t in logprobs["tokens"])
            yield chunk([{"index": i, "text": delta.text, "logprobs": logprobs,
                          "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}])
    except Exception as e:  # noqa: BLE001 - errors mid-stream go to the client as an SSE event
        yield error_body(500, f"the request failed: {e!r}")
        return
    if body.stream_options and body.stream_options.include_usage:
        yield chunk([], _usage(prompts, results))


async def _stream_chat(state, body: ChatCompletionRequest, streams, ids) -> AsyncIterator[dict]:
    rid, created = _id("chatcmpl"), int(time.time())
    results = [_Result() for _ in streams]
    num_top = body.top_logprobs or 0

    def chunk(choices, usage=None):
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                "choices": choices, "usage": usage}

    try:
        for i in range(len(streams)):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        async for i, delta in _merged(state, streams):
            results[i].add(delta)
            if not (delta.text or delta.finish_reason or delta.logprobs):
                continue
            logprobs = _chat_logprobs(state, delta.logprobs or [], num_top) if body.logprobs else None
            yield chunk([{"index": i, "delta": {"content": delta.text} if delta.text else {},
                          "logprobs": logprobs, "finish_reason": delta.finish_reason,
                          "stop_reason": delta.stop_reason}])
    except Exception as e:  # noqa: BLE001
        yield error_body(500, f"the request failed: {e!r}")
        return
    if body.stream_options and body.stream_options.include_usage:
        yield chunk([], _usage([ids], results))
