"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Clients built on the `openai` SDK parse this shape into their exceptions (``BadRequestError``
etc.). Messages never carry tracebacks: unexpected exceptions are logged server-side and answered
with a generic 500.

The server's own errors are built here (`APIError`, `error_response`); the app's are reshaped on
their way out (`OpenAIErrors`): FastAPI and Starlette answer some errors themselves, outside
vLLM's handlers, as ``{"detail": ...}`` (an unknown route, a method the route does not take, a
body FastAPI could not decode) or as plain text (a refused CORS preflight).
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from starlette.responses import Response
from starlette.types import Message, Send


class APIError(Exception):
    """An error answered to the client as an OpenAI-shaped JSON body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> Response:
        return error_response(self.status, self.message, self.type, self.param, self.code,
                              self.headers)


def unavailable(message: str, code: str) -> APIError:
    """A 503: the server is shutting down, or its engine died."""
    return APIError(503, message, type="server_error", code=code,
                    headers={"Retry-After": "1"})


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, type: str = "invalid_request_error",
                   param: str | None = None, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    """A JSON response with the OpenAI error object."""
    content = json.dumps(error_body(message, type, param, code)).encode()
    return Response(content, status_code=status, headers=headers, media_type="application/json")


def sse_error_event(message: str, type: str = "server_error",
                    code: str | int | None = None) -> bytes:
    """The SSE event that ends a broken stream, followed by ``[DONE]``."""
    payload = json.dumps(error_body(message, type, None, code))
    return f"data: {payload}\n\ndata: [DONE]\n\n".encode()


# --- the app's own errors -------------------------------------------------------------------------

_SHAPED_LIMIT = 64 * 1024  # error bodies are small; past this only the start is kept
_MESSAGE_LIMIT = 1000
_REPLACED_HEADERS = (b"content-type", b"content-length")
_PARSE_ERROR = "There was an error parsing the body"


def _phrase(status: int) -> str | None:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return None


def _code(status: int) -> str | None:
    """"not_found", "method_not_allowed" ... from the status."""
    phrase = _phrase(status)
    return phrase.lower().replace(" ", "_").replace("-", "_") if phrase else None


def _is_openai_shaped(content: Any) -> bool:
    error = content.get("error") if isinstance(content, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str)


def reshape_error(status: int, body: bytes, method: str, path: str) -> bytes | None:
    """The OpenAI-shaped body for an app's error answer, or None when it already is one.

    The message is the app's own (``detail``, ``error`` or ``message`` of a JSON object, else
    the text), bounded in size, with the request line for a route or method error.
    """
    try:
        content = json.loads(body)
    except ValueError:
        content = None
    if _is_openai_shaped(content):
        return None
    detail: Any = None
    if isinstance(content, dict):
        detail = next((content[key] for key in ("detail", "error", "message") if key in content),
                      content)
    elif content is not None:
        detail = content
    if detail is None or detail == "":
        detail = body.decode("utf-8", "replace").strip()
    message = detail if isinstance(detail, str) else json.dumps(detail)
    if len(message) > _MESSAGE_LIMIT:
        message = message[:_MESSAGE_LIMIT] + "...[truncated]"
    if not message:
        message = _phrase(status) or "Error"
    if status in (404, 405):
        message = f"{message} ({method} {path})"
    elif message == _PARSE_ERROR:
        message += ": the body must be JSON text in UTF-8, UTF-16 or UTF-32."
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return json.dumps(error_body(message, kind, None, _code(status))).encode()


class OpenAIErrors:
    """The ``send`` an app answers through: its error answers (status >= 400, not a stream)
    reach the client in OpenAI's shape, with their status and other headers (``Allow``,
    ``WWW-Authenticate`` ...) kept; everything else passes untouched, message by message."""

    __slots__ = ("_body", "_method", "_path", "_send", "_start")

    def __init__(self, send: Send, method: str, path: str) -> None:
        self._send = send
        self._method = method
        self._path = path
        self._start: Message | None = None
        self._body = b""

    async def __call__(self, message: Message) -> None:
        start = self._start
        if start is None:
            if message["type"] == "http.response.start" and message["status"] >= 400 \
                    and not _is_stream(message):
                self._start = message
                return
            await self._send(message)
            return
        if message["type"] != "http.response.body":
            return  # trailers of an answer we replace
        if len(self._body) < _SHAPED_LIMIT:
            self._body += message.get("body", b"")[:_SHAPED_LIMIT]
        if message.get("more_body", False):
            return
        status = start["status"]
        headers = list(start.get("headers", ()))
        body = self._body
        self._body = b""
        shaped = reshape_error(status, body, self._method, self._path)
        if shaped is not None:
            body = shaped
            headers = [(k, v) for k, v in headers if k.lower() not in _REPLACED_HEADERS]
            headers += [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())]
        await self._send({**start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})


def _is_stream(start: Message) -> bool:
    for name, value in start.get("headers", ()):
        if name.lower() == b"content-type":
            return value.startswith(b"text/event-stream")
    return False
