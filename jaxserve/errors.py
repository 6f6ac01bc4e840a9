"""The errors the engine raises at its public edge, so callers can tell a bad request from a fault.

`InvalidParameter` names the request field at fault (vLLM's and OpenAI's field names), which the
HTTP layer reports as the error's `param`. `RequestFailed` ends one request that went wrong while
it was being served (detokenizing, stop checks, its sampling row, its logprobs); the engine keeps
serving the others.
"""

from __future__ import annotations


class InvalidParameter(ValueError):
    """A request parameter out of range or malformed; `param` is the field's name."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


class RequestFailed(RuntimeError):
    """One request failed while it was being served; the message says where and why."""
