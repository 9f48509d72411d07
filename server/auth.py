"""Optional API key: ``Authorization: Bearer <key>`` on every /v1 route and pass-through route.

The key comes from ``--api-key`` or ``BREGMAN_API_KEY``. Both sides are hashed before a
constant-time comparison (`secrets.compare_digest`), so neither the content nor the length of the
key leaks through timing. /health, /metrics, /docs and /openapi.json stay open (probes, scrapers).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Awaitable, Callable

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr
from starlette.requests import Request

from .errors import APIError

# auto_error=False: we answer in OpenAI's error shape ourselves; the scheme documents /docs.
bearer_scheme = HTTPBearer(auto_error=False, description="The server's API key, if it has one.")


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8")).digest()


def key_matches(expected_digest: bytes, presented: str | None) -> bool:
    """Constant-time check of a presented key against the digest of the expected one."""
    if presented is None:
        return False
    return secrets.compare_digest(_digest(presented), expected_digest)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme case-insensitive)."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def make_key_check(api_key: SecretStr | None) -> Callable[[str | None], None] | None:
    """A check of a request's Authorization header against ``api_key`` that raises a 401
    `APIError`, or None when the server has no key."""
    if api_key is None or not api_key.get_secret_value():
        return None
    expected = _digest(api_key.get_secret_value())

    def check(authorization: str | None) -> None:
        if not key_matches(expected, bearer_token(authorization)):
            raise APIError(
                401, "Invalid or missing API key: send the header 'Authorization: Bearer <key>'.",
                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check


def make_auth_dependency(
    api_key: SecretStr | None,
) -> Callable[..., Awaitable[None]]:
    """A FastAPI dependency that enforces ``api_key`` (a no-op when it is None); it also puts
    the Bearer scheme in the OpenAPI document."""
    check = make_key_check(api_key)
    if check is None:

        async def no_auth() -> None:
            return None

        return no_auth

    async def require_api_key(
        request: Request,
        credentials: HTTPAuthorizationCredentials | None = Depends(bearer_scheme),  # noqa: B008
    ) -> None:
        check(request.headers.get("authorization"))

    return require_api_key
