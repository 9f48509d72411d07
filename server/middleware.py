"""Bregman decoding for vLLM's own OpenAI server, as one ASGI middleware.

Add it to any vLLM OpenAI server with vLLM's documented flag::

    vllm serve MODEL --middleware bregman_server.middleware.BregmanMiddleware

(settings from the ``BREGMAN_*`` environment: defaults, API key, body limit). `bregman-serve`
runs vLLM's server in its own process with it, and the gateway (``--upstream``) puts the same
class in front of its proxy routes. vLLM adds middleware named on the command line last, so this
one is the outermost layer: it sees every request before vLLM's routes and middleware do.

At the server's start (the ASGI lifespan) it puts the engine processes' Bregman metrics (k*,
exact path, failures) on vLLM's ``/metrics`` (`bregman_server.metrics.attach_engine_metrics`),
and takes them off when the server stops.

Each HTTP request, in order:

1. ``/health`` answers 503 with the reason while the server drains or its engine is dead, so
   that load balancers move on; otherwise it goes to the app (vLLM's own check).
2. With an API key, every route but ``/health`` needs ``Authorization: Bearer <key>``: vLLM's
   unguarded routes too (``/invocations``, ``/tokenize``, ``/metrics``, ``/load``,
   ``/openapi.json``, ``/docs`` ...). CORS preflights carry no credentials by design and pass.
3. While draining or after the engine died, every other request gets an OpenAI-shaped 503.
4. A request body is read whole, at most ``max_body_bytes`` (413), then on the routes that
   generate text with vLLM's ``vllm_xargs`` (`HONOURED_ROUTES`) the top-level ``bregman_*``
   fields and the server defaults are validated and written into ``vllm_xargs``; on every other
   route a top-level ``bregman_*`` field is a 400 naming it, never silently ignored. Bodies
   without ``bregman_``, ``NaN`` or ``Infinity`` (and with the server defaults off) reach vLLM
   byte for byte, unparsed.
5. The app runs; its response passes through untouched, streams chunk by chunk. The request is
   tracked in the server's `Lifecycle`, which ends it properly when the shutdown grace runs out
   or the engine dies: a stream gets an error event and ``data: [DONE]``, a request still
   waiting for its answer gets a 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bregman_vllm.params import BregmanParamError

from .auth import UNAUTHORIZED, KeyCheck, header
from .bregman import apply_bregman, encode_json_body, parse_json_body, refuse_bregman_fields
from .errors import APIError, error_response, unavailable
from .lifecycle import Cut, Flight, Lifecycle, SlowClient
from .metrics import attach_engine_metrics, detach_engine_metrics, metrics
from .routes import HONOURED_ROUTES, HONOURED_TEXT
from .settings import ServerSettings

logger = logging.getLogger("bregman_server")

# Bytes that make a body worth parsing. Without them (and with the defaults off) the body goes
# to vLLM as it came. Many brackets may mean JSON nested deeper than a parser can follow.
_MARKERS = (b"bregman_", b"NaN", b"Infinity")
_DEEP = 2_000
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_JSON_TYPES = (b"application/json", b"text/json")
_FORM_TYPES = (b"multipart/form-data", b"application/x-www-form-urlencoded")


#: The settings and lifecycle of the server this process runs (`configure_process`); None
#: under plain ``vllm serve --middleware ...``, where the environment gives the settings.
_process: tuple[ServerSettings, Lifecycle] | None = None


def configure_process(settings: ServerSettings, lifecycle: Lifecycle) -> None:
    """Make every `BregmanMiddleware` built in this process (by vLLM, from its import path)
    use ``settings`` and ``lifecycle``: how `bregman-serve` hands them to vLLM's app."""
    global _process
    _process = (settings, lifecycle)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` that first yields the body read already, then the client's own messages."""
    pending = True

    async def replayed() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _read_body(receive: Receive, limit: int, timeout: float) -> bytes | None:
    """The whole request body (None if the client left), 413 past ``limit`` bytes, 408 after
    ``timeout`` seconds without a byte (e.g. a body shorter than its Content-Length)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            message = await asyncio.wait_for(receive(), timeout)
        except asyncio.TimeoutError:
            raise APIError(408, f"The request body stalled: nothing arrived for {timeout:g} s "
                           "(is Content-Length larger than the body?).",
                           code="request_timeout", headers=_CLOSE) from None
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        if not message.get("more_body", False):
            if not chunks:
                return chunk
            chunks.append(chunk)
            return b"".join(chunks)
        chunks.append(chunk)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"Request body too large: the limit is {limit} bytes.",
                    code="request_too_large", headers=_CLOSE)


# The rest of an unread body would be taken for the next request: close the connection.
_CLOSE = {"Connection": "close"}


class BregmanMiddleware:
    """The Bregman fields, the API key on every route, bounded bodies, orderly ends.

    ``settings`` default to the ``BREGMAN_*`` environment (how ``vllm serve --middleware``
    builds it); ``lifecycle`` is shared with the server that drains it on shutdown.
    """

    def __init__(self, app: ASGIApp, settings: ServerSettings | None = None,
                 lifecycle: Lifecycle | None = None) -> None:
        self.app = app
        if settings is None and _process is not None:  # built by vLLM inside bregman-serve
            settings, lifecycle = _process
        standalone = settings is None  # loaded by `vllm serve --middleware`
        self.settings = settings if settings is not None else ServerSettings()
        self.lifecycle = lifecycle if lifecycle is not None else Lifecycle()
        defaults = self.settings.bregman_defaults()
        self.defaults = defaults
        self.parse_always = defaults.enabled
        self.limit = self.settings.max_body_bytes
        key = self.settings.api_key_value()
        self.key_check: KeyCheck | None = KeyCheck([key]) if key else None
        # Under plain `vllm serve` vLLM's own key (--api-key / VLLM_API_KEY) guards every route.
        self._adopt_vllm_key = standalone and key is None
        self._engine: Any = None
        self._openapi_ready = False
        self._engine_metrics_ready = False
        self.metrics = metrics()

    # --- per request ---------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind != "http":
            if kind == "lifespan":
                await self._lifespan(scope, receive, send)
                return
            if kind == "websocket" and not self._websocket_allowed(scope):
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        path = scope["path"]
        root = scope.get("root_path", "")
        if root:
            path = path.removeprefix(root)
        endpoint = path if path in HONOURED_ROUTES else "other"
        if self._adopt_vllm_key:
            self._adopt_key(scope)
        refused = self._refused(scope)
        if path == "/health" and refused is None:
            await self.app(scope, receive, send)
            return
        if path == "/openapi.json" and not self._openapi_ready:
            self._extend_openapi(scope)
        if path == "/metrics" and not self._engine_metrics_ready:
            self._engine_metrics_ready = True  # normally done at startup (`_lifespan`)
            attach_engine_metrics(scope.get("app"))

        task = asyncio.current_task()
        flight = Flight(send, self.settings.send_timeout, lambda: self._refused(scope))
        assert task is not None
        self.lifecycle.flights[task] = flight
        in_flight = self.metrics.in_flight_for(endpoint)
        in_flight.inc()
        mode = "none"
        try:
            try:
                if path != "/health" and self.key_check is not None \
                        and not self._preflight(scope) \
                        and not self.key_check(header(scope["headers"], b"authorization")):
                    raise UNAUTHORIZED
                if refused is not None:
                    raise unavailable(refused.message, refused.reason)
                if scope["method"] in _BODY_METHODS:
                    raw = await self._body(scope, receive)
                    if raw is None:  # the client left while sending
                        flight.status = 499
                        return
                    mode, scope, raw = self._map(scope, path, endpoint, raw)
                    receive = _replay(raw, receive)
            except BregmanParamError as exc:
                mode = "invalid"
                raise APIError(400, str(exc), param=exc.field) from None
            await self.app(scope, receive, flight.send)
        except APIError as exc:
            await exc.response()(scope, receive, flight.send)
        except asyncio.CancelledError:
            if flight.cut is None:
                raise
            uncancel = getattr(task, "uncancel", None)  # Python >= 3.11
            if uncancel is not None:
                uncancel()
            flight.status = await flight.finish(scope, receive)
        except SlowClient as exc:
            logger.warning("closing %s %s: %s", scope["method"], path, exc)
            flight.status = flight.status or 408
            raise
        except Exception:
            logger.exception("unhandled error on %s %s", scope["method"], path)
            if flight.status is not None:
                raise
            await error_response(500, "Internal server error.", type="server_error")(
                scope, receive, flight.send)
        finally:
            del self.lifecycle.flights[task]
            in_flight.dec()
            self.metrics.record(endpoint, mode, flight.status or 499,
                                time.perf_counter() - started)

    async def _body(self, scope: Scope, receive: Receive) -> bytes | None:
        declared = header(scope["headers"], b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            raise _too_large(self.limit)
        return await _read_body(receive, self.limit, self.settings.body_timeout)

    def _map(self, scope: Scope, path: str, endpoint: str, raw: bytes
             ) -> tuple[str, Scope, bytes]:
        """(mode, scope, body) for the app: the Bregman fields validated and mapped."""
        content_type = (header(scope["headers"], b"content-type") or b"").lower()
        if not content_type.startswith(_JSON_TYPES):
            if b"bregman_" in raw and content_type.startswith(_FORM_TYPES):
                raise BregmanParamError(
                    "bregman_*", f"Bregman fields need a JSON body; send them to "
                    f"{HONOURED_TEXT} with Content-Type: application/json")
            return ("off" if endpoint != "other" else "none"), scope, raw
        honoured = endpoint != "other"
        if not (honoured and self.parse_always) and not any(m in raw for m in _MARKERS) \
                and raw.count(b"[") + raw.count(b"{") < _DEEP:
            return ("off" if honoured else "none"), scope, raw
        body, special = parse_json_body(raw)
        if not honoured:
            refuse_bregman_fields(body, f"{scope['method']} {path}", HONOURED_TEXT)
            return "none", scope, raw
        mode, changed = apply_bregman(body, self.defaults)
        if not (changed or special):
            return mode, scope, raw
        raw = encode_json_body(body)
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(raw)).encode()))
        return mode, {**scope, "headers": headers}, raw

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The server's start and stop: the engine's metrics on /metrics while it runs."""
        self._engine_metrics_ready = True
        directory = attach_engine_metrics(scope.get("app"))
        try:
            await self.app(scope, receive, send)
        finally:
            if directory is not None:
                detach_engine_metrics(directory)

    # --- state ----------------------------------------------------------------------------

    def _refused(self, scope: Scope) -> Cut | None:
        """Why new requests get a 503 now (draining, engine dead), or None."""
        refusing = self.lifecycle.refusing
        if refusing is not None:
            return refusing
        engine = self._engine
        if engine is None:
            app = scope.get("app")
            engine = getattr(getattr(app, "state", None), "engine_client", None)
            if engine is None:
                return None
            self._engine = engine
        if engine.errored:
            return Cut("engine_dead", "The vLLM engine died; this server is restarting.")
        return None

    @staticmethod
    def _preflight(scope: Scope) -> bool:
        """A CORS preflight (no credentials by design; vLLM's CORS layer answers it)."""
        return scope["method"] == "OPTIONS" and header(
            scope["headers"], b"access-control-request-method") is not None

    def _websocket_allowed(self, scope: Scope) -> bool:
        if self._adopt_vllm_key:
            self._adopt_key(scope)
        if self._refused(scope) is not None:
            return False
        return self.key_check is None or self.key_check(
            header(scope["headers"], b"authorization"))

    def _adopt_key(self, scope: Scope) -> None:
        """Under plain `vllm serve`: guard every route with vLLM's own API key, if it has one."""
        self._adopt_vllm_key = False
        args = getattr(getattr(scope.get("app"), "state", None), "args", None)
        keys = list(getattr(args, "api_key", None) or [])
        if not keys:
            import os

            keys = [os.environ.get("VLLM_API_KEY", "")]
        if any(keys):
            self.key_check = KeyCheck(keys)

    def _extend_openapi(self, scope: Scope) -> None:
        """Add the Bregman fields to the app's OpenAPI document (vLLM's request models)."""
        self._openapi_ready = True
        app = scope.get("app")
        if app is not None and hasattr(app, "openapi"):
            from .openapi import extend_openapi

            extend_openapi(app, self.settings)


