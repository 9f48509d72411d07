"""The API key: ``Authorization: Bearer <key>`` on every route but /health.

The key comes from ``--api-key`` or ``BREGMAN_API_KEY`` (for ``vllm serve --middleware ...``:
also vLLM's own ``--api-key`` / ``VLLM_API_KEY``). Both sides are hashed before a constant-time
comparison (`secrets.compare_digest`), so neither the content nor the length of the key leaks
through timing; every configured key is compared, whichever matches.

The one request that passes without the key is a real CORS preflight, which browsers send
without credentials: exactly what Starlette's ``CORSMiddleware`` answers itself (``OPTIONS``
with both ``Origin`` and ``Access-Control-Request-Method``; `is_preflight`), and only when that
layer runs inside the middleware (`answers_preflights`), so that the request never reaches a
route.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from typing import Any

from .errors import APIError

UNAUTHORIZED = APIError(
    401, "Invalid or missing API key: send the header 'Authorization: Bearer <key>'.",
    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme case-insensitive)."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip() or None


class KeyCheck:
    """Whether a request's raw Authorization header carries one of the keys."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.digests = [_digest(key.encode("utf-8")) for key in keys if key]
        if not self.digests:
            raise ValueError("no API key")

    def __call__(self, authorization: bytes | None) -> bool:
        token = bearer_token(authorization)
        presented = _digest(token if token is not None else b"")
        matched = False
        for digest in self.digests:  # no early exit: the time does not depend on which matched
            matched |= secrets.compare_digest(presented, digest)
        return matched and token is not None


def header(scope_headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case) in an ASGI scope's headers."""
    for key, value in scope_headers:
        if key == name:
            return value
    return None


def is_preflight(scope: Any) -> bool:
    """Starlette's own test of a CORS preflight (``CORSMiddleware.__call__``)."""
    if scope["method"] != "OPTIONS":
        return False
    headers = scope["headers"]
    return header(headers, b"origin") is not None \
        and header(headers, b"access-control-request-method") is not None


def answers_preflights(app: Any, outer: type) -> bool:
    """Whether ``app`` (vLLM's FastAPI app) answers CORS preflights itself, inside the
    middleware ``outer``: a ``CORSMiddleware`` among its middleware, added before ``outer``
    (Starlette runs the last added outermost) or with ``outer`` wrapped around the app."""
    from starlette.middleware.cors import CORSMiddleware

    classes = [getattr(entry, "cls", None) for entry in getattr(app, "user_middleware", ())]
    if CORSMiddleware not in classes:
        return False
    return outer not in classes or classes.index(outer) < classes.index(CORSMiddleware)
