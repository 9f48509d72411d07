"""The API key: ``Authorization: Bearer <key>`` on every route but /health.

The key comes from ``--api-key`` or ``BREGMAN_API_KEY`` (for ``vllm serve --middleware ...``:
also vLLM's own ``--api-key`` / ``VLLM_API_KEY``). Both sides are hashed before a constant-time
comparison (`secrets.compare_digest`), so neither the content nor the length of the key leaks
through timing; every configured key is compared, whichever matches.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable

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
