"""Bregman decoding for vLLM's own OpenAI server, as one ASGI middleware.

Add it to any vLLM OpenAI server with vLLM's documented flag::

    vllm serve MODEL --middleware bregman_server.middleware.BregmanMiddleware

(settings from the ``BREGMAN_*`` environment: defaults, API key, body limits). `bregman-serve`
runs vLLM's server in its own process with it. vLLM adds middleware named on the command line
last, so this one is the outermost layer: it sees every request before vLLM's routes and
middleware do.

At the server's start (the ASGI lifespan) it refuses to start a server whose engine would drop
the Bregman processor (`bregman_server.routes.processor_dropped`: speculative decoding under
vLLM's V1 model runner), puts the engine processes' Bregman metrics (k*, exact path, failures)
on vLLM's ``/metrics`` (`bregman_server.metrics.attach_engine_metrics`), and runs the server's
lifecycle inside vLLM's server (`bregman_server.serving.run_lifecycle`: the drain on SIGTERM,
the engine-death policy); the metrics go when the server stops. On the first request it reads
the app it wraps (``scope["app"]``, vLLM's FastAPI app): which routes take the Bregman fields
(`bregman_server.routes`) and whether vLLM's CORS layer answers preflights inside it. Then each
HTTP request, in order:

0. A method token that HTTP does not define and no route of the app takes (``FOO``, ``M`` and
   a thousand letters) is a 405 in OpenAI's shape: it reaches no layer of the app, whose HTTP
   metrics would add series to ``/metrics`` for every new token.
1. ``/health`` answers 503 with the reason while the server drains or its engine is dead, so
   that load balancers move on; otherwise it goes to the app (vLLM's own check).
2. With an API key, every route but ``/health`` needs ``Authorization: Bearer <key>``: vLLM's
   unguarded routes too (``/invocations``, ``/tokenize``, ``/metrics``, ``/load``,
   ``/openapi.json``, ``/docs`` ...). Only a real CORS preflight, which vLLM's CORS layer
   answers before any route, passes without it (`bregman_server.auth.is_preflight`).
3. While draining or after the engine died, every other request gets an OpenAI-shaped 503.
4. A request body is read whole: at most ``max_body_bytes`` (413), no silence longer than
   ``body_timeout`` and all of it within ``body_deadline`` seconds (408); a ``Content-Encoding``
   vLLM cannot read is a 415. A body vLLM reads as JSON is read here as vLLM reads it
   (`bregman_server.jsonbody`: any of its encodings and escapes, the last of duplicate keys),
   unless it provably carries nothing to act on (the fast path, `jsonbody.must_parse`). On the
   routes that take them, the Bregman fields (top level and extra arguments, which must agree)
   and the server defaults are validated and written into the route's extra arguments
   (`bregman_server.bregman`); on every other route a Bregman field is a 400 naming it. A key
   meant as a Bregman field but misspelt (``BREGMAN_TOP_K``, ``bregman-top-k``) is a 400
   everywhere, never silently ignored; ``NaN`` / ``Infinity`` (but for ``bregman_alpha``) and
   JSON nested too deeply are 400s everywhere.
5. The app runs; its response passes through untouched, streams chunk by chunk, except that
   its errors reach the client in OpenAI's shape (`bregman_server.errors.OpenAIErrors`). The
   request is tracked in the server's `Lifecycle`, which ends it properly when the shutdown
   grace runs out or the engine dies: a stream gets an error event and ``data: [DONE]``, a
   request still waiting for its answer gets a 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from typing import Any
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bregman_vllm.params import BregmanParamError, BregmanParams, is_bregman_key

from .auth import UNAUTHORIZED, KeyCheck, answers_preflights, header, is_preflight
from .bregman import apply_bregman, refuse_beam_search, refuse_bregman_fields
from .errors import APIError, OpenAIErrors, error_response, unavailable
from .jsonbody import (
    encode_json_body,
    is_form_type,
    is_json_type,
    mentions_bregman,
    must_parse,
    parse_json_body,
    refuse_special,
)
from .lifecycle import ENGINE_DEAD, Cut, Flight, Lifecycle, SlowClient
from .limits import bound_tls_handshakes
from .metrics import attach_engine_metrics, detach_engine_metrics, metrics
from .routes import FORM, Routes, honoured_routes, processor_dropped
from .serving import run_lifecycle
from .settings import ServerSettings

logger = logging.getLogger("bregman_server")

_timeout = getattr(asyncio, "timeout", None)

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


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    length = header(headers, b"content-length")
    return (length is not None and length != b"0") \
        or header(headers, b"transfer-encoding") is not None


async def _receive_within(receive: Receive, seconds: float) -> Message:
    if _timeout is not None:  # Python >= 3.11: no task per message
        async with _timeout(seconds):
            return await receive()
    return await asyncio.wait_for(receive(), seconds)  # pragma: no cover - Python 3.10


async def _read_body(receive: Receive, limit: int, gap: float, deadline: float
                     ) -> bytes | None:
    """The whole request body (None if the client left): 413 past ``limit`` bytes, 408 after
    ``gap`` seconds without a byte (e.g. a body shorter than its Content-Length) or when it is
    not whole after ``deadline`` seconds (a trickle)."""
    clock = asyncio.get_running_loop().time
    end = clock() + deadline
    chunks: list[bytes] = []
    size = 0
    while True:
        left = end - clock()
        try:
            message = await _receive_within(receive, min(gap, left))
        except asyncio.TimeoutError:
            if gap < left:
                raise APIError(408, f"The request body stalled: nothing arrived for {gap:g} s "
                               "(is Content-Length larger than the body?).",
                               code="request_timeout", headers=_CLOSE) from None
            raise APIError(408, f"The request body did not arrive whole within {deadline:g} s.",
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


_PART_NAME = re.compile(rb'(?i)^content-disposition:.*?;\s*name=(?:"([^"]*)"|([^;\s]*))')


def _form_has_bregman_field(raw: bytes, content_type: bytes) -> bool:
    """Whether a form body has a field meant as a Bregman field (the matching rule of
    `bregman_vllm.params.is_bregman_key`; vLLM would ignore it)."""
    if content_type.lower().lstrip().startswith(b"multipart/"):
        if not mentions_bregman(raw) and raw.isascii():  # part names are written as they are
            return False
        names = (match.group(1) if match.group(1) is not None else match.group(2)
                 for match in map(_PART_NAME.match, raw.split(b"\r\n")) if match)
        return any(is_bregman_key(name.decode(charset, "replace")) for name in names
                   for charset in ("utf-8", "latin-1"))
    # URL-encoded names may be percent-escaped ("%62regman_top_k"): read them all, as UTF-8
    # and as Latin-1 (the form parser's charset decides).
    return any(is_bregman_key(key) for charset in ("utf-8", "latin-1")
               for key, _ in parse_qsl(raw.decode(charset, "replace"), keep_blank_values=True,
                                       encoding=charset))


def _form_values(raw: bytes, content_type: bytes) -> dict[str, str]:
    """The text fields of a form body (the last of each name), as its route reads them."""
    if content_type.lower().lstrip().startswith(b"multipart/"):
        from email.parser import BytesParser
        from email.policy import HTTP

        message = BytesParser(policy=HTTP).parsebytes(
            b"Content-Type: " + content_type + b"\r\n\r\n" + raw)
        values = {}
        for part in message.iter_parts() if message.is_multipart() else ():
            name = part.get_param("name", header="content-disposition")
            if isinstance(name, str) and part.get_filename() is None:
                payload = part.get_payload(decode=True)
                if isinstance(payload, bytes):
                    values[name] = payload.decode("utf-8", "replace")
        return values
    return dict(parse_qsl(raw.decode("latin-1"), keep_blank_values=True, encoding="utf-8"))


def _refuse_form_beam_search(raw: bytes, content_type: bytes) -> None:
    """A form route (speech to text) with beam search and Bregman fields in its ``vllm_xargs``
    JSON string: a 400 (its beam search drops them, as on the JSON routes; the server's
    defaults do not reach forms)."""
    values = _form_values(raw, content_type)
    try:
        xargs = json.loads(values.get("vllm_xargs") or "null")
        params = BregmanParams.from_mapping(xargs) if isinstance(xargs, dict) else None
    except (ValueError, BregmanParamError):  # vLLM's own 400, or the processor's
        return
    if params is not None and params.enabled:
        refuse_beam_search(values.get("use_beam_search"))


# The rest of an unread body would be taken for the next request: close the connection.
_CLOSE = {"Connection": "close"}
_IDENTITY = (b"", b"identity")
#: The methods HTTP defines (RFC 9110 and PATCH, RFC 5789): the middleware passes these, and any
#: other the app's routes take, to the app; it answers every other method token itself.
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE",
                          "PATCH"})


def served_methods(app: Any) -> frozenset[str]:
    """The methods the routes of ``app`` (and of the routers mounted in it) take."""
    methods: set[str] = set()
    for route in getattr(app, "routes", ()):
        methods |= set(getattr(route, "methods", None) or ())
        methods |= served_methods(route)
    return frozenset(methods)


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
        # Read from the app on the first request (`_learn`).
        self.routes: Routes | None = None
        self.methods = HTTP_METHODS
        self._served_methods: frozenset[str] = frozenset()
        self._cors_inside = False
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
        routes = self.routes if self.routes is not None else self._learn(scope)
        method = scope["method"]
        if method not in self.methods:
            await self._unknown_method(scope, receive, send, started)
            return
        path = scope["path"]
        root = scope.get("root_path", "")
        if root:
            path = path.removeprefix(root)
        route = routes.match(path)
        endpoint = route or "other"
        if self._adopt_vllm_key:
            self._adopt_key(scope)
        refused = self._refused(scope)
        if path == "/health" and refused is None:
            await self.app(scope, receive, OpenAIErrors(send, method, path))
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
                        and not (self._cors_inside and is_preflight(scope)) \
                        and not self.key_check(header(scope["headers"], b"authorization")):
                    raise UNAUTHORIZED
                if refused is not None:
                    raise unavailable(refused.message, refused.reason)
                if _has_body(scope["headers"]):
                    raw = await self._body(scope, receive)
                    if raw is None:  # the client left while sending
                        flight.status = 499
                        return
                    mode, scope, raw = self._map(scope, method, path, route, raw)
                    receive = _replay(raw, receive)
            except BregmanParamError as exc:
                mode = "invalid"
                raise APIError(400, str(exc), param=exc.field) from None
            await self.app(scope, receive, OpenAIErrors(flight.send, method, path))
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
            logger.warning("closing %s %s: %s", method, path, exc)
            flight.status = flight.status or 408
            raise
        except Exception:
            logger.exception("unhandled error on %s %s", method, path)
            if flight.status is not None:
                raise
            await error_response(500, "Internal server error.", type="server_error")(
                scope, receive, flight.send)
        finally:
            del self.lifecycle.flights[task]
            in_flight.dec()
            self.metrics.record(endpoint, mode, flight.status or 499,
                                time.perf_counter() - started)

    async def _unknown_method(self, scope: Scope, receive: Receive, send: Send,
                              started: float) -> None:
        """A 405 for a method token that HTTP does not define and no route takes, before any
        route or layer of the app sees it: vLLM's HTTP metrics label requests by method, so
        every new token would add series to /metrics for good."""
        method = scope["method"]
        allowed = ", ".join(sorted(self._served_methods)) or "none"
        headers = {"Allow": allowed, **(_CLOSE if _has_body(scope["headers"]) else {})}
        await APIError(405, f"Method {method[:40]!r} is not an HTTP method this server serves "
                       f"(its routes take {allowed}).", code="method_not_allowed",
                       headers=headers).response()(scope, receive, send)
        self.metrics.record("other", "none", 405, time.perf_counter() - started)

    async def _body(self, scope: Scope, receive: Receive) -> bytes | None:
        headers = scope["headers"]
        declared = header(headers, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            raise _too_large(self.limit)
        encoding = header(headers, b"content-encoding")
        if encoding is not None and encoding.strip().lower() not in _IDENTITY:
            # vLLM reads bodies as they come: a compressed body would reach it undecoded.
            raise APIError(415, f"Content-Encoding {encoding.decode('latin-1')[:40]!r} is not "
                           "supported: send the body uncompressed.",
                           code="unsupported_content_encoding", headers=_CLOSE)
        settings = self.settings
        return await _read_body(receive, self.limit, settings.body_timeout,
                                settings.body_deadline)

    def _map(self, scope: Scope, method: str, path: str, route: str | None, raw: bytes
             ) -> tuple[str, Scope, bytes]:
        """(mode, scope, body) for the app: the Bregman fields validated and mapped."""
        assert self.routes is not None
        target = self.routes.targets[route] if route is not None else None
        honoured = target is not None and target != FORM
        unread = "off" if honoured else "none"
        content_type = header(scope["headers"], b"content-type")
        if not is_json_type(content_type):  # vLLM does not read it as JSON either
            if is_form_type(content_type) and _form_has_bregman_field(raw, content_type or b""):
                raise BregmanParamError(
                    "bregman_*", "Bregman fields need a JSON body; send them to "
                    f"{self.routes.text} with Content-Type: application/json")
            if route in self.routes.beam_search and b"use_beam_search" in raw \
                    and is_form_type(content_type):
                _refuse_form_beam_search(raw, content_type or b"")
            return unread, scope, raw
        if not (honoured and self.parse_always) and not must_parse(raw):
            return unread, scope, raw
        body, special = parse_json_body(raw)
        if not honoured:
            refuse_bregman_fields(body, f"{method} {path}", self.routes.text)
            if special:
                raise refuse_special(body)
            return "none", scope, raw
        assert target is not None
        mode, changed = apply_bregman(body, self.defaults, target, self.settings.max_support,
                                      beam_search=route in self.routes.beam_search)
        if not (changed or special):
            return mode, scope, raw
        raw = encode_json_body(body)
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(raw)).encode()))
        return mode, {**scope, "headers": headers}, raw

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The server's start and stop: no start if the engine dropped the processor; the
        engine's metrics on /metrics and our lifecycle while it runs."""
        app = scope.get("app")
        config = getattr(getattr(app, "state", None), "vllm_config", None)
        dropped = config is not None and processor_dropped(
            config.speculative_config, config.use_v2_model_runner)
        if dropped:
            await receive()  # lifespan.startup
            await send({"type": "lifespan.startup.failed", "message": dropped})
            return
        # (before uvicorn creates its listening server, which it does once the lifespan started)
        bound_tls_handshakes(asyncio.get_running_loop(), self.settings.header_timeout)
        self._engine_metrics_ready = True
        directory = attach_engine_metrics(app)
        running: asyncio.Task[None] | None = None

        async def started(message: Message) -> None:
            nonlocal running
            if message["type"] == "lifespan.startup.complete":
                running = asyncio.create_task(run_lifecycle(self.lifecycle, self.settings, app))
            await send(message)

        try:
            await self.app(scope, receive, started)
        finally:
            if running is not None:
                running.cancel()
            if directory is not None:
                detach_engine_metrics(directory)

    # --- state ----------------------------------------------------------------------------

    def _learn(self, scope: Scope) -> Routes:
        """What the app serves: its honoured routes, whether it answers CORS preflights. The
        app is ``scope["app"]`` inside vLLM's app, the wrapped app when wrapped around one."""
        app = scope.get("app") or self.app
        self._cors_inside = answers_preflights(app, type(self))
        self._served_methods = served_methods(app)
        self.methods = HTTP_METHODS | self._served_methods
        routes = self.routes = honoured_routes(app)
        logger.info("Bregman fields taken on: %s", routes.text)
        return routes

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
            return Cut(*ENGINE_DEAD)
        return None

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
        if app is not None and hasattr(app, "openapi") and self.routes is not None:
            from .openapi import extend_openapi

            extend_openapi(app, self.settings, self.routes)
