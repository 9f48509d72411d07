"""Forwarding to vLLM: a keep-alive connection pool, round-robin over healthy upstreams, and
chunk-by-chunk SSE pass-through.

* Client: `server.upstream_http.ConnectionPool`, a lean HTTP/1.1 client on asyncio with the
  httptools (llhttp) parser. httpx's pool cost about 0.8 ms of CPU per request here, most of
  the 2 ms the issue allows the whole server; this one costs about 0.1 ms. Like any proxy it
  keeps no cookies, follows no redirects and ignores HTTP(S)_PROXY.
* Upstream health: a background task polls every upstream's ``/health``; two failed checks in a
  row take an upstream out (one slow answer on a loaded machine does not), a refused connection
  takes it out at once (and the request is retried on the next one, which is safe because it
  never reached the first). Requests go round-robin over the healthy ones; when none is healthy
  they are still tried (fail open: a stale health state must not refuse traffic that would
  succeed), except when the embedded vLLM child is known to be dead.
* Non-streaming: the upstream exchange races the client's disconnect; if the client goes away,
  the upstream connection is closed, which makes vLLM abort the generation.
* Streaming (``text/event-stream``): bytes are forwarded as they arrive (no buffering). A client
  disconnect closes the upstream stream (vLLM aborts); an upstream failure mid-stream ends the
  stream with an OpenAI-shaped ``data: {"error": ...}`` event and ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .errors import APIError, sse_error_event
from .metrics import Metrics
from .upstream_http import (
    ConnectionPool,
    Origin,
    UpstreamConnectError,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
)

logger = logging.getLogger("bregman_server.proxy")

T = TypeVar("T")

# Hop-by-hop headers (RFC 9110 7.6.1) and those the HTTP client recomputes.
_REQUEST_DROP = frozenset({
    b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te",
    b"trailer", b"upgrade", b"proxy-authorization", b"proxy-authenticate", b"expect",
    b"proxy-connection",
})
# Uvicorn writes its own date/server headers; Starlette its own content-length.
_RESPONSE_DROP = frozenset({
    b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer",
    b"upgrade", b"date", b"server",
})
# Characters left as they are when the (decoded) request path is written to the upstream.
_PATH_SAFE = "/!$&'()*+,;=:@-._~"
UNHEALTHY_AFTER = 2  # consecutive failed health checks


class ClientGone(Exception):
    """The client disconnected before the response was complete."""


class Upstream:
    """One vLLM server and what we know about its health."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.origin = Origin.from_url(self.url)
        self.healthy = False
        self.failures = 0
        self.last_error: str | None = None

    def __repr__(self) -> str:
        return f"Upstream({self.url!r}, healthy={self.healthy})"


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the ASGI server reports that the client went away.

    Only valid once the request body has been read: the next message is then the disconnect.
    """
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class UpstreamPool:
    """The upstream vLLM servers, one shared connection pool, and their health."""

    def __init__(
        self,
        urls: Iterable[str],
        *,
        connect_timeout: float = 5.0,
        read_timeout: float = 600.0,
        max_connections: int = 1024,
        idle_expiry: float = 4.0,
        health_interval: float = 2.0,
        health_timeout: float = 5.0,
        api_key: str | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.upstreams = [Upstream(url) for url in urls]
        if not self.upstreams:
            raise ValueError("at least one upstream URL is needed")
        self.timeout = {"connect_timeout": connect_timeout, "read_timeout": read_timeout,
                        "pool_timeout": connect_timeout}
        self.health_timeout = {"connect_timeout": health_timeout,
                               "read_timeout": health_timeout, "pool_timeout": health_timeout}
        self.max_connections = max_connections  # per upstream
        self.idle_expiry = idle_expiry
        self.health_interval = health_interval
        self.api_key = api_key
        self.metrics = metrics or Metrics()
        self.client: ConnectionPool | None = None
        self._counter = itertools.count()
        self._health_task: asyncio.Task[None] | None = None
        # Set by the embedded-mode monitor: a dead child is never healthy, whatever it answers.
        self.forced_down: str | None = None

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the pool, check every upstream once, then keep checking in the background."""
        self.client = ConnectionPool(max_connections=self.max_connections,
                                     max_idle=self.max_connections,
                                     idle_expiry=self.idle_expiry)
        await self.check_all()
        self._health_task = asyncio.create_task(self._health_loop(), name="upstream-health")

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.client is not None:
            await self.client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await self.check_all()
            except Exception:  # the loop must survive anything
                logger.exception("upstream health check failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(upstream) for upstream in self.upstreams))

    async def check(self, upstream: Upstream) -> bool:
        """GET the upstream's /health; update its state and the gauge."""
        error = None
        try:
            status, _ = await self.request("GET", upstream, "/health", self.health_timeout)
            if status != 200:
                error = f"/health answered {status}"
        except UpstreamError as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if self.forced_down is not None:
            error = self.forced_down
        self._set_health(upstream, error, at_once=self.forced_down is not None)
        return error is None

    async def request(self, method: str, upstream: Upstream, path: str,
                      timeout: dict[str, float] | None = None) -> tuple[int, bytes]:
        """A small request of our own (health checks, tests): status and body."""
        assert self.client is not None
        async with await self.client.send(upstream.origin, method, path.encode("ascii"),
                                          self._auth_headers(),
                                          **(timeout or self.timeout)) as response:
            return response.status_code, await response.read()

    def _set_health(self, upstream: Upstream, error: str | None, at_once: bool = True) -> None:
        upstream.failures = 0 if error is None else upstream.failures + 1
        healthy = error is None or (
            upstream.healthy and not at_once and upstream.failures < UNHEALTHY_AFTER)
        if healthy != upstream.healthy:
            if healthy:
                logger.info("upstream %s is healthy", upstream.url)
            else:
                logger.warning("upstream %s is down: %s", upstream.url, error)
        upstream.healthy = healthy
        upstream.last_error = error if not healthy else None
        self.metrics.upstream_healthy.labels(upstream.url).set(1 if healthy else 0)

    def mark_down(self, upstream: Upstream, reason: str) -> None:
        self._set_health(upstream, reason)

    def force_down(self, reason: str) -> None:
        """Mark every upstream down for good (the embedded vLLM child died)."""
        self.forced_down = reason
        for upstream in self.upstreams:
            self._set_health(upstream, reason)

    @property
    def healthy_count(self) -> int:
        return sum(1 for upstream in self.upstreams if upstream.healthy)

    def candidates(self) -> list[Upstream]:
        """The healthy upstreams (all of them when none is, unless the embedded child is dead),
        rotated so that successive requests start round-robin."""
        healthy = [upstream for upstream in self.upstreams if upstream.healthy]
        if not healthy and self.forced_down is None:
            healthy = list(self.upstreams)
        if len(healthy) > 1:
            start = next(self._counter) % len(healthy)
            healthy = healthy[start:] + healthy[:start]
        return healthy

    # --- forwarding ------------------------------------------------------------------------

    def _auth_headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"authorization", f"Bearer {self.api_key}".encode())] if self.api_key else []

    def upstream_headers(self, request: Request, drop_authorization: bool,
                         content_type: bytes | None = None) -> list[tuple[bytes, bytes]]:
        """The client's headers minus hop-by-hop ones. The client's Authorization is replaced
        by the upstream key when we have one, and dropped when it was our own API key."""
        drop_auth = drop_authorization or self.api_key is not None
        headers = [(name, value) for name, value in request.scope["headers"]
                   if name not in _REQUEST_DROP
                   and not (name == b"authorization" and drop_auth)
                   and not (name == b"content-type" and content_type is not None)]
        if content_type is not None:
            headers.append((b"content-type", content_type))
        return headers + self._auth_headers()

    async def forward(
        self,
        request: Request,
        method: str,
        path: str,
        content: bytes | None,
        *,
        drop_authorization: bool,
        on_done: Callable[[int], None],
        on_first_byte: Callable[[], None] | None = None,
        content_type: bytes | None = None,
    ) -> Response:
        """Send the request to a healthy upstream and return the response to give the client.

        ``on_done(status)`` is called once the response has been sent or has failed (status
        499 when the client went away first); on `APIError` the caller records it.
        """
        assert self.client is not None
        headers = self.upstream_headers(request, drop_authorization, content_type)
        # The path arrives percent-decoded: encode it again (a decoded CR LF must never reach
        # the request line). The query string arrives raw, already validated by the server.
        target = quote(path, safe=_PATH_SAFE).encode("ascii")
        query = request.scope.get("query_string", b"")
        if query:
            target += b"?" + query
        candidates = self.candidates()
        if not candidates:
            self._count_error("none", "unavailable")
            raise APIError(503, "No healthy vLLM upstream is available; retry later.",
                           type="upstream_error", code="upstream_unavailable")
        for upstream in candidates:
            try:
                response, body = await race_disconnect(
                    request.receive, self._exchange(upstream, method, target, headers, content))
            except ClientGone:
                self.metrics.client_disconnects.labels("buffered").inc()
                on_done(499)
                raise
            except UpstreamConnectError as exc:
                # The request never reached this upstream: safe to try the next one.
                self._count_error(upstream.url, "connect")
                self.mark_down(upstream, f"connect failed: {exc}")
                continue
            except UpstreamTimeout as exc:
                self._count_error(upstream.url, "timeout")
                logger.warning("upstream %s timed out: %s", upstream.url, exc)
                raise APIError(504, "The vLLM upstream timed out.", type="upstream_error",
                               code="upstream_timeout") from None
            except UpstreamError as exc:
                self._count_error(upstream.url, "request")
                logger.warning("upstream %s failed: %r", upstream.url, exc)
                raise APIError(502, "The vLLM upstream failed to answer.",
                               type="upstream_error", code="upstream_error") from None
            if body is None:
                return UpstreamStream(response, upstream.url, self, on_done, on_first_byte)
            if on_first_byte is not None:
                on_first_byte()
            out = Response(body, status_code=response.status_code)
            length = (b"content-length", str(len(body)).encode())
            out.raw_headers = [*_response_headers(response), length]
            on_done(response.status_code)
            return out
        self._count_error("none", "unavailable")
        raise APIError(503, "Could not connect to any vLLM upstream; retry later.",
                       type="upstream_error", code="upstream_unavailable")

    async def _exchange(self, upstream: Upstream, method: str, target: bytes,
                        headers: list[tuple[bytes, bytes]], content: bytes | None,
                        ) -> tuple[UpstreamResponse, bytes | None]:
        """Send; for a non-streaming answer also read it whole (raw bytes: any content-encoding
        passes) and release the connection. SSE answers come back open, with body None."""
        assert self.client is not None
        response = await self.client.send(upstream.origin, method, target, headers, content,
                                          **self.timeout)
        content_type = response.header(b"content-type") or b""
        if content_type.startswith(b"text/event-stream"):
            return response, None
        try:
            return response, await response.read()
        finally:
            await response.aclose()

    def _count_error(self, url: str, kind: str) -> None:
        self.metrics.upstream_errors.labels(url, kind).inc()


def _response_headers(response: UpstreamResponse) -> list[tuple[bytes, bytes]]:
    headers = []
    for name, value in response.headers:
        name = name.lower()
        if name not in _RESPONSE_DROP:
            headers.append((name, value))
    return headers


async def race_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first: then cancel it, raise ClientGone."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, listener), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        listener.cancel()
        raise
    if task.done():
        listener.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        result: Any = await task
        # The work finished in the same instant: release an open stream it produced.
        if isinstance(result, tuple) and isinstance(result[0], UpstreamResponse):
            await result[0].aclose()
    raise ClientGone()


class UpstreamStream(Response):
    """An SSE response relayed chunk by chunk from an open upstream response."""

    def __init__(self, upstream: UpstreamResponse, url: str, pool: UpstreamPool,
                 on_done: Callable[[int], None],
                 on_first_byte: Callable[[], None] | None = None) -> None:
        self.upstream = upstream
        self.url = url
        self.pool = pool
        self.on_done = on_done
        self.on_first_byte = on_first_byte
        self.status_code = upstream.status_code
        self.background = None
        self.raw_headers = _response_headers(upstream)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        listener = asyncio.ensure_future(wait_for_disconnect(receive))
        status = 499  # unless the pump finishes: closing the upstream makes vLLM abort
        try:
            await asyncio.wait((pump, listener), return_when=asyncio.FIRST_COMPLETED)
            if pump.done():
                try:
                    status = pump.result()
                except OSError:  # ASGI >= 2.4 servers raise on send() to a closed client
                    status = 499
                except Exception:
                    logger.exception("relaying the upstream stream failed")
                    status = 500
        finally:
            listener.cancel()
            if not pump.done():
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pump
            await self.upstream.aclose()
            if status == 499:
                self.pool.metrics.client_disconnects.labels("stream").inc()
            self.on_done(status)

    async def _pump(self, send: Send) -> int:
        """Relay the upstream bytes; return the status to record."""
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        tail = b"\n\n"
        first = self.on_first_byte
        try:
            async for chunk in self.upstream.chunks():
                if chunk:
                    if first is not None:
                        first()
                        first = None
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    tail = (tail + chunk)[-2:]
        except UpstreamError as exc:
            kind = "timeout" if isinstance(exc, UpstreamTimeout) else "read"
            self.pool._count_error(self.url, kind)
            logger.warning("upstream %s broke mid-stream: %r", self.url, exc)
            # Start a fresh event even if the upstream was cut in the middle of one.
            prefix = b"" if tail == b"\n\n" else b"\n\n"
            message = ("The vLLM upstream timed out mid-stream." if kind == "timeout"
                       else "The vLLM upstream connection broke mid-stream.")
            await send({"type": "http.response.body",
                        "body": prefix + sse_error_event(message, code=f"upstream_{kind}"),
                        "more_body": False})
            return 502
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return self.status_code
