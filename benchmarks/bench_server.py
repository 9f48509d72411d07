#!/usr/bin/env python
"""Latency that `bregman-serve` adds over calling vLLM directly (a script, not a timed test).

Starts one vLLM OpenAI server on the tiny model and one ``bregman-serve --upstream`` in front of
it, then measures side by side, in one run, with identical work for vLLM on both paths (the direct
requests carry in ``vllm_xargs`` exactly what the server writes there):

* short non-streaming completions: latency p50 / p99;
* streaming completions: time to first token (first SSE chunk with text) p50 / p99;

at concurrency 1 and 32. Direct and proxied rounds alternate so that drift (CPU frequency, other
load) hits both alike. Target: at most 2 ms added at p50.

Usage: python benchmarks/bench_server.py [--model models/tiny-llama] [--requests 400]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from server.embedded import free_port  # noqa: E402 - after the sys.path tweak

BREGMAN = {"bregman_mode": "primal", "bregman_alpha": 1.5, "bregman_lambda": 0.01}


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
            if httpx.get(url + "/health", timeout=1).status_code == 200:
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


def body(model: str, proxied: bool, stream: bool, max_tokens: int) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "prompt": "ROMEO:\n", "max_tokens": max_tokens,
                               "temperature": 1.0, "seed": 0, "stream": stream}
    if proxied:
        payload.update(BREGMAN)  # top-level fields: the server validates and maps them
    else:
        payload["vllm_xargs"] = dict(BREGMAN)  # what the server would send
    return payload


async def one_request(client: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> float:
    """Seconds to the full response (non-streaming) or to the first text chunk (streaming)."""
    data = json.dumps(payload).encode()
    headers = {"content-type": "application/json"}
    started = time.perf_counter()
    if not payload["stream"]:
        response = await client.post(url, content=data, headers=headers)
        response.raise_for_status()
        return time.perf_counter() - started
    first = None
    async with client.stream("POST", url, content=data, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {") and '"text"' in line:
                first = time.perf_counter() - started
    assert first is not None, "no token in the stream"
    return first


async def run_block(client: httpx.AsyncClient, url: str, payload: dict[str, Any],
                    requests: int, concurrency: int) -> list[float]:
    samples: list[float] = []
    remaining = iter(range(requests))

    async def worker() -> None:
        for _ in remaining:
            samples.append(await one_request(client, url, payload))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(direct: str, proxied: str, model: str, requests: int, rounds: int,
                  max_tokens: int, server_pid: int) -> list[dict[str, Any]]:
    """Alternate direct and proxied blocks (one request per block at concurrency 1) so that
    noise from other processes falls on both paths alike."""
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    rows = []
    async with httpx.AsyncClient(timeout=120, limits=limits, trust_env=False) as client:
        for stream in (False, True):
            for concurrency in (1, 32):
                results: dict[str, list[float]] = {"direct": [], "proxied": []}
                block = concurrency if concurrency > 1 else 1
                blocks = max(rounds, requests // block)
                bodies = {name: body(model, name == "proxied", stream, max_tokens)
                          for name in results}
                urls = {"direct": direct + "/v1/completions",
                        "proxied": proxied + "/v1/completions"}
                for name in results:  # warm-up, not recorded
                    await run_block(client, urls[name], bodies[name], 2 * concurrency,
                                    concurrency)
                server_cpu = 0.0
                for index in range(blocks):
                    order = ("direct", "proxied") if index % 2 == 0 else ("proxied", "direct")
                    for name in order:
                        before = cpu_seconds(server_pid)
                        results[name] += await run_block(client, urls[name], bodies[name],
                                                         block, concurrency)
                        if name == "proxied":
                            server_cpu += cpu_seconds(server_pid) - before
                rows.append({"metric": "TTFT (stream)" if stream else "latency (non-stream)",
                             "concurrency": concurrency,
                             "server_cpu_ms": server_cpu / len(results["proxied"]) * 1e3,
                             **results})
    return rows


def report(rows: list[dict[str, Any]]) -> str:
    header = (f"{'metric':<22}{'conc':>5}{'n':>6} | {'direct p50':>10}{'p99':>9} | "
              f"{'proxied p50':>11}{'p99':>9} | {'added p50':>10}{'p99':>9} | "
              f"{'ratio p50':>9}{'p99':>7} | {'server CPU/req':>14}")
    lines = [header, "-" * len(header)]
    for row in rows:
        d50, d99 = (percentile(row["direct"], q) * 1e3 for q in (50, 99))
        p50, p99 = (percentile(row["proxied"], q) * 1e3 for q in (50, 99))
        lines.append(
            f"{row['metric']:<22}{row['concurrency']:>5}{len(row['direct']):>6} | "
            f"{d50:>10.2f}{d99:>9.2f} | {p50:>11.2f}{p99:>9.2f} | "
            f"{p50 - d50:>+10.2f}{p99 - d99:>+9.2f} | {p50 / d50:>9.3f}{p99 / d99:>7.3f} | "
            f"{row['server_cpu_ms']:>14.3f}")
    lines.append("(milliseconds; added = proxied - direct; ratio = proxied / direct; server "
                 "CPU/req = user+system CPU time of bregman-serve per proxied request)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/tiny-llama")
    parser.add_argument("--requests", type=int, default=400,
                        help="Requests per path and cell (in blocks of `concurrency`).")
    parser.add_argument("--rounds", type=int, default=10,
                        help="Minimum number of alternating blocks per cell.")
    parser.add_argument("--max-tokens", type=int, default=4,
                        help="Tokens per request (short requests: the overhead shows).")
    parser.add_argument("--json", type=Path, help="Also write the raw samples here.")
    args = parser.parse_args()
    if not (ROOT / args.model / "config.json").exists() and not Path(args.model).exists():
        sys.exit(f"{args.model} not found: run `python scripts/prepare_models.py --only tiny`")

    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    env.pop("VLLM_API_KEY", None)
    logs = Path(tempfile.mkdtemp(prefix="bench_server_"))
    vllm_port, server_port = free_port(), free_port()
    direct, proxied = f"http://127.0.0.1:{vllm_port}", f"http://127.0.0.1:{server_port}"
    vllm = start([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                  args.model, "--host", "127.0.0.1", "--port", str(vllm_port),
                  "--disable-uvicorn-access-log"], logs / "vllm.log", env)
    server = None
    try:
        wait_healthy(direct, vllm, logs / "vllm.log", 900)
        server = start([sys.executable, "-m", "server.cli", "--upstream", direct, "--port",
                        str(server_port), "--log-level", "warning"], logs / "server.log", env)
        wait_healthy(proxied, server, logs / "server.log", 60)
        model = httpx.get(direct + "/v1/models").json()["data"][0]["id"]
        started = time.monotonic()
        rows = asyncio.run(measure(direct, proxied, model, args.requests, args.rounds,
                                   args.max_tokens, server.pid))
        print(f"bench_server: {args.model}, {args.max_tokens} tokens per request, "
              f"{os.cpu_count()} CPUs, {time.monotonic() - started:.0f} s")
        print(report(rows))
        if args.json:
            args.json.write_text(json.dumps(rows))
    finally:
        if server is not None:
            stop(server)
        stop(vllm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
