#!/usr/bin/env python
"""What the server adds per request (a script, not a timed test), two measurements in one run:

(a) In-process middleware: `BregmanMiddleware` around a stub ASGI app (reads the body, answers a
    small JSON) against the stub alone, called directly on one event loop (no sockets, so the
    difference is the middleware's own cost): a completion body without Bregman fields (passed
    through unparsed) and one with them (parsed, validated, mapped into ``vllm_xargs``).
    Calls alternate between the two paths. Target: at most 0.3 ms added at p50.

(b) Gateway: one vLLM OpenAI server on the tiny model, and ``bregman-serve --upstream`` in front
    of it; the same completions sent directly and through the gateway, alternating, one at a time
    (the direct requests carry in ``vllm_xargs`` exactly what the gateway writes there):
    non-streaming latency, and time to the first token of a stream. Target: at most 3 ms added at
    p50. Also the gateway's CPU time per request (/proc).

Usage: python benchmarks/bench_server.py [--model models/tiny-llama] [--requests 200]
       [--asgi-calls 20000] [--vllm-url http://127.0.0.1:8001] [--skip-gateway]

Starting vLLM on the tiny model takes about a minute on an idle 2-core machine (five under heavy
load); the measurements take under a minute. Exit status 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
MIDDLEWARE_TARGET_MS = 0.3
GATEWAY_TARGET_MS = 3.0
BREGMAN = {"bregman_mode": "primal", "bregman_alpha": 1.5, "bregman_lambda": 0.01}


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


# --- (a) the middleware alone ---------------------------------------------------------------------

async def _stub(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """What any app does: read the body, answer a small JSON."""
    while True:
        message = await receive()
        if not message.get("more_body", False):
            break
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}", "more_body": False})


def _scope(body: bytes) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "",
            "query_string": b"", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000),
            "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"authorization", b"Bearer sk-bench"), (b"accept", b"*/*")]}


async def _measure_middleware(calls: int) -> list[dict[str, Any]]:
    from bregman_server.middleware import BregmanMiddleware
    from bregman_server.settings import ServerSettings

    settings = ServerSettings(api_key="sk-bench")
    wrapped = BregmanMiddleware(_stub, settings=settings)
    prompt = {"model": "m", "prompt": "ROMEO:\n" * 20, "max_tokens": 16, "temperature": 1.0}
    rows = []
    for label, payload in (("no Bregman fields", prompt), ("Bregman fields mapped",
                                                           {**prompt, **BREGMAN})):
        body = json.dumps(payload).encode()
        scope = _scope(body)
        statuses: list[int] = []

        async def receive(body: bytes = body) -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any], statuses: list[int] = statuses) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        samples: dict[str, list[float]] = {"direct": [], "wrapped": []}
        apps = {"direct": _stub, "wrapped": wrapped}
        clock = time.perf_counter
        for index in range(calls + 200):
            order = ("direct", "wrapped") if index % 2 == 0 else ("wrapped", "direct")
            for name in order:
                started = clock()
                await apps[name](dict(scope), receive, send)
                if index >= 200:  # warm-up not recorded
                    samples[name].append(clock() - started)
        assert set(statuses) == {200}, set(statuses)
        rows.append({"part": "middleware (ASGI)", "metric": label, **samples,
                     "target": MIDDLEWARE_TARGET_MS})
    return rows


# --- (b) the gateway in front of vLLM -------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT, start_new_session=True)


def wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"{url} exited with {process.returncode}; log:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    sys.exit(f"{url} not healthy after {timeout:g} s; log:\n{log.read_text()[-3000:]}")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def completion(model: str, via_gateway: bool, stream: bool, max_tokens: int) -> bytes:
    payload: dict[str, Any] = {"model": model, "prompt": "ROMEO:\n", "max_tokens": max_tokens,
                               "temperature": 1.0, "seed": 0, "stream": stream}
    if via_gateway:
        payload.update(BREGMAN)  # top-level fields: the gateway validates and maps them
    else:
        payload["vllm_xargs"] = dict(BREGMAN)  # what the gateway sends
    return json.dumps(payload).encode()


async def one_request(client: httpx.AsyncClient, url: str, body: bytes, stream: bool) -> float:
    """Seconds to the whole answer (non-streaming) or to the first text chunk (streaming)."""
    headers = {"content-type": "application/json"}
    started = time.perf_counter()
    if not stream:
        response = await client.post(url, content=body, headers=headers)
        response.raise_for_status()
        return time.perf_counter() - started
    first = None
    async with client.stream("POST", url, content=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {") and '"text"' in line:
                first = time.perf_counter() - started
    assert first is not None, "no token in the stream"
    return first


async def _measure_gateway(direct: str, gateway: str, model: str, requests: int,
                           max_tokens: int, gateway_pid: int) -> list[dict[str, Any]]:
    rows = []
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        for stream in (False, True):
            urls = {"direct": direct + "/v1/completions", "wrapped": gateway + "/v1/completions"}
            bodies = {name: completion(model, name == "wrapped", stream, max_tokens)
                      for name in urls}
            for name in urls:  # warm-up, not recorded
                for _ in range(5):
                    await one_request(client, urls[name], bodies[name], stream)
            samples: dict[str, list[float]] = {"direct": [], "wrapped": []}
            gateway_cpu = 0.0
            for index in range(requests):
                order = ("direct", "wrapped") if index % 2 == 0 else ("wrapped", "direct")
                for name in order:
                    before = cpu_seconds(gateway_pid)
                    samples[name].append(await one_request(client, urls[name], bodies[name],
                                                           stream))
                    if name == "wrapped":
                        gateway_cpu += cpu_seconds(gateway_pid) - before
            rows.append({"part": "gateway (vLLM tiny)",
                         "metric": "TTFT (stream)" if stream else "latency (non-stream)",
                         **samples, "target": GATEWAY_TARGET_MS,
                         "cpu_ms": gateway_cpu / requests * 1e3})
    return rows


def measure_gateway(args: argparse.Namespace) -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BREGMAN_")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    env.pop("VLLM_API_KEY", None)
    logs = Path(tempfile.mkdtemp(prefix="bench_server_"))
    vllm_port, gateway_port = free_port(), free_port()
    direct, gateway = f"http://127.0.0.1:{vllm_port}", f"http://127.0.0.1:{gateway_port}"
    vllm = None
    if args.vllm_url:  # a vLLM server started beforehand (its startup is the slow part)
        direct = args.vllm_url.rstrip("/")
    else:
        started = time.monotonic()
        vllm = start([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                      args.model, "--host", "127.0.0.1", "--port", str(vllm_port),
                      "--disable-uvicorn-access-log"], logs / "vllm.log", env)
    server = None
    try:
        if vllm is not None:
            wait_healthy(direct, vllm, logs / "vllm.log", args.vllm_timeout)
            print(f"vLLM up in {time.monotonic() - started:.0f} s (logs: {logs})", flush=True)
        server = start([sys.executable, "-m", "bregman_server.cli", "--upstream", direct,
                        "--port", str(gateway_port), "--log-level", "warning"],
                       logs / "gateway.log", env)
        wait_healthy(gateway, server, logs / "gateway.log", 60)
        model = httpx.get(direct + "/v1/models").json()["data"][0]["id"]
        return asyncio.run(_measure_gateway(direct, gateway, model, args.requests,
                                            args.max_tokens, server.pid))
    finally:
        if server is not None:
            stop(server)
        if vllm is not None:
            stop(vllm)


# --- report -------------------------------------------------------------------------------------

def report(rows: list[dict[str, Any]]) -> str:
    header = (f"{'part':<20} {'metric':<22}{'n':>7} | {'base p50':>9}{'p99':>9} | "
              f"{'with p50':>9}{'p99':>9} | {'added p50':>10} {'ratio':>6} | "
              f"{'target':>7} {'ok':>3} | {'CPU/req':>7}")
    lines = [header, "-" * len(header)]
    for row in rows:
        b50, b99 = (percentile(row["direct"], q) * 1e3 for q in (50, 99))
        w50, w99 = (percentile(row["wrapped"], q) * 1e3 for q in (50, 99))
        added = w50 - b50
        cpu = f"{row['cpu_ms']:>7.3f}" if "cpu_ms" in row else f"{'-':>7}"
        lines.append(
            f"{row['part']:<20} {row['metric']:<22}{len(row['direct']):>7} | "
            f"{b50:>9.3f}{b99:>9.3f} | {w50:>9.3f}{w99:>9.3f} | {added:>+10.3f} "
            f"{w50 / b50:>6.2f} | {row['target']:>7.1f} "
            f"{'yes' if added <= row['target'] else 'NO':>3} | {cpu}")
    lines.append(
        "(milliseconds. middleware: base = stub ASGI app alone, with = inside BregmanMiddleware. "
        "gateway: base = vLLM directly, with = through bregman-serve --upstream. added = with - "
        "base at p50; ratio = with / base at p50; CPU/req = the gateway's user+system CPU time "
        "per request)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/tiny-llama")
    parser.add_argument("--requests", type=int, default=200,
                        help="Gateway: requests per path and metric.")
    parser.add_argument("--asgi-calls", type=int, default=20000,
                        help="Middleware: calls per path and body.")
    parser.add_argument("--max-tokens", type=int, default=4,
                        help="Tokens per request (short requests: the overhead shows).")
    parser.add_argument("--vllm-timeout", type=float, default=600,
                        help="Seconds to wait for vLLM to start.")
    parser.add_argument("--vllm-url", help="Measure against this running vLLM server (same "
                        "model) instead of starting one.")
    parser.add_argument("--skip-gateway", action="store_true",
                        help="Only the middleware part (no vLLM).")
    parser.add_argument("--json", type=Path, help="Also write the raw samples here.")
    args = parser.parse_args()

    started = time.monotonic()
    rows = asyncio.run(_measure_middleware(args.asgi_calls))
    if not args.skip_gateway:
        if not args.vllm_url and not (ROOT / args.model / "config.json").exists() \
                and not Path(args.model).exists():
            sys.exit(f"{args.model} not found: run `python scripts/prepare_models.py --only "
                     "tiny`")
        rows += measure_gateway(args)
    print(f"bench_server: {args.model}, {args.max_tokens} tokens per request, "
          f"{os.cpu_count()} CPUs, {time.monotonic() - started:.0f} s")
    print(report(rows))
    if args.json:
        args.json.write_text(json.dumps(rows))
    return 0 if all(percentile(r["wrapped"], 50) - percentile(r["direct"], 50)
                    <= r["target"] / 1e3 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
