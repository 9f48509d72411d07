"""The gateway: one OpenAI-compatible endpoint in front of several vLLM servers.

``bregman-serve --upstream URL [URL ...]`` runs `serve`; tests build the app with
`create_gateway_app`. The app is a FastAPI app wrapped in `BregmanMiddleware`, so the gateway
answers exactly like the in-process server: the API key on every route but ``/health``, the body
limit and deadline, the Bregman fields validated and mapped into ``vllm_xargs`` (the body that
reaches the routes below is already mapped and is forwarded unchanged), the shutdown drain.

Routes:

* ``POST /v1/completions``, ``POST /v1/chat/completions`` (documented in /docs with the Bregman
  fields), ``GET /v1/models``, every other ``/v1/*`` route and ``/tokenize``, ``/detokenize``,
  ``/version``: forwarded. vLLM's admin routes (LoRA loading, ``/sleep``, ...) are not: an
  OpenAI-shaped 404.
* ``GET /health``: 200 while at least one upstream is healthy, else 503. ``GET /metrics``:
  Prometheus text format, the process's default registry.

The upstream client is one `httpx.AsyncClient` with one connection pool per upstream (httpx
``mounts``), so ``upstream_max_connections`` bounds the connections to each upstream;
keep-alive connections idle for 4 s are closed, before vLLM's own 5 s keep-alive timeout does.
Proxied requests go straight to the client's pool for their upstream (what ``AsyncClient.send``
adds, cookies, redirects, auth flows, is nothing a proxy should do, and costs about 0.2 ms of
CPU per request); the health checks go through the client.
Every exchange is bounded:

* connect (``connect_timeout``), silence between two bytes (``read_timeout``), waiting for a
  pooled connection, and a total deadline (``request_timeout``) from the first attempt to the
  last byte, streams included: 504 before anything was sent, else the stream ends with an error
  event and ``data: [DONE]``;
* response heads: at most 100 KiB (httpcore's h11 limit), else 502; bytes an upstream sends
  after a response are never part of it (h11 frames the body), nor of the next one on that
  connection: it is closed instead of reused (`guard_trailing_bytes`);
* non-streaming responses are read with a running byte count, at most ``max_response_bytes``
  (502 above, and the upstream connection is closed, so memory stays bounded); SSE responses
  (``text/event-stream``) are relayed chunk by chunk as they arrive.

Upstreams: every ``health_interval`` seconds each upstream's ``/health`` is asked (at most
``health_timeout`` seconds); requests go round-robin over the healthy ones, and get 503 when none
is. An upstream leaves the rotation after two failed checks in a row, or at once when it refuses
a connection. A request whose connection to an upstream could not be opened (it never reached
it) is tried on the next healthy upstream, as is one answered 503 (vLLM refuses it before any
work, e.g. while it drains); any other failure is a 502 (or 504), never retried. If the client
goes away, the upstream response is closed, which makes vLLM abort the generation.

The client's ``Authorization`` header is replaced by ``upstream_api_key`` when one is set, and
dropped when it carried our own API key; otherwise it is forwarded (an upstream's own key still
works). Proxies from the environment are never used, and no cookies are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import signal
import socket
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from bregman_vllm import __version__

from .errors import APIError, error_response, sse_error_event
from .metrics import metrics
from .middleware import BregmanMiddleware, Lifecycle
from .openapi import openapi_components
from .settings import ServerSettings

logger = logging.getLogger("bregman_server.gateway")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODELS = "/v1/models"
# Forwarded besides the routes above; vLLM's admin routes are left out.
PASSTHROUGH_PREFIX = "/v1/"
PASSTHROUGH_EXACT = frozenset({"/tokenize", "/detokenize", "/version"})
PASSTHROUGH_BLOCKED = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
PASSTHROUGH_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]

UNHEALTHY_AFTER = 2  # failed health checks in a row that take an upstream out
KEEPALIVE_EXPIRY = 4.0  # seconds; vLLM (uvicorn) closes idle connections after 5
HEALTH_BODY_LIMIT = 64 * 1024  # bytes of a /health answer read (the connection stays open)

# Hop-by-hop headers (RFC 9110 7.6.1) and those httpx writes itself.
_REQUEST_DROP = frozenset({
    b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te",
    b"trailer", b"upgrade", b"proxy-authorization", b"proxy-authenticate", b"expect",
    b"proxy-connection",
})
# uvicorn writes its own date / server headers; we write content-length (or chunk the stream).
_RESPONSE_DROP = frozenset({
    b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer",
    b"upgrade", b"date", b"server", b"proxy-connection",
})
# Characters left as they are when the (decoded) request path is written to the upstream.
_PATH_SAFE = "/!$&'()*+,;=:@-._~"

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "Invalid request (e.g. a Bregman field out of range), OpenAI's shape: "
          '{"error": {"message", "type": "invalid_request_error", "param", "code"}}.'},
    401: {"description": "Missing or wrong API key (only when the server has one)."},
    413: {"description": "Request body larger than the server's limit."},
    502: {"description": "The vLLM upstream failed, or its answer was larger than the limit."},
    503: {"description": "No healthy vLLM upstream, or the server is shutting down."},
    504: {"description": "The vLLM upstream did not answer in time."},
}


# --- deadlines -------------------------------------------------------------------------------

class _Deadline:
    """``asyncio.timeout`` for Python 3.10 (which lacks it): cancels the task when the time is
    up, or at once after ``reschedule(0)``, and raises TimeoutError out of the block."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._task: asyncio.Task[Any] | None = None
        self._handle: asyncio.Handle | None = None
        self._expired = False

    async def __aenter__(self) -> _Deadline:
        self._task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        self._handle = loop.call_at(loop.time() + self._seconds, self._fire)
        return self

    async def __aexit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._expired and kind is asyncio.CancelledError:
            raise TimeoutError

    def _fire(self) -> None:
        self._handle = None
        self._expired = True
        assert self._task is not None
        self._task.cancel()

    def reschedule(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        loop = asyncio.get_running_loop()
        self._handle = loop.call_at(when, self._fire)

    def expired(self) -> bool:
        return self._expired


_timeout: Any = getattr(asyncio, "timeout", _Deadline)


# --- errors ------------------------------------------------------------------------------------

def _upstream_error(status: int, message: str, code: str) -> APIError:
    headers = {"Retry-After": "1"} if status == 503 else None
    return APIError(status, message, type="upstream_error", code=code, headers=headers)


def no_upstream() -> APIError:
    return _upstream_error(503, "No healthy vLLM upstream is available; retry later.",
                           "upstream_unavailable")


# --- upstreams -------------------------------------------------------------------------------

class Upstream:
    """One vLLM server and what the health checks know about it."""

    __slots__ = ("failures", "healthy", "last_error", "url")

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.healthy = False
        self.failures = 0
        self.last_error: str | None = "not checked yet"

    def __repr__(self) -> str:
        return f"Upstream({self.url!r}, healthy={self.healthy})"


def guard_trailing_bytes() -> None:
    """Never reuse a connection on which an upstream sent bytes after a complete response.

    httpcore puts such a connection back in its pool with the bytes still in h11's buffer, and
    h11 reads them as the start of the answer to the next request: an upstream (or anything on
    the path) writing ``{}`` + a whole second response with ``Content-Length: 2`` would answer
    another client's request. The first client gets exactly the announced body; the
    connection is closed instead of reused (the next request opens a new one). Installed once
    per process; a no-op if httpcore's internals change (test_gateway.py then fails).
    """
    try:
        import h11
        from httpcore._async.http11 import AsyncHTTP11Connection
    except ImportError:  # pragma: no cover
        logger.warning("cannot guard upstream connections against bytes after a response")
        return
    original = AsyncHTTP11Connection._response_closed
    if getattr(original, "bregman_guard", False):
        return

    async def _response_closed(self: Any) -> None:
        state = getattr(self, "_h11_state", None)
        if state is not None and state.their_state is h11.DONE and state.trailing_data[0]:
            logger.warning("an upstream sent %d bytes after a complete response: connection "
                           "closed", len(state.trailing_data[0]))
            await self.aclose()
            return
        await original(self)

    _response_closed.bregman_guard = True  # type: ignore[attr-defined]
    AsyncHTTP11Connection._response_closed = _response_closed  # type: ignore[method-assign]


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


class UpstreamPool:
    """The upstreams, their health, and the one HTTP client that talks to them."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.upstreams = [Upstream(url) for url in settings.upstream]
        self.metrics = metrics()
        key = settings.upstream_api_key_value()
        self.upstream_auth: tuple[bytes, bytes] | None = (
            (b"authorization", f"Bearer {key}".encode()) if key else None)
        # Drop the client's Authorization: it is our own key, or the upstream key replaces it.
        self.drop_authorization = (settings.api_key_value() is not None
                                   or self.upstream_auth is not None)
        self.timeout = httpx.Timeout(
            connect=settings.connect_timeout, read=settings.read_timeout,
            write=settings.read_timeout,
            # Waiting for a free connection to a busy upstream: the total deadline bounds it.
            pool=settings.request_timeout)
        self.client: httpx.AsyncClient | None = None
        self.transports: dict[str, httpx.AsyncBaseTransport] = {}
        self.extensions = {"timeout": self.timeout.as_dict()}
        self._rotation = itertools.count()
        self._health_task: asyncio.Task[None] | None = None
        for upstream in self.upstreams:
            self.metrics.upstream_healthy.labels(upstream.url).set(0)

    # --- lifecycle -------------------------------------------------------------------------

    def open(self) -> httpx.AsyncClient:
        """The HTTP client: one connection pool per upstream origin, no cookies, no proxies."""
        guard_trailing_bytes()
        limits = httpx.Limits(max_connections=self.settings.upstream_max_connections,
                              max_keepalive_connections=self.settings.upstream_max_connections,
                              keepalive_expiry=KEEPALIVE_EXPIRY)
        transports = {origin: httpx.AsyncHTTPTransport(limits=limits, retries=0)
                      for origin in {_origin(upstream.url) for upstream in self.upstreams}}
        self.transports = {upstream.url: transports[_origin(upstream.url)]
                           for upstream in self.upstreams}
        mounts: dict[str, httpx.AsyncBaseTransport | None] = dict(transports)
        client = httpx.AsyncClient(
            timeout=self.timeout, limits=limits, mounts=mounts, trust_env=False,
            follow_redirects=False,
            cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])))
        # Send only what the client sent (plus our key): no default User-Agent / Accept-Encoding.
        for name in ("user-agent", "accept-encoding", "accept"):
            del client.headers[name]
        return client

    async def start(self) -> None:
        """Open the client, check every upstream once, then keep checking in the background."""
        self.client = self.open()
        await self.check_all()
        self._health_task = asyncio.create_task(self._health_loop(), name="upstream-health")

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.client is not None:
            await self.client.aclose()

    # --- health ----------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval)
            try:
                await self.check_all()
            except Exception:  # the loop must survive anything
                logger.exception("upstream health check failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(upstream) for upstream in self.upstreams))

    async def check(self, upstream: Upstream) -> bool | None:
        """GET the upstream's /health, bounded in total by ``health_timeout`` (at most 64 KiB
        of its body are read). Returns whether it is healthy now (None: inconclusive)."""
        assert self.client is not None
        seconds = self.settings.health_timeout
        error = None
        at_once = False
        try:
            async with _timeout(seconds):
                request = self.client.build_request(
                    "GET", upstream.url + "/health", headers=self._auth_headers(),
                    timeout=httpx.Timeout(seconds, pool=seconds / 2))
                response = await self.client.send(request, stream=True)
                try:
                    size = 0
                    async for chunk in response.aiter_raw():
                        size += len(chunk)
                        if size > HEALTH_BODY_LIMIT:
                            break
                finally:
                    await response.aclose()
            if response.status_code != 200:
                error = f"/health answered {response.status_code}"
        except httpx.PoolTimeout:
            # Every connection to it is busy serving requests: that says nothing against it.
            return None
        except httpx.ConnectError as exc:
            error, at_once = f"connection failed: {exc}", True
        except TimeoutError:
            error = f"/health did not answer within {seconds:g} s"
        except httpx.HTTPError as exc:
            error = f"/health failed: {type(exc).__name__}: {exc}"
        self.set_health(upstream, error, at_once=at_once)
        return error is None

    def set_health(self, upstream: Upstream, error: str | None, at_once: bool = True) -> None:
        upstream.failures = 0 if error is None else upstream.failures + 1
        healthy = error is None or (
            upstream.healthy and not at_once and upstream.failures < UNHEALTHY_AFTER)
        if healthy != upstream.healthy:
            if healthy:
                logger.info("upstream %s is healthy", upstream.url)
            else:
                logger.warning("upstream %s is down: %s", upstream.url, error)
            self.metrics.upstream_healthy.labels(upstream.url).set(1 if healthy else 0)
        upstream.healthy = healthy
        upstream.last_error = None if healthy else error

    @property
    def healthy_count(self) -> int:
        return sum(1 for upstream in self.upstreams if upstream.healthy)

    def candidates(self) -> list[Upstream]:
        """The healthy upstreams, rotated so that successive requests start round-robin."""
        healthy = [upstream for upstream in self.upstreams if upstream.healthy]
        if len(healthy) > 1:
            start = next(self._rotation) % len(healthy)
            healthy = healthy[start:] + healthy[:start]
        return healthy

    # --- requests ----------------------------------------------------------------------------

    def _auth_headers(self) -> list[tuple[bytes, bytes]]:
        return [self.upstream_auth] if self.upstream_auth is not None else []

    def upstream_headers(self, scope_headers: Iterable[tuple[bytes, bytes]]
                         ) -> list[tuple[bytes, bytes]]:
        """The client's headers minus hop-by-hop ones, with the upstream's Authorization."""
        drop_auth = self.drop_authorization
        headers = [(name, value) for name, value in scope_headers
                   if name not in _REQUEST_DROP and not (drop_auth and name == b"authorization")]
        if self.upstream_auth is not None:
            headers.append(self.upstream_auth)
        return headers

    def count_error(self, upstream: Upstream | None, kind: str) -> None:
        self.metrics.upstream_errors.labels(upstream.url if upstream else "none", kind).inc()


# --- relaying one exchange -----------------------------------------------------------------------

async def _wait_disconnect(receive: Receive) -> None:
    """Return when the server reports that the client went away (the body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _response_headers(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    return [(name.lower(), value) for name, value in response.headers.raw
            if name.lower() not in _RESPONSE_DROP]


def _openai_404(content: bytes, status: int, method: str, route: str) -> bytes | None:
    """vLLM answers unknown routes with FastAPI's ``{"detail": ...}``: OpenAI's shape instead."""
    try:
        detail = json.loads(content)
    except ValueError:
        return None
    if not isinstance(detail, dict) or "error" in detail:
        return None
    message = f"{method} {route}: {detail.get('detail', 'not found')} (upstream vLLM)"
    return json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": "not_found"}}).encode()


class _State:
    """What one relay has done so far (read by the deadline and disconnect handling)."""

    __slots__ = ("active", "finished", "gone", "sse", "started", "tail", "upstream")

    def __init__(self) -> None:
        self.active = True
        self.started = False  # the response head went to the client
        self.finished = False  # the last bytes are on their way: a disconnect changes nothing
        self.gone = False  # the client went away
        self.sse = False
        self.tail = b"\n\n"
        self.upstream: Upstream | None = None


class Relay(Response):
    """The ASGI response of every forwarded request: sends it to a healthy upstream and relays
    the answer, within the total deadline, until the client goes away."""

    def __init__(self, pool: UpstreamPool, method: str, target: str,
                 headers: list[tuple[bytes, bytes]], content: bytes | None,
                 passthrough: bool) -> None:
        self.pool = pool
        self.method = method
        self.target = target
        self.headers_out = headers
        self.content = content
        self.passthrough = passthrough
        self.background = None
        self.status_code = 200
        self.raw_headers = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = _State()
        seconds = self.pool.settings.request_timeout
        listener = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            async with _timeout(seconds) as deadline:

                def client_left(task: asyncio.Future[None]) -> None:
                    if state.active and not state.finished and not task.cancelled():
                        state.gone = True  # end the exchange now: vLLM sees its socket close
                        deadline.reschedule(0)

                listener.add_done_callback(client_left)
                try:
                    await self._exchange(send, state)
                finally:
                    state.active = False
        except TimeoutError:
            if state.gone:
                return  # nobody listens; the upstream response is closed
            self.pool.count_error(state.upstream, "deadline")
            message = (f"The vLLM upstream did not finish within the request timeout "
                       f"({seconds:g} s).")
            logger.warning("upstream %s: %s %s past the deadline (%g s)",
                           state.upstream.url if state.upstream else "-", self.method,
                           self.target, seconds)
            if not state.started:
                await _upstream_error(504, message, "upstream_timeout").response()(
                    scope, receive, send)
            else:
                await self._end_stream(send, state, message, "upstream_timeout")
        except APIError as exc:
            await exc.response()(scope, receive, send)
        finally:
            listener.cancel()

    async def _exchange(self, send: Send, state: _State) -> None:
        pool = self.pool
        candidates = pool.candidates()
        if not candidates:
            pool.count_error(None, "unavailable")
            raise no_upstream()
        last = len(candidates) - 1
        for index, upstream in enumerate(candidates):
            state.upstream = upstream
            # Straight to the client's pool for this upstream: what AsyncClient.send adds
            # (cookies, redirects, auth flows, URL merging) is nothing a proxy should do.
            try:
                request = httpx.Request(self.method, upstream.url + self.target,
                                        headers=self.headers_out, content=self.content,
                                        extensions=pool.extensions)
            except httpx.InvalidURL as exc:
                raise APIError(400, f"Invalid request target: {exc}") from None
            try:
                response = await pool.transports[upstream.url].handle_async_request(request)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                # The request never reached this upstream: safe to try the next one.
                pool.count_error(upstream, "connect")
                pool.set_health(upstream, f"connection failed: {exc!r}")
                continue
            except httpx.TimeoutException as exc:
                pool.count_error(upstream, "timeout")
                logger.warning("upstream %s timed out: %r", upstream.url, exc)
                raise _upstream_error(504, "The vLLM upstream did not answer in time.",
                                      "upstream_timeout") from None
            except httpx.HTTPError as exc:
                pool.count_error(upstream, "read")
                logger.warning("upstream %s failed: %r", upstream.url, exc)
                raise _upstream_error(502, "The vLLM upstream failed to answer.",
                                      "upstream_error") from None
            try:
                if response.status_code == 503 and index < last:
                    # Refused before any work (vLLM starting or draining): the next one.
                    pool.count_error(upstream, "unavailable")
                    pool.set_health(upstream, "answered 503 to a request")
                    continue
                content_type = response.headers.get("content-type", "")
                if content_type.startswith("text/event-stream"):
                    await self._stream(response, upstream, send, state)
                    return
                content = await self._read(response, upstream)
            finally:
                await response.aclose()
            status = response.status_code
            if self.passthrough and status in (404, 405):
                content = _openai_404(content, status, self.method, self.target) or content
            headers = _response_headers(response)
            headers.append((b"content-length", str(len(content)).encode()))
            state.finished = True
            await send({"type": "http.response.start", "status": status, "headers": headers})
            state.started = True
            await send({"type": "http.response.body", "body": content, "more_body": False})
            return
        pool.count_error(None, "unavailable")
        raise _upstream_error(503, "Could not connect to any vLLM upstream; retry later.",
                              "upstream_unavailable")

    async def _read(self, response: httpx.Response, upstream: Upstream) -> bytes:
        """The whole non-streaming answer, at most ``max_response_bytes`` (else 502)."""
        limit = self.pool.settings.max_response_bytes
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise self._too_large(upstream, limit)
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in response.aiter_raw():
                size += len(chunk)
                if size > limit:
                    raise self._too_large(upstream, limit)
                chunks.append(chunk)
        except httpx.TimeoutException as exc:
            self.pool.count_error(upstream, "timeout")
            logger.warning("upstream %s timed out mid-answer: %r", upstream.url, exc)
            raise _upstream_error(504, "The vLLM upstream did not answer in time.",
                                  "upstream_timeout") from None
        except httpx.HTTPError as exc:
            self.pool.count_error(upstream, "read")
            logger.warning("upstream %s broke mid-answer: %r", upstream.url, exc)
            raise _upstream_error(502, "The vLLM upstream failed to answer.",
                                  "upstream_error") from None
        return b"".join(chunks)

    def _too_large(self, upstream: Upstream, limit: int) -> APIError:
        self.pool.count_error(upstream, "too_large")
        logger.warning("upstream %s: answer to %s %s over %d bytes", upstream.url, self.method,
                       self.target, limit)
        return _upstream_error(502, f"The vLLM upstream's answer is larger than the limit "
                               f"({limit} bytes).", "upstream_response_too_large")

    async def _stream(self, response: httpx.Response, upstream: Upstream, send: Send,
                      state: _State) -> None:
        """Relay an SSE answer as it arrives; an upstream failure ends it with an error event
        and ``data: [DONE]``."""
        state.sse = True
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": _response_headers(response)})
        state.started = True
        try:
            async for chunk in response.aiter_raw():
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    state.tail = (state.tail + chunk)[-2:]
        except httpx.HTTPError as exc:
            kind = "timeout" if isinstance(exc, httpx.TimeoutException) else "read"
            self.pool.count_error(upstream, kind)
            logger.warning("upstream %s broke mid-stream: %r", upstream.url, exc)
            await response.aclose()
            message = ("The vLLM upstream was silent for longer than the read timeout."
                       if kind == "timeout" else "The vLLM upstream connection broke mid-stream.")
            await self._end_stream(send, state, message, f"upstream_{kind}")
            return
        await response.aclose()
        state.finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _end_stream(send: Send, state: _State, message: str, code: str) -> None:
        """The last bytes of a broken stream: an error event (starting a fresh event even if the
        upstream stopped inside one) and ``data: [DONE]``."""
        state.finished = True
        body = b""
        if state.sse:
            prefix = b"" if state.tail == b"\n\n" else b"\n\n"
            body = prefix + sse_error_event(message, type="upstream_error", code=code)
        await send({"type": "http.response.body", "body": body, "more_body": False})


# --- the app -------------------------------------------------------------------------------------

def create_gateway_app(settings: ServerSettings, lifecycle: Lifecycle | None = None
                       ) -> BregmanMiddleware:
    """The gateway's ASGI app: the FastAPI routes inside `BregmanMiddleware`.

    ``lifecycle`` is the one `serve` drains on SIGTERM. The FastAPI app is ``.app`` of the
    result, the upstream pool ``.app.state.pool``; the pool opens with the app's lifespan.
    """
    if not settings.upstream:
        raise ValueError("the gateway needs at least one upstream URL")
    pool = UpstreamPool(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        try:
            yield
        finally:
            await pool.close()

    app = FastAPI(
        title="Bregman decoding gateway",
        version=__version__,
        description=(
            "OpenAI-compatible completions and chat completions with Bregman decoding (an "
            "adaptive generalization of top-k sampling), forwarded round-robin to the healthy "
            "vLLM servers behind this gateway. Send the `bregman_*` fields at the top level of "
            "the request body (with the `openai` SDK: `extra_body`). A top-level field wins "
            "over the same key in `vllm_xargs`, which wins over the server-wide default. Every "
            "other field is forwarded to vLLM unchanged."),
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.pool = pool

    # --- errors: always OpenAI's shape, never a traceback ----------------------------------

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail),
                              type="invalid_request_error" if exc.status_code < 500
                              else "server_error", headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(400, str(first.get("msg", "invalid request")), param=param)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, "Internal server error.", type="server_error")

    # --- forwarding ------------------------------------------------------------------------

    async def forward(request: Request, route: str, passthrough: bool = False) -> Relay:
        scope = request.scope
        method = scope["method"]
        content: bytes | None = await request.body()
        if not content and method in ("GET", "DELETE"):
            content = None
        target = quote(route, safe=_PATH_SAFE)
        query = scope.get("query_string", b"")
        if query:
            target += "?" + query.decode("latin-1")
        return Relay(pool, method, target, pool.upstream_headers(scope["headers"]), content,
                     passthrough)

    def request_body(name: str) -> dict[str, Any]:
        ref = {"$ref": f"#/components/schemas/{name}"}
        return {"requestBody": {"required": True, "content": {"application/json": {
            "schema": ref}}}}

    @app.post(COMPLETIONS, summary="Completion (with Bregman decoding)", tags=["OpenAI"],
              openapi_extra=request_body("CompletionRequest"), responses=_ERROR_RESPONSES,
              response_class=JSONResponse)
    async def completions(request: Request) -> Response:
        """OpenAI's ``POST /v1/completions`` plus the ``bregman_*`` fields. With ``"stream":
        true`` the answer is a stream of server-sent events ending with ``data: [DONE]``."""
        return await forward(request, COMPLETIONS)

    @app.post(CHAT, summary="Chat completion (with Bregman decoding)", tags=["OpenAI"],
              openapi_extra=request_body("ChatCompletionRequest"), responses=_ERROR_RESPONSES,
              response_class=JSONResponse)
    async def chat_completions(request: Request) -> Response:
        """OpenAI's ``POST /v1/chat/completions`` plus the ``bregman_*`` fields. With
        ``"stream": true`` the answer is a stream of server-sent events."""
        return await forward(request, CHAT)

    @app.get(MODELS, summary="List models", tags=["OpenAI"], responses=_ERROR_RESPONSES,
             response_class=JSONResponse)
    async def models(request: Request) -> Response:
        """The models served by vLLM (forwarded)."""
        return await forward(request, MODELS)

    @app.get("/health", summary="Health", tags=["Operations"],
             responses={503: {"description": "No healthy upstream, or shutting down."}})
    async def health() -> Response:
        """200 while at least one vLLM upstream is healthy, else 503 (OpenAI's error shape)."""
        total, healthy = len(pool.upstreams), pool.healthy_count
        if not healthy:
            return _upstream_error(
                503, f"None of the {total} vLLM upstream(s) answers /health.",
                "upstream_unavailable").response()
        return JSONResponse({"status": "ok", "upstreams": total, "healthy_upstreams": healthy})

    @app.get("/metrics", summary="Prometheus metrics", tags=["Operations"],
             response_class=Response)
    async def prometheus() -> Response:
        """Requests and latency by endpoint and Bregman mode, upstream errors and health."""
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=PASSTHROUGH_METHODS, include_in_schema=False)
    async def passthrough(request: Request, path: str) -> Response:
        """Other vLLM routes, unchanged; an OpenAI-shaped 404 for everything else."""
        route = "/" + path
        if not (route.startswith(PASSTHROUGH_PREFIX) or route in PASSTHROUGH_EXACT) \
                or route in PASSTHROUGH_BLOCKED:
            raise APIError(404, f"Unknown route {request.method} {route}. This gateway serves "
                           f"{COMPLETIONS}, {CHAT}, {MODELS}, /health, /metrics and /docs, and "
                           "forwards the other /v1/* routes and /tokenize, /detokenize, "
                           "/version to vLLM.", code="not_found")
        return await forward(request, route, passthrough=True)

    def custom_openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            components = schema.setdefault("components", {})
            components.setdefault("schemas", {}).update(openapi_components(settings))
            if settings.api_key_value() is not None:
                components["securitySchemes"] = {"bearer": {
                    "type": "http", "scheme": "bearer",
                    "description": "The server's API key: every route but /health needs it."}}
                schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = custom_openapi  # type: ignore[method-assign]
    return BregmanMiddleware(app, settings=settings, lifecycle=lifecycle)


# --- the process ---------------------------------------------------------------------------------

def serve(settings: ServerSettings) -> int:
    """Run the gateway until SIGTERM / SIGINT; the exit status (0, or 1 if it could not
    start, e.g. its port is taken)."""
    try:
        import uvloop

        run: Any = uvloop.run
    except ImportError:  # pragma: no cover - vLLM installs uvloop
        run = asyncio.run
    try:
        return run(_serve(settings))
    except KeyboardInterrupt:
        return 0
    except SystemExit as exc:  # uvicorn exits with 1 when it cannot bind its socket
        return exc.code if isinstance(exc.code, int) else 1


async def _serve(settings: ServerSettings) -> int:
    from .limits import uvicorn_config
    from .serving import end_open_requests, http_server

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:  # bound here: uvicorn would exit with its own status 3 (ours: the engine died)
        sock = _listen(settings.host, settings.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc)
        return 1
    lifecycle = Lifecycle()
    app: ASGIApp = create_gateway_app(settings, lifecycle)
    server = http_server(uvicorn_config(app, settings))
    serving = loop.create_task(server.serve(sockets=[sock]))
    stopping = loop.create_task(stop.wait())
    logger.info("Bregman gateway on http://%s:%d in front of %s", settings.host, settings.port,
                ", ".join(settings.upstream))
    try:
        done, _ = await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if stopping in done:
            logger.info("shutting down: %g s for open requests", settings.graceful_timeout)
            await end_open_requests(lifecycle, "shutdown", "The server is shutting down.",
                                    grace=settings.graceful_timeout)
        server.should_exit = True
        stopping.cancel()
        await serving
    except SystemExit:  # uvicorn gave up starting (e.g. the app's startup failed)
        return 1
    finally:
        sock.close()
    return 0 if server.started else 1


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket (IPv6 for an IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock
