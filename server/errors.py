"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Clients built on the `openai` SDK parse this shape into their exceptions (``BadRequestError``
etc.). Messages never carry tracebacks: unexpected exceptions are logged server-side and answered
with a generic 500.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response


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
