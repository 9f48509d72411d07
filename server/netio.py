"""An asyncio-native network backend for httpcore (the connection layer under httpx).

httpcore's default backend on asyncio goes through anyio, whose per-call checkpoints, cancel
scopes and task lookups cost more CPU than the whole HTTP exchange with a local vLLM: on the
2-core CI machine about a third of the proxy's CPU per request. This backend talks to asyncio's
streams directly and keeps httpcore's contract: its exception types (httpx maps them to its own),
per-call timeouts, TLS upgrade, and ``is_readable`` so that a keep-alive connection the upstream
closed is never reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import httpcore
import httpx


def asyncio_backend_supported() -> bool:
    """asyncio.timeout and StreamWriter.start_tls arrived in Python 3.11."""
    return sys.version_info >= (3, 11)


_Options = Iterable[tuple[int, int, int] | tuple[int, int, bytes | None]]


@contextlib.contextmanager
def _errors(timeout_error: type[Exception], other_error: type[Exception]) -> Iterator[None]:
    """Translate asyncio / socket errors into the httpcore ones httpx expects."""
    try:
        yield
    except TimeoutError as exc:
        raise timeout_error(str(exc) or "timed out") from exc
    except (OSError, EOFError, ssl.SSLError, asyncio.IncompleteReadError) as exc:
        raise other_error(str(exc) or type(exc).__name__) from exc


async def _within(timeout: float | None, awaitable: Any) -> Any:
    if timeout is None:
        return await awaitable
    async with asyncio.timeout(timeout):
        return await awaitable


class AsyncioStream(httpcore.AsyncNetworkStream):
    """One TCP (or TLS) connection as an asyncio reader / writer pair."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        with _errors(httpcore.ReadTimeout, httpcore.ReadError):
            return await _within(timeout, self._reader.read(max_bytes))

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        with _errors(httpcore.WriteTimeout, httpcore.WriteError):
            self._writer.write(buffer)
            await _within(timeout, self._writer.drain())

    async def aclose(self) -> None:
        # Do not wait for the peer: closing our side is enough, and a stuck peer must not hang.
        self._writer.close()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        with _errors(httpcore.ConnectTimeout, httpcore.ConnectError):
            await _within(timeout, self._writer.start_tls(
                ssl_context, server_hostname=server_hostname))
        return self

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            # The upstream closed an idle keep-alive connection (or sent something unasked).
            return self._reader.at_eof() or self._writer.is_closing() or bool(
                getattr(self._reader, "_buffer", b""))
        name = {"ssl_object": "ssl_object", "client_addr": "sockname",
                "server_addr": "peername", "socket": "socket"}.get(info)
        return None if name is None else self._writer.get_extra_info(name)


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    """Opens `AsyncioStream` connections (TCP_NODELAY is asyncio's default for TCP)."""

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: _Options | None = None) -> httpcore.AsyncNetworkStream:
        local = None if local_address is None else (local_address, 0)
        with _errors(httpcore.ConnectTimeout, httpcore.ConnectError):
            reader, writer = await _within(timeout, asyncio.open_connection(
                host, port, local_addr=local, limit=2**20))
        sock: socket.socket | None = writer.get_extra_info("socket")
        for option in socket_options or ():
            if sock is not None:
                sock.setsockopt(*option)  # type: ignore[arg-type]
        return AsyncioStream(reader, writer)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: _Options | None = None,
                                  ) -> httpcore.AsyncNetworkStream:
        with _errors(httpcore.ConnectTimeout, httpcore.ConnectError):
            reader, writer = await _within(timeout, asyncio.open_unix_connection(path))
        return AsyncioStream(reader, writer)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def make_transport(limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """httpx's pooled transport (no retries, no proxy from the environment) on `AsyncioBackend`.

    httpx has no argument for the network backend, so the pool it builds is replaced by the same
    pool on ours (Python < 3.11: httpx's default backend).
    """
    transport = httpx.AsyncHTTPTransport(limits=limits, retries=0)
    if asyncio_backend_supported():
        transport._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry, retries=0,
            network_backend=AsyncioBackend())
    return transport
