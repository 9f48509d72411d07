"""The reliability suite: every finding of the hostile reviews of issues 11 and 19, as a
regression test against real `bregman-serve` processes (vLLM in-process, the tiny model,
loopback only), plus property-based fuzzes (every request field; every way vLLM reads a body;
every method on every route) and a bounded load run.

Three servers start at once for the module: one that serves most tests; one with server-wide
defaults (``--default-mode primal --default-top-k 2``) that serves the defaults tests and is then
sent SIGTERM with requests in flight; and one whose engine process is killed. Every request loop
is bounded in count and time. At the end the suite prints its figures (requests tried, 5xx
answers, errors not in OpenAI's shape, load held, slow clients and the well-behaved clients
served meanwhile, faults survived, requests lost; tests/conftest.py prints them as
``reliability figures: {...}``): docs/server.md records them.

Run it alone with ``pytest -m reliability``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import gzip
import json
import math
import os
import re
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .test_server_support import (
    BODY_ENCODINGS,
    REVIEWED_UNTYPED_POSTS,
    ServerProcess,
    alive,
    comm,
    encode_body,
    finite_top_logprobs,
    prometheus_value,
    require_tiny_model,
    run_load,
    scrape,
    server_environment,
    shut_down_all,
)

pytestmark = [pytest.mark.reliability, pytest.mark.server, pytest.mark.timeout(600)]

MODEL = "models/tiny-llama"
PROMPT = "ROMEO:\n"
KEY = secrets.token_hex(8)
AUTH = {"Authorization": f"Bearer {KEY}"}
# Short deadlines, so that the tests of them are quick; long enough for a loaded 2-core machine.
LIMITS = ["--header-timeout", "3", "--body-timeout", "5", "--body-deadline", "30",
          "--max-header-bytes", "16384", "--max-connections", "64", "--graceful-timeout", "1",
          "--engine-exit-grace", "1"]
DEFAULTS = ["--default-mode", "primal", "--default-top-k", "2"]
#: The dying server's window of 503s after its engine dies (the default is 2 s): longer than a
#: test process goes without running on a loaded machine (seen: 9 s), so that the test sees
#: the 503s whenever it gets to look. Its exit comes that much later (the test waits for it).
DYING = ["--engine-exit-grace", "15"]
#: Documented settings with no other live test, on the dying server (before its death test):
#: its server-wide Bregman defaults, a small body limit and the CPU KV cache the server sets
#: for vLLM when the environment does not (its environment leaves VLLM_CPU_KVCACHE_SPACE out).
SETTINGS = ["--default-mode", "dual", "--default-alpha", "3", "--default-lambda", "0.001",
            "--default-k-max", "3", "--max-body-bytes", "8192", "--cpu-kvcache-space-gib", "1"]
# The fault tests need requests still running after SIGTERM + grace: 2000 steps of the tiny
# model (4.8 s at load 7 on 2 cores) once ended before that on a quieter machine, so they get
# 8000 (a longer context; the tiny model's KV cache is 1 KiB a token).
ENGINE = ["--logprobs-mode", "processed_logprobs", "--max-num-seqs", "32", "--enforce-eager",
          "--max-model-len", "8192"]
LONG_TOKENS = 8000

FIGURES: dict[str, Any] = {"requests": 0, "5xx": 0, "not_openai_shaped": 0,
                           "load_requests": 0, "load_ok": 0, "load_retried_408": 0,
                           "slow_clients": 0,
                           "slow_connections": 0, "served_while_slow": "",
                           "faults_survived": [], "lost": 0}


class Servers:
    def __init__(self, main: ServerProcess, draining: ServerProcess, dying: ServerProcess):
        self.main, self.draining, self.dying = main, draining, dying

    @property
    def url(self) -> str:
        return self.main.url

    @property
    def with_defaults(self) -> ServerProcess:
        """The server with server-wide defaults (the SIGTERM test ends it, last)."""
        return self.draining


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    require_tiny_model()
    logs = tmp_path_factory.mktemp("reliability-logs")
    bare = {k: v for k, v in server_environment().items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    made = [ServerProcess(["--model", MODEL, "--api-key", KEY, *LIMITS, *ENGINE, *extra],
                          logs / f"{name}.log", env=env)
            for name, extra, env in (("main", [], None), ("draining", DEFAULTS, None),
                                     ("dying", [*DYING, *SETTINGS], bare))]
    try:
        for server in made:
            server.start()
        for server in made:
            server.wait_healthy(timeout=600)
        yield Servers(*made)
    finally:
        # The fault tests end two of them themselves, and check how; nothing may be left.
        shut_down_all(made)


def count(response: httpx.Response) -> httpx.Response:
    """Count one answer in the figures: a 5xx, an error not in OpenAI's shape."""
    FIGURES["requests"] += 1
    FIGURES["5xx"] += response.status_code >= 500
    FIGURES["not_openai_shaped"] += response.status_code >= 400 and not openai_shaped(response)
    return response


def openai_shaped(response: httpx.Response) -> bool:
    if response.request.method == "HEAD":
        return True  # no body to shape
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


def post(url: str, body: Any, path: str = "/v1/completions", **kwargs: Any) -> httpx.Response:
    kwargs.setdefault("headers", AUTH)
    kwargs.setdefault("timeout", 60)
    return count(httpx.post(url + path, json=body, **kwargs))


def post_raw(url: str, path: str, raw: bytes, headers: dict[str, str] | None = None,
             ) -> httpx.Response:
    headers = {**AUTH, "content-type": "application/json", **(headers or {})}
    return count(httpx.post(url + path, content=raw, headers=headers, timeout=60))


def assert_openai_error(response: httpx.Response, param: str | None, status: int = 400
                        ) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error)
    assert error["param"] == param, error
    assert "Traceback" not in response.text
    return error


def assert_openai_400(response: httpx.Response, param: str | None) -> None:
    assert_openai_error(response, param)


# --- finding 1: no unguarded route, no second port ----------------------------------------------

def test_vllms_unguarded_routes_need_the_key(servers: Servers) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    for path in ("/invocations", "/tokenize"):
        assert httpx.post(servers.url + path, json=body, timeout=60).status_code == 401
    for path in ("/metrics", "/load", "/openapi.json", "/docs"):
        assert httpx.get(servers.url + path, timeout=60).status_code == 401
    assert post(servers.url, body, "/invocations").status_code == 200


# --- finding 2: one request cannot turn decoding off for its batch ------------------------------

POISON = [({"bregman_top_k": 9223372036854775808}, "bregman_top_k"),
          ({"bregman_k_max": 9223372036854775808}, "bregman_k_max"),
          ({"vllm_xargs": {"bregman_top_k": 9223372036854775808}}, "bregman_top_k"),
          ({"vllm_xargs": {"bregman_k_max": 2**31}}, "bregman_k_max")]


def test_poison_requests_are_refused_and_their_batch_decodes(servers: Servers) -> None:
    """8 requests with bregman_top_k=1 (at temperature 1) sent together with the poison ones:
    every poison request is a 400 naming the field, and every step of the 8 keeps exactly one
    token (a non-top-1 token was sampled in 123 of 246 steps before)."""
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 30, "temperature": 1.0,
            "logprobs": 3, "ignore_eos": True}
    good = {**base, "bregman_top_k": 1}
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        poison = [pool.submit(post, servers.url, {**base, **fields}) for fields, _ in POISON]
        batch = [pool.submit(post, servers.url, {**good, "seed": i}) for i in range(8)]
        for future, (_, param) in zip(poison, POISON, strict=True):
            assert_openai_400(future.result(), param)
        steps = 0
        for future in batch:
            response = future.result()
            assert response.status_code == 200, response.text
            entries = response.json()["choices"][0]["logprobs"]["top_logprobs"]
            assert [finite_top_logprobs(entry) for entry in entries] == [1] * 30
            steps += len(entries)
    assert steps == 240


# --- finding 3: bounded requests ----------------------------------------------------------------

def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_huge_request_header_is_a_431(servers: Servers) -> None:
    response = httpx.get(servers.url + "/v1/models",
                         headers={**AUTH, "x-filler": "a" * (1 << 20)}, timeout=60)
    assert response.status_code == 431
    assert response.json()["error"]["code"] == "request_header_fields_too_large"
    assert httpx.get(servers.url + "/v1/models", headers=AUTH, timeout=60).status_code == 200


def test_idle_partial_heads_cannot_exhaust_file_descriptors(servers: Servers) -> None:
    """1,000 connections that never finish their head: beyond the connection cap (and its
    headroom) each closes an older one (503), the rest close at the head deadline, and the
    server's descriptors go back to where they were."""
    before = _open_fds(servers.main.pid)
    sockets = []
    try:
        for _ in range(1000):
            sock = socket.create_connection(_host_port(servers.url), timeout=5)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            sockets.append(sock)
        time.sleep(5)  # past the 3 s head deadline
        assert _open_fds(servers.main.pid) < before + 50
    finally:
        for sock in sockets:
            sock.close()
    assert httpx.get(servers.url + "/v1/models", headers=AUTH, timeout=60).status_code == 200
    FIGURES["faults_survived"].append("1000 idle partial heads")


def test_body_shorter_than_content_length_is_a_408(servers: Servers) -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\":")
    with socket.create_connection(_host_port(servers.url), timeout=15) as sock:
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]


# --- finding 5: 400s, never 500s ----------------------------------------------------------------

@pytest.mark.parametrize(("raw", "param"), [
    (b'{"model": "M", "prompt": "x", "bregman_top_k": "\xc2\xb2"}', "bregman_top_k"),
    (b'{"model": "M", "prompt": "x", "bregman_alpha": 1' + b"0" * 400 + b"}", "bregman_alpha"),
    (b'{"model": "M", "prompt": "x", "bregman_lambda": 1' + b"0" * 400 + b"}", "bregman_lambda"),
    (b'{"model": "M", "prompt": "x", "bregman_alpha": 1' + b"0" * 400 + b".5}", "bregman_alpha"),
    (b"[" * 100_000 + b"]" * 100_000, None),
    (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, None),
])
def test_hostile_values_are_400s(servers: Servers, raw: bytes, param: str | None) -> None:
    raw = raw.replace(b'"M"', json.dumps(MODEL).encode())
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = httpx.post(servers.url + path, content=raw, timeout=60,
                              headers={**AUTH, "content-type": "application/json"})
        FIGURES["requests"] += 1
        assert_openai_400(response, param)


def test_lone_surrogate_prompt_with_bregman_fields_is_not_a_5xx(servers: Servers) -> None:
    raw = json.dumps({"model": MODEL, "prompt": "a\ud800b", "max_tokens": 2,
                      "bregman_alpha": 1.5}).encode()
    response = httpx.post(servers.url + "/v1/completions", content=raw, timeout=60,
                          headers={**AUTH, "content-type": "application/json"})
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert "error" in response.json()
    plain = json.dumps({"model": MODEL, "prompt": "a\ud800b", "max_tokens": 2}).encode()
    baseline = httpx.post(servers.url + "/v1/completions", content=plain, timeout=60,
                          headers={**AUTH, "content-type": "application/json"})
    assert baseline.status_code == response.status_code  # same as vLLM alone says


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_bodies_vllm_parses_itself_are_400s(servers: Servers, raw: bytes) -> None:
    response = httpx.post(servers.url + "/v1/completions", content=raw, timeout=60,
                          headers={**AUTH, "content-type": "application/json"})
    FIGURES["requests"] += 1
    assert 400 <= response.status_code < 500, response.text


# --- issue 19, finding 1: the middleware reads every body as vLLM reads it ----------------------

FINDING_1 = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "logprobs": 5}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Once upon a time"}],
        "max_tokens": 4, "logprobs": True, "top_logprobs": 5}


def finite_per_step(choice: dict[str, Any]) -> list[int]:
    """Finite top logprobs at each generated position of one choice (completion or chat)."""
    logprobs = choice["logprobs"]
    if "top_logprobs" in logprobs:
        return [finite_top_logprobs(entry) for entry in logprobs["top_logprobs"]]
    return [finite_top_logprobs(entry["top_logprobs"]) for entry in logprobs["content"]]


def written(body: dict[str, Any], how: str) -> bytes:
    if how == "escaped":  # the finding's own spelling
        return (json.dumps(body)[:-1] + ', "\\u0062regman_top_k": 2}').encode()
    return json.dumps({**body, "bregman_top_k": 2}).encode(how)


@pytest.mark.parametrize("how", ["escaped", "utf-16", "utf-32", "utf-16-be"])
def test_bregman_fields_are_read_in_every_spelling_and_encoding(servers: Servers, how: str
                                                                ) -> None:
    """The finding's request (5-6 finite logprobs per step before: plain sampling) decodes with
    bregman_top_k=2 on completions and chat, however written; /tokenize refuses the field."""
    for path, body in (("/v1/completions", FINDING_1), ("/v1/chat/completions", CHAT)):
        response = post_raw(servers.url, path, written(body, how))
        assert response.status_code == 200, response.text
        steps = finite_per_step(response.json()["choices"][0])
        assert steps and set(steps) == {2}, (path, how, steps)
    tokenize = post_raw(servers.url, "/tokenize",
                        written({"model": MODEL, "prompt": "Once upon a time"}, how))
    assert "not supported on POST /tokenize" in assert_openai_error(tokenize,
                                                                    "bregman_top_k")["message"]


@pytest.mark.parametrize(("field", "param"), [('"logit_bias": {"42": NaN}', "logit_bias.42"),
                                              ('"length_penalty": NaN', "length_penalty")])
@pytest.mark.parametrize("codec", ["utf-8", "utf-16", "utf-32-le"])
def test_nan_is_refused_in_every_encoding(servers: Servers, field: str, param: str,
                                          codec: str) -> None:
    raw = f'{{"model": "{MODEL}", "prompt": "x", "max_tokens": 2, {field}}}'.encode(codec)
    assert_openai_error(post_raw(servers.url, "/v1/completions", raw), param)


# --- issue 19, finding 2: the key on /metrics ----------------------------------------------------

@pytest.mark.parametrize("path", ["/metrics", "/metrics/", "/metrics/foo"])
def test_a_fake_cors_preflight_does_not_skip_the_key(servers: Servers, path: str) -> None:
    """OPTIONS with Access-Control-Request-Method but no Origin is no preflight to Starlette:
    it needs the key (it answered the whole Prometheus text before). A real preflight is
    answered by vLLM's CORS layer (which allows no origin by default), never by /metrics."""
    fake = count(httpx.options(servers.url + path, timeout=60,
                               headers={"Access-Control-Request-Method": "GET"}))
    assert fake.status_code == 401 and "vllm:" not in fake.text
    real = count(httpx.options(servers.url + path, timeout=60, headers={
        "Origin": "https://example.com", "Access-Control-Request-Method": "GET"}))
    assert real.status_code == 400 and "vllm:" not in real.text
    assert openai_shaped(real), real.text


# --- issue 19, finding 3, and issue 27, finding 2: slow clients -----------------------------------

def test_slow_clients_that_reconnect_at_once_cannot_lock_others_out(servers: Servers) -> None:
    """The attack of issue 27, scaled to this server's cap of 64: 192 slow clients of its five
    kinds (idle connections, slow heads, slow bodies with and without the key, chunked
    trickles; a byte every 0.5 s), each connecting again 0.1 s after the server closes it. At
    200 connections against 600 such clients, 8 % of the legitimate requests were served (the
    connections younger than 1 s could not be closed for room). Two threads of completions
    for 5 s meanwhile: at least 95 % are served (issue 19's 300 trickling bodies, which did not
    reconnect, are one of the five kinds)."""
    figures = run_load(servers.url, KEY, slow=192, reconnect=0.1, trickle=0.5, seconds=5.0,
                       warmup=1.5, legit_threads=2)
    FIGURES["slow_clients"] = figures["slow_clients"]
    FIGURES["slow_connections"] = figures["slow_connections"]["opened"]
    FIGURES["served_while_slow"] = f"{figures['served']} of {figures['legit']}"
    FIGURES["requests"] += figures["legit"]
    FIGURES["5xx"] += figures["failures"].get("503", 0)
    assert figures["legit"] >= 10 and figures["share"] >= 0.95, figures
    assert httpx.get(servers.url + "/health", timeout=60).status_code == 200
    FIGURES["faults_survived"].append(f"{figures['slow_clients']} slow clients reconnecting")


# --- issue 19, finding 4: the routes that take the fields are vLLM's own --------------------------

def test_server_defaults_reach_the_batch_route(servers: Servers) -> None:
    """--default-mode primal --default-top-k 2: /v1/chat/completions/batch decodes with 2
    tokens per step like /v1/chat/completions (5 finite logprobs per step before)."""
    url = servers.with_defaults.url
    single = post(url, CHAT, "/v1/chat/completions")
    assert single.status_code == 200, single.text
    assert set(finite_per_step(single.json()["choices"][0])) == {2}
    batch = post(url, {**CHAT, "messages": [CHAT["messages"]] * 2}, "/v1/chat/completions/batch")
    assert batch.status_code == 200, batch.text
    choices = batch.json()["choices"]
    assert len(choices) == 2
    for choice in choices:
        assert set(finite_per_step(choice)) == {2}, choice["logprobs"]


def _properties(schema: dict[str, Any], node: dict[str, Any]) -> set[str]:
    """Property names a request schema admits ($ref, anyOf / oneOf / allOf followed)."""
    if "$ref" in node:
        node = schema["components"]["schemas"][node["$ref"].rsplit("/", 1)[-1]]
    names = set(node.get("properties", {}))
    for key in ("anyOf", "oneOf", "allOf"):
        for member in node.get(key, []):
            names |= _properties(schema, member)
    return names


def test_every_route_whose_body_has_vllm_xargs_takes_the_fields(servers: Servers) -> None:
    """Read from the live app's OpenAPI document: each POST route whose request model has
    vllm_xargs validates a top-level Bregman field (a 400 about its value, not "not supported"),
    and so do the batch route (no vllm_xargs of its own; it carries it over) and /invocations."""
    schema = httpx.get(servers.url + "/openapi.json", headers=AUTH, timeout=60).json()
    with_xargs, untyped = [], []
    for path, item in schema["paths"].items():
        post_op = item.get("post")
        if post_op is None:
            continue
        body = post_op.get("requestBody", {}).get("content", {}).get("application/json")
        if body is None:
            untyped.append(path)
        elif "vllm_xargs" in _properties(schema, body["schema"]):
            with_xargs.append(path)
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses",
            "/v1/messages"} <= set(with_xargs)
    assert set(untyped) <= REVIEWED_UNTYPED_POSTS, set(untyped) - REVIEWED_UNTYPED_POSTS
    for path in [*with_xargs, "/v1/chat/completions/batch", "/invocations"]:
        response = post(servers.url, {"bregman_mode": "bogus"}, path)
        error = assert_openai_error(response, "bregman_mode")
        assert "not supported" not in error["message"], (path, error)


# --- issue 19, finding 5: every error in OpenAI's shape -------------------------------------------

ERRORS = [("GET", "/nonexistent", None, {}, 404), ("GET", "/v1/completions", None, {}, 405),
          ("POST", "/health", None, {}, 405),
          ("POST", "/v1/completions", b'{"model": "m", "prompt": "\xff\xfe\xfd"}', {}, 400),
          ("POST", "/v1/completions", gzip.compress(json.dumps(FINDING_1).encode(), mtime=0),
           {"Content-Encoding": "gzip"}, 415),
          ("POST", "/v1/completions", b'{"prompt": ' + b"[" * 1500 + b"]" * 1500 + b"}", {}, 400),
          ("POST", "/tokenize", b"[" * 1500 + b"]" * 1500, {}, 400)]


@pytest.mark.parametrize(("method", "path", "raw", "headers", "status"), ERRORS)
def test_vllms_own_errors_are_in_openai_shape(servers: Servers, method: str, path: str,
                                              raw: bytes | None, headers: dict[str, str],
                                              status: int) -> None:
    """vLLM answered these {"detail": ...} (15 of 291 hostile requests)."""
    response = count(httpx.request(method, servers.url + path, content=raw, timeout=60,
                                   headers={**AUTH, "Content-Type": "application/json",
                                            **headers}))
    assert response.status_code == status, response.text
    assert openai_shaped(response) and "detail" not in response.json(), response.text


# --- the fuzz: every way vLLM reads a body --------------------------------------------------------

ENCODED_VALUES = st.sampled_from([2, 1, 0, 1.5, "dual", "bogus", "inf", None, math.nan,
                                  math.inf, {"42": math.nan}, {"42": 1.0}, 10**30])


@st.composite
def encoded_requests(draw: Any) -> tuple[str, dict[str, Any], str]:
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]))
    if path == "/tokenize":
        body: dict[str, Any] = {"model": MODEL, "prompt": PROMPT}
    elif path == "/v1/chat/completions":
        body = {**CHAT, "max_tokens": 3, "top_logprobs": 3, "seed": 11}
    else:
        body = {**FINDING_1, "max_tokens": 3, "logprobs": 3, "seed": 11}
    fields = draw(st.dictionaries(st.sampled_from(
        [*BREGMAN_FIELDS, "length_penalty", "logit_bias"]), ENCODED_VALUES, max_size=3))
    if draw(st.booleans()):
        fields = {"vllm_xargs": fields}
    return path, {**body, **fields}, draw(st.sampled_from(BODY_ENCODINGS))


def _outcome(response: httpx.Response, path: str) -> tuple[Any, ...]:
    if response.status_code >= 400:
        return response.status_code, response.json()["error"]["param"]
    if path == "/tokenize":
        return response.status_code, response.json()["tokens"]
    choice = response.json()["choices"][0]
    return response.status_code, finite_per_step(choice), choice.get("text", choice.get(
        "message", {}).get("content"))


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=encoded_requests())
def test_fuzz_every_encoding_decodes_like_plain_utf8(servers: Servers,
                                                     case: tuple[str, dict[str, Any], str]
                                                     ) -> None:
    """A body written any way vLLM's json.loads reads it (escaped keys, UTF-16/32 with or
    without BOM, a UTF-8 BOM, duplicate keys) gets exactly the answer of its plain UTF-8 form,
    down to the tokens of a seeded generation; a gzip body is a 415."""
    path, body, how = case
    raw, headers = encode_body(body, how)
    response = post_raw(servers.url, path, raw, headers)
    assert response.status_code < 500 and (response.status_code < 400
                                            or openai_shaped(response)), response.text
    if how == "gzip":
        assert response.status_code == 415
        return
    plain, plain_headers = encode_body(body, "utf-8")
    expected = post_raw(servers.url, path, plain, plain_headers)
    assert _outcome(response, path) == _outcome(expected, path), (how, body)


# --- the fuzz: every method on every route ----------------------------------------------------

_ROUTES: list[str] = []
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


def _every_route(url: str) -> list[str]:
    if not _ROUTES:
        schema = httpx.get(url + "/openapi.json", headers=AUTH, timeout=60).json()
        paths = [path.replace("{", "").replace("}", "") for path in schema["paths"]]
        _ROUTES.extend(sorted({*paths, "/metrics", "/metrics/", "/metrics/foo", "/nonexistent",
                               "/health", "/v1/completions/", "/openapi.json", "/docs"}))
    return _ROUTES


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_every_method_on_every_route(servers: Servers, data: Any) -> None:
    """Never a 5xx; every error in OpenAI's shape; without the key a 401 on every route but
    /health, unless it is a real CORS preflight, which vLLM's CORS layer answers."""
    path = data.draw(st.sampled_from(_every_route(servers.url)))
    method = data.draw(st.sampled_from(METHODS))
    keyed, origin, request_method = (data.draw(st.booleans()) for _ in range(3))
    headers = {**(AUTH if keyed else {}),
               **({"Origin": "https://example.com"} if origin else {}),
               **({"Access-Control-Request-Method": "POST"} if request_method else {})}
    kind = data.draw(st.sampled_from(["none", "completion", "garbage", "utf-16 bregman"]))
    raw = {"none": None, "garbage": b"\x00\xff{[",
           "completion": json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 1}).encode(),
           "utf-16 bregman": json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 1,
                                         "bregman_top_k": 2}).encode("utf-16")}[kind]
    if raw is not None:
        headers["Content-Type"] = "application/json"
    response = count(httpx.request(method, servers.url + path, content=raw, headers=headers,
                                   timeout=60))
    assert response.status_code < 500, (method, path, response.text)
    assert response.status_code < 400 or openai_shaped(response), (method, path, response.text)
    preflight = method == "OPTIONS" and origin and request_method
    if preflight:
        assert response.status_code == 400 and "vllm:" not in response.text  # no origin allowed
    elif not keyed and path != "/health":
        assert response.status_code == 401, (method, path, response.status_code)


# --- the fuzz: every request field --------------------------------------------------------------

JSON_SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30)
                | st.sampled_from(["inf", "-inf", "nan", "1e999", "²", "١", " 5 ", "0x10",
                                   "primal", "dual", "off"]))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda children: st.lists(children, max_size=3)
                           | st.dictionaries(st.text(max_size=8), children, max_size=3),
                           max_leaves=6)
BREGMAN_FIELDS = ["bregman_mode", "bregman_alpha", "bregman_lambda", "bregman_top_k",
                  "bregman_k_max"]
OTHER_FIELDS = ["temperature", "top_k", "top_p", "min_p", "seed", "n", "logprobs", "stop"]


@st.composite
def request_bodies(draw: Any) -> tuple[str, dict[str, Any]]:
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/invocations"]))
    body: dict[str, Any] = {"model": MODEL, "max_tokens": draw(st.integers(1, 3))}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = PROMPT
    fields = draw(st.lists(st.sampled_from(BREGMAN_FIELDS + OTHER_FIELDS + ["vllm_xargs"]),
                           min_size=1, max_size=4, unique=True))
    for field in fields:
        if field == "vllm_xargs":
            body[field] = draw(st.dictionaries(st.sampled_from(BREGMAN_FIELDS), JSON_VALUES,
                                               max_size=3) | JSON_VALUES)
        elif field in BREGMAN_FIELDS:
            body[field] = draw(JSON_VALUES)
        else:
            body[field] = draw(JSON_SCALARS)
    return path, body


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=request_bodies())
def test_fuzz_every_field_never_a_5xx(servers: Servers, case: tuple[str, dict[str, Any]]
                                      ) -> None:
    path, body = case
    response = post(servers.url, body, path)
    assert response.status_code < 500, (body, response.text)
    if response.status_code == 200:
        _assert_an_answer_to(path, body, response.json())
    if response.status_code >= 400:
        error = response.json()["error"]
        assert {"message", "type", "param", "code"} <= set(error), response.text
        bad = [key for key in BREGMAN_FIELDS if key in body or key in str(body.get("vllm_xargs"))]
        if error["type"] == "invalid_request_error" and error["param"] in BREGMAN_FIELDS:
            assert error["param"] in bad


def _assert_an_answer_to(path: str, body: dict[str, Any], answer: dict[str, Any]) -> None:
    """A 200 of the fuzz answers what was asked: the route's object (a chat completion for
    messages, a text completion for a prompt), choices indexed 0..n-1 each ended by length or
    a stop, and no more tokens than max_tokens per choice."""
    chat = "messages" in body
    assert answer["object"] == ("chat.completion" if chat else "text_completion"), answer
    choices = answer["choices"]
    assert choices and sorted(c["index"] for c in choices) == list(range(len(choices))), answer
    for choice in choices:
        assert choice["finish_reason"] in ("length", "stop"), answer
        assert isinstance(choice["message"]["content"] if chat else choice["text"], str), answer
    assert 0 < answer["usage"]["completion_tokens"] <= body["max_tokens"] * len(choices), answer


def test_healthy_after_the_fuzz(servers: Servers) -> None:
    assert httpx.get(servers.url + "/health", timeout=60).status_code == 200
    response = post(servers.url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 3,
                                  "bregman_alpha": 1.5})
    assert response.status_code == 200


# --- load ----------------------------------------------------------------------------------------

def test_load_240_requests_at_concurrency_32(servers: Servers) -> None:
    configs = [{"bregman_alpha": 1.5}, {"bregman_mode": "dual", "bregman_alpha": 3},
               {"bregman_top_k": 5, "bregman_alpha": "inf"}, {"bregman_mode": "off"}, {}]

    retried: list[int] = []

    def send(body: dict[str, Any]) -> int:
        with httpx.Client(timeout=120, headers=AUTH) as client:
            if body["stream"]:
                with client.stream("POST", servers.url + "/v1/completions", json=body) as r:
                    lines = [line for line in r.iter_lines() if line]
                    if r.status_code != 200:
                        return r.status_code
                    return 200 if lines[-1] == "data: [DONE]" else 599  # (cut short)
            return client.post(servers.url + "/v1/completions", json=body).status_code

    def one(i: int) -> int:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0,
                "stream": i % 2 == 0, **configs[i % len(configs)]}
        status = send(body)
        if status == 408:
            # This module's head deadline is 3 s (its own tests' limit); 32 client threads on a
            # loaded 2-core machine once sent a head later than that (CI, 2026-11-27). The
            # official OpenAI client retries a 408; so does this one, once, and counts it.
            retried.append(i)
            status = send(body)
        return status

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        statuses = list(pool.map(one, range(240)))
    FIGURES["load_requests"] += len(statuses)
    FIGURES["load_ok"] += statuses.count(200)
    FIGURES["load_retried_408"] += len(retried)
    FIGURES["lost"] += len(statuses) - statuses.count(200)  # no complete answer
    FIGURES["requests"] += len(statuses) + len(retried)
    FIGURES["5xx"] += sum(status >= 500 for status in statuses)
    assert statuses.count(200) == 240, collections.Counter(statuses)
    assert len(retried) <= 5, retried  # (a late head now and then, not a pattern)


# --- finding 6: shutdown and faults --------------------------------------------------------------

def _in_flight(url: str) -> tuple[threading.Thread, threading.Thread, dict[str, Any]]:
    """A long stream and a long non-streaming request, running."""
    results: dict[str, Any] = {}
    long = {"model": MODEL, "prompt": PROMPT, "max_tokens": LONG_TOKENS, "ignore_eos": True,
            "n": 4}

    def stream() -> None:
        with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True},
                          headers=AUTH, timeout=120) as response:
            results["stream"] = (response.status_code,
                                 [line for line in response.iter_lines() if line])

    def waiting() -> None:
        response = httpx.post(url + "/v1/completions", json=long, headers=AUTH, timeout=120)
        results["plain"] = (response.status_code, response.text)

    threads = [threading.Thread(target=stream), threading.Thread(target=waiting)]
    for thread in threads:
        thread.start()
    # Both are running once the engine runs all their sequences (n each): a fixed sleep was
    # once too short on a loaded machine, and the stream came after the signal (a new request's
    # 503, the right answer to it).
    deadline = time.monotonic() + 60
    while prometheus_value(scrape(url, AUTH), "vllm:num_requests_running", 0.0) < 2 * long["n"]:
        assert time.monotonic() < deadline, "the two long requests never ran"
        time.sleep(0.1)
    return threads[0], threads[1], results


def _assert_ended_in_openai_shape(results: dict[str, Any], code: str) -> None:
    """Both in-flight requests got an ending a client can read: a stream's error event and
    [DONE], a 503 with the reason. Anything else counts as lost."""
    ended = 0
    if "stream" in results and results["stream"][1][-1:] == ["data: [DONE]"]:
        ended += 1
    if "plain" in results and results["plain"][0] == 503:
        ended += 1
    FIGURES["lost"] += 2 - ended
    status, lines = results["stream"]
    assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == code and error["type"] == "server_error"
    status, text = results["plain"]
    assert status == 503, text
    assert json.loads(text)["error"]["code"] == code


def test_documented_settings_reach_a_live_server(servers: Servers) -> None:
    """`SETTINGS` on a real bregman-serve: a request without Bregman fields decodes exactly as
    the same seeded request does on the main server with the defaults written as its fields
    (the same tokens and top logprobs: every default reached the engine), at most k_max = 3
    tokens a step holding all the mass (the main server keeps more without fields); a body
    above --max-body-bytes is a 413; the engine runs with VLLM_CPU_KVCACHE_SPACE=1 from
    --cpu-kvcache-space-gib."""
    server = servers.dying
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 3,
            "logprobs": 5}
    fields = {"bregman_mode": "dual", "bregman_alpha": 3, "bregman_lambda": 0.001,
              "bregman_k_max": 3}
    by_default = post(server.url, body)
    explicit = post(servers.url, {**body, **fields})
    plain = post(servers.url, body)
    assert by_default.status_code == explicit.status_code == plain.status_code == 200
    got, want = by_default.json()["choices"][0], explicit.json()["choices"][0]
    assert got["text"] == want["text"]
    for step, twin in zip(got["logprobs"]["top_logprobs"], want["logprobs"]["top_logprobs"],
                          strict=True):
        kept = {token: value for token, value in step.items() if value > -9000}
        assert 1 <= len(kept) <= 3 and abs(sum(map(math.exp, kept.values())) - 1) < 1e-4, step
        assert kept.keys() == {t for t, v in twin.items() if v > -9000}, (step, twin)
        assert all(abs(kept[token] - twin[token]) < 1e-5 for token in kept), (step, twin)
    assert max(finite_per_step(plain.json()["choices"][0])) > 3
    large = post(server.url, {**body, "prompt": "x" * 9000})
    assert large.status_code == 413 and openai_shaped(large), large.text
    # (vLLM's CPU worker says what it read from VLLM_CPU_KVCACHE_SPACE, which the server set
    # before starting it: the engine is forked, so /proc's environ shows the server's start)
    assert re.search(r"Explicitly set \(1\.0/[\d.]+\) GiB for KV cache",
                     server.log_tail(10**7)), "the engine did not get a 1 GiB KV cache"


def test_sigterm_drains_then_ends_open_requests(servers: Servers) -> None:
    server = servers.draining
    stream, waiting, results = _in_flight(server.url)
    server.remember_descendants()
    os.kill(server.pid, signal.SIGTERM)
    stream.join(60)
    waiting.join(60)
    _assert_ended_in_openai_shape(results, "shutdown")
    assert server.process is not None and server.process.wait(60) == 0
    assert not server.leftovers(), "engine processes left behind"
    FIGURES["faults_survived"].append("SIGTERM with requests in flight")


def test_engine_death_is_a_503_then_exit_3_with_nothing_left(servers: Servers) -> None:
    server = servers.dying
    stream, waiting, results = _in_flight(server.url)
    engines = [pid for pid in server.remember_descendants() if comm(pid).startswith("VLLM::Eng")]
    assert engines, "no engine process found"
    for pid in engines:
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    health = None
    # Until /health says 503: inside the server's window of 503s (DYING), whatever the time a
    # loaded machine takes to notice (a 1.5 s limit with three engines on two cores was the
    # machine's speed, not the server's; the 0.2 s health poll is the unit tests').
    while time.monotonic() - killed < 60:
        try:
            health = httpx.get(server.url + "/health", timeout=5).status_code
        except httpx.HTTPError:
            health = None
        if health == 503:
            break
        assert server.process is not None and server.process.poll() is None, \
            "the server exited before its 503 was seen"
        time.sleep(0.05)
    assert health == 503
    response = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=10,
                          json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
    stream.join(60)
    waiting.join(60)
    _assert_ended_in_openai_shape(results, "engine_dead")
    assert server.process is not None and server.process.wait(60) == 3
    # The server stops what is left (the killed engine core's worker) before it exits.
    assert not [pid for pid in server.seen if alive(pid)], "engine processes left behind"
    FIGURES["faults_survived"].append("engine process killed")
