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


def make_auth_dependency(
    api_key: SecretStr | None,
) -> Callable[..., Awaitable[None]]:
    """A FastAPI dependency that enforces ``api_key`` (a no-op when it is None)."""
    if api_key is None or not api_key.get_secret_value():

        async def no_auth() -> None:
            return None

        return no_auth

    expected = _digest(api_key.get_secret_value())

    async def require_api_key(
        credentials: HTTPAuthorizationCredentials | None = Depends(bearer_scheme),  # noqa: B008
    ) -> None:
        token = credentials.credentials if credentials is not None else None
        if not key_matches(expected, token):
            raise APIError(
                401, "Invalid or missing API key: send the header 'Authorization: Bearer <key>'.",
                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return require_api_key
