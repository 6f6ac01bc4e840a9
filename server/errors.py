"""The error model, and the guards in front of the routes: the API key, the request body's size.
(The Host header's check, `--allowed-hosts`, is Starlette's `TrustedHostMiddleware`, added in app.py.)

Every error a client sees is `{"error": {"message", "type", "param", "code"}}` with the HTTP status,
whatever raised it: an `APIError` from a handler, a request that does not parse, an unknown route,
or an exception nobody expected (a 500, logged here with its traceback). Messages name the problem
and the field (`param`); they never carry the `repr()` of an internal exception.
"""

from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve.errors import InvalidParameter
from server.protocol import REFUSED

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                413: "RequestTooLargeError", 422: "BadRequestError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}
INTERNAL_ERROR = "the server failed while handling this request; its log has the details"


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    @classmethod
    def invalid(cls, e: InvalidParameter) -> "APIError":
        return cls(400, str(e), e.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": param,
                      "code": status}}


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None):
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.headers)

    @app.exception_handler(InvalidParameter)
    async def _invalid_parameter(_: Request, e: InvalidParameter):
        return error_response(400, str(e), e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
        # An unknown field is named first: the other errors may only follow from it.
        errors = sorted(errors, key=lambda err: err.get("type") != "extra_forbidden")
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: "
                            f"{_message(err)}" for err in errors[:5])
        return error_response(400, message or "invalid request", ".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=e)
        return error_response(500, INTERNAL_ERROR)


def _message(error: dict) -> str:
    """pydantic's message, or for a field the model does not declare, why it is refused."""
    if error.get("type") != "extra_forbidden":
        return error.get("msg", "invalid")
    name = str(error.get("loc", ("",))[-1])
    if name in REFUSED:
        return f"{name} is not supported by jaxserve ({REFUSED[name]})"
    return f"unknown field {name!r} (jaxserve refuses fields it does not know rather than ignore them)"


# What answers without the key: probes, the version, the chat page and its files (the page asks for the
# key and sends it on its /v1 calls) and the API's description. Every other path, a route added later
# included, needs it: /tokenize, /detokenize, /server_info and /metrics tell or cost as much as /v1.
OPEN_PATHS = frozenset({"/health", "/version", "/", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
OPEN_PREFIX = "/static/"


def needs_api_key(path: str) -> bool:
    return path not in OPEN_PATHS and not path.startswith(OPEN_PREFIX)


class APIKeyMiddleware:
    """Requires `Authorization: Bearer KEY` on every path but `OPEN_PATHS`, compared in constant time.
    Plain ASGI, not BaseHTTPMiddleware, which would hide client disconnects from the handlers (and so
    keep abandoned requests running)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and needs_api_key(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """A request body over `max_bytes` is a 413: refused unread when its Content-Length says so, or
    as soon as the bytes of a chunked body pass the limit (raised as an HTTPException while the route
    reads the body, so it gets the same error shape)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"the request body is larger than this server accepts ({self.max_bytes} bytes)"
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await error_response(413, message)(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            event = await receive()
            if event["type"] == "http.request":
                received += len(event.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, message)
            return event

        await self.app(scope, limited_receive, send)
