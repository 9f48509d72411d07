"""The proxy's HTTP/1.1 client (server/upstream_http.py) against small asyncio servers on real
loopback sockets, each scripted to behave in one way a real upstream can: keep-alive and its
races, every way a body can end, timeouts, broken connections, back-pressure, aborts."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from server.upstream_http import (
    ConnectionPool,
    Origin,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamTimeout,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request: head plus Content-Length body, or None once the client closed."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + (await reader.readexactly(length) if length else b"")


def ok(body: bytes, *, close: bool = False) -> bytes:
    connection = b"close" if close else b"keep-alive"
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: " + connection + b"\r\n\r\n" + body)


async def serve(handler: Handler) -> tuple[asyncio.Server, Origin]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, Origin.from_url(f"http://127.0.0.1:{port}")


async def get(pool: ConnectionPool, origin: Origin, target: bytes = b"/",
              **timeouts: Any) -> tuple[int, bytes]:
    async with await pool.send(origin, "GET", target, [], **timeouts) as response:
        return response.status_code, await response.read()


def counting_handler(reply: Callable[[int, int, bytes], bytes | None]) -> tuple[Handler, list]:
    """A keep-alive server; ``reply(connection, request_number, request)`` gives the bytes to
    answer (None: close the connection without answering)."""
    connections: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = len(connections)
        connections.append(number)
        served = 0
        while (request := await read_request(reader)) is not None:
            served += 1
            answer = reply(number, served, request)
            if answer is None:
                break
            writer.write(answer)
            await writer.drain()
        writer.close()

    return handler, connections


def test_origin_from_url() -> None:
    origin = Origin.from_url("http://vllm:8000/prefix/")
    assert (origin.host, origin.port, origin.host_header, origin.base_path) == (
        "vllm", 8000, b"vllm:8000", b"/prefix")
    assert Origin.from_url("https://example.org").port == 443
    assert Origin.from_url("https://example.org").host_header == b"example.org"
    assert Origin.from_url("http://[::1]:9/").host_header == b"[::1]:9"
    with pytest.raises(ValueError, match="not an http"):
        Origin.from_url("ftp://example.org")


def test_request_bytes_on_the_wire_host_length_and_base_path() -> None:
    received: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await read_request(reader) or b"")
        writer.write(ok(b"done", close=True))
        await writer.drain()
        writer.close()

    async def main() -> tuple[int, bytes]:
        server, origin = await serve(handler)
        origin = Origin.from_url(f"http://127.0.0.1:{origin.port}/base")
        async with server:
            pool = ConnectionPool()
            response = await pool.send(origin, "POST", b"/v1/completions?x=1",
                                       [(b"content-type", b"application/json")], b'{"a":1}')
            async with response:
                return response.status_code, await response.read()

    assert asyncio.run(main()) == (200, b"done")
    assert received == [
        b"POST /base/v1/completions?x=1 HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
        % int(received[0].split(b"127.0.0.1:")[1].split(b"\r\n")[0])
        + b'content-type: application/json\r\ncontent-length: 7\r\n\r\n{"a":1}']


def test_keep_alive_reuse_and_an_upstream_closed_idle_connection_is_not_reused() -> None:
    def reply(connection: int, served: int, request: bytes) -> bytes:
        body = f"conn {connection} req {served}".encode()
        # The first connection closes after its second answer, like uvicorn's keep-alive timeout.
        return ok(body, close=connection == 0 and served == 2)

    handler, connections = counting_handler(reply)

    async def main() -> list[bytes]:
        server, origin = await serve(handler)
        async with server:
            pool = ConnectionPool()
            bodies = [(await get(pool, origin))[1], (await get(pool, origin))[1]]
            bodies.append((await get(pool, origin))[1])
            await pool.aclose()
            return bodies

    assert asyncio.run(main()) == [b"conn 0 req 1", b"conn 0 req 2", b"conn 1 req 1"]
    assert connections == [0, 1]


def test_connection_that_closes_silently_while_idle_is_dropped() -> None:
    handler, connections = counting_handler(
        lambda connection, served, request: None if served == 2 else ok(b"c%d" % connection))

    async def main() -> list[bytes]:
        server, origin = await serve(handler)
        async with server:
            pool = ConnectionPool()
            first = (await get(pool, origin))[1]
            # The upstream drops the connection on the next request without answering: the
            # keep-alive race. The request is sent once more, on a new connection.
            second = (await get(pool, origin))[1]
            return [first, second]

    assert asyncio.run(main()) == [b"c0", b"c1"]
    assert connections == [0, 1]


def test_fresh_connection_closed_without_an_answer_is_an_error_not_a_retry() -> None:
    handler, connections = counting_handler(lambda connection, served, request: None)

    async def main() -> None:
        server, origin = await serve(handler)
        async with server:
            with pytest.raises(UpstreamProtocolError, match="closed the connection"):
                await get(ConnectionPool(), origin)

    asyncio.run(main())
    assert connections == [0]


def test_idle_connections_expire() -> None:
    handler, connections = counting_handler(lambda connection, served, request: ok(b"x"))

    async def main() -> None:
        server, origin = await serve(handler)
        async with server:
            pool = ConnectionPool(idle_expiry=0.05)
            await get(pool, origin)
            await asyncio.sleep(0.15)
            await get(pool, origin)
            await pool.aclose()

    asyncio.run(main())
    assert connections == [0, 1]


def test_refused_connection_is_a_connect_error() -> None:
    async def main() -> None:
        server, origin = await serve(lambda reader, writer: asyncio.sleep(0))
        server.close()
        await server.wait_closed()
        with pytest.raises(UpstreamConnectError, match="cannot connect"):
            await get(ConnectionPool(), origin)

    asyncio.run(main())


def answers(data: bytes, then_wait: float) -> Handler:
    """A server that reads one request, writes ``data``, waits, and closes the connection."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if data:
            writer.write(data)
            await writer.drain()
        await asyncio.sleep(then_wait)
        writer.close()

    return handler


@pytest.mark.parametrize(("handler", "error", "message"), [
    (answers(b"", 1.0), UpstreamTimeout, r"no response .* within 0\.2 s"),
    (answers(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf", 1.0), UpstreamTimeout,
     r"no data .* within 0\.2 s"),
    (answers(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part", 0.0),
     UpstreamProtocolError, "before the end"),
    (answers(b"HTTP/1.1 2OO NOT OK\r\n\r\n", 1.0), UpstreamProtocolError, "invalid HTTP"),
], ids=["silent", "stalls-mid-body", "dropped-mid-body", "invalid-http"])
def test_upstream_failures_are_the_errors_the_proxy_handles(
        handler: Handler, error: type[Exception], message: str) -> None:
    async def main() -> None:
        server, origin = await serve(handler)
        async with server:
            with pytest.raises(error, match=message):
                await get(ConnectionPool(), origin, read_timeout=0.2)
            server.close()

    asyncio.run(main())


def test_chunked_stream_arrives_piece_by_piece_not_buffered() -> None:
    async def main() -> list[bytes]:
        received_first = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            for index, part in enumerate((b"data: 1\n\n", b"data: 2\n\n")):
                writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                await writer.drain()
                if index == 0:  # the second piece only once the client has the first
                    await asyncio.wait_for(received_first.wait(), 5)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            writer.close()

        server, origin = await serve(handler)
        async with server:
            pieces = []
            async with await ConnectionPool().send(origin, "GET", b"/", []) as response:
                assert response.header(b"content-type") == b"text/event-stream"
                async for chunk in response.chunks():
                    pieces.append(chunk)
                    received_first.set()
            return pieces

    assert asyncio.run(main()) == [b"data: 1\n\n", b"data: 2\n\n"]


def test_body_until_close_and_interim_1xx_answers() -> None:
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)  # the interim answer arrives on its own
        writer.write(b"HTTP/1.1 201 Created\r\nconnection: close\r\n\r\nall of ")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"it")
        await writer.drain()
        writer.close()

    async def main() -> tuple[int, bytes]:
        server, origin = await serve(until_close)
        async with server:
            return await get(ConnectionPool(), origin)

    assert asyncio.run(main()) == (201, b"all of it")


def test_closing_a_response_early_closes_its_connection() -> None:
    """How a client that went away aborts the generation upstream: vLLM sees the close."""
    async def main() -> bool:
        upstream_saw_close = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            await writer.drain()
            if await reader.read(1) == b"":
                upstream_saw_close.set()
            writer.close()

        server, origin = await serve(handler)
        async with server:
            pool = ConnectionPool()
            response = await pool.send(origin, "GET", b"/", [])
            assert await response.chunks().__anext__() == b"first"
            await response.aclose()
            await asyncio.wait_for(upstream_saw_close.wait(), 5)
            return not pool._pools[origin].idle

    assert asyncio.run(main())


def test_pool_limit_waits_for_a_free_connection_then_times_out() -> None:
    handler, connections = counting_handler(lambda connection, served, request: ok(b"x"))

    async def main() -> None:
        server, origin = await serve(handler)
        async with server:
            pool = ConnectionPool(max_connections=1)
            held = await pool.send(origin, "GET", b"/", [])
            with pytest.raises(UpstreamTimeout, match="no free connection"):
                await get(pool, origin, pool_timeout=0.1)
            waiting = asyncio.ensure_future(get(pool, origin, pool_timeout=5))
            await asyncio.sleep(0.05)
            assert not waiting.done()
            assert await held.read() == b"x"
            await held.aclose()
            assert await waiting == (200, b"x")

    asyncio.run(main())
    assert connections == [0]  # the waiting request reused the freed connection


def test_slow_reader_pauses_the_upstream_and_still_gets_every_byte() -> None:
    size = 8 << 20

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        writer.write(b"z" * size)
        await writer.drain()
        writer.close()

    async def main() -> tuple[bool, int]:
        server, origin = await serve(handler)
        async with server:
            async with await ConnectionPool().send(origin, "GET", b"/", []) as response:
                await asyncio.sleep(0.3)  # nobody reads: the buffer fills, reading pauses
                paused = response._connection._paused
                buffered = response._buffered
                body = await response.read()
            return paused and buffered < size, len(body)

    assert asyncio.run(main()) == (True, size)


def test_head_requests_are_refused() -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="HEAD"):
            await ConnectionPool().send(Origin.from_url("http://127.0.0.1:1"), "HEAD", b"/", [])

    asyncio.run(main())
