#!/usr/bin/env python
"""Clients that behave, served while slow clients hold the connection cap (issue 27, part 2).

A real `bregman-serve` on the tiny model (``--max-connections 200`` unless told otherwise, an
API key) is attacked by slow clients of the five kinds of the issue's attack, in equal shares:

1. ``idle``: connects and sends nothing;
2. ``slow-head``: a request head trickled a byte at a time, never finished;
3. ``slow-body-key``: a whole head with the key and ``Content-Length: 100000``, then a body
   byte at a time;
4. ``slow-body-nokey``: the same without the key (the server answers 401 before the body);
5. ``chunked``: a head with the key and ``Transfer-Encoding: chunked``, then a one-byte chunk
   at a time.

Each sends its next byte every ``--trickle`` seconds and, once the server closes its connection,
connects again ``--reconnect`` seconds later (0.1 s: at once). They run in a process of their
own (asyncio), so that they do not take the interpreter from the clients that behave: after
``--warmup`` seconds, ``--legit-threads`` threads send completions (4 tokens, with the key, a
fresh connection each, 30 s timeout) one after another for ``--seconds`` seconds. Printed: the
share of those served (200), how the others failed (503, reset, timeout ...), their latency
(p50, p90, max), and the slow clients' connections (opened; closed by the server).

Usage::

    flock /work/wt/engine.lock .venv/bin/python benchmarks/bench_connections.py \
        [--max-connections 200 1024] [--slow 600] [--reconnect 0.1] [--seconds 30] [--json FILE]

One server is started per ``--max-connections`` value, one after another. `run_load` is the
load itself, for a server already running (tests/test_reliability.py runs a short one).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import multiprocessing
import secrets
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = "models/tiny-llama"
KINDS = ("idle", "slow-head", "slow-body-key", "slow-body-nokey", "chunked")


# --- the slow clients (their own process) -----------------------------------------------------

def _head(kind: str, key: str) -> tuple[bytes, bytes]:
    """What a slow client of ``kind`` sends at once, and what it trickles byte by byte."""
    auth = f"Authorization: Bearer {key}\r\n".encode()
    start = b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    if kind == "idle":
        return b"", b""
    if kind == "slow-head":
        return b"", start + b"X-Filler: " + b"a" * 100_000
    if kind == "chunked":
        return start + auth + b"Transfer-Encoding: chunked\r\n\r\n", b"1\r\n \r\n" * 100_000
    with_key = auth if kind == "slow-body-key" else b""
    return start + with_key + b"Content-Length: 100000\r\n\r\n", b"{" + b" " * 99_999


async def _slow_client(kind: str, host: str, port: int, key: str, trickle: float,
                       reconnect: float, stop: float, counts: dict[str, int]) -> None:
    loop = asyncio.get_running_loop()
    first, rest = _head(kind, key)
    step = 8 if kind == "chunked" else 1
    while loop.time() < stop:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            counts["connect_failed"] += 1
            await asyncio.sleep(reconnect)
            continue
        counts["opened"] += 1
        sent = 0
        try:
            if first:
                writer.write(first)
            while loop.time() < stop:
                try:  # the server's answer or its close ends this connection
                    data = await asyncio.wait_for(reader.read(65536), trickle)
                except asyncio.TimeoutError:
                    data = None
                if data is not None:
                    if data[:12].startswith(b"HTTP/1.1 503"):
                        counts["answered_503"] += 1
                    if not data:
                        counts["closed_by_server"] += 1
                        break
                    continue
                if rest and sent < len(rest):
                    writer.write(rest[sent:sent + step])
                    sent += step
        except (ConnectionError, OSError):
            counts["closed_by_server"] += 1
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        await asyncio.sleep(reconnect)


async def _slow_clients(host: str, port: int, key: str, count: int, trickle: float,
                        reconnect: float, seconds: float) -> dict[str, int]:
    counts = dict.fromkeys(("opened", "connect_failed", "closed_by_server", "answered_503"), 0)
    stop = asyncio.get_running_loop().time() + seconds
    clients = []
    for i in range(count):
        clients.append(asyncio.create_task(_slow_client(
            KINDS[i % len(KINDS)], host, port, key, trickle, reconnect, stop, counts)))
        if i % 50 == 49:
            await asyncio.sleep(0)  # let the first ones connect while the rest start
    await asyncio.gather(*clients, return_exceptions=True)
    return counts


def _slow_process(args: tuple[Any, ...], results: Any) -> None:
    results.put(asyncio.run(_slow_clients(*args)))


# --- the clients that behave ---------------------------------------------------------------------

def _legit_request(url: str, key: str) -> tuple[str, float]:
    """One completion on a fresh connection: (outcome, seconds)."""
    import httpx

    body = {"model": MODEL, "prompt": "ROMEO:\n", "max_tokens": 4, "temperature": 1.0}
    started = time.perf_counter()
    try:
        with httpx.Client(timeout=30, trust_env=False) as client:
            response = client.post(url + "/v1/completions", json=body,
                                   headers={"Authorization": f"Bearer {key}"})
        outcome = "ok" if response.status_code == 200 else str(response.status_code)
    except httpx.TimeoutException:
        outcome = "timeout"
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError,
            httpx.ConnectError) as error:
        outcome = "reset" if "reset" in str(error).lower() or isinstance(
            error, (httpx.ReadError, httpx.WriteError)) else type(error).__name__
    return outcome, time.perf_counter() - started


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def run_load(url: str, key: str, slow: int = 600, reconnect: float = 0.1, trickle: float = 1.0,
             seconds: float = 30.0, warmup: float = 3.0, legit_threads: int = 2,
             max_legit: int | None = None) -> dict[str, Any]:
    """``slow`` slow clients (the five kinds) against the server at ``url`` for ``warmup +
    seconds`` seconds; meanwhile, after ``warmup``, ``legit_threads`` threads of completions
    (at most ``max_legit`` in all). Returns the figures."""
    host, port = url.removeprefix("http://").split(":")
    results: Any = multiprocessing.get_context("spawn").Queue()
    attack = multiprocessing.get_context("spawn").Process(
        target=_slow_process, daemon=True,
        args=((host, int(port), key, slow, trickle, reconnect, warmup + seconds + 1.0), results))
    attack.start()
    outcomes: list[tuple[str, float]] = []
    lock = threading.Lock()
    try:
        time.sleep(warmup)
        stop = time.monotonic() + seconds

        def legit() -> None:
            while time.monotonic() < stop:
                with lock:
                    if max_legit is not None and len(outcomes) >= max_legit:
                        return
                outcome = _legit_request(url, key)
                with lock:
                    outcomes.append(outcome)

        with concurrent.futures.ThreadPoolExecutor(legit_threads) as pool:
            for future in [pool.submit(legit) for _ in range(legit_threads)]:
                future.result()
        slow_counts = results.get(timeout=warmup + seconds + 60)
    finally:
        attack.join(10)
        if attack.is_alive():
            attack.kill()
    served = [seconds for outcome, seconds in outcomes if outcome == "ok"]
    failures: dict[str, int] = {}
    for outcome, _ in outcomes:
        if outcome != "ok":
            failures[outcome] = failures.get(outcome, 0) + 1
    latency = {f"p{q}_ms": round(_percentile(served, q) * 1000, 1) for q in (50, 90)} \
        if served else {}
    if served:
        latency["max_ms"] = round(max(served) * 1000, 1)
        latency["mean_ms"] = round(statistics.fmean(served) * 1000, 1)
    return {"legit": len(outcomes), "served": len(served),
            "share": round(len(served) / len(outcomes), 3) if outcomes else None,
            "failures": failures, "latency": latency, "slow_clients": slow,
            "slow_connections": slow_counts}


# --- the benchmark ---------------------------------------------------------------------------

def _serve(cap: int, key: str, log: Path) -> Any:
    sys.path.insert(0, str(ROOT))
    from tests.test_server_support import ServerProcess, require_tiny_model

    require_tiny_model()
    server = ServerProcess(["--model", MODEL, "--api-key", key, "--max-connections", str(cap),
                            "--enforce-eager", "--max-num-seqs", "32"], log)
    server.start()
    server.wait_healthy(timeout=600)
    return server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-connections", type=int, nargs="+", default=[200])
    parser.add_argument("--slow", type=int, default=600, help="slow clients")
    parser.add_argument("--reconnect", type=float, default=0.1)
    parser.add_argument("--trickle", type=float, default=1.0, help="seconds between bytes")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--legit-threads", type=int, default=2)
    parser.add_argument("--url", help="an already running server (its --max-connections: "
                        "the first value given)")
    parser.add_argument("--api-key", help="the key of --url")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for cap in args.max_connections:
        key = args.api_key or secrets.token_hex(8)
        server = None
        if args.url is None:
            import tempfile

            server = _serve(cap, key, Path(tempfile.mkdtemp()) / "server.log")
        url = args.url or server.url
        try:
            figures = run_load(url, key, args.slow, args.reconnect, args.trickle, args.seconds,
                               args.warmup, args.legit_threads)
        finally:
            if server is not None:
                from tests.test_server_support import shut_down

                with contextlib.suppress(AssertionError):
                    shut_down(server, expect_code=None)
        figures["max_connections"] = cap
        rows.append(figures)
        print(f"--max-connections {cap}, {args.slow} slow clients (reconnect after "
              f"{args.reconnect:g} s, a byte every {args.trickle:g} s), {args.seconds:g} s: "
              f"{figures['served']} of {figures['legit']} legitimate requests served "
              f"({100 * (figures['share'] or 0):.1f} %); failures {figures['failures']}; "
              f"latency {figures['latency']}; slow connections {figures['slow_connections']}",
              flush=True)
        if args.url is not None:
            break
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
