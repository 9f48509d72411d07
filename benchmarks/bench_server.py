#!/usr/bin/env python
"""What the server adds per request (a script, not a timed test).

`BregmanMiddleware` around a stub ASGI app (reads the body, answers a small JSON) against the
stub alone, called directly on one event loop (no sockets, so the difference is the
middleware's own cost), for each kind of completion body: without Bregman fields (UTF-8: the
fast path), with them (parsed, validated, mapped into ``vllm_xargs``), with an escaped key
(``"\u0062regman_top_k"``) and in UTF-16 with and without them (read as vLLM reads them).
``scope["app"]`` is a FastAPI app shaped like vLLM's (a POST route whose request model has
``vllm_xargs``), from which the middleware reads its routes as it does from vLLM's. Calls
alternate between the two paths. Target: at most 0.3 ms added at p50. Everything else in
`bregman-serve` is vLLM's own server.

Usage: python benchmarks/bench_server.py [--asgi-calls 20000] [--json FILE]

Exit status 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MIDDLEWARE_TARGET_MS = 0.3
BREGMAN = {"bregman_mode": "primal", "bregman_alpha": 1.5, "bregman_lambda": 0.01}


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


# --- the middleware alone ---------------------------------------------------------------------

async def _stub(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """What any app does: read the body, answer a small JSON."""
    while True:
        message = await receive()
        if not message.get("more_body", False):
            break
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}", "more_body": False})


def _vllm_shaped_app() -> Any:
    """A FastAPI app with vLLM's shape for /v1/completions (never called: its routes are read)."""
    from fastapi import FastAPI
    from pydantic import BaseModel, ConfigDict

    class CompletionRequest(BaseModel):
        model_config = ConfigDict(extra="allow")
        vllm_xargs: dict[str, Any] | None = None

    async def create_completion(request: CompletionRequest) -> None:  # pragma: no cover
        return None

    create_completion.__annotations__["request"] = CompletionRequest  # a local class
    app = FastAPI()
    app.add_api_route("/v1/completions", create_completion, methods=["POST"])
    return app


def _scope(body: bytes, app: Any) -> dict[str, Any]:
    return {"type": "http", "app": app, "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "",
            "query_string": b"", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000),
            "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"authorization", b"Bearer sk-bench"), (b"accept", b"*/*")]}


async def _check_mapping(settings: Any, scope: dict[str, Any], body: bytes, mapped: bool
                         ) -> None:
    """One call through the middleware to an app that keeps what it receives: the fields of a
    "mapped" body reach it in vllm_xargs, any other body arrives as it was sent."""
    from bregman_server.middleware import BregmanMiddleware

    received: list[bytes] = []

    async def keep(scope: dict[str, Any], receive: Any, send: Any) -> None:
        received.append((await receive())["body"])
        await _stub(scope, _empty, send)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await BregmanMiddleware(keep, settings=settings)(dict(scope), receive, send)
    assert received, sent
    assert (b'"vllm_xargs"' in received[0]) if mapped else received[0] == body, received


async def _empty() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _measure_middleware(calls: int) -> list[dict[str, Any]]:
    from bregman_server.middleware import BregmanMiddleware
    from bregman_server.settings import ServerSettings

    settings = ServerSettings(api_key="sk-bench")
    wrapped = BregmanMiddleware(_stub, settings=settings)
    app = _vllm_shaped_app()
    prompt = {"model": "m", "prompt": "ROMEO:\n" * 20, "max_tokens": 16, "temperature": 1.0}
    plain = json.dumps(prompt)
    mapped = json.dumps({**prompt, **BREGMAN})
    bodies = (("no Bregman fields", plain.encode()),
              ("Bregman fields mapped", mapped.encode()),
              ("escaped key mapped", (plain[:-1] + ', "\\u0062regman_top_k": 4}').encode()),
              ("UTF-16, no fields", plain.encode("utf-16")),
              ("UTF-16, fields mapped", mapped.encode("utf-16")))
    rows = []
    for label, body in bodies:
        scope = _scope(body, app)
        await _check_mapping(settings, scope, body, mapped="mapped" in label)
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


# --- report -------------------------------------------------------------------------------------

def report(rows: list[dict[str, Any]]) -> str:
    header = (f"{'part':<20} {'metric':<22}{'n':>7} | {'base p50':>9}{'p99':>9} | "
              f"{'with p50':>9}{'p99':>9} | {'added p50':>10} {'ratio':>6} | "
              f"{'target':>7} {'ok':>3}")
    lines = [header, "-" * len(header)]
    for row in rows:
        b50, b99 = (percentile(row["direct"], q) * 1e3 for q in (50, 99))
        w50, w99 = (percentile(row["wrapped"], q) * 1e3 for q in (50, 99))
        added = w50 - b50
        lines.append(
            f"{row['part']:<20} {row['metric']:<22}{len(row['direct']):>7} | "
            f"{b50:>9.3f}{b99:>9.3f} | {w50:>9.3f}{w99:>9.3f} | {added:>+10.3f} "
            f"{w50 / b50:>6.2f} | {row['target']:>7.1f} "
            f"{'yes' if added <= row['target'] else 'NO':>3}")
    lines.append(
        "(milliseconds. base = stub ASGI app alone, with = inside BregmanMiddleware. added = "
        "with - base at p50; ratio = with / base at p50)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--asgi-calls", type=int, default=20000,
                        help="Middleware: calls per path and body.")
    parser.add_argument("--json", type=Path, help="Also write the raw samples here.")
    args = parser.parse_args()

    started = time.monotonic()
    rows = asyncio.run(_measure_middleware(args.asgi_calls))
    print(f"bench_server: {args.asgi_calls} calls per path, {os.cpu_count()} CPUs, "
          f"{time.monotonic() - started:.0f} s")
    print(report(rows))
    if args.json:
        args.json.write_text(json.dumps(rows))
    return 0 if all(percentile(r["wrapped"], 50) - percentile(r["direct"], 50)
                    <= r["target"] / 1e3 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
