"""Bounded client connections: the uvicorn configuration both servers run with.

Uvicorn's default HTTP implementation (httptools) takes request heads of any size and lets a
client hold a connection open forever before it finishes its head. Both servers therefore run
on h11 through `BoundedH11Protocol`, which adds, per connection:

1. a cap on the request head (request line and headers): ``max_header_bytes``, answered 431;
2. a deadline for a request head once a connection opens or a new request begins:
   ``header_timeout`` seconds, answered 408 (slow-loris connections cannot pile up);
3. a cap on open connections, ``max_connections``, that keeps room for clients that send their
   requests (`Room`): when every slot is taken, a new connection is let in and closes a
   connection that waits for its client instead (no request yet, a head or a body still
   arriving, or idle between requests; never one whose request is being served or answered),
   the one that has waited longest, a body arriving fast last. A connection younger than
   `EVICT_AFTER` is never closed for room while there is headroom, so that every client has
   the time to send its head: when only young ones wait, the newcomer is let in beyond the cap
   (by at most `Room.headroom`: half the cap, at least 16) and room is made as soon as they
   are old enough; with no headroom left, the young give way too, oldest first. Only when no
   other connection waits for its client (every one is being served) is a newcomer answered
   503 and closed. So
   clients that hold connections open, however many and however fast they reconnect, cannot
   lock out a client that sends its request;
4. a deadline for the whole body of each request (``body_deadline`` plus `BODY_GRACE` seconds,
   from the end of its head), also when the app answered without reading it: the middleware's
   own body deadline answers 408 first, this one closes what remains;
5. OpenAI-shaped JSON bodies for these answers and for malformed requests (400), instead of
   uvicorn's plain text;
6. vLLM's ``--h11-max-header-count`` (at most that many header fields, 431), which vLLM hands
   to uvicorn's config and uvicorn's own protocols ignore.

Before all of these, with TLS, a connection's handshake is held at most ``header_timeout``
seconds (`bound_tls_handshakes`; asyncio's default is 60 s): only then does the connection
reach the protocol, whose head deadline starts at that point.

`uvicorn_options` are the keyword arguments `bregman-serve` passes through vLLM's launcher to
its uvicorn (``build_and_serve(..., **uvicorn_kwargs)``): the protocol class bound to our
settings (`BoundedH11Protocol.bound`), whose keep-alive is ``keep_alive_timeout``; the head size
is uvicorn's ``h11_max_incomplete_event_size`` (vLLM's ``--h11-max-incomplete-event-size``,
which `bregman-serve` sets to ``max_header_bytes`` unless given). The body size, the silence
between body bytes and slow readers are bounded in the ASGI middleware
(`bregman_server.middleware`), where the request is known.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body
from .settings import ServerSettings

#: Seconds a connection must have waited for its client (since it opened, or since its last
#: response) before it may be closed to make room while there is headroom: time for any client
#: to send its head. A client that sends its request at once is past its head within
#: milliseconds, and then never closed for room while it is served.
EVICT_AFTER = 0.1
#: A body arriving at least this fast (bytes per second since its head) is an upload, not a
#: trickle: closed for room only when no slower connection waits.
FAST_BODY = 64 * 1024
#: Seconds past the body deadline before the connection closes (the middleware's 408 first).
BODY_GRACE = 1.0


def _json(status: int, message: str, type: str, code: str) -> bytes:
    return json.dumps(error_body(message, type, None, code)).encode()


class Room:
    """The connections of one server that wait for their clients, in the order in which they
    began to wait, and the choice of which to close when a new one needs room (item 3 of the
    module docstring).

    A connection is listed when it opens, and again (last) when its response completes and it
    waits for its next request; it leaves the list once its request has arrived whole (it is
    being served) and when it closes. The search for a victim therefore goes from the front and
    stops at the first connection that began to wait less than `EVICT_AFTER` ago.
    """

    def __init__(self, cap: int, connections: set[Any]) -> None:
        self.cap = cap
        #: Beyond the cap, room for newcomers while only young connections wait.
        self.headroom = max(16, cap // 2)
        self.connections = connections  # uvicorn's: every open connection of the server
        self.waiting: dict[BoundedH11Protocol, None] = {}
        self.closing: set[BoundedH11Protocol] = set()  # closed for room, not yet gone
        self._settle: asyncio.TimerHandle | None = None

    @property
    def open(self) -> int:
        return len(self.connections) - len(self.closing)

    def wait(self, connection: BoundedH11Protocol) -> None:
        """``connection`` waits for its client from now on (listed last)."""
        self.waiting.pop(connection, None)
        self.waiting[connection] = None

    def admit(self, newcomer: BoundedH11Protocol) -> bool:
        """Make room for ``newcomer``, just opened past the cap; False: refuse it."""
        victim, young = self._victim(newcomer.loop.time(), newcomer)
        if victim is None and young is not None and self.open > self.cap + self.headroom:
            victim = young  # no headroom left: even the young give way, oldest first
        if victim is not None:
            victim.close_for_room()
            return True
        if young is None:
            return False  # every other connection is being served
        self._settle_at(newcomer.loop, young.waiting_since + EVICT_AFTER)
        return True

    def settle(self, loop: asyncio.AbstractEventLoop) -> None:
        """Back under the cap: close the waiting connections that have become old enough."""
        self._settle = None
        while self.open > self.cap:
            victim, young = self._victim(loop.time(), None)
            if victim is None:
                if young is not None:
                    self._settle_at(loop, young.waiting_since + EVICT_AFTER)
                return
            victim.close_for_room()

    def _settle_at(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._settle is None:
            self._settle = loop.call_at(when, self.settle, loop)

    def _victim(self, now: float, newcomer: BoundedH11Protocol | None
                ) -> tuple[BoundedH11Protocol | None, BoundedH11Protocol | None]:
        """(the connection to close, or None; the first waiting connection too young to be
        closed, or None). The one to close waits for its client, began to wait at least
        `EVICT_AFTER` ago and, of those, has waited longest; a body arriving at `FAST_BODY`
        or more only when no other is left."""
        slow: BoundedH11Protocol | None = None
        fast: BoundedH11Protocol | None = None
        young: BoundedH11Protocol | None = None
        gone = []
        for connection in self.waiting:
            if connection is newcomer:
                continue
            if connection.transport is None or connection.transport.is_closing():
                gone.append(connection)
            elif not connection.waits_for_client():
                continue  # its answer is being written; listed again when it is complete
            elif now - connection.waiting_since < EVICT_AFTER:
                young = connection  # and every one after it is younger
                break
            elif connection.body_rate(now) < FAST_BODY:
                slow = connection
                break
            else:
                fast = fast or connection
        for connection in gone:
            del self.waiting[connection]
        return slow or fast, young


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a head deadline, a connection cap and JSON error bodies.

    The limits are those of ``settings``, a class attribute: uvicorn builds the protocol from
    its class alone, so each server runs a subclass bound to its settings (`bound`). The head
    size and the header count are uvicorn's config's (vLLM's flags).
    """

    settings: ClassVar[ServerSettings]

    @classmethod
    def bound(cls, settings: ServerSettings) -> type[BoundedH11Protocol]:
        """This protocol with the limits of ``settings``."""
        return type(cls.__name__, (cls,), {"settings": settings})

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        settings = self.settings
        self.timeout_keep_alive = settings.keep_alive_timeout
        self._header_timeout: float = settings.header_timeout
        self._body_deadline: float = settings.body_deadline + BODY_GRACE
        self._max_head: int = config.h11_max_incomplete_event_size
        self._max_fields: int | None = getattr(config, "h11_max_header_count", None)
        room = getattr(self.server_state, "bregman_room", None)
        if room is None:  # one per server: every connection of it shares the room
            room = Room(settings.max_connections, self.connections)
            self.server_state.bregman_room = room
        self._room: Room = room
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._head_seen = 0  # bytes of the current head so far
        self._head_lines = 0  # its lines so far (the request line and header fields)
        self._head_tail = b""  # its last bytes, where a blank line may begin
        self.waiting_since = 0.0  # when it began to wait for its current request
        self._body_since = 0.0  # when the current request's head was complete
        self._body_bytes = 0  # bytes received since

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.waiting_since = self.loop.time()
        room = self._room
        room.wait(self)
        if room.open > room.cap and not room.admit(self):
            self._answer(503, _json(503, "Too many open connections; retry later.",
                                    "server_error", "too_many_connections"),
                         extra=[(b"retry-after", b"1")])
            return
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and (problem := self._head_too_long(data)):
            self._disarm_head_timer()
            self._answer(431, _json(431, problem, "invalid_request_error",
                                    "request_header_fields_too_large"))
            return
        before = self.conn.their_state
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE and not self.transport.is_closing():
            self._arm_head_timer()  # bytes of a new head arrived: its deadline runs
        else:
            self._disarm_head_timer()
        if state is h11.SEND_BODY:
            if self._body_timer is None:  # the head is complete: the body's deadline runs
                self._body_timer = self.loop.call_later(self._body_deadline, self._body_expired)
                self._body_since = self.loop.time()
                self._body_bytes = 0
            elif before is h11.SEND_BODY:
                self._body_bytes += len(data)
        elif self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if state is not h11.IDLE and state is not h11.SEND_BODY:
            self._room.waiting.pop(self, None)  # its request is here: being served

    def on_response_complete(self) -> None:
        self.waiting_since = self.loop.time()  # now waiting for the next request
        if not self.transport.is_closing():
            self._room.wait(self)
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._room.waiting.pop(self, None)
        self._room.closing.discard(self)
        super().connection_lost(exc)

    # --- keeping room ------------------------------------------------------------------------

    def waits_for_client(self) -> bool:
        """Whether the connection waits for its client: no request yet (or a head still
        arriving), or a body still arriving while no answer is being written."""
        theirs = self.conn.their_state
        if theirs is h11.IDLE:
            return True
        cycle = self.cycle  # an answer being written is never cut short
        return theirs is h11.SEND_BODY and (cycle is None or not cycle.response_started
                                            or cycle.response_complete)

    def body_rate(self, now: float) -> float:
        """Bytes per second of the body arriving since its head was complete (0 without)."""
        if self.conn.their_state is not h11.SEND_BODY:
            return 0.0
        return self._body_bytes / max(now - self._body_since, 1e-3)

    def close_for_room(self) -> None:
        """Close this connection to make room for another."""
        if self.conn.their_state is h11.IDLE:
            self._disarm_head_timer()
            self._answer(503, _json(
                503, "The server is full and this connection sent no request: it was closed to "
                "make room for another client.", "server_error", "too_many_connections"),
                extra=[(b"retry-after", b"1")])
        else:  # a body still arriving: its request ends as a client that left (499)
            self._close()

    def _close(self) -> None:
        """Close the connection: from now on it no longer counts against the cap."""
        self._room.waiting.pop(self, None)
        self._room.closing.add(self)
        self.transport.close()

    def _body_expired(self) -> None:
        self._body_timer = None
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self._close()

    def send_400_response(self, msg: str) -> None:
        self._disarm_head_timer()
        if self._head_too_large():
            self._answer(431, _json(
                431, f"Request line and headers larger than {self._max_head} bytes.",
                "invalid_request_error", "request_header_fields_too_large"))
        else:
            self._answer(400, _json(400, "Invalid HTTP request.", "invalid_request_error",
                                    "invalid_http_request"))

    # --- helpers ---------------------------------------------------------------------------

    def _head_too_long(self, data: bytes) -> str | None:
        """Why the head being received (up to its blank line) passes a limit (its size, its
        number of header fields), or None. h11's own size limit only counts a head that is still
        incomplete, so a whole head in one read would pass it."""
        window = self._head_tail + data
        end = window.find(b"\r\n\r\n")
        seen = self._head_seen + (len(data) if end < 0 else end + 4 - len(self._head_tail))
        if seen > self._max_head:
            return f"Request line and headers larger than {self._max_head} bytes."
        # Line ends so far, those of the tail (the last bytes already counted) excepted.
        lines = self._head_lines + (window if end < 0 else window[:end + 2]).count(b"\r\n") \
            - self._head_tail.count(b"\r\n")
        if self._max_fields is not None and lines - 1 > self._max_fields:
            return f"More than {self._max_fields} header fields."
        self._head_seen, self._head_lines, self._head_tail = (
            (seen, lines, window[-3:]) if end < 0 else (0, 0, b""))
        return None

    def _head_too_large(self) -> bool:
        buffered = getattr(self.conn, "_receive_buffer", b"")
        try:
            return len(buffered) >= self._max_head
        except TypeError:  # pragma: no cover - h11 internals changed
            return False

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self._header_timeout, self._head_expired)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:
            self._answer(408, _json(
                408, f"The request head did not arrive within {self._header_timeout:g} s.",
                "invalid_request_error", "request_timeout"))

    def _answer(self, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None
                ) -> None:
        """A complete JSON response through h11, then close the connection."""
        self._unset_keepalive_if_required()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode()), *(extra or [])]
        try:
            if self.conn.our_state is h11.IDLE and self.conn.their_state is not h11.ERROR:
                self.transport.write(self.conn.send(h11.Response(status_code=status,
                                                                 headers=headers)))
            else:  # h11 refuses to answer a request it could not parse: a fresh writer
                writer = h11.Connection(h11.SERVER)
                writer.receive_data(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                writer.next_event()
                self.conn = writer
                self.transport.write(writer.send(h11.Response(status_code=status,
                                                              headers=headers)))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # pragma: no cover - nothing more we can send
            pass
        self._close()


def bound_tls_handshakes(loop: asyncio.AbstractEventLoop, seconds: float) -> None:
    """Hold a TLS handshake at most ``seconds`` (the head deadline) on every server ``loop``
    creates from now on, instead of asyncio's (and uvloop's) 60 s default.

    A connection is handed to the HTTP protocol (`BoundedH11Protocol`, whose head deadline then
    starts) only once its TLS handshake is complete, and uvicorn, which creates the listening
    server, passes no handshake timeout: a client that opens connections and stalls their
    handshakes would hold each for 60 s. The middleware calls this when the ASGI lifespan
    starts, which uvicorn runs before it creates its server, under `bregman-serve` and plain
    ``vllm serve --middleware`` alike. A timeout the caller gives wins."""
    for name in ("create_server", "create_unix_server"):
        create = getattr(loop, name, None)
        if create is None or getattr(create, "bregman_handshake", None) is not None:
            continue

        async def bounded(*args: Any, _create: Any = create, **kwargs: Any) -> Any:
            if kwargs.get("ssl") is not None and kwargs.get("ssl_handshake_timeout") is None:
                kwargs["ssl_handshake_timeout"] = seconds
            return await _create(*args, **kwargs)

        bounded.bregman_handshake = seconds  # type: ignore[attr-defined]
        setattr(loop, name, bounded)


def uvicorn_options(settings: ServerSettings) -> dict[str, Any]:
    """What our servers add to uvicorn's configuration (the keyword arguments `bregman-serve`
    passes through vLLM's launcher): `BoundedH11Protocol` with the limits of ``settings``."""
    return dict(http=BoundedH11Protocol.bound(settings), lifespan="on",
                # Our own drain (`bregman_server.serving`) runs before uvicorn's shutdown starts.
                timeout_graceful_shutdown=2.0)
