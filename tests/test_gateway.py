"""The gateway (``bregman-serve --upstream ...``) over real HTTP on loopback.

The gateway runs as its own process (``python -m bregman_server.cli --upstream ...``) in front of
scripted upstreams: raw asyncio HTTP/1.1 servers in a thread of this process that answer like
vLLM (/health, /v1/models, /v1/completions as JSON and SSE) or misbehave on request (header
``x-script``, forwarded by the gateway like any other header). Each misbehaviour is a regression
test for a finding against the old hand-written upstream client: bytes after a response, an
unbounded body, huge response heads, a trickling upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "sk-gateway-test"
UPSTREAM_KEY = "sk-upstream-test"
AUTH = {"authorization": f"Bearer {API_KEY}"}
MAX_RESPONSE = 8 * 1024 * 1024
REQUEST_TIMEOUT = 4.0
HUGE_BODY = 300 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- scripted upstreams ---------------------------------------------------------------------------

def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _event(text: str) -> bytes:
    return f'data: {json.dumps({"choices": [{"text": text}]})}\n\n'.encode()


class ScriptedUpstream:
    """A vLLM look-alike on a loopback port, served by an event loop in a thread of its own.

    ``requests`` records what reached it (method, path, headers, body); ``closed`` the scripts
    whose connection the gateway closed while the upstream was still answering.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.requests: list[dict[str, Any]] = []
        self.closed: list[str] = []
        self.sent: dict[str, int] = {}
        self.health_status = 200
        self.draining = False  # answers 503 to generation requests (vLLM refusing work)
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ScriptedUpstream:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._server = self.loop.run_until_complete(asyncio.start_server(
            self._connection, "127.0.0.1", 0, limit=1 << 20))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    def call(self, coro: Any, timeout: float = 10) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def go_down(self) -> None:
        """Stop listening and drop every open connection (a crashed vLLM)."""
        async def down() -> None:
            assert self._server is not None
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
        self.call(down())

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.go_down()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    # --- the server ----------------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                          ) -> None:
        self._writers.add(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if line:
                        key, _, value = line.partition(":")
                        headers[key.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.requests.append({"method": method, "path": target, "headers": headers,
                                      "body": body})
                keep = await self._answer(method, target, headers, body, reader, writer)
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _json(self, writer: asyncio.StreamWriter, status: int, payload: Any) -> bool:
        data = json.dumps(payload).encode()
        writer.write(_head(status, {"content-type": "application/json",
                                    "content-length": str(len(data)),
                                    "x-upstream": self.name}) + data)
        await writer.drain()
        return True

    async def _until_closed(self, script: str, reader: asyncio.StreamReader) -> bool:
        """Wait for the gateway to close the connection, then record it."""
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass
        self.closed.append(script)
        return False

    async def _answer(self, method: str, path: str, headers: dict[str, str], body: bytes,
                      reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        script = headers.get("x-script", "")
        if path == "/health":
            return await self._json(writer, self.health_status, {})
        if path == "/v1/models":  # (with a cookie that the gateway must not keep)
            data = json.dumps({"object": "list", "upstream": self.name,
                               "data": [{"id": "scripted"}]}).encode()
            writer.write(_head(200, {"content-type": "application/json",
                                     "content-length": str(len(data)), "x-upstream": self.name,
                                     "set-cookie": f"session={self.name}; Path=/"}) + data)
            await writer.drain()
            return True
        if path == "/tokenize":
            return await self._json(writer, 200, {"tokens": [1, 2, 3], "upstream": self.name})
        if not path.startswith("/v1/completions"):
            return await self._json(writer, 404, {"detail": "Not Found"})
        request = json.loads(body or b"{}")
        if script == "smuggle":
            # A 2-byte body, then more bytes: a whole second response, in the same write.
            writer.write(_head(200, {"content-type": "application/json",
                                     "content-length": "2"}) + b"{}"
                         + _head(200, {"content-type": "application/json",
                                       "content-length": "17"}) + b'{"smuggled":true}')
            await writer.drain()
            return True
        if script == "huge-body":
            # No Content-Length: the body ends when the connection does.
            writer.write(_head(200, {"content-type": "application/json",
                                     "connection": "close"}))
            block = b"x" * (1 << 20)
            sent = 0
            try:
                while sent < HUGE_BODY:
                    writer.write(block)
                    await writer.drain()
                    sent += len(block)
            except ConnectionError:
                pass
            self.sent[script] = sent
            return False
        if script == "huge-headers":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
            line = b"x-padding: " + b"a" * 1000 + b"\r\n"
            sent = 0
            try:
                while sent < HUGE_BODY:  # until the gateway hangs up
                    writer.write(line * 64)
                    await writer.drain()
                    sent += 64 * len(line)
            except ConnectionError:
                pass
            self.sent[script] = sent
            return False
        if script == "trickle":  # one byte at a time, never silent long enough for read_timeout
            if request.get("stream"):
                writer.write(_head(200, {"content-type": "text/event-stream",
                                         "transfer-encoding": "chunked"}))
                writer.write(_chunk(_event("first")))
                chunks = (_chunk(b":\n") for _ in iter(int, 1))
            else:
                writer.write(_head(200, {"content-type": "application/json",
                                         "content-length": "100000"}))
                chunks = (b" " for _ in iter(int, 1))
            try:
                for piece in chunks:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.2)
                    if reader.at_eof():
                        break
            except ConnectionError:
                pass
            return await self._until_closed(script, reader)
        if script == "hang":  # starts answering, then waits (a long generation)
            if request.get("stream"):
                writer.write(_head(200, {"content-type": "text/event-stream",
                                         "transfer-encoding": "chunked"})
                             + _chunk(_event("first")))
                await writer.drain()
            return await self._until_closed(script, reader)
        if script == "break":  # a stream cut in the middle of an event
            writer.write(_head(200, {"content-type": "text/event-stream",
                                     "transfer-encoding": "chunked"})
                         + _chunk(_event("first")) + _chunk(b'data: {"cho'))
            await writer.drain()
            return False
        if self.draining:
            return await self._json(writer, 503, {"error": {"message": "draining"}})
        if request.get("stream"):
            writer.write(_head(200, {"content-type": "text/event-stream",
                                     "transfer-encoding": "chunked", "x-upstream": self.name}))
            for text in ("Hello", " world", "!"):
                writer.write(_chunk(_event(text)))
                await writer.drain()
            writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
            return True
        return await self._json(writer, 200, {"object": "text_completion",
                                              "upstream": self.name, "received": request,
                                              "choices": [{"text": "Hello"}]})


# --- the gateway process --------------------------------------------------------------------------

class Gateway:
    """``python -m bregman_server.cli --upstream ...`` on a free loopback port."""

    def __init__(self, upstreams: list[str], *flags: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("BREGMAN_")}
        env["PYTHONUNBUFFERED"] = "1"
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "bregman_server.cli", "--upstream", *upstreams,
                 "--port", str(self.port), "--log-level", "warning", *flags],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60, healthy: bool = True) -> Gateway:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                status = httpx.get(self.url + "/health", timeout=2).status_code
                if status == 200 or (not healthy and status == 503):
                    return self
            time.sleep(0.1)
        raise AssertionError(f"gateway not ready:\n{self.log.read_text()[-3000:]}")

    def rss_mib(self) -> float:
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


@pytest.fixture(scope="module")
def upstreams() -> Iterator[tuple[ScriptedUpstream, ScriptedUpstream]]:
    a, b = ScriptedUpstream("A").start(), ScriptedUpstream("B").start()
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture(scope="module")
def gateway(upstreams: tuple[ScriptedUpstream, ScriptedUpstream], tmp_path_factory: Any
            ) -> Iterator[Gateway]:
    a, b = upstreams
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    server = Gateway([a.url, b.url], "--api-key", API_KEY, "--upstream-api-key", UPSTREAM_KEY,
                     "--max-response-bytes", str(MAX_RESPONSE), "--request-timeout",
                     str(REQUEST_TIMEOUT), "--read-timeout", "3", "--health-interval", "0.5",
                     log=log)
    try:
        yield server.wait_ready()
    finally:
        code = server.stop()
        assert code == 0, server.log.read_text()[-3000:]


def post(gateway: Gateway, body: dict[str, Any], script: str = "", timeout: float = 30,
         **headers: str) -> httpx.Response:
    return httpx.post(gateway.url + "/v1/completions", json=body, timeout=timeout,
                      headers={**AUTH, "x-script": script, **headers})


def sse_lines(response: httpx.Response) -> list[str]:
    return [line for line in response.text.split("\n") if line.startswith("data: ")]


def error_of(response: httpx.Response) -> dict[str, Any]:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# --- routes, keys, Bregman fields -----------------------------------------------------------------

@pytest.mark.timeout(60)
def test_api_key_on_every_route_but_health(gateway: Gateway,
                                           upstreams: tuple[ScriptedUpstream, ...]) -> None:
    assert httpx.get(gateway.url + "/health").status_code == 200
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("POST", "/tokenize"), ("GET", "/metrics"), ("GET", "/docs"),
                         ("GET", "/openapi.json"), ("GET", "/v1/anything"), ("GET", "/sleep")]:
        response = httpx.request(method, gateway.url + path, json={} if method == "POST" else None)
        assert response.status_code == 401, (path, response.text)
        assert error_of(response)["code"] == "invalid_api_key"
    response = httpx.get(gateway.url + "/v1/models", headers=AUTH)
    assert response.status_code == 200 and response.json()["data"][0]["id"] == "scripted"
    # Our key never reaches vLLM: the upstream key replaces it.
    seen = [r for u in upstreams for r in u.requests if r["path"] == "/v1/models"]
    assert seen and all(r["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}" for r in seen)


@pytest.mark.timeout(60)
def test_bregman_fields_validated_and_mapped(gateway: Gateway) -> None:
    response = post(gateway, {"prompt": "x", "bregman_top_k": 2**63})
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == "bregman_top_k"
    response = post(gateway, {"prompt": "x", "max_tokens": 3, "bregman_mode": "primal",
                              "bregman_alpha": 1.5, "bregman_lambda": 0.01})
    assert response.status_code == 200, response.text
    received = response.json()["received"]
    assert "bregman_mode" not in received and received["prompt"] == "x"
    assert received["vllm_xargs"]["bregman_mode"] == "primal"
    assert received["vllm_xargs"]["bregman_alpha"] == 1.5
    # A body without Bregman fields reaches the upstream byte for byte.
    raw = b'{"prompt":  "same bytes", "max_tokens": 1}'
    response = httpx.post(gateway.url + "/v1/completions", content=raw,
                          headers={**AUTH, "content-type": "application/json"})
    assert response.status_code == 200
    assert response.json()["received"] == {"prompt": "same bytes", "max_tokens": 1}


@pytest.mark.timeout(60)
def test_routes_passthrough_and_404(gateway: Gateway) -> None:
    response = httpx.post(gateway.url + "/tokenize", json={"prompt": "x"}, headers=AUTH)
    assert response.status_code == 200 and response.json()["tokens"] == [1, 2, 3]
    for path in ("/sleep", "/v1/load_lora_adapter", "/collective_rpc"):
        response = httpx.post(gateway.url + path, json={}, headers=AUTH)
        assert response.status_code == 404, path
        assert error_of(response)["code"] == "not_found"
    # vLLM's own FastAPI 404 ({"detail": ...}) comes back in OpenAI's shape.
    response = httpx.get(gateway.url + "/v1/no-such-route", headers=AUTH)
    assert response.status_code == 404 and error_of(response)["code"] == "not_found"
    spec = httpx.get(gateway.url + "/openapi.json", headers=AUTH).json()
    schema = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"bregman_mode", "bregman_alpha", "bregman_top_k"} <= set(schema)
    metrics = httpx.get(gateway.url + "/metrics", headers=AUTH)
    assert metrics.status_code == 200
    assert "bregman_server_upstream_healthy" in metrics.text


@pytest.mark.timeout(60)
def test_round_robin_over_two_upstreams(gateway: Gateway,
                                        upstreams: tuple[ScriptedUpstream, ...]) -> None:
    seen = [httpx.get(gateway.url + "/v1/models", headers=AUTH).json()["upstream"]
            for _ in range(6)]
    assert sorted(seen) == ["A"] * 3 + ["B"] * 3, seen
    assert all(x != y for x, y in itertools.pairwise(seen)), seen
    # The upstream's cookies reach the client, but the gateway keeps none for the next ones.
    assert httpx.get(gateway.url + "/v1/models", headers=AUTH).headers["set-cookie"]
    assert not any("cookie" in r["headers"] for u in upstreams for r in u.requests)


@pytest.mark.timeout(60)
def test_stream_relayed_to_done(gateway: Gateway) -> None:
    with httpx.stream("POST", gateway.url + "/v1/completions", headers=AUTH,
                      json={"prompt": "x", "stream": True}, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = "".join(response.iter_text())
    lines = [line for line in text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]) \
        == "Hello world!"


@pytest.mark.timeout(60)
def test_stream_broken_by_upstream_ends_with_error_event(gateway: Gateway) -> None:
    response = post(gateway, {"prompt": "x", "stream": True}, script="break")
    assert response.status_code == 200
    lines = sse_lines(response)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "upstream_read"
    assert "\n\ndata: {\"error\"" in response.text  # a fresh event after the cut one


# --- the findings against the old client ----------------------------------------------------------

@pytest.mark.timeout(60)
def test_bytes_after_a_response_never_reach_a_client(gateway: Gateway) -> None:
    """``{}`` then a whole second response in the same write: the client gets ``{}``; the
    bytes left over never become the answer to another request on that connection."""
    for _ in range(4):
        response = post(gateway, {"prompt": "x"}, script="smuggle")
        assert response.status_code == 200 and response.content == b"{}", response.content
        for _ in range(2):  # the next requests, on whatever connection the pool picks
            response = post(gateway, {"prompt": "x"})
            assert b"smuggled" not in response.content
            assert response.status_code == 200, response.text


@pytest.mark.timeout(60)
def test_huge_body_is_refused_and_memory_stays_bounded(
        gateway: Gateway, upstreams: tuple[ScriptedUpstream, ...]) -> None:
    before = gateway.rss_mib()
    started = time.monotonic()
    response = post(gateway, {"prompt": "x"}, script="huge-body")
    elapsed = time.monotonic() - started
    assert response.status_code == 502, response.text[:200]
    assert error_of(response)["code"] == "upstream_response_too_large"
    assert elapsed < 15
    after = gateway.rss_mib()
    assert after - before < 100, (before, after)
    # The gateway stopped reading: the upstream could not push its 300 MB.
    time.sleep(0.5)
    sent = sum(u.sent.get("huge-body", 0) for u in upstreams)
    assert sent < HUGE_BODY, sent


@pytest.mark.timeout(60)
def test_huge_response_head_is_refused_quickly(
        gateway: Gateway, upstreams: tuple[ScriptedUpstream, ...]) -> None:
    """An upstream that sends headers without end (up to 300 MB): a quick 502 (the head is
    refused past 100 KiB), and /health stays fast meanwhile."""
    result: dict[str, Any] = {}

    def request() -> None:
        started = time.monotonic()
        result["response"] = post(gateway, {"prompt": "x"}, script="huge-headers")
        result["elapsed"] = time.monotonic() - started

    thread = threading.Thread(target=request)
    thread.start()
    health = []
    while thread.is_alive():
        started = time.monotonic()
        assert httpx.get(gateway.url + "/health", timeout=10).status_code == 200
        health.append(time.monotonic() - started)
        time.sleep(0.02)
    thread.join()
    response = result["response"]
    assert response.status_code == 502, response.text[:300]
    assert error_of(response)["code"] == "upstream_error"
    assert result["elapsed"] < 5, result["elapsed"]
    assert max(health) < 2, health
    time.sleep(0.5)
    assert sum(u.sent.get("huge-headers", 0) for u in upstreams) < 50 * 1024 * 1024


@pytest.mark.timeout(60)
def test_trickling_upstream_hits_the_total_deadline(
        gateway: Gateway, upstreams: tuple[ScriptedUpstream, ...]) -> None:
    started = time.monotonic()
    response = post(gateway, {"prompt": "x"}, script="trickle")
    elapsed = time.monotonic() - started
    assert response.status_code == 504, response.text[:300]
    assert error_of(response)["code"] == "upstream_timeout"
    assert REQUEST_TIMEOUT - 0.5 < elapsed < REQUEST_TIMEOUT + 5, elapsed
    # A stream: the error event and [DONE] at the deadline.
    started = time.monotonic()
    response = post(gateway, {"prompt": "x", "stream": True}, script="trickle")
    elapsed = time.monotonic() - started
    assert response.status_code == 200
    lines = sse_lines(response)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "upstream_timeout"
    assert REQUEST_TIMEOUT - 0.5 < elapsed < REQUEST_TIMEOUT + 5, elapsed
    wait_closed(upstreams, "trickle", count=2, timeout=5)


def wait_closed(upstreams: tuple[ScriptedUpstream, ...], script: str, count: int = 1,
                timeout: float = 10) -> float:
    """Seconds until the upstreams saw ``count`` connections of ``script`` closed."""
    started = time.monotonic()
    while sum(u.closed.count(script) for u in upstreams) < count:
        assert time.monotonic() - started < timeout, [u.closed for u in upstreams]
        time.sleep(0.02)
    return time.monotonic() - started


@pytest.mark.timeout(60)
def test_client_disconnect_closes_the_upstream(
        gateway: Gateway, upstreams: tuple[ScriptedUpstream, ...]) -> None:
    for upstream in upstreams:
        upstream.closed.clear()
    # A stream: the client leaves after the first event.
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", gateway.url + "/v1/completions", json={"prompt": "x", "stream": True},
            headers={**AUTH, "x-script": "hang"}) as response:
        assert response.status_code == 200
        next(response.iter_raw())
    # The gateway closes the upstream connection (vLLM aborts the generation) at once, not
    # at the deadline.
    assert wait_closed(upstreams, "hang") < REQUEST_TIMEOUT - 1.5
    # Not streaming: the client leaves while the upstream still computes the answer.
    body = json.dumps({"prompt": "x"}).encode()
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\nx-script: hang\r\n"
                     + f"authorization: Bearer {API_KEY}\r\n".encode()
                     + f"content-length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 10
        while sum(len([r for r in u.requests if r["headers"].get("x-script") == "hang"])
                  for u in upstreams) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert wait_closed(upstreams, "hang", count=2) < REQUEST_TIMEOUT - 1.5


# --- upstreams going down ---------------------------------------------------------------------

@pytest.mark.timeout(90)
def test_upstream_down_retry_then_503(tmp_path: Path) -> None:
    """Requests that never reached an upstream (connection refused, or a 503 from vLLM
    refusing work) go to the next healthy one; with none left: 503. The health checks are
    30 s apart here, so the requests alone must notice."""
    c, d, e = (ScriptedUpstream(name).start() for name in "CDE")
    server = Gateway([c.url, d.url, e.url], "--health-interval", "30", "--connect-timeout",
                     "2", log=tmp_path / "gateway.log")
    try:
        server.wait_ready()
        assert httpx.get(server.url + "/health").json()["healthy_upstreams"] == 3
        e.draining = True  # answers 503: the request goes to the next upstream
        answers = [post(server, {"prompt": "x"}) for _ in range(6)]
        assert [r.status_code for r in answers] == [200] * 6
        assert {r.json()["upstream"] for r in answers} == {"C", "D"}
        # No key of ours and no upstream key: the client's own Authorization reaches vLLM.
        assert c.requests[-1]["headers"]["authorization"] == f"Bearer {API_KEY}"
        d.go_down()  # refuses connections from now on: the requests go to C, none fails
        for _ in range(4):
            response = post(server, {"prompt": "x"})
            assert response.status_code == 200, response.text
            assert response.json()["upstream"] == "C"
        c.go_down()
        response = post(server, {"prompt": "x"})
        assert response.status_code == 503
        assert error_of(response)["code"] == "upstream_unavailable"
        response = httpx.get(server.url + "/health")
        assert response.status_code == 503
        assert error_of(response)["code"] == "upstream_unavailable"
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        for url, kind in ((e.url, "unavailable"), (d.url, "connect"), (c.url, "connect")):
            assert f'bregman_server_upstream_errors_total{{kind="{kind}",upstream="{url}"}}' \
                in metrics, (url, kind)
    finally:
        assert server.stop() == 0
        for upstream in (c, d, e):
            upstream.stop()


@pytest.mark.timeout(60)
def test_no_upstream_reachable_at_start(tmp_path: Path) -> None:
    server = Gateway([f"http://127.0.0.1:{free_port()}"], log=tmp_path / "gateway.log")
    try:
        server.wait_ready(healthy=False)
        response = httpx.get(server.url + "/health")
        assert response.status_code == 503 and error_of(response)["type"] == "upstream_error"
        response = post(server, {"prompt": "x"})
        assert response.status_code == 503
    finally:
        assert server.stop() == 0


# --- shutdown ---------------------------------------------------------------------------------

@pytest.mark.timeout(90)
def test_sigterm_drains_then_cuts(tmp_path: Path) -> None:
    upstream = ScriptedUpstream("E").start()
    server = Gateway([upstream.url], "--graceful-timeout", "1.5", log=tmp_path / "gateway.log")
    results: dict[str, Any] = {}
    try:
        server.wait_ready()

        def stream() -> None:
            with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                              json={"prompt": "x", "stream": True},
                              headers={"x-script": "hang"}) as response:
                results["stream_status"] = response.status_code
                results["stream"] = "".join(response.iter_text())

        def buffered() -> None:
            results["buffered"] = post(server, {"prompt": "x"}, script="hang")

        threads = [threading.Thread(target=stream), threading.Thread(target=buffered)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        while len([r for r in upstream.requests if r["headers"].get("x-script") == "hang"]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.2)
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # Draining: new requests and /health get 503.
        refused = httpx.get(server.url + "/health")
        assert refused.status_code == 503 and error_of(refused)["code"] == "shutdown"
        for thread in threads:
            thread.join(20)
        assert server.process.wait(20) == 0
        elapsed = time.monotonic() - started
        assert 1.0 < elapsed < 10, elapsed
        assert results["stream_status"] == 200
        lines = [x for x in results["stream"].split("\n") if x.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["code"] == "shutdown"
        assert results["buffered"].status_code == 503
        assert error_of(results["buffered"])["code"] == "shutdown"
        # The cut requests were aborted upstream too.
        deadline = time.monotonic() + 5
        while upstream.closed.count("hang") < 2:
            assert time.monotonic() < deadline, upstream.closed
            time.sleep(0.05)
    finally:
        server.stop()
        upstream.stop()
