"""The requests a server is serving, and how they end: drain on shutdown, cut on engine death.

`Lifecycle` holds every open request (`Flight`: what its response has sent so far), whether
the server still takes new ones, and how its process should end. `bregman_server.serving`
drives it from inside vLLM's server: on SIGTERM it refuses new requests, drains the open ones
for the grace period, then cuts the rest; when the engine dies it cuts at once. A cut request
ends in OpenAI's shape: a 503 if nothing was sent yet, an error event and ``data: [DONE]`` for a
stream that had started.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from .errors import sse_error_event, unavailable
from .metrics import metrics

_timeout = getattr(asyncio, "timeout", None)

#: Exit status of a server whose engine died while it served (so that a supervisor restarts it).
ENGINE_DIED_EXIT_CODE = 3
#: The two reasons a server ends requests: (code, message).
SHUTDOWN = ("shutdown", "The server is shutting down.")
ENGINE_DEAD = ("engine_dead", "The vLLM engine died; this server is restarting.")


class Cut(Exception):
    """Why the server ended a request: ``reason`` is the code, ``message`` the text."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class SlowClient(Exception):
    """The client left a response unread for longer than the send timeout."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the client read nothing for {seconds:g} s")


class Flight:
    """One request being served: what its response has sent so far (the ``send`` wrapper)."""

    __slots__ = ("_send", "cut", "done", "replaced", "send_timeout", "sse", "status", "tail",
                 "why_down")

    def __init__(self, send: Send, send_timeout: float,
                 why_down: Callable[[], Cut | None] | None = None) -> None:
        self._send = send
        self.send_timeout = send_timeout
        # Why the server is going down, if it is: then the app's own 5xx answers and error
        # events (vLLM's "EngineCore encountered an issue" 500) become ours (503, its code).
        self.why_down = why_down
        self.replaced = False
        self.status: int | None = None
        self.sse = False
        self.tail = b"\n\n"
        self.done = False
        self.cut: Cut | None = None

    async def send(self, message: Message) -> None:
        if self.replaced:  # the rest of an answer we replaced
            return
        kind = message["type"]
        if kind == "http.response.start" and message["status"] >= 500 \
                and self.why_down is not None and (down := self.why_down()) is not None:
            await self._replace_answer(down)
            return
        if kind == "http.response.body" and self.sse and self.why_down is not None \
                and message.get("body", b"").startswith(b'data: {"error"') \
                and (down := self.why_down()) is not None:
            self.replaced = self.done = True
            await self._timed_send({"type": "http.response.body", "more_body": False,
                                    "body": sse_error_event(down.message, code=down.reason)})
            return
        if kind == "http.response.start":
            self.status = message["status"]
            for name, value in message.get("headers", ()):
                if name.lower() == b"content-type":
                    self.sse = value.startswith(b"text/event-stream")
        elif kind == "http.response.body":
            if self.sse:
                body = message.get("body", b"")
                if body:
                    self.tail = (self.tail + body)[-2:]
            if not message.get("more_body", False):
                self.done = True
        await self._timed_send(message)

    async def _timed_send(self, message: Message) -> None:
        # A client that stops reading must not hold the request (and its engine slot).
        try:
            if _timeout is not None:  # Python >= 3.11: no task per message
                async with _timeout(self.send_timeout):
                    await self._send(message)
            else:  # pragma: no cover - Python 3.10
                await asyncio.wait_for(self._send(message), self.send_timeout)
        except asyncio.TimeoutError:
            raise SlowClient(self.send_timeout) from None

    async def _replace_answer(self, down: Cut) -> None:
        response = unavailable(down.message, down.reason).response()
        self.replaced = self.done = True
        self.status = response.status_code
        await self._timed_send({"type": "http.response.start", "status": response.status_code,
                                "headers": response.raw_headers})
        await self._timed_send({"type": "http.response.body", "body": response.body,
                                "more_body": False})

    async def finish(self, scope: Scope, receive: Receive) -> int:
        """End a cut request: a 503, or an error event and ``[DONE]`` for a started stream.
        Returns the status to record."""
        cut = self.cut
        assert cut is not None
        if self.done:
            return self.status or 503
        if self.status is None:
            await unavailable(cut.message, cut.reason).response()(scope, receive, self._send)
            return 503
        body = b""
        if self.sse:  # a fresh event even if the stream stopped in the middle of one
            body = (b"" if self.tail == b"\n\n" else b"\n\n") + sse_error_event(
                cut.message, code=cut.reason)
        await self._send({"type": "http.response.body", "body": body, "more_body": False})
        return self.status


class Lifecycle:
    """The requests a server is serving, whether it takes new ones, and how it ends.

    `refuse` stops new requests (503; /health 503); `drain` waits for open ones; `cut` ends
    every open one now (`Flight.finish`). One instance per server, shared by its middleware.
    The process that runs the server may ask to hear when it serves (``on_serving``, called
    with uvicorn's server), name a signal that means "the engine died" (``engine_died_signal``:
    several API servers, whose engine clients cannot see it), and read how it ended
    (``serving``: whether it ever served; ``exit_status``).
    """

    def __init__(self, on_serving: Callable[[Any], None] | None = None,
                 engine_died_signal: int | None = None) -> None:
        self.flights: dict[asyncio.Task[Any], Flight] = {}
        self.refusing: Cut | None = None
        self.on_serving = on_serving
        self.engine_died_signal = engine_died_signal
        self.serving = False
        self.exit_status = 0

    def refuse(self, reason: str, message: str) -> None:
        """Answer new requests with 503 from now on (the first reason stays)."""
        if self.refusing is None:
            self.refusing = Cut(reason, message)

    async def drain(self, grace: float, poll: float = 0.05) -> int:
        """Wait up to ``grace`` seconds for the open requests to end; return how many remain."""
        deadline = time.monotonic() + grace
        while self.flights and time.monotonic() < deadline:
            await asyncio.sleep(poll)
        return len(self.flights)

    def cut(self, reason: str, message: str) -> int:
        """End every open request now (each gets its 503 or final event); return how many."""
        count = 0
        for task, flight in list(self.flights.items()):
            if flight.cut is None and not task.done():
                flight.cut = Cut(reason, message)
                task.cancel()
                count += 1
        if count:
            metrics().cut.labels(reason).inc(count)
        return count
