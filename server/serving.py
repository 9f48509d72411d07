"""Running uvicorn under our own signal handling (`bregman_server.engine`).

The server installs its SIGTERM / SIGINT handlers on the event loop itself and shuts down in
this order: refuse new requests (503, /health 503), let open ones finish for
``graceful_timeout`` seconds, end the rest (a stream gets an error event and ``data: [DONE]``, a
request still waiting for its answer a 503), then stop uvicorn.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from .lifecycle import Lifecycle

logger = logging.getLogger("bregman_server")


def http_server(config: Any) -> Any:
    """uvicorn's server without its own signal handlers (ours are on the event loop), without
    importing vLLM (the unit tests' server; `bregman_server.engine` runs vLLM's own
    ``NoSignalServer``, which also spreads connections over several API server processes)."""
    import uvicorn

    class NoSignalServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[no-untyped-def]
            yield

    return NoSignalServer(config)


async def end_open_requests(lifecycle: Lifecycle, reason: str, message: str, grace: float
                            ) -> None:
    """Refuse new requests, give open ones ``grace`` seconds, end the rest (and let their final
    bytes reach the clients)."""
    lifecycle.refuse(reason, message)
    left = await lifecycle.drain(grace)
    if left:
        logger.warning("ending %d open request(s): %s", left, reason)
        lifecycle.cut(reason, message)
        await lifecycle.drain(2.0)
