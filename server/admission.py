"""The server's state, admission and back-pressure, and draining at shutdown.

`ServerState` is what every route reads: the engine loop, the tokenizer and a small thread pool
that runs tokenization and chat templates off the event loop (one huge prompt must not stall the
other clients), the capacity (`max_num_seqs` running plus `--max-queued-requests` waiting), and
whether the server is draining. A `Submission` is one HTTP request's engine streams; it holds its
share of the capacity until `close()`, which every way a response can end reaches exactly once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from typing import Callable, TypeVar

from jaxserve.core.engine_loop import EngineLoop, EngineStuck, RequestStream, StreamDelta
from jaxserve.errors import InvalidParameter
from jaxserve.lora import LoRARequest
from jaxserve.config.sampling_params import SamplingParams
from server.errors import APIError
from server.metrics import Metrics

logger = logging.getLogger(__name__)
T = TypeVar("T")
TOKENIZER_THREADS = 2  # tokenization is CPU work: more threads than this only contend with the engine


class ServerShuttingDown(RuntimeError):
    """Ends the requests still running when the shutdown timeout passes."""


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
        self.open_submissions: set[Submission] = set()
        self.draining = False  # set at shutdown: no new requests, in-flight ones may finish
        self.metrics = Metrics(engine_loop)
        self.created = int(time.time())
        self._executor = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, "jaxserve-tokenize")

    async def run_blocking(self, fn: Callable[..., T], *args) -> T:
        """Runs `fn(*args)` (tokenization, chat templates, decoding) on the tokenizer threads."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def shutdown_executor(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def unavailable_reason(self) -> str | None:
        if self.draining:
            return "the server is shutting down"
        if not self.engine_loop.is_alive:
            if isinstance(self.engine_loop.error, EngineStuck):  # the watchdog's verdict names no internals
                return str(self.engine_loop.error)
            return "the engine is not running"
        return None

    async def drain(self, timeout_s: float) -> None:
        """Stops admitting (503), waits up to `timeout_s` for in-flight requests to finish, then ends
        the rest with an error (an error event in their streams) and aborts them in the engine."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.open_submissions and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.open_submissions:
            logger.warning("shutting down: ending %d unfinished requests", len(self.open_submissions))
        for submission in list(self.open_submissions):
            submission.end_with_error(ServerShuttingDown("the server is shutting down"))
        for _ in range(100):  # let those responses send their last event
            if not self.open_submissions:
                break
            await asyncio.sleep(0.02)


class Submission(list):
    """The streams of one HTTP request; `close()` aborts unfinished ones and releases capacity, once.
    `model_name`: what its response names as the model (a LoRA adapter's name, or the base model's)."""

    def __init__(self, state: ServerState, streams: list[RequestStream], model_name: str | None = None):
        super().__init__(streams)
        self.state, self.closed = state, False
        self.model_name = model_name or state.model_name
        state.num_in_flight += len(streams)
        state.open_submissions.add(self)

    __hash__ = object.__hash__  # a list is unhashable; a submission is one identity
    __eq__ = object.__eq__

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for stream in self:
            if not stream.request.status.is_finished:
                self.state.engine_loop.abort(stream.request_id)
        self.state.num_in_flight -= len(self)
        self.state.open_submissions.discard(self)

    def end_with_error(self, error: Exception) -> None:
        """Ends every stream now with `error` (shutdown); the response sends it and closes."""
        for stream in self:
            stream.put(StreamDelta([], error=error))


def submit(state: ServerState, prompts: list[list[int]], params: SamplingParams, priority: int,
           lora_request: LoRARequest | None = None, received: float | None = None) -> Submission:
    """Admits one HTTP request's `len(prompts) * n` sequences (run with `lora_request`'s adapter, if
    given) or raises 400 / 503. `received`: when the route started handling it (time.monotonic), before
    tokenizing: its sequences wait for admission behind requests received earlier, not behind those
    whose tokenization (on one of several threads) merely ended first."""
    count = len(prompts) * params.n
    if count > state.capacity:
        raise APIError(400, f"the request asks for {count} sequences (prompts x n), more than this server "
                            f"holds at once ({state.capacity})", "n" if len(prompts) == 1 else "prompt")
    reason = state.unavailable_reason()
    if reason is not None:
        raise APIError(503, reason, headers={"Retry-After": "1"} if state.draining else None)
    if state.num_in_flight + count > state.capacity:
        raise APIError(503, f"the server is at capacity ({state.capacity} requests in flight); retry shortly",
                       headers={"Retry-After": "1"})
    loop = asyncio.get_running_loop()
    base = uuid.uuid4().hex[:16]
    streams = []
    try:
        for p, ids in enumerate(prompts):
            for i in range(params.n):
                streams.append(state.engine_loop.submit(ids, params, f"{base}-{p}-{i}", priority, loop, i,
                                                        lora_request=lora_request, arrival_time=received))
    except (ValueError, RuntimeError) as e:
        for stream in streams:
            state.engine_loop.abort(stream.request_id)
        if isinstance(e, InvalidParameter):
            raise APIError.invalid(e) from None
        if isinstance(e, ValueError):
            raise APIError(400, str(e), "prompt") from None
        raise APIError(503, "the engine is not running") from None
    state.metrics.prompt_tokens.inc(sum(len(ids) for ids in prompts) * params.n)
    return Submission(state, streams, None if lora_request is None else lora_request.lora_name)
