"""Fast tests of the server's parts: the Bregman middleware, request merging, bounded
connections, the command line, settings and errors.

No vLLM here (tests/test_server.py and tests/test_reliability.py run real engines). The
middleware and the bounded h11 protocol run for real: uvicorn serves, on a loopback port, a small
FastAPI app that stands in for vLLM's (POST routes validate request models as vLLM's do; it
echoes the body it receives, streams on request and can hang), wrapped in `BregmanMiddleware`
exactly as vLLM's app is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import json
import math
import os
import select
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from bregman_server.bregman import apply_bregman
from bregman_server.cli import parse_args
from bregman_server.jsonbody import MAX_DEPTH, must_parse
from bregman_server.lifecycle import Lifecycle
from bregman_server.limits import uvicorn_options
from bregman_server.middleware import BregmanMiddleware
from bregman_server.settings import ServerSettings
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from bregman_vllm.params import FIELD_SPECS, BregmanParamError, BregmanParams, is_bregman_key

from .test_server_support import BODY_ENCODINGS, encode_body

ROOT = Path(__file__).resolve().parent.parent
OFF = BregmanParams(mode="off")
PRIMAL = BregmanParams(mode="primal", alpha=1.5, lam=0.01)
KEY = "s3cret"
AUTH = {"authorization": f"Bearer {KEY}"}


# --- import hygiene ----------------------------------------------------------------------------

def test_server_never_imports_torch_or_vllm_until_it_serves() -> None:
    code = textwrap.dedent("""
        import sys
        import bregman_server, bregman_server.cli, bregman_server.engine, bregman_server.limits
        import bregman_server.middleware, bregman_server.lifecycle, bregman_server.openapi
        import bregman_server.routes, bregman_server.jsonbody
        from bregman_server.cli import parse_args
        parse_args(["--model", "m"])
        heavy = sorted(m for m in sys.modules
                       if m.split(".")[0] in ("torch", "vllm")
                       or m.startswith(("bregman_vllm.core", "bregman_vllm.adapter")))
        assert not heavy, heavy
        assert "server" not in sys.modules  # the package is bregman_server
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# --- a stand-in for vLLM's app, behind the real middleware and uvicorn -------------------------

class Generation(BaseModel):
    """Like vLLM's CompletionRequest / ChatCompletionRequest: extra fields allowed, vllm_xargs."""

    model_config = ConfigDict(extra="allow")
    vllm_xargs: dict[str, Any] | None = None


class BatchGeneration(BaseModel):
    """Like vLLM's BatchChatCompletionRequest: no vllm_xargs of its own, but it converts itself
    into a Generation with its extra fields."""

    model_config = ConfigDict(extra="allow")

    def to_generation(self) -> Generation:
        return Generation.model_validate(self.model_dump())


class Other(BaseModel):
    """Like vLLM's TokenizeRequest: no sampling."""

    model_config = ConfigDict(extra="allow")


#: Gates the stub's requests wait on (``{"gate": name}``), opened by `open_gate`: a test decides
#: when a request ends by an event, not by a sleep that a loaded machine may outlast.
GATES: dict[str, asyncio.Event] = {}


async def _echo(request: Request) -> Response:
    raw = await request.body()
    body = json.loads(raw) if raw else None
    if isinstance(body, dict) and body.get("stream"):
        async def events() -> Any:
            padding = "x" * int(body.get("size", 0))
            for i in range(int(body.get("events", 3))):
                await asyncio.sleep(float(body.get("interval", 0.0)))
                yield f"data: {json.dumps({'i': i, 'pad': padding})}\n\n".encode()
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    if isinstance(body, dict) and body.get("hang"):
        await asyncio.sleep(float(body["hang"]))
    if isinstance(body, dict) and body.get("gate"):  # held until the test opens the gate
        await GATES.setdefault(str(body["gate"]), asyncio.Event()).wait()
    # ASCII JSON, so that a lone surrogate in the body comes back as its escape.
    return Response(json.dumps({"received": body, "raw": raw.decode("utf-8", "replace")},
                               ensure_ascii=True), media_type="application/json")


async def _generation(request: Request, body: Generation) -> Response:
    return await _echo(request)


async def _batch(request: Request, body: BatchGeneration) -> Response:
    return await _echo(request)


async def _other(request: Request, body: Other) -> Response:
    return await _echo(request)


async def _plain() -> Response:
    return Response("ok")


GENERATION_ROUTES = ["/v1/completions", "/v1/chat/completions", "/invocations", "/v1/responses",
                     "/v1/messages"]
STUB_ROUTES = [*GENERATION_ROUTES, "/v1/chat/completions/batch", "/tokenize", "/pooling"]


def stub_app() -> FastAPI:
    """vLLM's shape: a FastAPI app whose POST routes validate request models."""
    app = FastAPI()
    for path in GENERATION_ROUTES:
        app.add_api_route(path, _generation, methods=["POST"])
    app.add_api_route("/v1/chat/completions/batch", _batch, methods=["POST"])
    for path in ("/tokenize", "/pooling"):
        app.add_api_route(path, _other, methods=["POST"])
    for path in ("/health", "/metrics", "/load", "/v1/models", "/version"):
        app.add_api_route(path, _plain, methods=["GET"])
    return app


def http_server(app: Any, settings: ServerSettings, **overrides: Any) -> Any:
    """uvicorn serving ``app`` with our `uvicorn_options` (what `bregman-serve` passes through
    vLLM's launcher) on the settings' address, without signal handlers (it runs in a thread
    here; vLLM's launcher runs its own ``NoSignalServer``). ``h11_max_header_count``: the
    header count limit `BoundedH11Protocol` reads from the config."""
    import uvicorn

    class NoSignalServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[no-untyped-def]
            yield

    header_count = overrides.pop("h11_max_header_count", None)
    options: dict[str, Any] = dict(
        host=settings.host, port=settings.port, log_level=settings.log_level,
        h11_max_incomplete_event_size=settings.max_header_bytes, **uvicorn_options(settings))
    options.update(overrides)
    config = uvicorn.Config(app, **options)
    config.h11_max_header_count = header_count  # type: ignore[attr-defined]
    return NoSignalServer(config)


class Served:
    """uvicorn serving the stub behind `BregmanMiddleware` in a thread, on a loopback port."""

    def __init__(self, inner: FastAPI | None = None, **overrides: Any) -> None:
        overrides.setdefault("api_key", KEY)
        # (no largest support size unless a test asks: bodies reach the app as they were sent;
        # the default's own tests are in tests/test_request_fields.py)
        overrides.setdefault("max_support", None)
        self.settings = ServerSettings(host="127.0.0.1", port=_free_port(), **overrides)
        self.lifecycle = Lifecycle()
        app = BregmanMiddleware(inner or stub_app(), settings=self.settings,
                                lifecycle=self.lifecycle)
        # The servers' own uvicorn, without signal handlers (it runs in a thread here).
        self.server = http_server(app, self.settings, log_level="warning",
                                  h11_max_header_count=32)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "stub server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def wait_for_flights(self, count: int, within: float = 60.0) -> None:
        """Wait until the middleware serves ``count`` requests (its open flights)."""
        deadline = time.monotonic() + within
        while self.call(lambda: len(self.lifecycle.flights)) < count:
            assert time.monotonic() < deadline, f"fewer than {count} requests being served"
            time.sleep(0.02)

    def open_gate(self, name: str) -> None:
        """Let the requests waiting at the stub's gate ``name`` answer."""
        # (a gate stays open: a request counted as served before it reached the gate passes it)
        self.call(lambda: GATES.setdefault(name, asyncio.Event()).set())

    def call(self, function: Any, *args: Any) -> Any:
        """Run ``function(*args)`` on the server's own event loop and return its result."""
        loop = self.server.servers[0].get_loop()

        async def run() -> Any:
            return function(*args)

        return asyncio.run_coroutine_threadsafe(run(), loop).result(30)

    def post(self, path: str, body: Any = None, headers: dict[str, str] | None = None,
             **kwargs: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers={**AUTH, **(headers or {})},
                          timeout=30, **kwargs)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with Served(max_body_bytes=4096, body_timeout=1.0, header_timeout=1.0,
                max_header_bytes=8192, max_connections=40) as server:
        yield server


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None
                        ) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert "Traceback" not in response.text
    return error


# --- the Bregman fields on the generation routes ---------------------------------------------

def test_fields_are_validated_and_mapped_into_vllm_xargs(served: Served) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/invocations", "/v1/responses"):
        body = {"prompt": "x", "bregman_alpha": 2, "bregman_top_k": "5",
                "vllm_xargs": {"user_key": 1}}
        received = served.post(path, body).json()["received"]
        assert "bregman_alpha" not in received and received["prompt"] == "x"
        assert received["vllm_xargs"] == {"user_key": 1, "bregman_mode": "primal",
                                          "bregman_alpha": 2.0, "bregman_lambda": 0.01,
                                          "bregman_top_k": 5}, path


def test_bodies_without_bregman_fields_reach_the_app_byte_for_byte(served: Served) -> None:
    raw = b'{"prompt":  "x",\n "max_tokens": 3, "n": 1.0}'
    response = httpx.post(served.url + "/v1/completions", content=raw,
                          headers={**AUTH, "content-type": "application/json"})
    assert response.json()["raw"] == raw.decode()


INVALID_REQUESTS = [
    ({"bregman_top_k": 9223372036854775808}, "bregman_top_k"),
    ({"bregman_k_max": 2**31}, "bregman_k_max"),
    ({"vllm_xargs": {"bregman_top_k": 2**63}}, "bregman_top_k"),
    ({"vllm_xargs": {"bregman_k_max": "9223372036854775808"}}, "bregman_k_max"),
    ({"bregman_top_k": "²"}, "bregman_top_k"),
    ({"bregman_alpha": "١٫٥"}, "bregman_alpha"),
    ({"bregman_alpha": 10**400}, "bregman_alpha"),
    ({"bregman_lambda": 10**400}, "bregman_lambda"),
    ({"bregman_alpha": "1e999"}, "bregman_alpha"),
    ({"bregman_lambda": "nan"}, "bregman_lambda"),
    ({"bregman_mode": "greedy"}, "bregman_mode"),
    ({"bregman_alpha": 0}, "bregman_alpha"),
    ({"bregman_alpha": True}, "bregman_alpha"),
    ({"bregman_mode": "dual", "bregman_alpha": 1}, "bregman_alpha"),
    ({"bregman_topk": 3}, "bregman_topk"),  # a misspelt field is never silently ignored
    ({"vllm_xargs": "bregman_alpha=2"}, "vllm_xargs"),
]


@pytest.mark.parametrize(("fields", "param"), INVALID_REQUESTS)
def test_invalid_fields_are_openai_400s_naming_the_field(served: Served, fields: dict[str, Any],
                                                         param: str) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/invocations"):
        response = served.post(path, {"prompt": "x", **fields})
        error = assert_openai_error(response, 400, param)
        assert error["type"] == "invalid_request_error" and param in error["message"]
        assert len(error["message"]) < 600  # a huge input is never echoed whole


def test_integer_bound_names_the_allowed_range(served: Served) -> None:
    response = served.post("/v1/completions", {"bregman_top_k": 2**31})
    assert "[1, 2147483647]" in assert_openai_error(response, 400, "bregman_top_k")["message"]
    received = served.post("/v1/completions", {"bregman_top_k": 2**31 - 1}).json()["received"]
    assert received["vllm_xargs"]["bregman_top_k"] == 2**31 - 1  # the engine clamps to V


@pytest.mark.parametrize(("raw", "param"), [
    (b'{"prompt": "a\\ud800b", "bregman_alpha": 2}', None),  # a lone surrogate passes through
    (b'{"prompt": "x", "bregman_alpha": Infinity, "bregman_top_k": 3}', None),
    (b'{"prompt": "x", "bregman_alpha": -Infinity, "bregman_top_k": 3}', None),
])
def test_odd_but_valid_json_is_accepted(served: Served, raw: bytes, param: str | None) -> None:
    response = httpx.post(served.url + "/v1/completions", content=raw,
                          headers={**AUTH, "content-type": "application/json"})
    assert response.status_code == 200, response.text
    received = response.json()["received"]
    if b"Infinity" in raw:  # lm-evaluation-harness sends float("inf") this way
        assert received["vllm_xargs"]["bregman_alpha"] in ("inf", "-inf")
    else:
        assert received["prompt"] == "a\ud800b"


@pytest.mark.parametrize(("raw", "param"), [
    (b'{"prompt": "x", "bregman_alpha": Infinity}', "bregman_alpha"),  # adaptive needs finite
    (b'{"prompt": "x", "temperature": NaN, "bregman_alpha": 2}', "temperature"),
    (b'{"prompt": "x", "max_tokens": Infinity}', "max_tokens"),
    (b'{"prompt": "x", "bregman_lambda": 1e999}', "bregman_lambda"),
    (b'{"prompt": "x", "bregman_alpha": 2, "top_p": 1e400}', "top_p"),
    (b"[" * 100_000 + b"]" * 100_000, None),
    (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, None),
    (b'{"bregman_alpha": 2, not json', None),
    (b'["bregman_alpha", 2]', None),
    (b'{"bregman_alpha": "\xff\xfe"}', None),
])
def test_malformed_json_is_an_openai_400(served: Served, raw: bytes, param: str | None) -> None:
    """Bodies the middleware must parse (Bregman fields, NaN / Infinity, deep nesting); any
    other body reaches vLLM untouched, and vLLM answers it (tests/test_reliability.py)."""
    with Served(max_body_bytes=4 * 1024 * 1024) as roomy:
        for path in ("/v1/completions", "/v1/chat/completions"):
            response = httpx.post(roomy.url + path, content=raw, timeout=30,
                                  headers={**AUTH, "content-type": "application/json"})
            assert_openai_error(response, 400, param)
        assert httpx.get(roomy.url + "/health").status_code == 200


def test_bregman_fields_on_a_route_that_cannot_honour_them_are_a_400(served: Served) -> None:
    response = served.post("/pooling", {"input": "x", "bregman_alpha": 2})
    error = assert_openai_error(response, 400, "bregman_alpha")
    assert "/v1/completions" in error["message"]
    # Without Bregman fields the route is the app's business.
    assert served.post("/pooling", {"input": "x"}).status_code == 200
    form = httpx.post(served.url + "/v1/completions", data={"bregman_alpha": "2"}, headers=AUTH)
    assert form.status_code == 400 and "JSON" in form.json()["error"]["message"]
    # Any spelling the matching rule finds, percent-escaped names too, and multipart forms.
    for raw in (b"BREGMAN_TOP_K=2", b"prompt=x&%62regman_top_k=2", b"Bregman-Alpha=2"):
        form = httpx.post(served.url + "/v1/completions", content=raw, headers={
            **AUTH, "content-type": "application/x-www-form-urlencoded"})
        assert form.status_code == 400, raw
    multipart = httpx.post(served.url + "/v1/completions", files={"f": b"x"},
                           data={"Bregman-Top-K": "2"}, headers=AUTH)
    assert multipart.status_code == 400 and "JSON" in multipart.json()["error"]["message"]


# --- no Bregman field dropped in silence, wherever it is written (issue 27, part 1) --------------

MISSPELT = ["Bregman_top_k", "BREGMAN_TOP_K", "bregman-top-k", "bregmantopk", "bregman_topk",
            "BregmanTopK", " bregman_top_k"]
HONOURED = [*GENERATION_ROUTES, "/v1/chat/completions/batch"]


@pytest.mark.parametrize("key", MISSPELT)
def test_a_misspelt_field_is_refused_at_the_top_level_and_in_vllm_xargs(served: Served,
                                                                        key: str) -> None:
    """On every honoured route, streamed or not, and in both places, with one message: "did
    you mean `bregman_top_k`?" (vLLM dropped these as unknown fields and sampled plainly)."""
    for path in HONOURED:
        for stream in (False, True):
            messages = set()
            for fields in ({key: 2}, {"vllm_xargs": {key: 2}}):
                error = assert_openai_error(served.post(
                    path, {"prompt": "x", "stream": stream, **fields}), 400, key)
                assert "did you mean `bregman_top_k`?" in error["message"], error
                messages.add(error["message"])
            assert len(messages) == 1, messages
    for fields, param in (({key: 2}, key), ({"vllm_xargs": {key: 2}}, f"vllm_xargs.{key}")):
        # a route that samples nothing
        error = assert_openai_error(served.post("/tokenize", {"prompt": "x", **fields}), 400,
                                    param)
        assert "not supported on POST /tokenize" in error["message"]


@pytest.mark.parametrize(("fields", "param"), [
    ({"VLLM_XARGS": {"bregman_top_k": 2}}, "VLLM_XARGS.bregman_top_k"),
    ({"vllm-xargs": {"bregman_alpha": 2}}, "vllm-xargs.bregman_alpha"),
    ({"extra_body": {"bregman_top_k": 2}}, "extra_body.bregman_top_k"),  # the SDK's argument
    ({"bregman": {"top_k": 2}}, "bregman"),
    ({"bregman_temperature": 2}, "bregman_temperature"),
])
def test_bregman_fields_where_vllm_never_reads_them_are_refused(served: Served,
                                                               fields: dict[str, Any],
                                                               param: str) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        assert_openai_error(served.post(path, {"prompt": "x", **fields}), 400, param)


def test_the_two_places_must_agree_on_every_honoured_route(served: Served) -> None:
    for path in HONOURED:
        for stream in (False, True):
            error = assert_openai_error(served.post(path, {
                "prompt": "x", "stream": stream, "bregman_top_k": 2,
                "vllm_xargs": {"bregman_mode": "off"}}), 400, "bregman_mode")
            assert "in vllm_xargs" in error["message"] and "at the top level" in error["message"]
            agreed = served.post(path, {"prompt": "x", "bregman_top_k": 2,
                                        "vllm_xargs": {"bregman_top_k": "2", "u": 1}})
            assert agreed.json()["received"]["vllm_xargs"]["bregman_top_k"] == 2, path


def test_server_defaults_apply_to_requests_that_do_not_say() -> None:
    with Served(default_mode="primal", default_top_k=3) as server:
        received = server.post("/v1/completions", {"prompt": "x"}).json()["received"]
        assert received["vllm_xargs"]["bregman_top_k"] == 3
        off = server.post("/v1/completions", {"prompt": "x", "bregman_mode": "off"})
        assert "vllm_xargs" not in off.json()["received"]



def test_the_largest_support_size_holds_every_request_to_it() -> None:
    """``--max-support`` (issue 25's attack: one request's rows, k* in the tens of thousands,
    slowed every other request's steps): a bregman_top_k or bregman_k_max above it is refused
    with a 400 naming the field and its range, at the top level and in vllm_xargs, on every
    honoured route; a request without bregman_k_max reaches vLLM with k_max = the limit; one
    within it reaches vLLM as sent; a request that does not decode (off) is left alone."""
    with Served(max_support=1024) as server:
        for path in HONOURED:
            for fields in ({"bregman_top_k": 1025}, {"vllm_xargs": {"bregman_k_max": 5000}},
                           {"bregman_lambda": 1e-100, "bregman_k_max": 2**31 - 1}):
                key = next(k for k in ("bregman_top_k", "bregman_k_max")
                           if k in fields or k in fields.get("vllm_xargs", {}))
                error = assert_openai_error(server.post(path, {"prompt": "x", **fields}), 400,
                                            key)
                assert "[1, 1024] on this server" in error["message"], error
            attack = {"prompt": "x", "bregman_mode": "dual", "bregman_alpha": 10,
                      "bregman_lambda": 1e-100}
            received = server.post(path, attack).json()["received"]["vllm_xargs"]
            assert received["bregman_k_max"] == 1024, path
            within = {"prompt": "x", "bregman_top_k": 1024, "bregman_k_max": 7}
            received = server.post(path, within).json()["received"]["vllm_xargs"]
            assert (received["bregman_top_k"], received["bregman_k_max"]) == (1024, 7), path
            off = server.post(path, {"prompt": "x", "bregman_mode": "off", "bregman_top_k": 5000})
            assert off.status_code == 200 and "vllm_xargs" not in off.json()["received"], path
    with Served(max_support=64, default_mode="primal") as server:  # the defaults, held too
        received = server.post("/v1/completions", {"prompt": "x"}).json()["received"]
        assert received["vllm_xargs"]["bregman_k_max"] == 64


def test_server_defaults_above_the_largest_support_size_do_not_start() -> None:
    """A deployment whose own defaults every request would be refused for cannot start; the
    flag parses like every other setting, and the schema shows the limit as the sizes'
    maximum and the k_max a request without one decodes with."""
    from bregman_server.openapi import bregman_properties
    from pydantic import ValidationError

    for defaults in ({"default_top_k": 65}, {"default_k_max": 100}):
        with pytest.raises(ValidationError, match="invalid server default"):
            ServerSettings(max_support=64, **defaults)
    with pytest.raises(ValidationError):
        ServerSettings(max_support=0)
    settings, _ = parse_args(["--model", "m", "--max-support", "4096"])
    assert settings.max_support == 4096
    properties = bregman_properties(settings)
    for key in ("bregman_top_k", "bregman_k_max"):
        assert properties[key]["anyOf"][0]["maximum"] == 4096
        assert "At most 4096 on this server." in properties[key]["description"]
    assert properties["bregman_k_max"]["default"] == 4096
    assert properties["bregman_top_k"]["default"] is None
    unlimited = bregman_properties(ServerSettings(max_support=None))
    assert unlimited["bregman_k_max"]["anyOf"][0]["maximum"] == 2**31 - 1


# --- bodies read as vLLM reads them (issue 19, finding 1) ---------------------------------------

FINDING_1 = {"model": "m", "prompt": "Once upon a time", "max_tokens": 4, "logprobs": 5,
             "bregman_top_k": 2}
READABLE = [how for how in BODY_ENCODINGS if how != "gzip"]


def post_raw(server: Served, path: str, raw: bytes, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(server.url + path, content=raw, headers={**AUTH, **headers}, timeout=30)


@pytest.mark.parametrize("how", READABLE)
def test_every_body_vllm_reads_is_read_the_same(served: Served, how: str) -> None:
    """The finding's request (its key escaped as ``\\u0062regman_top_k``, the body in UTF-16 /
    UTF-32 with and without BOM, keys written twice ...) reaches the app mapped, exactly as the
    plain UTF-8 body does; NaN is refused and /tokenize refuses the field in every encoding."""
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch"):
        raw, headers = encode_body(FINDING_1, how)
        response = post_raw(served, path, raw, headers)
        assert response.status_code == 200, (how, response.text)
        assert response.json()["received"]["vllm_xargs"]["bregman_top_k"] == 2, how
    for fields, param in (({"logit_bias": {"42": math.nan}}, "logit_bias.42"),
                          ({"length_penalty": math.nan}, "length_penalty"),
                          ({"temperature": math.inf}, "temperature")):
        raw, headers = encode_body({"prompt": "x", **fields}, how)
        assert_openai_error(post_raw(served, "/v1/completions", raw, headers), 400, param)
    raw, headers = encode_body(FINDING_1, how)
    error = assert_openai_error(post_raw(served, "/tokenize", raw, headers), 400,
                                "bregman_top_k")
    assert "not supported on POST /tokenize" in error["message"]


def test_compressed_bodies_are_refused_not_passed_on(served: Served) -> None:
    raw, headers = encode_body(FINDING_1, "gzip")
    error = assert_openai_error(post_raw(served, "/v1/completions", raw, headers), 415)
    assert error["code"] == "unsupported_content_encoding"


def test_duplicate_keys_are_validated_as_vllm_reads_them(served: Served) -> None:
    """The last of duplicate keys wins, in vLLM and in the middleware."""
    later_bad = b'{"prompt": "x", "bregman_top_k": 2, "bregman_top_k": 0}'
    later_good = b'{"prompt": "x", "bregman_top_k": 0, "bregman_top_k": 2}'
    headers = {"content-type": "application/json"}
    assert_openai_error(post_raw(served, "/v1/completions", later_bad, headers), 400,
                        "bregman_top_k")
    received = post_raw(served, "/v1/completions", later_good, headers).json()["received"]
    assert received["vllm_xargs"]["bregman_top_k"] == 2


def test_json_media_types_are_read_as_fastapi_reads_them(served: Served) -> None:
    raw = json.dumps(FINDING_1).encode("utf-16")
    for content_type in ("application/json; charset=utf-16", "Application/JSON",
                         "application/vnd.example+json", "application/json ; x=1"):
        response = post_raw(served, "/v1/completions", raw, {"content-type": content_type})
        assert response.json()["received"]["vllm_xargs"]["bregman_top_k"] == 2, content_type
    # A type FastAPI does not read as JSON: the app refuses the body itself, never a silent 200.
    plain = post_raw(served, "/v1/completions", raw, {"content-type": "text/plain"})
    assert plain.status_code >= 400 and "error" in plain.json()


@pytest.mark.parametrize("depth", [255, 257, 1500])
def test_nesting_is_bounded(served: Served, depth: int) -> None:
    raw = b'{"prompt": "x", "a": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
    response = post_raw(served, "/v1/completions", raw, {"content-type": "application/json"})
    if depth <= MAX_DEPTH:
        assert response.status_code == 200, response.text
    else:
        assert "nested too deeply" in assert_openai_error(response, 400)["message"]


# The fuzz: any body, written any way vLLM reads it, has the outcome of its plain UTF-8 form.

FUZZ_KEYS = ["bregman_mode", "bregman_alpha", "bregman_lambda", "bregman_top_k",
             "bregman_k_max", "bregman_topk", "BREGMAN-ALPHA", "temperature", "logit_bias",
             "prompt", "n"]
FUZZ_SCALARS = (st.none() | st.booleans() | st.integers(-5, 2**40) | st.sampled_from(
    [0.5, 1.5, 2.0, math.nan, math.inf, -math.inf, "inf", "primal", "dual", "off", "²", "x"])
    | st.text(max_size=6))
FUZZ_VALUES = st.recursive(FUZZ_SCALARS, lambda children: st.lists(children, max_size=2)
                           | st.dictionaries(st.sampled_from(FUZZ_KEYS), children, max_size=2),
                           max_leaves=4)


@st.composite
def fuzz_bodies(draw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": draw(st.text(max_size=8))}
    for key in draw(st.lists(st.sampled_from(FUZZ_KEYS), max_size=4, unique=True)):
        body[key] = draw(FUZZ_VALUES)
    if draw(st.booleans()):
        body["vllm_xargs"] = draw(st.dictionaries(st.sampled_from(FUZZ_KEYS), FUZZ_VALUES,
                                                  max_size=3))
    return body


def _outcome(response: httpx.Response) -> tuple[int, Any]:
    content = response.json()
    if response.status_code >= 400:
        assert set(content["error"]) == {"message", "type", "param", "code"}, content
        return response.status_code, content["error"]["param"]
    return response.status_code, content["received"]


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=fuzz_bodies(), how=st.sampled_from(BODY_ENCODINGS),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions/batch", "/tokenize"]))
def test_fuzz_any_encoding_has_the_outcome_of_plain_utf8(served: Served, body: dict[str, Any],
                                                         how: str, path: str) -> None:
    raw, headers = encode_body(body, how)
    response = post_raw(served, path, raw, headers)
    if how == "gzip":
        assert assert_openai_error(response, 415)["code"] == "unsupported_content_encoding"
        return
    plain, plain_headers = encode_body(body, "utf-8")
    assert _outcome(response) == _outcome(post_raw(served, path, plain, plain_headers)), how


def test_fuzz_defaults_any_encoding() -> None:
    """With server defaults every body is read: the encodings still agree."""
    with Served(default_mode="primal", default_top_k=3) as server:
        for how in READABLE:
            raw, headers = encode_body({"prompt": "x", "\u00e9": [1]}, how)
            received = post_raw(server, "/v1/completions", raw, headers).json()["received"]
            assert received["vllm_xargs"]["bregman_top_k"] == 3, how
            batch = post_raw(server, "/v1/chat/completions/batch", raw, headers)
            assert batch.json()["received"]["vllm_xargs"]["bregman_top_k"] == 3, how


# The fast path is safe: whatever it leaves unread holds nothing the middleware acts on.

_TEXT_KEYS = st.sampled_from(["bregman_top_k", "bregman_", "bregma", "regman_", "b", "prompt",
                              "\u00e9", "NaN", "x", "BREGMAN_TOP_K", "Bregman-top-k",
                              "b-r-e_g-man", " bregman", "BreGman", "bregmantopk"])


@st.composite
def json_texts(draw: Any) -> bytes:
    """JSON text with keys and values escaped at random, in any encoding json.loads reads."""
    value = draw(st.recursive(
        FUZZ_SCALARS, lambda children: st.lists(children, max_size=3)
        | st.dictionaries(_TEXT_KEYS, children, max_size=3), max_leaves=8))
    text = json.dumps(value, ensure_ascii=draw(st.booleans()))
    if draw(st.booleans()):  # \\u-escape some letters the way a hostile client would
        letters = draw(st.sets(st.sampled_from("bregmanBREGMAN_-NaIity"), max_size=4))
        text = "".join(f"\\u{ord(c):04x}" if c in letters and draw(st.booleans()) else c
                       for c in text)
    codec = draw(st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-16-be", "utf-32"]))
    return text.encode(codec, "surrogatepass")


@settings(max_examples=500, deadline=None, derandomize=True)
@given(raw=json_texts())
def test_fast_path_leaves_unread_only_what_needs_no_reading(raw: bytes) -> None:
    if must_parse(raw):
        return
    try:
        body = json.loads(raw)
    except ValueError:
        return  # vLLM answers it (a 400), in OpenAI's shape

    def walk(node: Any) -> Iterator[Any]:
        yield node
        children = node.values() if isinstance(node, dict) else (
            node if isinstance(node, list) else ())
        for child in children:
            yield from walk(child)
        if isinstance(node, dict):
            yield from (("key", key) for key in node)

    for item in walk(body):
        assert not (isinstance(item, tuple) and is_bregman_key(item[1])), raw
        assert not (isinstance(item, float) and not math.isfinite(item)), raw


# --- the API key --------------------------------------------------------------------------------

def test_api_key_guards_every_route_but_health(served: Served) -> None:
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("POST", "/invocations"), ("POST", "/tokenize"), ("GET", "/metrics"),
                         ("GET", "/load"), ("GET", "/openapi.json"), ("GET", "/docs"),
                         ("GET", "/version"), ("GET", "/no-such-route")]:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY},
                        {"authorization": f"Basic {KEY}"}):
            response = httpx.request(method, served.url + path, headers=headers, json={})
            assert assert_openai_error(response, 401)["code"] == "invalid_api_key", path
            assert response.headers["www-authenticate"] == "Bearer"
        response = httpx.request(method, served.url + path, headers=AUTH, json={})
        assert response.status_code != 401, path
    assert httpx.get(served.url + "/health").status_code == 200


def test_plain_vllm_serve_adopts_vllms_own_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``vllm serve --middleware ...`` (no settings given), VLLM_API_KEY guards every
    route, not only vLLM's /v1 prefix."""
    for name in list(os.environ):
        if name.startswith("BREGMAN_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_API_KEY", "vk")
    middleware = BregmanMiddleware(stub_app())
    transport = httpx.ASGITransport(app=middleware)

    async def go() -> tuple[int, int, int]:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            bare = await client.post("/invocations", json={"prompt": "x"})
            keyed = await client.post("/invocations", json={"prompt": "x"},
                                      headers={"authorization": "Bearer vk"})
            health = await client.get("/health")
            return bare.status_code, keyed.status_code, health.status_code

    assert asyncio.run(go()) == (401, 200, 200)


# --- bounded requests ---------------------------------------------------------------------------

def test_body_size_limit(served: Served) -> None:
    response = served.post("/v1/completions", {"prompt": "x" * 5000})
    assert assert_openai_error(response, 413)["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no content-length: the limit holds while reading
        for _ in range(30):
            yield b" " * 200

    response = httpx.post(served.url + "/v1/completions", content=chunked(), headers=AUTH)
    assert_openai_error(response, 413)


def test_request_head_size_limit(served: Served) -> None:
    response = httpx.get(served.url + "/health", headers={"x-big": "a" * 20_000})
    assert assert_openai_error(response, 431)["code"] == "request_header_fields_too_large"
    assert httpx.get(served.url + "/health").status_code == 200


def test_request_header_count_limit(served: Served) -> None:
    """vLLM's --h11-max-header-count (32 here), which uvicorn's own protocols ignore: a head
    with more header fields is a 431, also when its line ends arrive split across reads."""
    def head(fields: int) -> list[bytes]:
        lines = b"".join(b"X-F%d: v\r\n" % i for i in range(fields - 1))
        return [b"GET /health HTTP/1.1\r\nHost: x\r\n" + lines[:-1], lines[-1:] + b"\r\n"]

    for fields, status in ((32, b"200"), (33, b"431")):
        host, port = served.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            for part in head(fields):  # the last line end split between two reads
                sock.sendall(part)
                time.sleep(0.05)
            answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 " + status), (fields, answer[:300])
    assert b"More than 32 header fields." in answer


def _raw_exchange(url: str, data: bytes, wait: float) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait + 5) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def test_a_request_head_that_never_ends_gets_a_408_and_is_closed(served: Served) -> None:
    started = time.monotonic()
    answer = _raw_exchange(served.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", 10)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"request_timeout"' in answer
    assert time.monotonic() - started < 5


def test_a_body_shorter_than_its_content_length_gets_a_408(served: Served) -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"a\": 1")
    started = time.monotonic()
    answer = _raw_exchange(served.url, head, 10)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert time.monotonic() - started < 5


def test_idle_connections_cannot_exhaust_the_server(served: Served) -> None:
    """Far more half-open connections than the cap (40), opened faster than any may be closed
    for room: up to the headroom (20) beyond the cap they are let in, the rest answered 503 at
    once; once 0.1 s old the oldest are closed (503) down to the cap, the others at the head
    deadline (408), and the server serves again right after."""
    host, port = served.url.removeprefix("http://").split(":")
    sockets = []
    try:
        for _ in range(120):
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            sockets.append(sock)
        answers = []
        for sock in sockets:  # the head deadline is 1 s: every one is answered and closed
            sock.settimeout(5)
            answers.append(sock.recv(4096)[:12])
    finally:
        for sock in sockets:
            sock.close()
    assert answers.count(b"HTTP/1.1 503") >= 70, answers
    assert set(answers) <= {b"HTTP/1.1 503", b"HTTP/1.1 408", b""}, set(answers)
    assert httpx.get(served.url + "/health", timeout=5).status_code == 200


def _hold(url: str, count: int, stop: threading.Event, closed: list[bytes]) -> None:
    """``count`` connections that send nothing and, once the server closes one, connect again
    at once (the issue's slow clients, reconnecting 0.1 s after each close or sooner)."""
    host, port = url.removeprefix("http://").split(":")
    held = [socket.create_connection((host, int(port))) for _ in range(count)]
    try:
        while not stop.is_set():
            readable, _, _ = select.select(held, [], [], 0.05)
            for sock in readable:
                try:
                    closed.append(sock.recv(4096)[:12])
                except OSError:
                    closed.append(b"reset")
                sock.close()
                held[held.index(sock)] = socket.create_connection((host, int(port)))
    finally:
        for sock in held:
            sock.close()


def test_clients_that_send_their_request_get_in_while_young_connections_hold_every_slot(
        ) -> None:
    """Issue 27, part 2: every slot held by connections that send nothing and reconnect at
    once, so that most are younger than a second (they locked new clients out: 503s). A
    client that sends its request is let in and closes the connection that has waited
    longest: all 30 are served."""
    with Served(max_connections=20, header_timeout=5) as server:
        stop = threading.Event()
        closed: list[bytes] = []
        holder = threading.Thread(target=_hold, args=(server.url, 20, stop, closed))
        holder.start()
        try:
            time.sleep(0.3)
            statuses = [server.post("/v1/completions", {"prompt": "x"}).status_code
                        for _ in range(30)]
        finally:
            stop.set()
            holder.join(10)
    assert statuses == [200] * 30, statuses
    assert closed.count(b"HTTP/1.1 503") >= 20, closed  # closed for room, each answered 503


def test_connections_being_served_are_never_closed_for_room() -> None:
    """Every slot serving a request (held by the stub until the test lets them go): a newcomer
    is answered 503 at once, and every request being served completes. (Events, not sleeps:
    the four were assumed served 0.7 s after being sent and to last 1.5 s.)"""
    with Served(max_connections=4) as server, concurrent.futures.ThreadPoolExecutor(4) as pool:
        slow = [pool.submit(server.post, "/v1/completions", {"gate": "room"}) for _ in range(4)]
        server.wait_for_flights(4)
        refused = httpx.get(server.url + "/health", timeout=5)
        server.open_gate("room")
        assert [future.result().status_code for future in slow] == [200] * 4
    assert assert_openai_error(refused, 503)["code"] == "too_many_connections"


def _closed(sockets: list[socket.socket], wait: float) -> int:
    """How many of ``sockets`` the server has closed (within ``wait`` s): end of file or reset."""
    readable, _, _ = select.select(sockets, [], [], wait)
    closed = 0
    for sock in readable:
        try:
            closed += sock.recv(1) == b""
        except ConnectionError:
            closed += 1
    return closed


def test_a_body_arriving_fast_outlasts_trickles() -> None:
    """An upload (1 MiB at about 1 MiB/s) and three trickled bodies fill every slot; three new
    clients (which keep their connections) close the tricklers, never the upload, although it
    has waited longest."""
    with Served(max_connections=4, max_body_bytes=4 * 1024 * 1024) as server, \
            contextlib.ExitStack() as clients:
        host, port = server.url.removeprefix("http://").split(":")
        body = json.dumps({"prompt": "x" * (1024 * 1024)}).encode()
        upload = clients.enter_context(socket.create_connection((host, int(port)), timeout=30))
        upload.sendall(_head(len(body)))
        tricklers = []
        for _ in range(3):
            tricklers.append(clients.enter_context(socket.create_connection((host, int(port)))))
            tricklers[-1].sendall(_head(1000) + b"{")
        sent = 0
        statuses = []
        while sent < len(body):
            upload.sendall(body[sent:sent + 64 * 1024])
            sent += 64 * 1024
            time.sleep(0.05)
            if sent >= 256 * 1024 and len(statuses) < 3:
                client = clients.enter_context(httpx.Client(headers=AUTH, timeout=30))
                statuses.append(client.post(server.url + "/v1/completions",
                                            json={"prompt": "y"}).status_code)
        answer = b""
        while not answer.endswith(b"}"):
            chunk = upload.recv(1 << 20)
            assert chunk, answer[:200]
            answer += chunk
        closed = _closed(tricklers, 2.0)
    assert statuses == [200] * 3 and answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert closed == 3


def test_a_client_that_stops_reading_is_cut_off() -> None:
    """A stream of 64 MB to a client that reads nothing for 3 s: the server gives up after its
    send timeout, so the client then finds far less than 64 MB before the connection ends."""
    with Served(send_timeout=0.5) as server:
        host, port = server.url.removeprefix("http://").split(":")
        body = json.dumps({"stream": True, "events": 4096, "size": 16384}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(head + body)
            time.sleep(3)  # read nothing: the server's writes stall, then it gives up
            sock.settimeout(10)
            received = 0
            deadline = time.monotonic() + 30
            while (chunk := sock.recv(1 << 20)) and time.monotonic() < deadline:
                received += len(chunk)
        assert received < 4096 * 16384 // 2, received  # it stopped long before the end
        assert httpx.get(server.url + "/health").status_code == 200


# --- every error in OpenAI's shape (issue 19, finding 5) ---------------------------------------

def test_the_apps_own_errors_reach_the_client_in_openai_shape(served: Served) -> None:
    """FastAPI's {"detail": ...} answers (unknown route, wrong method, a body it cannot decode)
    keep their status and headers and gain OpenAI's shape."""
    missing = httpx.get(served.url + "/nonexistent", headers=AUTH)
    assert assert_openai_error(missing, 404)["code"] == "not_found"
    for method, path in (("GET", "/v1/completions"), ("POST", "/health"),
                         ("DELETE", "/v1/models")):
        response = httpx.request(method, served.url + path, headers=AUTH)
        error = assert_openai_error(response, 405)
        assert error["code"] == "method_not_allowed" and f"({method} {path})" in error["message"]
        assert response.headers["allow"]
    undecodable = post_raw(served, "/v1/completions", b'{"prompt": "\xff"}',
                           {"content-type": "application/json"})
    assert "UTF-8, UTF-16 or UTF-32" in assert_openai_error(undecodable, 400)["message"]


_TOKEN = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def test_methods_http_does_not_define_never_reach_the_app() -> None:
    """Issue 27, part 3: vLLM's HTTP metrics (prometheus_fastapi_instrumentator, inside the
    middleware as in vLLM's app) label requests by method, so that every new method token
    added series to /metrics for good. 500 requests with odd tokens (``M`` and 1000 letters,
    random ones, ``get``: methods are case-sensitive) are 405s in OpenAI's shape that add no
    series; HTTP's own methods reach the app as before, and are counted there."""
    import random

    from bregman_server.middleware import HTTP_METHODS
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_fastapi_instrumentator import Instrumentator

    registry = CollectorRegistry()
    app = stub_app()
    Instrumentator(registry=registry).instrument(app)

    def series() -> set[str]:
        return {line.rsplit(" ", 1)[0] for line in generate_latest(registry).decode().splitlines()
                if line and not line.startswith("#")}

    rng = random.Random(27)
    odd = ["M" + "x" * 1000, "get", "FOO"]
    while len(odd) < 500:
        token = "".join(rng.choice(_TOKEN) for _ in range(rng.randint(1, 24)))
        if token not in HTTP_METHODS:
            odd.append(token)
    with Served(app) as server, httpx.Client(headers=AUTH, timeout=30) as client:
        assert client.get(server.url + "/v1/models").status_code == 200
        before = series()
        host, port = server.url.removeprefix("http://").split(":")
        raw = http.client.HTTPConnection(host, int(port), timeout=30)  # sends methods as given
        try:
            for method in odd:
                raw.request(method, "/x", body=b"{}", headers=AUTH)
                response = raw.getresponse()
                error = json.loads(response.read())["error"]
                assert response.status == 405 and error["code"] == "method_not_allowed", error
                assert repr(method[:40]) in error["message"], error
                assert response.headers["allow"] == "GET, HEAD, POST"
                if response.headers.get("connection") == "close":
                    raw.close()
        finally:
            raw.close()
        assert series() == before
        for method in ("PUT", "DELETE", "PATCH", "OPTIONS"):  # the app's own 405s, as before
            response = client.request(method, server.url + "/v1/completions")
            error = assert_openai_error(response, 405)
            assert f"({method} /v1/completions)" in error["message"], error
        assert client.head(server.url + "/v1/models").status_code == 405  # FastAPI: GET only
        assert client.post(server.url + "/v1/completions", json={}).status_code == 200
        counted = series() - before
        assert any('method="PUT"' in name for name in counted), counted
        # h11 refuses a method that is no token (here "M@X") before the app: a 400 of ours.
        answer = _raw_exchange(server.url, b"M@X /x HTTP/1.1\r\nHost: x\r\n\r\n", 5)
        assert answer.startswith(b"HTTP/1.1 400") and b"invalid_http_request" in answer


def test_plain_text_errors_and_already_shaped_ones() -> None:
    from starlette.responses import JSONResponse, PlainTextResponse

    app = stub_app()
    app.add_api_route("/teapot", lambda: PlainTextResponse("short and stout", 418))
    shaped = {"error": {"message": "m", "type": "t", "param": None, "code": 7}}
    app.add_api_route("/shaped", lambda: JSONResponse(shaped, 400))
    with Served(app) as server:
        teapot = httpx.get(server.url + "/teapot", headers=AUTH)
        assert assert_openai_error(teapot, 418)["message"] == "short and stout"
        assert httpx.get(server.url + "/shaped", headers=AUTH).json() == shaped


# --- the API key and CORS preflights (issue 19, finding 2) --------------------------------------

def _metrics_behind_cors() -> FastAPI:
    """vLLM's shape: /metrics is a mounted Prometheus app (it answers /metrics/anything too),
    and a CORSMiddleware inside ours."""
    from starlette.middleware.cors import CORSMiddleware

    async def prometheus(scope: Any, receive: Any, send: Any) -> None:
        await Response("secret_metric_total 1\n")(scope, receive, send)

    app = stub_app()
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", "") != "/metrics"]
    app.mount("/metrics", prometheus)
    app.add_middleware(CORSMiddleware, allow_origins=["https://ok.example"], allow_methods=["*"])
    return app


def test_only_a_real_cors_preflight_passes_without_the_key() -> None:
    with Served(_metrics_behind_cors()) as server:
        for path in ("/metrics", "/metrics/", "/metrics/foo"):
            fake = httpx.options(server.url + path,
                                 headers={"access-control-request-method": "GET"})
            assert assert_openai_error(fake, 401)["code"] == "invalid_api_key", path
            for origin, status in (("https://ok.example", 200), ("https://evil.example", 400)):
                real = httpx.options(server.url + path, headers={
                    "origin": origin, "access-control-request-method": "GET"})
                assert real.status_code == status, (path, origin, real.text)
                assert "secret_metric" not in real.text  # answered by the CORS layer
                if status == 400:
                    assert_openai_error(real, 400)
            assert "secret_metric" in httpx.get(server.url + path, headers=AUTH,
                                                follow_redirects=True).text
    with Served() as server:  # no CORS layer inside: nothing answers preflights, so no waiver
        real = httpx.options(server.url + "/metrics", headers={
            "origin": "https://ok.example", "access-control-request-method": "GET"})
        assert_openai_error(real, 401)


# --- slow bodies (issue 19, finding 3) ------------------------------------------------------------

def _trickle(url: str, head: bytes, every: float, limit: int = 200) -> tuple[bytes, int]:
    """Send ``head``, then one body byte every ``every`` s (at most ``limit``) until the server
    answers or closes; (what it answered, bytes of body sent)."""
    host, port = url.removeprefix("http://").split(":")
    sent = 0
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head)
        sock.settimeout(every)
        answer = b""
        while sent < limit:
            try:
                chunk = sock.recv(65536)
                if not chunk:
                    return answer, sent
                answer += chunk
                continue
            except TimeoutError:
                pass
            except OSError:
                return answer, sent
            try:
                sock.sendall(b" ")
                sent += 1
            except OSError:
                return answer, sent
        return answer, sent


def _head(length: int, key: bool = True) -> bytes:
    auth = b"Authorization: Bearer " + KEY.encode() + b"\r\n" if key else b""
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth
            + b"Content-Type: application/json\r\nContent-Length: "
            + str(length).encode() + b"\r\n\r\n")


def test_a_trickled_body_has_a_deadline() -> None:
    """A byte every 0.2 s never leaves a 10 s silence (a client thread a loaded machine starves
    for seconds left more than the 1 s silence this used: a 408 for silence, not for the
    deadline), but the whole body must arrive in 1.5 s (the server's timer: the deadline)."""
    with Served(body_timeout=10.0, body_deadline=1.5) as server:
        answer, sent = _trickle(server.url, _head(1000), every=0.2)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"did not arrive whole within 1.5 s" in answer and sent < 200


def test_an_unread_body_cannot_hold_the_connection() -> None:
    """Answered 401 before its body was read, a client that keeps trickling that body is
    disconnected at the body deadline (uvicorn alone would wait for the whole body)."""
    with Served(body_timeout=1.0, body_deadline=1.0) as server:
        answer, sent = _trickle(server.url, _head(100_000, key=False), every=0.2)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert sent < 200  # closed long before the body could end


def test_trickling_clients_cannot_lock_others_out() -> None:
    """Every slot held by a client trickling its body: new clients still get served, each
    closing the connection that has waited longest."""
    with Served(max_connections=20, body_timeout=30, body_deadline=60) as server:
        host, port = server.url.removeprefix("http://").split(":")
        tricklers = []
        try:
            for _ in range(20):
                sock = socket.create_connection((host, int(port)), timeout=10)
                sock.sendall(_head(1000) + b"{")
                tricklers.append(sock)
            time.sleep(0.3)  # past EVICT_AFTER: they have waited long enough to make room
            served_ok = sum(server.post("/v1/completions", {"prompt": "x"}).status_code == 200
                            for _ in range(10))
            closed = _closed(tricklers, 1.0)
        finally:
            for sock in tricklers:
                sock.close()
    assert served_ok == 10
    # Room was made by closing tricklers (one per client open at once), not by their deadline.
    assert 1 <= closed < 20


# --- the routes that take the fields (issue 19, finding 4) -------------------------------------

def test_routes_are_read_from_the_apps_request_models() -> None:
    from bregman_server.routes import VLLM_XARGS, Routes, honoured_routes

    routes = honoured_routes(stub_app())
    assert routes.targets == dict.fromkeys([*GENERATION_ROUTES, "/v1/chat/completions/batch"],
                                           VLLM_XARGS)
    assert honoured_routes(object()).targets == {}  # unreadable: nothing is honoured
    templated = Routes.of({"/v1/things/{thing_id}/run": VLLM_XARGS})
    assert templated.match("/v1/things/abc/run") == "/v1/things/{thing_id}/run"
    assert templated.match("/v1/things/abc/run/x") is None


def test_server_defaults_reach_every_honoured_route() -> None:
    with Served(default_mode="primal", default_top_k=2) as server:
        for path in [*GENERATION_ROUTES, "/v1/chat/completions/batch"]:
            received = server.post(path, {"messages": [[{"role": "user", "content": "x"}]]})
            assert received.json()["received"]["vllm_xargs"]["bregman_top_k"] == 2, path
        assert "vllm_xargs" not in server.post("/tokenize", {"prompt": "x"}).json()["received"]


def test_fields_go_into_sampling_params_extra_args_where_the_route_has_them() -> None:
    from bregman_server.routes import Target

    target: Target = ("sampling_params", "extra_args")
    body: dict[str, Any] = {"token_ids": [1], "sampling_params": {"extra_args": {"u": 1}},
                            "bregman_top_k": 3}
    assert apply_bregman(body, OFF, target) == ("primal", True)
    assert body["sampling_params"]["extra_args"]["bregman_top_k"] == 3
    assert body["sampling_params"]["extra_args"]["u"] == 1 and "bregman_top_k" not in body
    with pytest.raises(BregmanParamError) as info:
        apply_bregman({"bregman_top_k": 3}, OFF, target)
    assert info.value.field == "sampling_params"
    untouched = {"token_ids": [1]}
    assert apply_bregman(untouched, OFF, target) == ("off", False)
    # The same rules as for vllm_xargs (issue 27), with this route's own place in the messages.
    for fields, param, words in (
            ({"sampling_params": {"extra_args": {"BREGMAN_TOP_K": 2}}}, "BREGMAN_TOP_K",
             "did you mean `bregman_top_k`?"),
            ({"bregman_top_k": 2, "sampling_params": {"extra_args": {"bregman_top_k": 3}}},
             "bregman_top_k", "3 in sampling_params.extra_args"),
            ({"vllm_xargs": {"bregman_top_k": 2}}, "vllm_xargs.bregman_top_k",
             "send it at the top level or in sampling_params.extra_args")):
        with pytest.raises(BregmanParamError) as info:
            apply_bregman(fields, OFF, target)
        assert info.value.field == param and words in str(info.value), str(info.value)


# --- shutdown ----------------------------------------------------------------------------------

def test_shutdown_ends_open_requests_in_openai_shape() -> None:
    with Served() as server:
        results: dict[str, Any] = {}

        def stream() -> None:
            with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, timeout=30,
                              json={"stream": True, "events": 1000, "interval": 0.05}) as r:
                results["stream"] = [line for line in r.iter_lines() if line]

        def waiting() -> None:
            results["plain"] = server.post("/v1/completions", {"hang": 60})

        threads = [threading.Thread(target=stream), threading.Thread(target=waiting)]
        for thread in threads:
            thread.start()
        server.wait_for_flights(2)  # both open (a 1 s sleep assumed so)
        server.call(server.lifecycle.refuse, "shutdown", "The server is shutting down.")
        refused = server.post("/v1/completions", {"prompt": "x"})
        assert assert_openai_error(refused, 503)["code"] == "shutdown"
        assert httpx.get(server.url + "/health").status_code == 503
        assert server.call(server.lifecycle.cut, "shutdown", "The server is shutting down.") == 2
        for thread in threads:
            thread.join(20)
        lines = results["stream"]
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "shutdown" and error["type"] == "server_error"
        assert assert_openai_error(results["plain"], 503)["code"] == "shutdown"


# --- merging the Bregman fields into vllm_xargs -------------------------------------------------

def test_request_without_bregman_fields_is_untouched() -> None:
    body = {"prompt": "hi", "max_tokens": 3, "vllm_xargs": {"other": 1}}
    mode, changed = apply_bregman(body, OFF)
    assert (mode, changed) == ("off", False)
    assert body == {"prompt": "hi", "max_tokens": 3, "vllm_xargs": {"other": 1}}


def test_top_level_fields_move_into_vllm_xargs_next_to_the_users_keys() -> None:
    body = {"prompt": "hi", "bregman_mode": "dual", "bregman_alpha": "inf", "bregman_top_k": 4,
            "unknown_field": [1, 2], "vllm_xargs": {"other": "x"}}
    mode, changed = apply_bregman(body, OFF)
    assert (mode, changed) == ("dual", True)
    assert body == {"prompt": "hi", "unknown_field": [1, 2], "vllm_xargs": {
        "other": "x", "bregman_mode": "dual", "bregman_alpha": "inf",
        "bregman_lambda": 0.01, "bregman_top_k": 4}}


def test_top_level_and_vllm_xargs_fields_add_up_where_they_agree() -> None:
    body = {"bregman_alpha": 3, "vllm_xargs": {"bregman_alpha": "3.0", "bregman_lambda": 0.5}}
    apply_bregman(body, OFF)
    assert body["vllm_xargs"]["bregman_alpha"] == 3.0  # the same value, written two ways
    assert body["vllm_xargs"]["bregman_lambda"] == 0.5  # from vllm_xargs


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"bregman_alpha": 3, "vllm_xargs": {"bregman_alpha": 2}}, "bregman_alpha",
     ["3 at the top level", "2 in vllm_xargs"]),
    ({"bregman_top_k": 2, "vllm_xargs": {"bregman_mode": "off"}}, "bregman_mode",
     ['"off" in vllm_xargs', "at the top level (bregman_top_k)"]),
    ({"bregman_mode": "off", "vllm_xargs": {"bregman_top_k": 2}}, "bregman_mode",
     ['"off" at the top level', "in vllm_xargs (bregman_top_k)"]),
    ({"bregman_mode": "dual", "vllm_xargs": {"bregman_mode": "off"}}, "bregman_mode",
     ["'dual' at the top level", "'off' in vllm_xargs"]),
])
def test_top_level_and_vllm_xargs_that_disagree_are_a_400_naming_both(
        fields: dict[str, Any], param: str, words: list[str]) -> None:
    """Issue 27: the key-by-key merge let vllm_xargs switch the request's own top-level fields
    off (or override them) without a word."""
    with pytest.raises(BregmanParamError) as info:
        apply_bregman(json.loads(json.dumps(fields)), OFF)
    assert info.value.field == param
    assert all(word in str(info.value) for word in words), str(info.value)


def test_vllm_xargs_alone_beats_the_server_default() -> None:
    defaults = BregmanParams(mode="primal", alpha=1.5, lam=0.01, top_k=7)
    body = {"vllm_xargs": {"bregman_top_k": 2}}
    assert apply_bregman(body, defaults) == ("primal", True)
    assert body["vllm_xargs"]["bregman_top_k"] == 2


def test_server_default_applies_to_requests_that_do_not_say() -> None:
    defaults = BregmanParams(mode="primal", alpha=2.0, lam=0.001)
    body: dict[str, Any] = {"prompt": "hi"}
    assert apply_bregman(body, defaults) == ("primal", True)
    assert body["vllm_xargs"] == {"bregman_mode": "primal", "bregman_alpha": 2.0,
                                  "bregman_lambda": 0.001}


def test_explicit_off_beats_the_server_default_and_strips_vllm_xargs() -> None:
    body = {"bregman_mode": "off", "vllm_xargs": {"seed_hint": 1}}
    assert apply_bregman(body, PRIMAL) == ("off", True)
    assert body == {"vllm_xargs": {"seed_hint": 1}}
    # "off" beside other fields in the same place: the request says off, in one place.
    body = {"vllm_xargs": {"bregman_mode": "off", "bregman_alpha": 2, "seed_hint": 1}}
    assert apply_bregman(body, PRIMAL) == ("off", True)
    assert body == {"vllm_xargs": {"seed_hint": 1}}


def test_any_field_turns_decoding_on_when_the_server_default_is_off() -> None:
    defaults = BregmanParams(mode="off", alpha=2.5, lam=0.2)
    body = {"bregman_lambda": 0.3}
    assert apply_bregman(body, defaults) == ("primal", True)
    assert body["vllm_xargs"] == {"bregman_mode": "primal", "bregman_alpha": 2.5,
                                  "bregman_lambda": 0.3}


def test_null_fields_count_as_absent() -> None:
    body = {"bregman_alpha": None, "prompt": "x"}
    assert apply_bregman(body, OFF) == ("off", True)
    assert body == {"prompt": "x"}


INVALID = [
    ({"bregman_mode": "greedy"}, "bregman_mode"),
    ({"bregman_mode": 1}, "bregman_mode"),
    ({"bregman_alpha": 0}, "bregman_alpha"),  # adaptive primal: (0, inf)
    ({"bregman_alpha": -1}, "bregman_alpha"),
    ({"bregman_alpha": "inf"}, "bregman_alpha"),  # inf needs bregman_top_k
    ({"bregman_alpha": "abc"}, "bregman_alpha"),
    ({"bregman_alpha": True}, "bregman_alpha"),
    ({"bregman_mode": "dual", "bregman_alpha": 1}, "bregman_alpha"),  # adaptive dual: (1, inf)
    ({"bregman_mode": "dual", "bregman_alpha": 0.5, "bregman_top_k": 3}, "bregman_alpha"),
    ({"bregman_top_k": 3, "bregman_alpha": 0}, "bregman_alpha"),  # fixed-k primal: not 0
    ({"bregman_lambda": -0.1}, "bregman_lambda"),
    ({"bregman_lambda": "lots"}, "bregman_lambda"),
    ({"bregman_top_k": 0}, "bregman_top_k"),
    ({"bregman_top_k": 2.5}, "bregman_top_k"),
    ({"bregman_k_max": 0}, "bregman_k_max"),
    ({"vllm_xargs": {"bregman_alpha": -2}}, "bregman_alpha"),
    ({"vllm_xargs": "bregman_alpha=2"}, "vllm_xargs"),
]


@pytest.mark.parametrize(("fields", "param"), INVALID)
def test_invalid_fields_name_the_parameter(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(BregmanParamError) as info:
        apply_bregman(dict(fields), OFF)
    assert info.value.field == param


@pytest.mark.parametrize("fields", [
    {"bregman_alpha": "inf", "bregman_top_k": 5},
    {"bregman_alpha": "-inf", "bregman_top_k": 5},
    {"bregman_mode": "dual", "bregman_alpha": 1, "bregman_top_k": 5},
    {"bregman_mode": "dual", "bregman_alpha": 1.01},
    {"bregman_alpha": 0.3, "bregman_lambda": 0, "bregman_k_max": 1},
])
def test_valid_edge_values_are_accepted(fields: dict[str, Any]) -> None:
    body = dict(fields)
    mode, _ = apply_bregman(body, OFF)
    assert mode == fields.get("bregman_mode", "primal")
    assert BregmanParams.from_mapping(body["vllm_xargs"]) is not None



# --- command line and settings ----------------------------------------------------------------

@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith("BREGMAN_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_cli_forwards_unknown_arguments_to_vllm_in_order(clean_env: pytest.MonkeyPatch) -> None:
    # The command line a GPU Dockerfile would use.
    settings, vllm_args = parse_args([
        "--model", "/models/smollm2", "--host", "0.0.0.0", "--port", "8000",
        "--max-model-len", "2048", "--dtype", "bfloat16", "--enforce-eager",
        "--gpu-memory-utilization=0.9", "--default-mode", "primal", "--default-alpha", "1.5",
        "--default-lambda", "0.01"])
    assert settings.model == "/models/smollm2"
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)
    assert vllm_args == ["--max-model-len", "2048", "--dtype", "bfloat16", "--enforce-eager",
                         "--gpu-memory-utilization=0.9"]
    assert settings.bregman_defaults() == BregmanParams("primal", 1.5, 0.01)


def test_environment_settings_and_flags_over_environment(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("BREGMAN_MODEL", "/models/m")
    clean_env.setenv("BREGMAN_API_KEY", "from-env")
    clean_env.setenv("BREGMAN_PORT", "9001")
    clean_env.setenv("BREGMAN_DEFAULT_MODE", "dual")
    clean_env.setenv("BREGMAN_DEFAULT_ALPHA", "inf")
    clean_env.setenv("BREGMAN_DEFAULT_TOP_K", "8")
    settings, _ = parse_args(["--port", "9002"])
    assert settings.model == "/models/m"
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "from-env"
    assert "from-env" not in repr(settings)  # SecretStr
    assert settings.port == 9002
    assert settings.bregman_defaults().to_request() == {
        "bregman_mode": "dual", "bregman_alpha": "inf", "bregman_lambda": 0.01,
        "bregman_top_k": 8}


@pytest.mark.parametrize("argv", [
    [],  # vLLM in this process needs --model
    ["--upstream", "http://a:1"],  # the gateway is gone: replicas go behind vllm-router
    ["--model", "m", "--default-mode", "dual", "--default-alpha", "1"],  # adaptive dual: > 1
    ["--model", "m", "--default-lambda", "-1"],
    ["--model", "m", "--default-mode", "beam"],
])
def test_cli_rejects_bad_command_lines(argv: list[str], clean_env: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_cli_flags_are_not_abbreviated(clean_env: pytest.MonkeyPatch) -> None:
    # "--mod" must reach vLLM untouched rather than be taken for our --model.
    settings, vllm_args = parse_args(["--model", "m", "--mod", "x", "--port", "1"])
    assert settings.model == "m" and vllm_args == ["--mod", "x"]





def test_vllm_gets_our_model_host_port_and_the_users_arguments_in_order(
        clean_env: pytest.MonkeyPatch) -> None:
    from bregman_server.engine import MIDDLEWARE_PATH, vllm_argv, vllm_namespace

    settings, vllm_args = parse_args(["--model", str(ROOT / "models" / "tiny-llama"), "--port",
                                      "8123", "--max-model-len", "512", "--enforce-eager",
                                      "--api-key", "ours"])
    argv = vllm_argv(settings, vllm_args)
    assert argv[:6] == ["--model", str(ROOT / "models" / "tiny-llama"), "--host", "127.0.0.1",
                        "--port", "8123"]
    assert argv[6:9] == ["--max-model-len", "512", "--enforce-eager"]
    namespace = vllm_namespace(settings, vllm_args)  # vLLM's own parser
    assert namespace.port == 8123 and namespace.max_model_len == 512
    assert MIDDLEWARE_PATH in namespace.middleware
    assert not namespace.api_key  # our middleware guards every route with our key


def test_cpu_builds_prefill_whole_prompts(tmp_path: Path) -> None:
    from bregman_server.engine import CPU_MAX_MODEL_LEN, cpu_safe_engine_args

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    assert cpu_safe_engine_args(str(model), ["--enforce-eager"]) == [
        "--enforce-eager", "--no-enable-chunked-prefill", "--max-num-batched-tokens", "256"]
    assert cpu_safe_engine_args("hub/model", []) == [
        "--max-model-len", str(CPU_MAX_MODEL_LEN), "--no-enable-chunked-prefill",
        "--max-num-batched-tokens", str(CPU_MAX_MODEL_LEN)]
    chosen = ["--enable-chunked-prefill", "--max-model-len", "64"]
    assert cpu_safe_engine_args(str(model), chosen) == chosen
    assert cpu_safe_engine_args(str(model), ["--max-model-len", "100"])[-1] == "100"


def test_installed_package_is_bregman_server() -> None:
    from importlib.metadata import entry_points

    scripts = [ep for ep in entry_points(group="console_scripts") if ep.name == "bregman-serve"]
    assert [ep.value for ep in scripts] == ["bregman_server.cli:main"]


def test_error_body_is_json_serializable_shape() -> None:
    from bregman_server.errors import error_body, sse_error_event

    assert error_body("m", param="p") == {"error": {"message": "m", "type":
                                                     "invalid_request_error", "param": "p",
                                                     "code": None}}
    event = sse_error_event("broke", code="shutdown").decode()
    first, second = event.strip().split("\n\n")
    assert json.loads(first.removeprefix("data: "))["error"]["message"] == "broke"
    assert second == "data: [DONE]"


def test_docs_reference_tables_are_generated_from_the_code() -> None:
    from bregman_server.docs import render

    document = (ROOT / "docs" / "server.md").read_text()
    assert render(document) == document, "run: python -m bregman_server.docs --write docs/server.md"
    for spec in FIELD_SPECS:
        assert f"| `{spec.name}` |" in document
    assert "`BREGMAN_API_KEY`" in document and "`--default-mode`" in document




def test_openapi_fields_are_generated_from_the_parameter_model() -> None:
    """Every request field of the parameter model (`FIELD_SPECS`) is in the OpenAPI properties,
    with its value schema (ranges, enums), null for "absent", and this server's default: a new
    field needs no code here."""
    from bregman_server.openapi import bregman_properties

    settings = ServerSettings(default_mode="dual", default_alpha=2.0, default_top_k=9,
                              max_support=None)
    properties = bregman_properties(settings)
    assert list(properties) == [spec.name for spec in FIELD_SPECS]
    for spec in FIELD_SPECS:
        options = properties[spec.name]["anyOf"]
        assert options[-1] == {"type": "null"} and len(options) == len(spec.schema) + 1
        assert spec.allowed in properties[spec.name]["description"]
    assert properties["bregman_mode"]["default"] == "dual"
    assert properties["bregman_top_k"]["default"] == 9
    assert properties["bregman_k_max"]["anyOf"][0] == {"type": "integer", "minimum": 1,
                                                      "maximum": 2**31 - 1}
    assert properties["bregman_lambda"]["anyOf"][0]["minimum"] == 0
    assert properties["bregman_alpha"]["anyOf"][1]["enum"] == ["inf", "-inf"]


# --- the lifecycle inside vLLM's server ------------------------------------------------------


def test_a_failing_ready_callback_still_lets_the_server_stop():
    """`serving.run_lifecycle` replaces vLLM's signal handlers, so whatever fails inside it
    must still stop uvicorn: here the ready-line callback raises (a closed stdout), then the
    engine dies; the watch goes on, and the server is told to exit (it once ended the task
    with the error, and nothing would ever stop the server)."""
    from types import SimpleNamespace

    from bregman_server.serving import run_lifecycle

    def closed_stdout(server: Any) -> None:
        raise BrokenPipeError("stdout closed")

    server = SimpleNamespace(started=True, should_exit=False)
    engine = SimpleNamespace(errored=False)
    app = SimpleNamespace(state=SimpleNamespace(server=server, engine_client=engine))
    lifecycle = Lifecycle(on_serving=closed_stdout)

    async def run() -> None:
        task = asyncio.create_task(run_lifecycle(lifecycle, ServerSettings(
            engine_exit_grace=0.0), app))
        await asyncio.sleep(0.3)
        assert not task.done() and lifecycle.serving  # the watch survived the callback
        engine.errored = True
        await asyncio.wait_for(task, 10)

    asyncio.run(run())
    assert server.should_exit and lifecycle.exit_status == 3


@pytest.mark.parametrize("level", ["DEBUG", "NOTSET", "warning"])
def test_every_log_level_vllm_takes_is_taken(level: str) -> None:
    """``--log-level`` is ours and vLLM's: every value vLLM accepts (NOTSET included) is
    accepted, and reaches vLLM's flag in its own spelling."""
    settings, vllm_args = parse_args(["--model", "m", "--log-level", level])
    assert settings.log_level == level.lower()
    assert vllm_args[-2:] == ["--log-level", level.upper()]
