"""Live test of the embedded vLLM child dying under the server (its own server instance).

The vLLM API-server process is SIGKILLed (a crash: its engine process is not told) while a
stream is open. Expected: the stream ends with an OpenAI-shaped error event and ``[DONE]``
instead of hanging; /health answers 503 with the reason; new requests get a 503; after
``--child-exit-grace`` seconds the server exits with status 3, and no process of the vLLM
group (the orphaned engine included) survives.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from .test_server_support import (
    ServerProcess,
    alive,
    descendants,
    require_tiny_model,
    server_environment,
)

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]

MODEL = "models/tiny-llama"
GRACE = 20.0  # long enough for the checks below on a loaded machine


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_tiny_model()
    log = tmp_path_factory.mktemp("child-death") / "server.log"
    process = ServerProcess(["--model", MODEL, "--child-exit-grace", str(GRACE),
                             "--enforce-eager"], log,
                            env=server_environment())
    try:
        process.start().wait_healthy(timeout=480)
        yield process
    finally:
        process.stop(timeout=30)
        process.kill_everything()


def vllm_api_server_pid(server: ServerProcess) -> int:
    for pid in descendants(server.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if b"vllm.entrypoints.openai.api_server" in cmdline.read():
                    return pid
        except FileNotFoundError:
            continue
    raise AssertionError("no vLLM child found")


def test_child_death_is_reported_and_the_server_exits(server: ServerProcess) -> None:
    child = vllm_api_server_pid(server)
    group = os.getpgid(child)
    assert group == child and group != os.getpgid(server.pid)  # its own process group
    server.remember_descendants()
    body = {"model": MODEL, "prompt": "ROMEO:\n", "max_tokens": 2000, "ignore_eos": True,
            "stream": True, "bregman_alpha": 2.0}
    events: list[str] = []
    started = killed = time.monotonic()
    with httpx.Client(timeout=httpx.Timeout(30, read=15)) as client, client.stream(
            "POST", server.url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line)
            if len(events) == 10:
                os.kill(child, signal.SIGKILL)  # the API server only: a crash
                killed = time.monotonic()
    # The stream ended (no hang) with an error event, then [DONE].
    assert time.monotonic() - started < 20
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["type"] == "upstream_error" and error["message"]
    assert not any("Traceback" in event for event in events)

    health = httpx.get(server.url + "/health", timeout=15)
    checked = time.monotonic() - killed
    assert health.status_code == 503, health.text
    assert health.json()["status"] == "unavailable"
    assert "-9" in health.json()["reason"] and "-9" in health.json()["vllm_child"]
    # Still inside the grace period (a loaded CI machine can stall this client for seconds).
    assert time.monotonic() - killed < GRACE, f"/health took until {checked:.1f} s after the kill"
    response = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "upstream_unavailable"

    # Exit status 3 after the grace period, and nothing of vLLM left.
    assert server.process is not None
    server.process.wait(GRACE + 30)
    assert server.process.returncode == 3, server.log_tail()
    left = server.leftovers()
    assert not left, f"left behind: {sorted(left)}"
    assert not alive(child)
