"""vLLM's data parallelism and several API servers under `bregman-serve`, on the CPU, the tiny
model. Two deployments, started together for the module:

* the data-parallel one, ``--data-parallel-size 2 --api-server-count 2`` (two engines, two API
  server processes on one port, the process that started them, and bregman-serve's supervisor
  above it):

  * the middleware in every API server process: on each (found by who owns the connection) a
    request without the key is a 401, a bad field a 400 naming it, with the key a 200;
  * the processor in every engine: the engines' Bregman metrics add up over both (the check of
    tests/test_server_support.py, which needs a data-parallel server: this one), and the top-k
    oracle (``--logprobs-mode processed_logprobs``, ``bregman_top_k=2`` leaves at most 2 tokens
    above -9000 at every step) over requests that vLLM spread over both engines (its per-engine
    ``vllm:request_success_total``);
  * the lifecycle: SIGTERM to the server's whole process group with streams open on both API
    servers: new requests get 503 while the open streams run to their end (the drain), then
    the server exits 0 and leaves nothing behind (last: it ends the deployment);
  * the ready line, once every API server serves;

* one engine behind two API servers over TLS (``--ssl-keyfile`` / ``--ssl-certfile``, a
  certificate made here with ``openssl``) with a tool-parser plugin file
  (``--tool-parser-plugin``): the official `openai` client over HTTPS (Bregman fields honoured,
  the plugin's parser answering a chat with tools), plain HTTP refused; then its engine is killed
  and every API server answers 503 ``engine_dead`` before the server exits with status 3 (last:
  it ends the deployment).

Plus the unit checks of what `bregman_server.engine` decides before vLLM starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from bregman_server import engine
from bregman_server.settings import ServerSettings

from .test_server_support import (
    ENGINE_COMMS,
    TOOL_PARSER_PLUGIN,
    ServerProcess,
    assert_stream_ran_to_length,
    check_engine_metrics_add_up,
    comm,
    engine_processes,
    finished_requests,
    finite_top_logprobs,
    require_tiny_model,
    scrape,
    self_signed_tls,
    shut_down_all,
    signal_all,
    top_k_oracle,
)

MODEL = "models/tiny-llama"
PROMPT = "ROMEO:\n"
KEY = secrets.token_hex(8)
AUTH = {"Authorization": f"Bearer {KEY}"}
GRACE = 240  # seconds: over twice what the streams needed on a 2-core machine at half speed (101 s)
ARGS = ["--model", MODEL, "--api-key", KEY, "--logprobs-mode", "processed_logprobs",
        "--enforce-eager", "--max-model-len", "4096", "--max-num-seqs", "32",
        "--graceful-timeout", str(GRACE), "--data-parallel-size", "2", "--api-server-count", "2",
        # The drain test's connections may wait for a while on a loaded machine.
        "--header-timeout", str(GRACE), "--keep-alive-timeout", str(GRACE)]
READY = re.compile(r"^bregman-serve ready on http://127\.0\.0\.1:(\d+) \(vLLM \S+, model "
                   r"models/tiny-llama, data parallel 2, 2 API servers\)$", re.M)
TLS_ARGS = ["--model", MODEL, "--api-key", KEY, "--logprobs-mode", "processed_logprobs",
            "--enforce-eager", "--max-model-len", "512", "--api-server-count", "2",
            "--enable-auto-tool-choice", "--tool-call-parser", "bregman-probe"]
TLS_READY = re.compile(r"^bregman-serve ready on https://127\.0\.0\.1:(\d+) \(vLLM \S+, model "
                       r"models/tiny-llama, data parallel 1, 2 API servers\)$", re.M)

#: Figures for the closing note (printed by tests/conftest.py).
FIGURES: dict[str, Any] = {}


# --- before vLLM starts ---------------------------------------------------------------------------

@pytest.fixture
def namespace(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(engine, "vllm_is_cpu_build", lambda: False)

    def parse(*args: str) -> Any:
        return engine.vllm_namespace(ServerSettings(model=MODEL), list(args))

    return parse


@pytest.mark.parametrize(("args", "count"), [
    ([], 1),
    (["--data-parallel-size", "2"], 2),  # vllm serve's default: one API server per rank
    (["--data-parallel-size", "4", "--api-server-count", "1"], 1),
    (["--api-server-count", "3"], 3),
    (["--data-parallel-size", "2", "--data-parallel-rank", "1"], 1),  # an external balancer
    (["--data-parallel-size", "4", "--data-parallel-size-local", "2",
      "--data-parallel-start-rank", "2"], 2),  # hybrid: the node's own ranks
    (["--data-parallel-size", "2", "--enable-elastic-ep"], 1),  # vllm serve caps it at 1
])
def test_api_server_count_follows_vllm_serve(namespace: Any, args: list[str], count: int
                                             ) -> None:
    assert engine.api_server_count(namespace(*args)) == count


def test_bad_combinations_of_vllm_flags_exit_2(namespace: Any,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's own checks raise ValueError; bregman-serve exits 2 with the message."""
    with pytest.raises(SystemExit) as exited:
        namespace("--data-parallel-size", "2", "--data-parallel-multi-port-external-lb")
    assert exited.value.code == 2
    assert "requires --data-parallel-size-local >= 2" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["--api-server-count", "0"], "--api-server-count 0 is vLLM's headless mode"),
    (["--data-parallel-size", "2", "--data-parallel-external-lb", "--data-parallel-hybrid-lb"],
     "more than one data parallel load balancing mode"),
    (["--data-parallel-size", "2", "--data-parallel-rank", "0", "--data-parallel-start-rank",
      "0"], "more than one data parallel load balancing mode"),
])
def test_what_vllm_serve_refuses_before_its_launcher_exits_2(
        namespace: Any, args: list[str], message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`vllm serve`'s checks of its own command (not in the argument validation bregman-serve
    calls): no API server (headless), two load-balancing modes."""
    with pytest.raises(SystemExit) as exited:
        namespace(*args)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--headless", "--data-parallel-multi-port-external-lb",
                                  "--grpc"])
def test_modes_without_our_http_server_are_refused(namespace: Any, flag: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """No silent server without the middleware: exit 2, naming the flag."""
    extra = ["--data-parallel-size", "2", "--data-parallel-size-local", "2"] if (
        "multi-port" in flag) else []
    with pytest.raises(SystemExit) as exited:
        namespace(flag, *extra)
    assert exited.value.code == 2
    assert f"{flag} is not supported by bregman-serve" in capsys.readouterr().err


def test_server_log_survives_vllms_app(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's app imports a library (model_hosting_container_standards) that sets the root
    logger and its handlers to ERROR: the server's own log (drain, engine death) stays at its
    level."""
    import logging

    from bregman_server.engine import configure_logging

    configure_logging("info")
    import model_hosting_container_standards.logging_config  # noqa: F401

    logging.getLogger("bregman_server.engine").info("still visible")
    assert "INFO bregman_server.engine: still visible" in capsys.readouterr().err


# --- the live server ---------------------------------------------------------------------------

class Live:
    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.tls = server.tls
        self.api_servers = sorted(pid for pid in server.remember_descendants()
                                  if comm(pid).startswith("VLLM::APIServer"))
        self.engines = sorted(pid for pid in server.remember_descendants()
                              if comm(pid).startswith(ENGINE_COMMS[0]))

    @property
    def url(self) -> str:
        return self.server.url

    def connect(self, timeout: float = 60) -> socket.socket:
        """A connection to the server (TLS-wrapped when it serves HTTPS)."""
        connection = socket.create_connection(("127.0.0.1", self.server.port), timeout=timeout)
        if self.tls is None:
            return connection
        return self.tls.wrap_socket(connection, server_hostname="127.0.0.1")

    def metrics(self) -> str:
        return scrape(self.url, AUTH)

    def finished_per_engine(self) -> list[float]:
        text = self.metrics()
        return [finished_requests(text, engine=str(rank)) for rank in (0, 1)]

    def owner(self, local_port: int, within: float = 30.0) -> int | None:
        """The API server process holding the server side of a client connection (None if no
        API server accepted it within ``within`` seconds)."""
        return self.owners([local_port], within)[0]

    def owners(self, local_ports: list[int], within: float = 120.0) -> list[int | None]:
        """`owner` of several connections, found together: the kernel's table of TCP sockets
        (/proc/net/tcp, read once per try) gives each server-side socket's inode, the API
        servers' file descriptors its process. (psutil's per-process lookup reads the whole
        table once per process and call: seconds each after the suite's thousands of
        connections.)"""
        deadline = time.monotonic() + within
        found: dict[int, int] = {}
        while True:
            inodes = _server_side_inodes(self.server.port, set(local_ports) - set(found))
            if inodes:
                for pid in self.api_servers:
                    try:
                        fds = os.listdir(f"/proc/{pid}/fd")
                    except OSError:  # (an API server whose drain has ended: gone)
                        continue
                    for fd in fds:
                        with contextlib.suppress(OSError):
                            target = os.readlink(f"/proc/{pid}/fd/{fd}")
                            if target in inodes:
                                found[inodes[target]] = pid
            if len(found) == len(set(local_ports)) or time.monotonic() > deadline:
                return [found.get(port) for port in local_ports]
            time.sleep(0.01)


def _server_side_inodes(server_port: int, client_ports: set[int]) -> dict[str, int]:
    """``socket:[inode]`` of each loopback connection from one of ``client_ports`` to
    ``server_port``, server side (IPv4: the servers listen on 127.0.0.1)."""
    inodes: dict[str, int] = {}
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            local, remote = int(fields[1].rsplit(":", 1)[1], 16), int(
                fields[2].rsplit(":", 1)[1], 16)
            if local == server_port and remote in client_ports:
                inodes[f"socket:[{fields[9]}]"] = remote
    return inodes


def wait_ready(server: ServerProcess, ready: re.Pattern[str]) -> Live:
    """Wait for ``server``'s ready line (/health answers once one API server serves; the ready
    line once both do)."""
    server.wait_healthy(timeout=600)
    deadline = time.monotonic() + 300
    while not ready.search(server.log_tail(10**7)):
        assert time.monotonic() < deadline, server.log_tail()
        assert server.process is not None and server.process.poll() is None
        time.sleep(0.2)
    return Live(server)


class Deployments:
    def __init__(self, parallel: Live, tls: Live) -> None:
        self.parallel, self.tls = parallel, tls


@pytest.fixture(scope="module")
def deployments(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployments]:
    """Both deployments, started at once (each test that ends one checks how it ended)."""
    require_tiny_model()
    logs = tmp_path_factory.mktemp("dp-logs")
    key, cert, client = self_signed_tls(logs)
    plugin = logs / "probe_tool_parser.py"
    plugin.write_text(TOOL_PARSER_PLUGIN)
    parallel = ServerProcess(ARGS, logs / "server.log")
    tls = ServerProcess([*TLS_ARGS, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                         "--tool-parser-plugin", str(plugin)], logs / "tls.log", tls=client)
    started = time.monotonic()
    try:
        parallel.start()
        tls.start()
        made = Deployments(wait_ready(parallel, READY), wait_ready(tls, TLS_READY))
        FIGURES["start_seconds"] = round(time.monotonic() - started, 1)
        yield made
    finally:
        shut_down_all((parallel, tls))


@pytest.fixture
def live(deployments: Deployments) -> Live:
    return deployments.parallel


@pytest.mark.server
@pytest.mark.timeout(900)
def test_ready_line_and_process_layout(live: Live) -> None:
    assert [int(port) for port in READY.findall(live.server.log_tail(10**7))] == [
        live.server.port]
    assert len(live.api_servers) == 2 and len(live.engines) == 2
    # bregman-serve's process stays in the caller's group; the server and everything it
    # started live in a session of their own.
    server = [pid for pid in live.server.remember_descendants()
              if os.getsid(pid) == pid and pid != live.server.pid]
    assert len(server) == 1
    assert {os.getsid(pid) for pid in live.api_servers + live.engines} == set(server)
    assert os.getsid(live.server.pid) != server[0]


@pytest.mark.server
@pytest.mark.timeout(900)
def test_middleware_and_key_in_every_api_server(live: Live) -> None:
    """Connections go to the least loaded API server: held open, they spread over both."""
    held: list[socket.socket] = []
    try:
        bad = json.dumps({"model": MODEL, "prompt": PROMPT, "bregman_top_k": 0}).encode()
        for connection in _one_connection_per_api_server(live, held).values():
            status, body = _exchange(connection, b"GET", b"/metrics", b"")
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
            status, body = _exchange(connection, b"POST", b"/v1/completions", bad, auth=True)
            assert status == 400 and body["error"]["param"] == "bregman_top_k", body
            status, body = _exchange(connection, b"GET", b"/v1/models", b"", auth=True)
            assert status == 200 and body["data"][0]["id"] == MODEL
    finally:
        for connection in held:
            connection.close()


def _one_connection_per_api_server(live: Live, held: list[socket.socket]
                                   ) -> dict[int, socket.socket]:
    """Connections opened until each API server holds one (every connection opened is put in
    ``held``, for the caller to close); one per API server, by its process ID."""
    owners: dict[int, socket.socket] = {}
    while len(owners) < 2 and len(held) < 16:
        connection = live.connect()
        held.append(connection)
        owner = live.owner(connection.getsockname()[1])
        assert owner is not None
        owners.setdefault(owner, connection)
    assert sorted(owners) == live.api_servers
    return owners


def _exchange(connection: socket.socket, method: bytes, path: bytes, body: bytes,
              auth: bool = False) -> tuple[int, Any]:
    """One HTTP/1.1 request on a kept-alive connection; (status, JSON body or None)."""
    headers = b"Host: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
    if auth:
        headers += f"Authorization: Bearer {KEY}\r\n".encode()
    connection.sendall(method + b" " + path + b" HTTP/1.1\r\n" + headers + b"\r\n" + body)
    reader = connection.makefile("rb")
    status = int(reader.readline().split()[1])
    length = 0
    while (line := reader.readline().strip()):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
    data = reader.read(length)
    return status, json.loads(data) if data else None


@pytest.mark.server
@pytest.mark.timeout(900)
def test_oracle_on_both_engines(live: Live) -> None:
    before = live.finished_per_engine()

    def counts(extra: dict[str, Any]) -> list[int]:
        response = httpx.post(live.url + "/v1/completions", headers=AUTH, timeout=120, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0,
            "logprobs": 5, **extra})
        assert response.status_code == 200, response.text
        return [finite_top_logprobs(entry)
                for entry in response.json()["choices"][0]["logprobs"]["top_logprobs"]]

    FIGURES["oracle"] = top_k_oracle(counts, requests=24, steps=6, threads=8)
    served = [after - start for after, start in
              zip(live.finished_per_engine(), before, strict=True)]
    FIGURES["oracle"]["served_per_engine"] = served
    assert sum(served) == 48 and min(served) > 0, f"both engines serve: {served}"


@pytest.mark.server
@pytest.mark.timeout(900)
def test_engine_metrics_add_up_over_engines_and_api_servers(live: Live) -> None:
    """The engines' Bregman metrics (k*, exact path, failures) on /metrics, summed over both
    engine processes, whichever API server answers the scrape."""
    check_engine_metrics_add_up(live.url, MODEL, headers=AUTH, engines=2)


@pytest.mark.server
@pytest.mark.timeout(900)
def test_sigterm_to_the_process_group_drains_every_api_server(live: Live) -> None:
    """``kill -- -PGID`` with streams open on both API servers: the engines keep running
    (they are not in that group), each API server refuses new requests (/health and a
    completion, 503 ``shutdown``) while its streams run to their end, then the server stops
    everything and exits 0."""
    # Streams that outlast the seconds a test process can go without running on a loaded
    # 2-core machine (seen: 7.6 s), so that both refusals are checked inside the drains.
    # Every stream still runs at the signal by construction: until each has its first tokens
    # the engines run in 50 ms slices (SIGSTOP / SIGCONT from this process), and they stay
    # paused across the signal and the refusals. (Before, everything between the streams'
    # start and the signal ran while the engines generated: the owners' lookup in /proc and
    # the first tokens' wait took about half of the streams' run (ended 39 to 52 s after the
    # signal; in a later loaded run the signal came 12.8 s after the start, one stream had
    # 58 % of its bytes), and under a loaded `make test` one stream had every byte before
    # the signal, another all but 4 %.) The owners' lookup for connections its first pass
    # misses runs during the drain.
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 4000, "n": 4,
                       "ignore_eos": True, "stream": True}).encode()
    results: dict[int, Any] = {}
    reading = threading.Event()
    reading.set()
    held: list[socket.socket] = []
    connections: list[socket.socket] = []
    engines: list[int] = []
    try:
        # One kept-alive connection per API server, accepted and answered before the streams
        # start (so that nothing but their first tokens comes between them and the signal): the
        # refusal is checked on each of them. (A new connection would wait for a busy API
        # server to accept it, and one still queued when the drains end is reset with the
        # listening socket.)
        probes = _one_connection_per_api_server(live, held)
        for probe in probes.values():
            assert _exchange(probe, b"GET", b"/health", b"")[0] == 200
        connections += [live.connect(timeout=GRACE) for _ in range(4)]
        started = [threading.Event() for _ in connections]
        threads = [threading.Thread(target=_read_stream, args=(
            connection, body, results, index, started[index], reading))
            for index, connection in enumerate(connections)]
        engines.extend(engine_processes(live.server))
        assert len(engines) >= 2, "the two engines were not found"
        begun = time.monotonic()
        for thread in threads:
            thread.start()
        while not all(event.is_set() for event in started):  # each stream's first tokens
            assert time.monotonic() - begun < 120, "a stream never started"
            # (once a stream runs, shorter slices: on a loaded machine a stream that started
            # early once ran to its end, every byte before the signal, while the slowest one
            # waited for its first tokens)
            signal_all(engines, signal.SIGCONT)
            time.sleep(0.01 if any(event.is_set() for event in started) else 0.05)
            signal_all(engines, signal.SIGSTOP)
            time.sleep(0.05)  # (the API servers send what the engines made)
        # The readers pause while the refusals are checked: woken by a stream's bytes, four of
        # them kept this thread from running for up to 20 s on a loaded machine.
        reading.clear()
        ports = [connection.getsockname()[1] for connection in connections]
        owners = live.owners(ports, within=0.0)  # one pass (its misses: after the signal)
        assert not results, f"a stream ended before the signal: {sorted(results)}, {owners}"
        signalled = time.monotonic()
        os.killpg(os.getpgid(live.server.pid), signal.SIGTERM)
        refused = {pid: _refused_on(probe, "shutdown") - signalled
                   for pid, probe in probes.items()}
        signal_all(engines, signal.SIGCONT)  # the drains: the streams run to their end
        # Those the first pass missed, during the drain (each connection accepted long before),
        # briefly: in two loaded runs one of the four was not found in 120 s, its stream
        # answered (the cause is not known). Such a stream stays out of the per-server
        # accounting below (it is still checked to run to its length); those found must cover
        # both API servers.
        missing = [port for port, owner in zip(ports, owners, strict=True) if owner is None]
        found = dict(zip(missing, live.owners(missing, within=10.0), strict=True))
        owners = [owner if owner is not None else found[port]
                  for port, owner in zip(ports, owners, strict=True)]
        looked_up = time.monotonic() - signalled
        reading.set()
        assert {owner for owner in owners if owner is not None} == set(live.api_servers), (
            f"streams on both: {owners}")
        for thread in threads:
            thread.join(GRACE + 60)
    finally:
        signal_all(engines, signal.SIGCONT)
        reading.set()
        for connection in connections + held:
            connection.close()
    assert live.server.process is not None
    code = live.server.process.wait(GRACE + 60)
    exited = time.monotonic() - signalled
    ends, after = [], []
    last_end = dict.fromkeys(live.api_servers, 0.0)  # when each API server's last stream ended
    for index, (status, lines, ended, blocks) in results.items():
        if owners[index] is not None:
            last_end[owners[index]] = max(last_end[owners[index]], ended - signalled)
        # Each stream was still being generated when the signal came (4000 tokens take
        # seconds): part of it arrived after.
        after.append(round(sum(size for when, size in blocks if when > signalled)
                           / sum(size for _, size in blocks), 2))
        # (once, under a loaded `make test`, a stream had every byte before the signal: its
        # status, its last lines and when it ended say why, next time)
        assert after[-1] > 0, (after, status, lines[-3:], round(ended - signalled, 1), owners)
        assert status == 200, lines[-3:]
        assert_stream_ran_to_length(lines, 4)
        ends.append(round(ended - signalled, 1))
    # Each API server refused while it still had a stream to finish (its drain).
    assert all(refused[pid] < last_end[pid] for pid in live.api_servers), (refused, last_end)
    FIGURES["drain"] = {"streams": len(ends), "stream_ends_after_signal_s": sorted(ends),
                        "refused_after_signal_s": sorted(round(seconds, 2)
                                                         for seconds in refused.values()),
                        "share_of_bytes_after_signal": sorted(after),
                        "grace_s": GRACE, "exit_code": code, "exit_after_s": round(exited, 1),
                        "signal_after_streams_began_s": round(signalled - begun, 1),
                        "owners_found_after_signal_s": round(looked_up, 1),
                        "streams_not_attributed": owners.count(None)}
    assert len(ends) == 4 and code == 0
    assert not live.server.leftovers(), "processes left behind"


def _refused_on(connection: socket.socket, code: str, within: float = 60.0) -> float:
    """When the API server holding ``connection`` began to refuse with ``code`` (shutdown,
    engine_dead): /health again until it is 503 (a signal reaches each API server through the
    process that started it, a moment later), then a completion on the same connection, 503
    too."""
    deadline = time.monotonic() + within
    while (answer := _exchange(connection, b"GET", b"/health", b""))[0] == 200:
        assert time.monotonic() < deadline, "still healthy after the signal"
        time.sleep(0.05)
    when = time.monotonic()
    status, body = answer
    assert status == 503 and body["error"]["code"] == code, answer
    completion = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).encode()
    status, body = _exchange(connection, b"POST", b"/v1/completions", completion, auth=True)
    assert status == 503 and body["error"]["code"] == code, (status, body)
    return when


def _read_stream(connection: socket.socket, body: bytes, results: dict[int, Any], index: int,
                 started: threading.Event, reading: threading.Event) -> None:
    """POST a streamed completion on ``connection`` and read it to the end, in large blocks,
    while ``reading`` is set: (status, the SSE lines, when it ended, (when, size) of each block
    read). ``started`` is set at the first token."""
    connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                       b"Content-Type: application/json\r\nAuthorization: Bearer "
                       + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    blocks: list[bytes] = []
    arrivals: list[tuple[float, int]] = []
    while reading.wait() and (block := connection.recv(1 << 20)):
        blocks.append(block)
        arrivals.append((time.monotonic(), len(block)))
        if b"data: {" in block:
            started.set()
        # Let tokens gather in the socket's buffer: a reader woken at every token would hold
        # the interpreter's lock and starve the thread that sends the signal and the requests.
        time.sleep(0.05)
    started.set()
    head, _, rest = b"".join(blocks).partition(b"\r\n\r\n")
    payload, at = [], 0
    while at < len(rest):  # chunked transfer encoding: hex size, CRLF, data, CRLF
        end = rest.index(b"\r\n", at)
        size = int(rest[at:end], 16)
        payload.append(rest[end + 2:end + 2 + size])
        at = end + 2 + size + 2  # (by offset: slicing off the rest is quadratic in the stream)
    lines = [line for line in b"".join(payload).decode().splitlines() if line]
    results[index] = (int(head.split()[1]), lines, arrivals[-1][0], arrivals)


@pytest.mark.server
@pytest.mark.timeout(900)
def test_https_with_the_openai_client_and_a_tool_parser_plugin(deployments: Deployments
                                                                ) -> None:
    """``--ssl-keyfile`` / ``--ssl-certfile`` reach vLLM's uvicorn in every API server: the
    `openai` client, trusting only the certificate made here, gets completions whose Bregman
    fields were honoured (at most 2 tokens above -9000 at every step with ``bregman_top_k=2``)
    and a chat answered by the plugin's tool parser (``--tool-parser-plugin``, loaded into the
    API server processes); plain HTTP gets no HTTP answer."""
    live = deployments.tls
    assert [int(port) for port in TLS_READY.findall(live.server.log_tail(10**7))] == [
        live.server.port]
    assert live.tls is not None
    tools = [{"type": "function", "function": {
        "name": "bregman_probe", "parameters": {"type": "object", "properties": {}}}}]
    with httpx.Client(verify=live.tls, timeout=120) as http:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, http_client=http,
                               max_retries=0)
        completion = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, logprobs=5,
            extra_body={"bregman_top_k": 2})
        steps = [finite_top_logprobs(entry)
                 for entry in completion.choices[0].logprobs.top_logprobs]
        assert len(steps) == 6 and max(steps) <= 2, steps
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                      extra_body={"bregman_top_k": 0})
        assert refused.value.param == "bregman_top_k"
        chat = client.chat.completions.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hello"}],
            tools=tools)
        calls = chat.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "bregman_probe", chat
    # The plugin in each API server process (on a TLS connection each of them holds).
    held: list[socket.socket] = []
    try:
        body = json.dumps({"model": MODEL, "max_tokens": 4, "tools": tools,
                           "messages": [{"role": "user", "content": "Hello"}]}).encode()
        for connection in _one_connection_per_api_server(live, held).values():
            status, answer = _exchange(connection, b"POST", b"/v1/chat/completions", body,
                                       auth=True)
            assert status == 200, answer
            calls = answer["choices"][0]["message"]["tool_calls"]
            assert calls[0]["function"]["name"] == "bregman_probe", answer
    finally:
        for connection in held:
            connection.close()
    with socket.create_connection(("127.0.0.1", live.server.port), timeout=30) as plain:
        plain.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        with contextlib.suppress(ConnectionResetError):
            assert not plain.recv(64).startswith(b"HTTP/")
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{live.server.port}/health", timeout=30)


@pytest.mark.server
@pytest.mark.timeout(900)
def test_engine_death_reaches_every_api_server(deployments: Deployments) -> None:
    """The engine killed (SIGKILL to the TLS deployment's EngineCore): the API servers, whose
    engine clients did not start the engine, hear it from the process that did, and each (on a
    connection it holds) answers /health and a completion with 503 engine_dead; then the server
    exits with status 3 and leaves nothing behind."""
    dead = deployments.tls
    server = dead.server
    held: list[socket.socket] = []
    try:
        connections = _one_connection_per_api_server(dead, held).values()
        server.remember_descendants()
        os.kill(dead.engines[-1], signal.SIGKILL)
        for connection in connections:
            _refused_on(connection, "engine_dead", within=10)
        for connection in held:
            connection.close()
        assert server.process is not None and server.process.wait(120) == 3
        assert not server.leftovers(), "processes left behind"
    finally:
        for connection in held:
            connection.close()
        server.kill_everything()
