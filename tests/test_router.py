"""Replicas behind vLLM's router: two real `bregman-serve` replicas (the tiny model, one engine
each) behind the real `vllm-router` (PyPI, pinned in requirements/dev.txt), on loopback.

What deploy/README.md says about the router is checked here:

* the top-level ``bregman_*`` fields reach both replicas' processors through the router (the
  top-k oracle: with ``--logprobs-mode processed_logprobs`` a token outside the support has
  logprob -9999, so ``bregman_top_k=2`` leaves at most 2 tokens above -9000 at every step; the
  same requests without the field keep 5);
* a bad field is answered by the replica's OpenAI-shaped 400, unchanged by the router;
* streams pass through the router chunk by chunk;
* the API key: the replicas hold it, the router passes the client's ``Authorization`` on to
  them (the documented scheme); the router's own ``--api-key`` is what it sends on the routes
  it does not know (``/tokenize``, ``/v1/responses``, ``/metrics``...), for any client, so it
  stays unset;
* one replica stopped (SIGTERM to its whole process group, with a stream open on it): the
  stream still ends normally (it drains), and every later request is answered by the other;
* ``bregman-serve`` prints its ready line, and a SIGKILL of it leaves no process behind.

The module starts two engines (one per replica), shared by every test.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from .test_server_support import (
    ServerProcess,
    alive,
    assert_stream_ran_to_length,
    finished_requests,
    finite_top_logprobs,
    free_port,
    prometheus_value,
    require_tiny_model,
    scrape,
    shut_down_all,
    top_k_oracle,
)

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

MODEL = "models/tiny-llama"
PROMPT = "ROMEO:\n"
KEY = secrets.token_hex(8)
AUTH = {"Authorization": f"Bearer {KEY}"}
TOP = 5
#: Replica B's drain: about 4x what its stream needs after the signal on a 2-core machine at
#: half speed (a 2000-token stream took 118 s there and outlived a 120 s grace).
GRACE = 240
ENGINE = ["--logprobs-mode", "processed_logprobs", "--enforce-eager", "--max-model-len", "2048",
          "--max-num-seqs", "32", "--graceful-timeout", str(GRACE)]
READY = re.compile(r"^bregman-serve ready on (http://\S+) \(vLLM (\S+), model (\S+)\)$", re.M)

#: Figures for the closing note (printed by tests/conftest.py).
FIGURES: dict[str, Any] = {}


def router_binary() -> str:
    path = Path(sys.executable).with_name("vllm-router")
    if not path.is_file():
        pytest.fail("vllm-router is missing: it comes with requirements/dev.txt "
                    "(scripts/bootstrap.sh installs it)")
    return str(path)


class Router:
    """One ``vllm-router`` process (a Rust binary behind a Python launcher), in a session of
    its own, round-robin over ``workers``."""

    def __init__(self, workers: list[str], log_path: Path, *extra: str) -> None:
        self.port = free_port()
        self.log_path = log_path
        command = [router_binary(), "--host", "127.0.0.1", "--port", str(self.port),
                   "--worker-urls", *workers, "--policy", "round_robin",
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                   "--health-check-interval-secs", "1", "--log-level", "warning", *extra]
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log_path.read_text(errors="replace")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/readiness", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        pytest.fail(f"router not ready:\n{self.log_path.read_text(errors='replace')[-3000:]}")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class Deployment:
    def __init__(self, replicas: list[ServerProcess], router: Router, logs: Path) -> None:
        self.replicas = replicas
        self.router = router
        self.logs = logs

    def client(self, api_key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.router.url + "/v1", api_key=api_key, max_retries=0,
                             timeout=120)

    def replica_metrics(self, replica: ServerProcess) -> str:
        return scrape(replica.url, AUTH)

    def finished(self, replica: ServerProcess) -> float:
        return finished_requests(self.replica_metrics(replica))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    require_tiny_model()
    logs = tmp_path_factory.mktemp("router-logs")
    replicas = [ServerProcess(["--model", MODEL, "--api-key", KEY, *ENGINE],
                              logs / f"replica-{name}.log") for name in ("a", "b")]
    router = None
    started = time.monotonic()
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.wait_healthy(timeout=600)
        router = Router([replica.url for replica in replicas], logs / "router.log")
        router.wait_ready()
        FIGURES["start_seconds"] = round(time.monotonic() - started, 1)
        yield Deployment(replicas, router, logs)
    finally:
        if router is not None:
            router.stop()
        # The stop tests end replicas themselves and check how; nothing may be left.
        shut_down_all(replicas)


def sample(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0,
            "logprobs": TOP, **extra}


def test_each_replica_prints_its_ready_line(deployment: Deployment) -> None:
    from vllm.version import __version__

    for replica in deployment.replicas:
        lines = READY.findall(replica.log_tail(10**7))
        assert lines == [(replica.url, __version__, MODEL)], lines


def test_bregman_fields_honoured_on_both_replicas(deployment: Deployment) -> None:
    """The top-k oracle through the router: 16 requests, round-robin over both replicas."""
    before = [deployment.finished(replica) for replica in deployment.replicas]
    client = deployment.client()

    def counts(extra_body: dict[str, Any]) -> list[int]:
        response = client.completions.create(**sample(), extra_body=extra_body)
        return [finite_top_logprobs(entry) for entry in response.choices[0].logprobs.top_logprobs]

    FIGURES["oracle"] = top_k_oracle(counts, requests=16, steps=6, threads=4)
    served = [deployment.finished(replica) - start
              for replica, start in zip(deployment.replicas, before, strict=True)]
    FIGURES["oracle"]["served_per_replica"] = served
    assert sum(served) == 32 and min(served) >= 8, f"round-robin over both replicas: {served}"


def test_a_bad_field_is_the_replicas_openai_400(deployment: Deployment) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        deployment.client().completions.create(**sample(), extra_body={"bregman_top_k": 0})
    error = raised.value.body
    assert isinstance(error, dict) and error["param"] == "bregman_top_k", error
    assert error["type"] == "invalid_request_error" and "bregman_top_k" in error["message"]
    # The same body straight to a replica: the router adds nothing to the answer.
    direct = httpx.post(deployment.replicas[0].url + "/v1/completions", headers=AUTH,
                        json=sample(bregman_top_k=0), timeout=60)
    assert direct.status_code == 400 and direct.json()["error"] == error


def test_streaming_through_the_router(deployment: Deployment) -> None:
    kwargs = sample(max_tokens=12, logprobs=None, seed=7)
    extra = {"bregman_mode": "dual", "bregman_alpha": "inf", "bregman_top_k": 3}
    client = deployment.client()
    chunks = list(client.completions.create(**kwargs, extra_body=extra, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    # Several chunks, not one buffered answer (vLLM merges the tokens a busy API server has not
    # sent yet into one chunk, so the count varies with the machine's load).
    assert len(texts) >= 2, "chunk by chunk, not one buffered answer"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # Seeded: the same request, not streamed, says the same, on either replica.
    for _ in deployment.replicas:
        assert client.completions.create(**kwargs, extra_body=extra).choices[0].text == \
            "".join(texts)


def test_the_key_scheme_with_the_router(deployment: Deployment, tmp_path: Path) -> None:
    """The documented scheme: the replicas hold the key, the router passes the client's
    Authorization header on. Without it: 401 in OpenAI's shape, from the replica."""
    router = deployment.router.url
    body = sample(max_tokens=1, logprobs=None)
    chat = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    for path, payload in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        refused = httpx.post(router + path, json=payload, timeout=60)
        assert refused.status_code == 401, (path, refused.text)
        assert refused.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.post(router + path, json=payload, timeout=60,
                           headers={"Authorization": "Bearer wrong"})
        assert wrong.status_code == 401, path
        assert httpx.post(router + path, json=payload, headers=AUTH, timeout=60
                          ).status_code == 200, path
    # Routes the router does not know it forwards without the client's header: refused by the
    # replicas even with the key (call them on a replica, deploy/README.md).
    for method, path in (("POST", "/tokenize"), ("GET", "/metrics")):
        answer = httpx.request(method, router + path, headers=AUTH, timeout=60,
                               json={"model": MODEL, "prompt": PROMPT} if method == "POST"
                               else None)
        assert answer.status_code == 401, (path, answer.text)
    # Why the router's own --api-key stays unset: it sends that key on those routes for any
    # client, so a client without a key would pass the replicas' check.
    keyed = Router([replica.url for replica in deployment.replicas], tmp_path / "keyed.log",
                   "--api-key", KEY)
    try:
        keyed.wait_ready()
        opened = httpx.post(keyed.url + "/tokenize", json={"model": MODEL, "prompt": PROMPT},
                            timeout=60)
        assert opened.status_code == 200 and opened.json()["tokens"], opened.text
    finally:
        keyed.stop()
    # The router's own routes need no key at all (keep its port private: deploy/README.md).
    workers = httpx.get(router + "/list_workers", timeout=10).json()["urls"]
    assert sorted(workers) == sorted(replica.url for replica in deployment.replicas)


def _stream(url: str, results: dict[int, Any], index: int) -> None:
    """A long streamed completion through ``url``: (status, its SSE lines, when it ended). Read
    in 64 KiB pieces (no sleeping in between: a reader that sleeps per event lags minutes
    behind a stream of 8,000 events)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "n": 8, "ignore_eos": True,
            "stream": True}
    chunks: list[bytes] = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH,
                          timeout=GRACE + 60) as response:
            chunks.extend(response.iter_bytes(chunk_size=65536))
        lines = [line for line in b"".join(chunks).decode().splitlines() if line]
        results[index] = (response.status_code, lines, time.monotonic())
    except httpx.HTTPError as error:
        results[index] = (None, [repr(error)], time.monotonic())


def test_one_replica_stopped_every_later_request_answered(deployment: Deployment) -> None:
    """SIGTERM to the whole process group of replica B (``kill -- -PGID``) while a stream runs
    on it: B drains (the stream ends normally), exits 0 and leaves nothing behind; every
    request sent through the router from the signal on is answered."""
    stopped = deployment.replicas[1]
    results: dict[int, Any] = {}
    streams: list[threading.Thread] = []

    def on_b() -> bool:
        return prometheus_value(deployment.replica_metrics(stopped),
                                "bregman_server_requests_in_flight", default=0.0,
                                endpoint="/v1/completions") >= 1

    # Round-robin: of two streams in a row, one is on replica B (each runs for seconds).
    while not on_b():
        assert len(streams) < 4, f"no stream reached replica B: {sorted(results)}"
        streams.append(threading.Thread(target=_stream, args=(deployment.router.url, results,
                                                              len(streams))))
        streams[-1].start()
        time.sleep(0.2)
    assert streams, "replica B had a request in flight before any stream"
    stopped.remember_descendants()
    assert stopped.process is not None
    exit_seen: list[float] = []
    watcher = threading.Thread(target=lambda: (stopped.process.wait(),  # type: ignore[union-attr]
                                               exit_seen.append(time.monotonic())))
    signalled = time.monotonic()
    os.killpg(os.getpgid(stopped.pid), signal.SIGTERM)
    watcher.start()

    def one(i: int) -> int:
        return httpx.post(deployment.router.url + "/v1/completions", headers=AUTH, timeout=120,
                          json=sample(max_tokens=2, logprobs=None, bregman_top_k=2)).status_code

    statuses = [one(i) for i in range(20)]
    for thread in [*streams, watcher]:
        thread.join(GRACE + 60)
        assert not thread.is_alive(), f"a stream or replica B did not end in {GRACE + 60} s"
    code = stopped.process.wait()
    exited = exit_seen[0] - signalled
    left = stopped.leftovers()
    # Every stream ended (one of them was on replica B when it got the signal).
    assert sorted(results) == list(range(len(streams))), sorted(results)
    ends = []
    for status, lines, ended in results.values():
        assert status == 200, lines[-3:]
        assert_stream_ran_to_length(lines, 8)
        ends.append(round(ended - signalled, 1))
    FIGURES["replica_stop"] = {"later_requests": len(statuses), "answered_200":
                               statuses.count(200), "stream_ends_after_signal_s": ends,
                               "exit_code": code, "exit_after_s": round(exited, 1)}
    assert statuses == [200] * 20, statuses
    assert code == 0 and not left, (code, left)


def test_sigkill_of_bregman_serve_stops_the_server(deployment: Deployment) -> None:
    """``kill -9`` reaches only bregman-serve's own process: the server it runs (in a session
    of its own) gets SIGTERM from the kernel (parent-death signal), drains and stops its
    engine. Nothing is left behind."""
    replica = deployment.replicas[0]
    replica.remember_descendants()
    assert replica.process is not None
    os.killpg(os.getpgid(replica.pid), signal.SIGKILL)
    replica.process.wait(30)
    left = replica.leftovers(grace=60)
    assert not left, f"left behind: {sorted(left)}"
    assert not alive(replica.pid)

