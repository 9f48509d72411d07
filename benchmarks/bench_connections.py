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
load itself (`tests.test_server_support.run_load`, which tests/test_reliability.py runs
briefly against its own server).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.test_server_support import (  # noqa: E402
    MODEL,
    ServerProcess,
    require_tiny_model,
    run_load,
    shut_down,
)

# --- the benchmark ---------------------------------------------------------------------------

def _serve(cap: int, key: str, log: Path) -> Any:
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
            server = _serve(cap, key, Path(tempfile.mkdtemp()) / "server.log")
        url = args.url or server.url
        try:
            figures = run_load(url, key, args.slow, args.reconnect, args.trickle, args.seconds,
                               args.warmup, args.legit_threads)
        finally:
            if server is not None:
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
