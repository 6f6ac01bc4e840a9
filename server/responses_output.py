"""The Responses API's output: a response object, whole or as the stream of events that builds it.

`ResponseBuilder` takes one sequence's output as the chat route reads it (`ChatFormat` splits text from tool
calls, streamed or whole) and makes output items of it: a `message` item with one `output_text` part for a
run of text, a `function_call` item for each call. Every item is announced (`response.output_item.added`),
grows (`response.output_text.delta`, `response.function_call_arguments.delta`) and is closed (its `.done`
events, then `response.output_item.done`) before the next one opens; a whole response is the same
items without the events. Each event carries `type` and `sequence_number`, as the openai SDK parses them.
What this module does not own: reading the request (`responses_api.py`), the engine streams (`streaming.py`).
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from typing import AsyncIterator, Callable

from server.admission import ServerState, Submission
from server.responses import ChatFormat, Result
from server.streaming import api_error, merged


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(num_prompt: int, num_output: int, num_cached: int) -> dict:
    """The Responses usage object; jaxserve's models write no reasoning tokens."""
    return {"input_tokens": num_prompt, "input_tokens_details": {"cached_tokens": num_cached, "cache_write_tokens": 0},
            "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_prompt + num_output}


class ResponseBuilder:
    """One response's output items and events. `header`: the response's fields that do not change as it is
    generated (id, model, the request's settings echoed)."""

    def __init__(self, header: dict):
        self.header = header
        self.output: list[dict] = []
        self.open: dict | None = None  # the item still growing
        self.call_indices: list[int] = []  # ChatFormat's index of each function_call item, in order
        self.sequence_number = 0
        self.incomplete = False
        self.response: dict | None = None  # set by finish()

    def event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def snapshot(self, status: str, usage_: dict | None = None) -> dict:
        return {**self.header, "status": status, "output": copy.deepcopy(self.output), "usage": usage_}

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.snapshot("in_progress")),
                self.event("response.in_progress", response=self.snapshot("in_progress"))]

    def chat_delta(self, message: dict) -> list[dict]:
        """A ChatFormat stream delta (`content` and/or `tool_calls` deltas) as Responses events."""
        events = self.text(message["content"]) if message.get("content") else []
        for call in message.get("tool_calls", ()):
            events += self.call(call)
        return events

    def chat_message(self, message: dict) -> None:
        """A ChatFormat whole message: its content, then its calls."""
        if message.get("content"):
            self.text(message["content"])
        for index, call in enumerate(message.get("tool_calls") or ()):
            self.call({"index": index, **call})

    def text(self, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self._close()
            item = {"id": new_item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            events += self._add(item)
            item["content"].append({"type": "output_text", "text": "", "annotations": []})
            events.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                     part=copy.deepcopy(item["content"][0])))
        if text:
            self.open["content"][0]["text"] += text
            events.append(self.event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                     logprobs=[]))
        return events

    def call(self, delta: dict) -> list[dict]:
        """A chat tool-call delta: `id` and the function's name open a call, `arguments` fragments follow."""
        events = []
        if "id" in delta:
            events += self._close()
            # chat's call id (chatcmpl-tool-<hex>) as the Responses call_id (call_<hex>)
            call_id = "call_" + delta["id"].rsplit("-", 1)[-1]
            events += self._add({"id": new_item_id("fc"), "type": "function_call", "call_id": call_id,
                                 "name": delta["function"]["name"], "arguments": "", "status": "in_progress"})
            self.call_indices.append(delta["index"])
        # ChatFormat's readers finish one call's arguments before they name the next
        assert self.open is not None and self.open["type"] == "function_call", delta
        assert self.call_indices[-1] == delta["index"], delta
        arguments = delta.get("function", {}).get("arguments")
        if arguments:
            self.open["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return events

    def finish(self, finish_reason: str | None, usage_: dict) -> list[dict]:
        """Closes the output and makes the final response: "incomplete" when cut at the token limit."""
        self.incomplete = finish_reason == "length"
        events = self.text("") if not self.output else []  # an empty output is an empty message
        events += self._close()
        status = "incomplete" if self.incomplete else "completed"
        self.response = self.snapshot(status, usage_)
        if self.incomplete:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            self.response["completed_at"] = int(time.time())
        events.append(self.event(f"response.{status}", response=self.response))
        return events

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def _add(self, item: dict) -> list[dict]:
        self.output.append(item)
        self.open = item
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=copy.deepcopy(item))]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        item, where = self.open, self._where()
        item["status"] = "incomplete" if self.incomplete else "completed"
        if item["type"] == "message":
            part = item["content"][0]
            events = [self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                                 logprobs=[]),
                      self.event("response.content_part.done", **where, content_index=0, part=copy.deepcopy(part))]
        else:
            events = [self.event("response.function_call_arguments.done", **where, arguments=item["arguments"])]
        self.open = None
        return events + [self.event("response.output_item.done", output_index=where["output_index"],
                                    item=copy.deepcopy(item))]


def cached_tokens(submission: Submission) -> int:
    return sum(stream.request.num_cached_tokens for stream in submission)


def whole(builder: ResponseBuilder, fmt: ChatFormat, result: Result, num_prompt: int, num_cached: int) -> dict:
    builder.chat_message(fmt.whole_choice(0, result)["message"])
    builder.finish(result.finish_reason, usage(num_prompt, len(result.token_ids), num_cached))
    return builder.response


async def event_stream(state: ServerState, submission: Submission, builder: ResponseBuilder, fmt: ChatFormat,
                       num_prompt: int, on_done: Callable[[dict], None]) -> AsyncIterator[str]:
    """The response's SSE events (`event: <type>` and `data: <json>`; no [DONE]); an error after the start
    is an `error` event. `on_done` gets the final response."""

    def sse(event: dict) -> str:
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    result = Result()
    try:
        for event in builder.start():
            yield sse(event)
        async for _, delta in merged(state, submission):
            result.add(delta)
            choice = fmt.delta_choice(0, delta)
            for event in builder.chat_delta(choice["delta"]) if choice is not None else ():
                yield sse(event)
        num_output = len(result.token_ids)
        for event in builder.finish(result.finish_reason, usage(num_prompt, num_output, cached_tokens(submission))):
            yield sse(event)
        on_done(builder.response)
    except Exception as e:  # noqa: BLE001 - errors mid-stream go to the client as an SSE event
        error = api_error(e)
        yield sse(builder.event("error", code=str(error.status), message=error.message, param=error.param))
    finally:
        submission.close()
