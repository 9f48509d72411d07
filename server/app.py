"""The FastAPI app: OpenAI-compatible routes in front of one or more vLLM servers.

``create_app(settings, upstream_pool)`` builds it (tests and `server.cli` call it). Routes:

* ``POST /v1/completions``, ``POST /v1/chat/completions``: the Bregman fields are validated and
  mapped into ``vllm_xargs`` (`server.bregman`); everything else is forwarded unchanged,
  streaming (SSE) or not.
* ``GET /v1/models``, and the pass-through routes (every other ``/v1/*`` route plus
  ``/tokenize``, ``/detokenize``, ``/version``): forwarded unchanged. vLLM's admin routes
  (LoRA loading, sleep, profiling, ...) are not exposed: anything else is an OpenAI-shaped 404.
* ``GET /health`` (200 / 503), ``GET /metrics`` (Prometheus), ``/docs``, ``/openapi.json``.

The two generation routes run through `GenerationFastPath`, a thin ASGI layer in front of
FastAPI's router (less CPU per request); their FastAPI routes document them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from bregman_vllm import __version__
from bregman_vllm.params import BregmanParamError

from .auth import make_auth_dependency, make_key_check
from .bregman import apply_bregman
from .errors import APIError, error_response
from .metrics import Metrics
from .models import openapi_components
from .proxy import ClientGone, UpstreamPool
from .settings import ServerSettings

logger = logging.getLogger("bregman_server")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODELS = "/v1/models"
GENERATION_ROUTES = frozenset({COMPLETIONS, CHAT})
# Forwarded unchanged besides the two generation routes; vLLM's admin routes are left out.
PASSTHROUGH_PREFIXES = ("/v1/",)
PASSTHROUGH_EXACT = frozenset({"/tokenize", "/detokenize", "/version"})
PASSTHROUGH_BLOCKED = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "Invalid request (e.g. a Bregman field out of range), OpenAI's shape: "
          '{"error": {"message", "type": "invalid_request_error", "param", "code"}}.'},
    401: {"description": "Missing or wrong API key (only when the server has one)."},
    413: {"description": "Request body larger than the server's limit."},
    502: {"description": "The vLLM upstream failed."},
    503: {"description": "No healthy vLLM upstream."},
    504: {"description": "The vLLM upstream timed out."},
}


class ChildProcess(Protocol):
    """What the app needs from the embedded vLLM child (`server.embedded.EmbeddedVLLM`)."""

    def status(self) -> str: ...

    def returncode(self) -> int | None: ...

    async def watch(self, on_exit: Callable[[int], None]) -> None: ...


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or an OpenAI-shaped 400."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(400, f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    return body


async def read_body(request: Request, limit: int) -> bytes:
    """The whole request body, refusing more than ``limit`` bytes (413) without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"Request body too large: the limit is {limit} bytes.",
                       code="request_too_large")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"Request body too large: the limit is {limit} bytes.",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class _Record:
    """The metrics of one proxied request; ``finish`` runs once, whoever calls it first."""

    __slots__ = ("_done", "endpoint", "metrics", "mode", "started")

    def __init__(self, metrics: Metrics, endpoint: str, mode: str, started: float) -> None:
        self.metrics = metrics
        self.endpoint = endpoint
        self.mode = mode
        self.started = started
        self._done = False
        metrics.in_flight.labels(endpoint).inc()

    def first_byte(self) -> None:
        self.metrics.first_byte.labels(self.endpoint, self.mode).observe(
            time.perf_counter() - self.started)

    def finish(self, status: int) -> None:
        if self._done:
            return
        self._done = True
        metrics = self.metrics
        metrics.in_flight.labels(self.endpoint).dec()
        metrics.requests.labels(self.endpoint, self.mode, str(status)).inc()
        metrics.latency.labels(self.endpoint, self.mode).observe(
            time.perf_counter() - self.started)


def create_app(
    settings: ServerSettings,
    upstream_pool: UpstreamPool,
    *,
    child: ChildProcess | None = None,
    on_child_exit: Callable[[int], None] | None = None,
) -> FastAPI:
    """Build the app. ``child`` (embedded mode) is watched; when it dies every upstream is
    marked down (/health: 503) and ``on_child_exit(returncode)`` is called."""
    pool = upstream_pool
    metrics = pool.metrics
    defaults = settings.bregman_defaults()
    auth = make_auth_dependency(settings.api_key)
    check_key = make_key_check(settings.api_key)
    auth_enabled = settings.api_key is not None and bool(settings.api_key.get_secret_value())
    limit = settings.max_body_bytes
    state: dict[str, str | None] = {"child_error": None}

    def child_exited(returncode: int) -> None:
        if state["child_error"] is not None:  # /health may have seen it before the watcher
            return
        reason = f"the vLLM child exited with code {returncode}"
        state["child_error"] = reason
        pool.force_down(reason)
        logger.error("%s; /health now answers 503", reason)
        if on_child_exit is not None:
            on_child_exit(returncode)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        watcher = asyncio.create_task(child.watch(child_exited)) if child is not None else None
        try:
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            await pool.close()

    app = FastAPI(
        title="Bregman decoding server",
        version=__version__,
        description=(
            "OpenAI-compatible completions and chat completions with Bregman decoding (an "
            "adaptive generalization of top-k sampling) in front of vLLM. Send the "
            "`bregman_*` fields at the top level of the request body (with the `openai` SDK: "
            "`extra_body`). A top-level field wins over the same key in `vllm_xargs`, which "
            "wins over the server-wide default. Every other field is forwarded to vLLM "
            "unchanged."),
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.pool = pool

    # --- errors: always OpenAI's shape, never a traceback -------------------------------------

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
        logger.error("unhandled error on %s %s", request.method, request.url.path,
                     exc_info=exc)
        return error_response(500, "Internal server error.", type="server_error")

    # --- proxying ------------------------------------------------------------------------------

    async def proxy(request: Request, method: str, path: str, content: bytes | None,
                    record: _Record, content_type: bytes | None = None) -> Response:
        try:
            return await pool.forward(
                request, method, path, content, drop_authorization=auth_enabled,
                on_done=record.finish, on_first_byte=record.first_byte,
                content_type=content_type)
        except ClientGone:
            record.finish(499)
            return Response(status_code=499)  # nobody is listening; closes our side cleanly
        except APIError as exc:
            record.finish(exc.status)
            return exc.response()

    async def generate(request: Request, endpoint: str) -> Response:
        started = time.perf_counter()
        try:
            raw = await read_body(request, limit)
            body = parse_json_object(raw)
            mode, changed = apply_bregman(body, defaults)
        except BregmanParamError as exc:
            metrics.requests.labels(endpoint, "invalid", "400").inc()
            return error_response(400, str(exc), param=exc.field)
        except APIError as exc:
            metrics.requests.labels(endpoint, "invalid", str(exc.status)).inc()
            return exc.response()
        if changed:
            raw = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        # We parsed the body as JSON whatever it was labelled (curl -d says form-urlencoded).
        return await proxy(request, "POST", endpoint, raw,
                           _Record(metrics, endpoint, mode, started), b"application/json")

    async def serve_generation(scope: Scope, receive: Receive, send: Send,
                               endpoint: str) -> None:
        """The generation routes as plain ASGI (see `GenerationFastPath`): the same auth,
        handler and errors as the FastAPI routes below, which document them in /docs."""
        request = Request(scope, receive, send)
        try:
            if check_key is not None:
                check_key(request.headers.get("authorization"))
            response = await generate(request, endpoint)
        except APIError as exc:
            response = exc.response()
        except Exception as exc:
            logger.error("unhandled error on POST %s", endpoint, exc_info=exc)
            response = error_response(500, "Internal server error.", type="server_error")
        await response(scope, receive, send)

    app.add_middleware(GenerationFastPath, serve=serve_generation)

    generation_docs: dict[str, Any] = {
        "dependencies": [Depends(auth)],
        "responses": _ERROR_RESPONSES,
        "response_class": JSONResponse,
    }

    def request_body_schema(name: str) -> dict[str, Any]:
        ref = {"$ref": f"#/components/schemas/{name}"}
        return {"requestBody": {"required": True, "content": {"application/json": {
            "schema": ref}}}}

    @app.post(COMPLETIONS, summary="Completion (with Bregman decoding)", tags=["OpenAI"],
              openapi_extra=request_body_schema("CompletionRequest"), **generation_docs)
    async def completions(request: Request) -> Response:
        """OpenAI's ``POST /v1/completions`` plus the ``bregman_*`` fields. With ``"stream":
        true`` the answer is a stream of server-sent events ending with ``data: [DONE]``."""
        return await generate(request, COMPLETIONS)

    @app.post(CHAT, summary="Chat completion (with Bregman decoding)", tags=["OpenAI"],
              openapi_extra=request_body_schema("ChatCompletionRequest"), **generation_docs)
    async def chat_completions(request: Request) -> Response:
        """OpenAI's ``POST /v1/chat/completions`` plus the ``bregman_*`` fields. With
        ``"stream": true`` the answer is a stream of server-sent events."""
        return await generate(request, CHAT)

    @app.get(MODELS, summary="List models", tags=["OpenAI"], **generation_docs)
    async def models(request: Request) -> Response:
        """The models served by vLLM (forwarded)."""
        return await proxy(request, "GET", MODELS, None,
                           _Record(metrics, MODELS, "none", time.perf_counter()))

    @app.get("/health", summary="Health", tags=["Operations"],
             responses={503: {"description": "No healthy upstream, or the vLLM child died."}})
    async def health() -> Response:
        """200 when at least one vLLM upstream is healthy (in embedded mode: the child is
        alive and healthy), else 503 with the reason."""
        upstreams = len(pool.upstreams)
        healthy = pool.healthy_count
        if child is not None and state["child_error"] is None:
            code = child.returncode()
            if code is not None:  # died since the watcher's last poll: do not wait for it
                child_exited(code)
                healthy = pool.healthy_count
        body: dict[str, Any] = {
            "status": "ok" if healthy else "unavailable",
            "mode": "embedded" if child is not None else "upstream",
            "upstreams": upstreams,
            "healthy_upstreams": healthy,
        }
        if child is not None:
            body["vllm_child"] = child.status()
        if not healthy:
            body["reason"] = state["child_error"] or "no vLLM upstream answers /health"
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/metrics", summary="Prometheus metrics", tags=["Operations"],
             response_class=Response)
    async def prometheus() -> Response:
        """Requests and latency by endpoint and Bregman mode, upstream errors and health."""
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                   include_in_schema=False, dependencies=[Depends(auth)])
    async def passthrough(request: Request, path: str) -> Response:
        """Other vLLM routes, unchanged; a clear 404 for everything else."""
        route = "/" + path
        allowed = (route.startswith(PASSTHROUGH_PREFIXES) or route in PASSTHROUGH_EXACT) \
            and route not in PASSTHROUGH_BLOCKED
        if not allowed:
            raise APIError(404, f"Unknown route {request.method} {route}. This server serves "
                           f"{COMPLETIONS}, {CHAT}, {MODELS}, /health, /metrics and /docs, and "
                           "forwards the other /v1/* routes and /tokenize, /detokenize, "
                           "/version to vLLM.", code="not_found")
        raw = await read_body(request, limit)
        response = await proxy(request, request.method, route, raw or None,
                               _Record(metrics, "passthrough", "none", time.perf_counter()))
        return _openai_shaped(response, request.method, route)

    def custom_openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(openapi_components(settings.default_request_values()))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = custom_openapi  # type: ignore[method-assign]
    return app


class GenerationFastPath:
    """ASGI middleware: ``POST /v1/completions`` and ``POST /v1/chat/completions`` go straight
    to their handler; every other request goes on to the FastAPI app.

    The hot path skips FastAPI's exception middleware, router and dependency solving (about
    0.3 ms of CPU per request on the 2-core CI machine, a sixth of what the server may add).
    The FastAPI routes stay: they define /docs and /openapi.json, and the handler is the same.
    """

    def __init__(self, app: ASGIApp,
                 serve: Callable[[Scope, Receive, Send, str], Awaitable[None]]) -> None:
        self.app = app
        self.serve = serve

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" \
                and scope["path"] in GENERATION_ROUTES:
            await self.serve(scope, receive, send, scope["path"])
        else:
            await self.app(scope, receive, send)


def _openai_shaped(response: Response, method: str, route: str) -> Response:
    """vLLM answers unknown routes with FastAPI's ``{"detail": ...}``: rewrite those 404/405s."""
    if response.status_code not in (404, 405) or not hasattr(response, "body"):
        return response
    try:
        detail = json.loads(response.body)
    except ValueError:
        return response
    if isinstance(detail, dict) and "error" not in detail:
        message = f"{method} {route}: {detail.get('detail', 'not found')} (upstream vLLM)"
        return error_response(response.status_code, message, code="not_found")
    return response
