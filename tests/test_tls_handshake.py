"""A TLS handshake is held no longer than the head deadline (``--header-timeout``).

A connection reaches the HTTP protocol, whose head deadline then starts, only once its TLS
handshake is complete; uvicorn creates its server with asyncio's (and uvloop's) default
handshake timeout, 60 s, so a client that opened connections and stalled their handshakes held
each for a minute. Real parts: uvicorn on uvloop with our options and a certificate made by
``openssl``, the middleware in front of a stand-in app (its ASGI lifespan is where the bound is
set, as in vLLM's server), raw sockets and the ``ssl`` module as clients.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from bregman_server.lifecycle import Lifecycle
from bregman_server.middleware import BregmanMiddleware
from bregman_server.settings import ServerSettings

from .test_server_support import free_port, self_signed_tls
from .test_server_units import AUTH, KEY, http_server, stub_app

HEAD_DEADLINE = 1.0


class TLSServed:
    def __init__(self, directory: Path) -> None:
        key, cert, self.client = self_signed_tls(directory)
        self.settings = ServerSettings(host="127.0.0.1", port=free_port(), api_key=KEY,
                                       header_timeout=HEAD_DEADLINE)
        app = BregmanMiddleware(stub_app(), settings=self.settings, lifecycle=Lifecycle())
        self.server = http_server(app, self.settings, log_level="warning",
                                  ssl_keyfile=str(key), ssl_certfile=str(cert))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSServed]:
    server = TLSServed(tmp_path_factory.mktemp("tls"))
    yield server
    server.stop()


def _held(connection: socket.socket, limit: float) -> float:
    """Seconds until the server closes ``connection`` (``limit``: the test gives up)."""
    connection.settimeout(limit)
    started = time.monotonic()
    try:
        while connection.recv(4096):
            pass
    except (ConnectionResetError, ssl.SSLError):
        pass
    except TimeoutError:
        return limit
    return time.monotonic() - started


def test_a_stalled_tls_handshake_is_closed_at_the_head_deadline(served: TLSServed) -> None:
    """A client that connects and sends nothing, or half a ClientHello: closed after the head
    deadline (1 s here), not asyncio's 60 s. The limit of 10 s leaves room for a loaded
    machine and is still 6x below the old hold."""
    for first in (b"", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"):
        with socket.create_connection(("127.0.0.1", served.settings.port)) as connection:
            if first:
                connection.sendall(first)
            held = _held(connection, 10.0)
        assert HEAD_DEADLINE * 0.9 <= held < 10.0, (first, held)


def test_tls_clients_are_served_and_a_silent_one_gets_the_head_deadline(served: TLSServed
                                                                        ) -> None:
    url = f"https://127.0.0.1:{served.settings.port}"
    with httpx.Client(verify=served.client, timeout=10) as client:
        response = client.post(url + "/v1/completions", headers=AUTH,
                               json={"prompt": "x", "bregman_top_k": 2})
        assert response.status_code == 200
        assert response.json()["received"]["vllm_xargs"]["bregman_top_k"] == 2
    # After a complete handshake, the head has its own deadline (408), as without TLS.
    with socket.create_connection(("127.0.0.1", served.settings.port)) as raw, \
            served.client.wrap_socket(raw, server_hostname="127.0.0.1") as connection:
        connection.settimeout(10)
        answer = connection.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
