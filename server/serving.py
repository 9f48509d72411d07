"""Our lifecycle inside vLLM's own HTTP server: what the middleware runs while uvicorn serves.

vLLM's launcher (``serve_http``) runs uvicorn with SIGTERM / SIGINT handlers of its own (stop
the engine client at once, aborting open requests unless ``--shutdown-timeout``) and stops the
server when its engine dies (unless ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH``). Neither drains. Once
uvicorn has started the app (the ASGI lifespan, `BregmanMiddleware._lifespan`), `run_lifecycle`
puts its own handlers on the event loop in place of vLLM's, then, in order:

1. once uvicorn serves: ``lifecycle.on_serving(server)`` (`bregman-serve`'s ready line);
2. on SIGTERM / SIGINT: refuse new requests (503 ``shutdown``, /health 503), let open ones
   finish for ``graceful_timeout`` seconds, end the rest (a stream gets an error event and
   ``data: [DONE]``, a request still waiting for its answer a 503), then stop uvicorn; vLLM's
   launcher then stops its engine client, as after its own shutdown;
3. once the engine is dead (vLLM marks its client ``errored``, or the process that started the
   engines sends ``lifecycle.engine_died_signal``): refuse new requests (503 ``engine_dead``),
   end the open ones at once, and after ``engine_exit_grace`` seconds stop uvicorn, with exit
   status `ENGINE_DIED_EXIT_CODE` for the process to return.

The same runs under plain ``vllm serve --middleware ...`` (where vLLM's own watchdog may stop the
server sooner after an engine death, and its exit status is vLLM's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

from .lifecycle import ENGINE_DEAD, ENGINE_DIED_EXIT_CODE, SHUTDOWN, Lifecycle
from .settings import ServerSettings

logger = logging.getLogger("bregman_server")

#: How often the engine's health is looked at, seconds.
WATCH_INTERVAL = 0.2


async def run_lifecycle(lifecycle: Lifecycle, settings: ServerSettings, app: Any) -> None:
    """Steps 1-3 of the module docstring, for the uvicorn server that vLLM's launcher put in
    ``app.state.server``; nothing for an app served otherwise (the tests' stand-in servers,
    which stop themselves)."""
    state = getattr(app, "state", None)
    server = getattr(state, "server", None)
    if server is None:
        return
    engine = getattr(state, "engine_client", None)
    loop = asyncio.get_running_loop()
    stop, dead = asyncio.Event(), asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if lifecycle.engine_died_signal is not None:
        loop.add_signal_handler(lifecycle.engine_died_signal, dead.set)

    try:
        while not (server.started or stop.is_set()):
            await asyncio.sleep(0.05)
        if server.started:
            lifecycle.serving = True
            if lifecycle.on_serving is not None:
                try:  # (the ready line: a closed stdout must not end the watch)
                    lifecycle.on_serving(server)
                except Exception:
                    logger.exception("the start-up callback failed; serving on")
        while not (stop.is_set() or dead.is_set() or getattr(engine, "errored", False)):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), WATCH_INTERVAL)
        if stop.is_set():
            logger.info("shutting down: %g s for open requests", settings.graceful_timeout)
            await end_open_requests(lifecycle, *SHUTDOWN, grace=settings.graceful_timeout)
        else:
            lifecycle.exit_status = ENGINE_DIED_EXIT_CODE
            await end_open_requests(lifecycle, *ENGINE_DEAD, grace=0.0)
            logger.error("the vLLM engine died: exiting with status %d in %g s",
                         ENGINE_DIED_EXIT_CODE, settings.engine_exit_grace)
            await asyncio.sleep(settings.engine_exit_grace)
    except asyncio.CancelledError:
        raise
    except Exception:
        # Our signal handlers replaced vLLM's: whatever failed here, the server still stops.
        logger.exception("the shutdown watch failed: stopping the server")
    finally:
        server.should_exit = True


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
