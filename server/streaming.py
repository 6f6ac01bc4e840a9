"""Reading a submission's engine streams: whole (`collect`) or as server-sent events (`sse_response`).

Both endpoints stream through `sse_response`, shaped by their `ChoiceFormat`. However a response
ends (finished, failed, the client gone before or after the first event, the server shutting down),
its submission is closed exactly once, which aborts unfinished sequences and frees their capacity.
An error after the response has started is sent as an SSE event in the OpenAI error shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from jaxserve.core.engine_loop import EngineStuck, RequestStream, StreamDelta
from jaxserve.errors import InvalidParameter, RequestFailed
from server.admission import ServerShuttingDown, ServerState, Submission
from server.errors import APIError, error_body
from server.metrics import RequestTimer
from server.responses import ChoiceFormat, Result, new_id, usage

logger = logging.getLogger(__name__)


def api_error(e: BaseException) -> APIError:
    """What the client is told when a stream ends with `e` instead of a finish reason."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidParameter):
        return APIError.invalid(e)
    if isinstance(e, (ServerShuttingDown, EngineStuck)):
        return APIError(503, str(e))
    if isinstance(e, RequestFailed):
        return APIError(500, f"the request failed: {e}")
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    logger.error("a request ended with an engine error", exc_info=e)
    return APIError(500, "the engine failed while serving this request; the server log has the details")


async def merged(state: ServerState, submission: Submission) -> AsyncIterator[tuple[int, StreamDelta]]:
    """Deltas of several streams as they come, tagged with the stream's index; raises a stream's
    error; closes the submission on exit."""
    queue: asyncio.Queue = asyncio.Queue()
    timers = [RequestTimer(state.metrics, stream.request.arrival_time) for stream in submission]

    async def pump(index: int, stream: RequestStream):
        async for delta in stream:
            await queue.put((index, delta))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(submission)]
    open_streams = set(range(len(submission)))
    try:
        while open_streams:
            index, delta = await queue.get()
            if delta is None:
                open_streams.discard(index)
                continue
            timers[index].tokens(len(delta.new_token_ids))
            if delta.finish_reason is not None:
                timers[index].finished(delta.finish_reason)
            if delta.error is not None:
                raise delta.error
            yield index, delta
    finally:
        for task in tasks:
            task.cancel()
        submission.close()


async def collect(state: ServerState, submission: Submission, raw: Request) -> list[Result]:
    """Waits for every stream; a client that disconnects first aborts them all (pages freed)."""
    results = [Result() for _ in submission]

    async def gather():
        async for index, delta in merged(state, submission):
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
    except Exception as e:  # noqa: BLE001 - one request's failure must not take the server down
        raise api_error(e) from None
    finally:
        submission.close()
    return results


class _SubmissionResponse(StreamingResponse):
    """Closes its submission however the response ends, even if its body never started (a client
    gone before the first event cancels the response before the body generator runs)."""

    def __init__(self, content, submission: Submission):
        super().__init__(content, media_type="text/event-stream")
        self.submission = submission

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.submission.close()


def sse_response(state: ServerState, submission: Submission, fmt: ChoiceFormat, prompts: list[list[int]],
                 include_usage: bool) -> StreamingResponse:
    return _SubmissionResponse(_sse_body(state, submission, fmt, prompts, include_usage), submission)


def submission_stream(body: AsyncIterator[str], submission: Submission) -> StreamingResponse:
    """An SSE body of another shape over a submission (the Responses API's events), closed as sse_response's."""
    return _SubmissionResponse(body, submission)


async def _sse_body(state: ServerState, submission: Submission, fmt: ChoiceFormat, prompts: list[list[int]],
                    include_usage: bool) -> AsyncIterator[str]:
    rid, created = new_id(fmt.id_prefix), int(time.time())
    results = [Result() for _ in submission]

    def event(choices: list[dict], usage_: dict | None = None) -> str:
        return f"data: {json.dumps(fmt.envelope(rid, created, submission.model_name, choices, usage_, chunk=True))}\n\n"

    try:
        for i in range(len(submission)):
            opening = fmt.opening(i)
            if opening is not None:
                yield event([opening])
        async for i, delta in merged(state, submission):
            results[i].add(delta)
            choice = fmt.delta_choice(i, delta)
            if choice is not None:
                yield event([choice])
        if include_usage:
            yield event([], usage(prompts, results))
    except Exception as e:  # noqa: BLE001 - errors mid-stream go to the client as an SSE event
        error = api_error(e)
        yield f"data: {json.dumps(error_body(error.status, error.message, error.param))}\n\n"
    finally:
        submission.close()
    yield "data: [DONE]\n\n"
