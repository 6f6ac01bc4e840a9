"""The engine loop in a background thread, for callers on other threads or an asyncio loop.

One thread owns the `LLMEngine`: it alone touches the scheduler, the page pool, the requests' state
and the device. Other threads call `submit` (which validates on the caller's thread through
`LLMEngine.make_request`, reading only the engine's fixed settings and tokenizer), `abort`, and read
per-request streams of token deltas and the `stats` snapshot the loop publishes every iteration. XLA releases
the GIL while a step runs on the device, so an HTTP event loop in the main thread stays responsive.
A request that fails while being served (detokenizing, stop checks, its sampling row or logprobs,
building its delta) ends alone, with finish reason "error" and a `RequestFailed` in its last delta;
only a failure of the step itself (the model call) kills the loop, which then fails every open stream
and leaves `error` set, so health checks can say so.

Nothing waits forever on a dead loop: however it ends (a step raised, `fail` from another thread, the
watchdog, shutdown), every request it holds and every one still queued for it gets a final delta with
an error, and `submit` re-checks after queueing, so a request queued as the loop died is ended too.

The watchdog (vLLM's `VLLM_ENGINE_ITERATION_TIMEOUT_S`, here `iteration_timeout_s` and the server's
--engine-iteration-timeout-s): the loop writes a timestamp when a step starts, and a second thread
declares the engine stuck (`EngineStuck`, through `fail`) when one step runs past the limit: by default
`ITERATION_TIMEOUT_MULTIPLE` times the slowest step seen so far, never under `MIN_ITERATION_TIMEOUT_S`.
A wedged device, a collective waiting on a hung peer or a blocked send leaves the engine thread blocked
where it is: Python cannot kill a thread, so it stays blocked (a daemon thread, it does not hold up
the process's exit), and no request waits on it any more; the process must be restarted (the
data-parallel launcher restarts a replica whose /health stays 503).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import queue
import threading
import time

from jaxserve.core.engine import LLMEngine
from jaxserve.errors import RequestFailed
from jaxserve.core.request import Request, RequestStatus
from jaxserve.config.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
MIN_ITERATION_TIMEOUT_S = 60.0  # the derived limit's floor: CI machines are slow and loaded
ITERATION_TIMEOUT_MULTIPLE = 20  # times the slowest step seen so far
# Fault injection for tests, read once at start: with it set, a step of the process that finds the file
# `$JAXSERVE_FAULT_HANG_DIR/hang-<its pid>` blocks forever before calling the model, as a wedged device.
FAULT_HANG_DIR_ENV = "JAXSERVE_FAULT_HANG_DIR"


class EngineStuck(RuntimeError):
    """The watchdog's verdict: one step ran past the iteration timeout."""


@dataclasses.dataclass
class StreamDelta:
    new_token_ids: list[int]
    text: str = ""  # new text; the tail a stop string might still claim is held back until it can't
    logprobs: list[dict[int, float]] | None = None  # one entry per new token, when requested
    finish_reason: str | None = None  # set on a request's last delta
    stop_reason: int | str | None = None
    error: BaseException | None = None  # set if the request failed instead (finish_reason "error" or None)
    # The request's prompt logprobs (Request.prompt_logprobs), in its first delta only, when requested
    prompt_logprobs: list | None = None


class RequestStream:
    """Token deltas of one request, readable from a thread (iteration) or asyncio (`async for`)."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop | None = None):
        self.request = request
        self._loop = loop
        self._queue: queue.SimpleQueue | asyncio.Queue = asyncio.Queue() if loop else queue.SimpleQueue()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def put(self, delta: StreamDelta) -> None:
        if self._loop is None:
            self._queue.put(delta)
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._queue.put_nowait, delta)

    def __iter__(self):
        while True:
            delta = self._queue.get()
            yield delta
            if delta.finish_reason is not None or delta.error is not None:
                return

    async def __aiter__(self):
        while True:
            delta = await self._queue.get()
            yield delta
            if delta.finish_reason is not None or delta.error is not None:
                return


class EngineLoop:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05, iteration_timeout_s: float | None = None):
        """`iteration_timeout_s`: a step that runs longer declares the engine stuck; None derives the limit
        from the steps seen (see the module docstring)."""
        if iteration_timeout_s is not None and not iteration_timeout_s > 0:
            raise ValueError(f"{iteration_timeout_s=} must be a positive number of seconds (or None: derived)")
        self.engine = engine
        self.error: BaseException | None = None
        # The engine's counters as of its last step, published by the engine thread for readers on
        # other threads (metrics): they never call into the engine themselves.
        self.stats: dict = engine.get_stats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._sent: dict[str, tuple[int, int]] = {}  # (tokens, characters) already delivered per request
        self._wakeup = threading.Event()
        self._stopped = threading.Event()
        self._idle_wait_s = idle_wait_s
        self._iteration_timeout_s = iteration_timeout_s
        self._step_started: float | None = None  # time.monotonic() at the start of the running step
        self._slowest_step_s = 0.0
        hang_dir = os.environ.get(FAULT_HANG_DIR_ENV)
        self._hang_file = os.path.join(hang_dir, f"hang-{os.getpid()}") if hang_dir else None
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="jaxserve-engine-watchdog", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        self._watchdog.start()
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopped.set()
        self._wakeup.set()
        if self._thread.is_alive() and self.error is None:  # a failed loop's thread may be blocked for good
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stopped.is_set()

    @property
    def iteration_timeout_s(self) -> float:
        if self._iteration_timeout_s is not None:
            return self._iteration_timeout_s
        return max(MIN_ITERATION_TIMEOUT_S, ITERATION_TIMEOUT_MULTIPLE * self._slowest_step_s)

    def fail(self, message: str, error_type: type[RuntimeError] = RuntimeError) -> None:
        """Marks the loop dead and ends every open and queued request with an error, from any thread: for
        a failure outside the engine thread (a multi-host follower gone, the watchdog) while that thread
        may be blocked in a step. Only streams and the command queue are touched, both thread-safe."""
        if self.error is None:
            self.error = error_type(message)
        self._stopped.set()
        self._wakeup.set()
        self._end_all(self.error)

    def _end_all(self, error: BaseException) -> None:
        """Ends every stream the engine holds and every one still queued for it (the loop is dead or
        stopping: whatever it did not take by now it never will)."""
        for stream in list(self._streams.values()):
            stream.put(StreamDelta([], error=error))
        for command, arg in self._queued_commands():
            if command == "add":
                arg.put(StreamDelta([], error=error))
            elif command == "call":
                arg[0].set_exception(RuntimeError("the engine loop is not running"))

    def _queued_commands(self):
        """Takes the queued commands, oldest first, until the queue is empty."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    # -- callers' side (any thread) -----------------------------------------------------------------

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
               priority: int = 0, loop: asyncio.AbstractEventLoop | None = None,
               sample_index: int = 0, lora_request=None, arrival_time: float | None = None) -> RequestStream:
        """Validates now (raising ValueError to the caller) and queues the request for the engine.
        `lora_request`: the LoRA adapter it runs with (a `jaxserve.lora.LoRARequest`; None: the base model);
        `arrival_time`: when it arrived (time.monotonic; default now): waiting requests are admitted in that order."""
        if not self.is_alive:
            raise RuntimeError("the engine loop is not running") from self.error
        lora = {} if lora_request is None else {"lora_request": lora_request}
        request = self.engine.make_request(prompt_token_ids, params, request_id, priority, sample_index, **lora,
                                           arrival_time=arrival_time)
        stream = RequestStream(request, loop)
        self._commands.put(("add", stream))
        self._wakeup.set()
        if not self.is_alive:  # it died after the check above, maybe after its last drain of the queue
            self._end_all(self.error or RuntimeError("the engine is shutting down"))
            raise RuntimeError("the engine loop is not running") from self.error
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    def call(self, fn, *args) -> concurrent.futures.Future:
        """Runs `fn(*args)` on the engine's thread between two steps (what changes the engine's state
        outside requests: LoRA adapters loaded and unloaded); the future holds its result or exception."""
        if not self.is_alive:
            raise RuntimeError("the engine loop is not running") from self.error
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", (future, fn, args)))
        self._wakeup.set()
        if not self.is_alive:  # as submit: it may have died after its last drain of the queue
            self._end_all(self.error or RuntimeError("the engine is shutting down"))
        return future

    # -- the engine's thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._apply_commands()
                self.stats = self.engine.get_stats()
                if not self.engine.has_unfinished:
                    self._wakeup.wait(self._idle_wait_s)
                    self._wakeup.clear()
                    continue
                self._step_started = started = time.monotonic()
                if self._hang_file is not None and os.path.exists(self._hang_file):
                    logger.warning("fault injection: %s exists; this step blocks forever", self._hang_file)
                    threading.Event().wait()
                outputs = self.engine.step()
                self._step_started = None
                self._slowest_step_s = max(self._slowest_step_s, time.monotonic() - started)
                for request in outputs:
                    try:
                        self._deliver(request)
                    except Exception:  # noqa: BLE001 - one request's failure must not end the loop
                        logger.exception("request %s: delivering its output failed", request.request_id)
                        self._end_failed(request)
        except BaseException as e:  # noqa: BLE001 - the loop must report any death
            logger.exception("the engine loop died")
            if self.error is None:
                self.error = e
            self._stopped.set()
            self._end_all(self.error)
            self._streams.clear()
            return
        for stream in list(self._streams.values()):  # shut down (or failed from outside): end every open stream
            self.engine.abort_request(stream.request_id)
        self._end_all(self.error or RuntimeError("the engine is shutting down"))
        self._streams.clear()

    def _watch(self) -> None:
        """The watchdog thread: fails the loop once a step runs past the limit; ends when the loop stops."""
        poll_s = min(1.0, self.iteration_timeout_s / 10)
        while not self._stopped.wait(poll_s):
            started = self._step_started
            if started is None:
                continue
            elapsed, limit = time.monotonic() - started, self.iteration_timeout_s
            if elapsed > limit:
                logger.error("the engine is stuck: a step has run for %.1f s, past the %.1f s limit", elapsed, limit)
                self.fail(f"the engine is stuck: a step has run for more than {limit:g} s "
                          f"(--engine-iteration-timeout-s)", EngineStuck)
                return

    def _apply_commands(self) -> None:
        for command, arg in self._queued_commands():
            if command == "add":
                try:
                    self.engine.add_request(arg.request)
                except Exception as e:  # noqa: BLE001 - this request's error, not the loop's
                    arg.put(StreamDelta([], error=e))
                    continue
                self._streams[arg.request_id] = arg
                self._sent[arg.request_id] = (0, 0)
            elif command == "call":
                future, fn, args = arg
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args))
                    except Exception as e:  # noqa: BLE001 - the caller's error, not the loop's
                        future.set_exception(e)
            elif command == "abort":
                stream = self._streams.pop(arg, None)
                self._sent.pop(arg, None)
                self.engine.abort_request(arg)
                if stream is not None:
                    stream.put(StreamDelta([], finish_reason="abort"))

    def _end_failed(self, request: Request) -> None:
        self.engine.fail_request(request.request_id, "delivering its output failed")
        self._sent.pop(request.request_id, None)
        stream = self._streams.pop(request.request_id, None)
        if stream is not None:
            stream.put(StreamDelta([], finish_reason="error", error=RequestFailed("delivering its output failed")))

    def _deliver(self, request: Request) -> None:
        stream = self._streams.get(request.request_id)
        if stream is None:
            return
        if request.status is RequestStatus.FINISHED_ERROR:
            self._streams.pop(request.request_id)
            self._sent.pop(request.request_id)
            stream.put(StreamDelta([], finish_reason="error", error=RequestFailed(request.error)))
            return
        sent_tokens, sent_chars = self._sent[request.request_id]
        finished = request.status.is_finished
        text = request.output_text
        hold_back = 0 if finished or request.detokenizer is None else request.detokenizer.hold_back
        upto = max(sent_chars, len(text) - hold_back)
        logprobs = request.logprobs[sent_tokens:] if request.sampling_params.logprobs is not None else None
        delta = StreamDelta(request.output_token_ids[sent_tokens:], text[sent_chars:upto], logprobs,
                            request.finish_reason, request.stop_reason,
                            prompt_logprobs=request.prompt_logprobs if sent_tokens == 0 else None)
        self._sent[request.request_id] = (len(request.output_token_ids), upto)
        if finished:
            self._streams.pop(request.request_id)
            self._sent.pop(request.request_id)
        stream.put(delta)
