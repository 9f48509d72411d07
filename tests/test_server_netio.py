"""The asyncio network backend under the proxy's HTTP pool (server/netio.py), on real loopback
sockets served by small asyncio servers: keep-alive reuse, an idle connection the upstream closed
is never reused, and errors and timeouts come out as the httpx exceptions the proxy handles."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpcore
import httpx
import pytest

from server.netio import AsyncioBackend, asyncio_backend_supported, make_transport

pytestmark = pytest.mark.skipif(not asyncio_backend_supported(),
                                reason="the asyncio backend needs Python 3.11")

LIMITS = httpx.Limits(max_connections=4, max_keepalive_connections=4, keepalive_expiry=30.0)
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


def response(body: bytes, *, close: bool = False) -> bytes:
    connection = b"close" if close else b"keep-alive"
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: " + connection + b"\r\n\r\n" + body)


async def serve(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def test_the_pool_runs_on_the_asyncio_backend() -> None:
    transport = make_transport(LIMITS)
    assert isinstance(transport._pool._network_backend, AsyncioBackend)


def test_keep_alive_reuse_and_an_upstream_closed_idle_connection_is_not_reused() -> None:
    connections: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = len(connections)
        connections.append(number)
        served = 0
        while await read_request(reader) is not None:
            served += 1
            writer.write(response(f"conn {number} req {served}".encode()))
            await writer.drain()
            if number == 0 and served == 2:
                break  # like uvicorn's keep-alive timeout: close the idle connection silently
        writer.close()

    async def main() -> list[str]:
        server, url = await serve(handler)
        async with server, httpx.AsyncClient(transport=make_transport(LIMITS)) as client:
            texts = [(await client.get(url + "/a")).text, (await client.get(url + "/b")).text]
            await asyncio.sleep(0.2)  # the close reaches us while the connection is idle
            texts.append((await client.get(url + "/c")).text)
            return texts

    assert asyncio.run(main()) == ["conn 0 req 1", "conn 0 req 2", "conn 1 req 1"]


def test_refused_connection_is_an_httpx_connect_error() -> None:
    async def main() -> None:
        server, url = await serve(lambda r, w: asyncio.sleep(0))
        server.close()
        await server.wait_closed()
        async with httpx.AsyncClient(transport=make_transport(LIMITS)) as client:
            with pytest.raises(httpx.ConnectError):
                await client.get(url)

    asyncio.run(main())


def test_silent_upstream_is_an_httpx_read_timeout() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)  # never answers in time
        writer.close()

    async def main() -> None:
        server, url = await serve(handler)
        async with server, httpx.AsyncClient(transport=make_transport(LIMITS)) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.get(url, timeout=httpx.Timeout(5.0, read=0.3))

    asyncio.run(main())


def test_connection_dropped_mid_body_is_an_httpx_protocol_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
        await writer.drain()
        writer.close()

    async def main() -> None:
        server, url = await serve(handler)
        async with server, httpx.AsyncClient(transport=make_transport(LIMITS)) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get(url)

    asyncio.run(main())


def test_stream_reads_arrive_as_sent() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def main() -> list[bytes]:
        server, url = await serve(handler)
        async with server, httpx.AsyncClient(transport=make_transport(LIMITS)) as client, \
                client.stream("GET", url) as streamed:
            return [chunk async for chunk in streamed.aiter_raw()]

    assert b"".join(asyncio.run(main())) == b"data: 1\n\ndata: 2\n\n"


def test_backend_errors_are_httpcore_types() -> None:
    async def main() -> None:
        backend = AsyncioBackend()
        with pytest.raises(httpcore.ConnectError):
            await backend.connect_tcp("127.0.0.1", 1, timeout=2.0)

    asyncio.run(main())
