"""Helpers for the live server tests (no tests here): real `bregman-serve` processes on loopback.

`ServerProcess` starts ``python -m bregman_server.cli ...`` in a session of its own, waits for its
/health, remembers every descendant it has seen (vLLM's engine processes), and
on teardown checks that a SIGTERM stopped them all, then SIGKILLs whatever is left so that a
failing test never leaves processes behind.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import re
import signal
import ssl
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ROOT / "models" / "tiny-llama"
#: Niceness of the engines of the servers the tests start (`ServerProcess.lower_engines`).
ENGINE_NICENESS = 5


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: A tool-parser plugin file (``--tool-parser-plugin``): a parser registered as "bregman-probe"
#: that "calls" the tool `bregman_probe` whatever the model wrote, so that a chat with tools shows
#: whether the file was loaded and is used.
TOOL_PARSER_PLUGIN = '''
from vllm.entrypoints.generate.base.protocol import FunctionCall, ToolCall
from vllm.tool_parsers import ToolParser, ToolParserManager
from vllm.tool_parsers.abstract_tool_parser import ExtractedToolCallInformation


@ToolParserManager.register_module("bregman-probe")
class ProbeToolParser(ToolParser):
    def extract_tool_calls(self, model_output, request):
        call = ToolCall(function=FunctionCall(name="bregman_probe", arguments="{}"))
        return ExtractedToolCallInformation(tools_called=True, tool_calls=[call], content=None)
'''


def self_signed_tls(directory: Path) -> tuple[Path, Path, ssl.SSLContext]:
    """A key and a self-signed certificate for 127.0.0.1 (made by ``openssl``), and a client
    context that trusts it and nothing else."""
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return key, cert, ssl.create_default_context(cafile=str(cert))


def require_tiny_model() -> Path:
    if not (TINY_MODEL / "config.json").exists():
        raise RuntimeError(f"{TINY_MODEL} is missing: run `python scripts/prepare_models.py "
                           "--only tiny` (make test does)")
    return TINY_MODEL


def server_environment() -> dict[str, str]:
    """Our environment minus BREGMAN_* settings (tests pass flags), with a small CPU KV cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BREGMAN_")}
    env.pop("VLLM_API_KEY", None)
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    # Long generations for the disconnect tests: the tiny model was trained on 256 positions.
    env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env




def _stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, pgid, state) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return int(fields[1]), int(fields[2]), fields[0]


#: What `comm` gives vLLM's engine processes: the kernel keeps 15 characters of a process's
#: name, so ``VLLM::EngineCore_DP0`` reads ``VLLM::EngineCor`` (a prefix of ``VLLM::EngineCore``
#: would match none of them).
ENGINE_COMMS = ("VLLM::EngineCor", "VLLM::Worker")


def comm(pid: int) -> str:
    """The process's name (what vLLM sets: ``VLLM::EngineCore_DP0``...), "" once it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as name:
            return name.read().strip()
    except OSError:
        return ""


def engine_processes(server: ServerProcess) -> list[int]:
    """The engines' processes (vLLM's EngineCore and any Worker) among ``server``'s
    descendants."""
    return [pid for pid in server.remember_descendants() if comm(pid).startswith(ENGINE_COMMS)]


def signal_all(pids: list[int], signum: int) -> None:
    """``signum`` to each of ``pids`` (SIGSTOP / SIGCONT: pausing the engines), those that
    have already exited skipped."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def assert_stream_ran_to_length(lines: list[str], choices: int) -> None:
    """A completion stream's SSE ``data:`` lines: ended by ``[DONE]``, no error event (a stream
    cut by a shutdown ends with one), every one of its ``choices`` finished by ``length``."""
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert not [event for event in events if "error" in event], "a stream was cut"
    finished = [choice["finish_reason"] for event in events for choice in event["choices"]
                if choice["finish_reason"]]
    assert finished == ["length"] * choices, finished


def descendants(root: int) -> set[int]:
    """Live (non-zombie) descendants of ``root``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _stat(int(entry))
            if info is not None and info[2] != "Z":
                children.setdefault(info[0], []).append(int(entry))
    found: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs. A process that has already released its memory on the way
    out (empty cmdline) counts as gone: on a loaded VM a killed vLLM worker can linger in the
    kernel for a minute in that state, but it can no longer do anything."""
    info = _stat(pid)
    if info is None or info[2] == "Z":
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return bool(cmdline.read())
    except (FileNotFoundError, ProcessLookupError):
        return False


def prometheus_value(text: str, name: str, default: float | None = None, **labels: str) -> float:
    """Sum of the samples of metric ``name`` whose labels include ``labels`` (``default`` when
    there is none; KeyError if there is no default)."""
    total = 0.0
    found = False
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not match or match.group(1) != name:
            continue
        sample = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(sample.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
            found = True
    if not found:
        if default is not None:
            return default
        raise KeyError(f"no sample {name}{labels}")
    return total


class ServerProcess:
    """One ``python -m bregman_server.cli`` process (or another ``module``, e.g. vLLM's own
    server) and everything it starts."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 port: int | None = None, module: str = "bregman_server.cli",
                 tls: ssl.SSLContext | None = None, cwd: Path = ROOT) -> None:
        self.module = module
        self.cwd = cwd  # (the working directory comes first on a ``-m`` module's path)
        self.port = port or free_port()
        self.args = ["--port", str(self.port), *args]
        self.log_path = log_path
        self.env = env if env is not None else server_environment()
        self.tls = tls  # a client context, for a server that serves HTTPS
        self.process: subprocess.Popen[bytes] | None = None
        self.seen: set[int] = set()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> ServerProcess:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", self.module, *self.args], cwd=self.cwd, env=self.env,
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        return self

    def lower_engines(self) -> None:
        """Run the server's engines (vLLM's ``EngineCore`` and ``Worker`` processes, which
        generate) below the tests' own priority, every thread (niceness is per thread on
        Linux): generating, an engine kept a test's client from running for 5 to 9 s on a loaded
        2-core machine (a 0.5 s read timeout raised after 9 s; a load test's head sent after the
        server's 3 s head deadline, a 408). The API servers stay at the tests' priority: they
        serve the tests' own attack traffic."""
        for pid in descendants(self.pid):
            with contextlib.suppress(OSError):
                title = Path(f"/proc/{pid}/cmdline").read_bytes()
                if not title.startswith((b"VLLM::EngineCore", b"VLLM::Worker")):
                    continue
                for thread in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError):
                        os.setpriority(os.PRIO_PROCESS, int(thread), ENGINE_NICENESS)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def remember_descendants(self) -> set[int]:
        current = descendants(self.pid)
        self.seen |= current
        return current

    def wait_healthy(self, timeout: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        with httpx.Client(trust_env=False, timeout=2, verify=self.tls or True) as client:
            while True:
                self.remember_descendants()
                if self.process.poll() is not None:
                    raise RuntimeError(f"server exited with {self.process.returncode}:\n"
                                       f"{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.url + "/health").status_code == 200:
                        self.remember_descendants()
                        self.lower_engines()
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not healthy after {timeout:g} s:\n"
                                       f"{self.log_tail()}")
                time.sleep(0.25)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM the server (only it: stopping vLLM is its job) and wait for it."""
        assert self.process is not None
        if self.process.poll() is None:
            self.remember_descendants()
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
        return self.process.returncode

    def leftovers(self, grace: float = 20.0) -> set[int]:
        """Processes it started that are still alive after ``grace`` seconds."""
        deadline = time.monotonic() + grace
        while True:
            left = {pid for pid in self.seen if alive(pid)}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def kill_everything(self) -> None:
        """Last resort, whatever happened: SIGKILL the server's and the children's groups."""
        groups = set()
        for pid in ({self.pid} | self.seen) if self.process is not None else set():
            info = _stat(pid)
            if info is not None:
                groups.add(info[1])
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        for pid in self.seen:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def shut_down(server: ServerProcess, expect_code: int | None = 0) -> None:
    """Teardown: SIGTERM, then assert a clean exit and no orphans (after killing them)."""
    try:
        code = server.stop()
        left = server.leftovers()
    finally:
        server.kill_everything()
    assert code is not None, f"server ignored SIGTERM:\n{server.log_tail()}"
    assert not left, f"processes left behind: {sorted(left)}"
    if expect_code is not None:
        assert code == expect_code, f"exit code {code}:\n{server.log_tail()}"


def shut_down_all(servers: Iterable[ServerProcess]) -> None:
    """Teardown of a module's servers, hiding nothing: one still running must stop on SIGTERM
    with exit code 0 and nothing left behind; one a test already ended (and checked: its exit
    code is the test's business) must have left nothing behind either. Every server is
    stopped before the first failure is raised."""
    failures: list[AssertionError] = []
    for server in servers:
        if server.process is None:
            continue
        ended = server.process.poll() is not None
        try:
            shut_down(server, expect_code=None if ended else 0)
        except AssertionError as failure:
            failures.append(failure)
    if failures:
        raise failures[0]


def finite_top_logprobs(entry: Any) -> int:
    """How many of one position's top logprobs are finite (vLLM clamps -inf to -9999)."""
    if isinstance(entry, dict):  # completions: {token: logprob}
        values = list(entry.values())
    else:  # chat: [{"token", "logprob", ...}] (dicts, or the SDK's objects)
        values = [item["logprob"] if isinstance(item, dict) else item.logprob for item in entry]
    return sum(1 for value in values if value > -9000)


# --- request bodies written the many ways vLLM reads them ------------------------------------

#: How `encode_body` writes a body. All but "gzip" are the same JSON object to vLLM's
#: ``json.loads``; "gzip" is the same bytes compressed, with ``Content-Encoding: gzip``.
BODY_ENCODINGS = ("utf-8", "escaped-keys", "ascii-escapes", "utf-8-bom", "utf-16", "utf-16-le",
                  "utf-16-be", "utf-32", "utf-32-le", "utf-32-be", "duplicate-keys", "gzip")

_BOMS = {"utf-8-bom": ("utf-8", b"\xef\xbb\xbf"), "utf-16": ("utf-16-le", b"\xff\xfe"),
         "utf-32": ("utf-32-le", b"\xff\xfe\x00\x00")}


def _escaped(key: str) -> str:
    """A JSON string for ``key`` with its first letter and every underscore as ``\\uXXXX``."""
    text = json.dumps(key)[1:-1]
    if text:
        text = f"\\u{ord(text[0]):04x}" + text[1:]
    return '"' + text.replace("_", "\\u005f") + '"'


def _write(value: Any, escape_keys: bool, decoys: bool, ascii_only: bool) -> str:
    """JSON text of ``value``; keys escaped, or each key written twice (a decoy value first: the
    last one wins), as asked."""
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            name = _escaped(key) if escape_keys else json.dumps(key, ensure_ascii=ascii_only)
            written = _write(item, escape_keys, decoys, ascii_only)
            if decoys:
                items.append(f"{name}: {json.dumps(_decoy(item))}")
            items.append(f"{name}: {written}")
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_write(item, escape_keys, decoys, ascii_only)
                               for item in value) + "]"
    return json.dumps(value, ensure_ascii=ascii_only)


def _decoy(value: Any) -> Any:
    """A different value of another kind, which would change the outcome if it were read."""
    return "decoy" if not isinstance(value, str) else 0


def encode_body(body: dict[str, Any], how: str) -> tuple[bytes, dict[str, str]]:
    """``body`` as raw bytes written ``how`` (one of BODY_ENCODINGS), and the headers that go
    with them."""
    import gzip

    headers = {"content-type": "application/json"}
    if how == "gzip":
        headers["content-encoding"] = "gzip"
        return gzip.compress(json.dumps(body).encode()), headers
    text = _write(body, escape_keys=how == "escaped-keys", decoys=how == "duplicate-keys",
                  ascii_only=how == "ascii-escapes")
    if how in _BOMS:
        codec, bom = _BOMS[how]
        return bom + text.encode(codec, "surrogatepass"), headers
    codec = how if how.startswith("utf-") else "utf-8"
    return text.encode(codec, "surrogatepass"), headers


#: POST routes of vLLM 0.32 whose handler has no request model (it reads the body itself, or
#: not at all): each was read and found not to turn its body into a SamplingParams, except
#: /invocations, which dispatches to the completion and chat handlers (`bregman_server.routes.
#: DISPATCHERS`). The scale-out routes are such stubs (a 403) unless --enable-scale-out. A new
#: one after a vLLM upgrade fails the tests until someone has read it.
REVIEWED_UNTYPED_POSTS = frozenset({
    "/invocations", "/ping", "/scale_elastic_ep", "/is_scaling_elastic_ep",
    "/v1/responses/{response_id}/cancel", "/inference/v1/abort_requests",
    "/v1/chat/completions/render", "/v1/messages/render", "/v1/completions/render",
    "/v1/responses/render", "/v1/chat/completions/derender", "/v1/completions/derender",
    "/inference/v1/generate"})


# --- the engine's Bregman metrics on /metrics (k*, exact path, failures) ----------------------

def top_k_oracle(counts: Callable[[dict[str, Any]], list[int]], requests: int, steps: int,
                 threads: int) -> dict[str, int]:
    """The top-k oracle: ``requests`` completions with ``bregman_top_k=2`` and as many without
    (the control), ``threads`` at a time; ``counts(extra_body)`` sends one and returns its
    finite top logprobs per step (under ``--logprobs-mode processed_logprobs``). No step of the
    oracle keeps more than 2 tokens; most steps of the control do. Returns the figures."""
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        oracle = [step for found in pool.map(counts, [{"bregman_top_k": 2}] * requests)
                  for step in found]
        control = [step for found in pool.map(counts, [{}] * requests) for step in found]
    figures = {"violations": sum(count > 2 for count in oracle), "steps": len(oracle),
               "control_over_2": sum(count > 2 for count in control),
               "control_steps": len(control)}
    assert len(oracle) == requests * steps and figures["violations"] == 0, oracle
    assert figures["control_over_2"] >= len(control) // 2, "the control must keep more than 2"
    return figures


def finished_requests(text: str, **labels: str) -> float:
    """Requests vLLM completed normally (stop / EOS or the length limit), by one /metrics text
    (``labels``: e.g. ``engine="1"`` for one data-parallel engine)."""
    return sum(prometheus_value(text, "vllm:request_success_total", default=0.0,
                                finished_reason=reason, **labels) for reason in ("stop", "length"))


def engine_counts(text: str) -> dict[str, float]:
    """The engine-side Bregman metrics of one /metrics text: k* observations and their sum by
    mode, exact-path rows by reason, failures; and vLLM's generated tokens per engine."""
    counts = {}
    for mode in ("primal", "dual"):
        counts[mode] = prometheus_value(text, "bregman_support_size_count", 0.0, mode=mode)
        counts[f"{mode}_sum"] = prometheus_value(text, "bregman_support_size_sum", 0.0,
                                                 mode=mode)
    for reason in ("family", "uncertified"):
        counts[reason] = prometheus_value(text, "bregman_exact_path_rows_total", 0.0,
                                          reason=reason)
    counts["failures"] = prometheus_value(text, "bregman_processor_failures_total", 0.0)
    for engine in sorted(set(re.findall(
            r'^vllm:generation_tokens_total\{[^}]*engine="(\d+)"', text, re.M))):
        counts[f"generated{engine}"] = prometheus_value(
            text, "vllm:generation_tokens_total", engine=engine)
    return counts


def scrape(url: str, headers: dict[str, str] | None = None) -> str:
    response = httpx.get(url + "/metrics", headers=headers or {}, timeout=30)
    assert response.status_code == 200, response.text
    return response.text


def wait_for_no_running_request(url: str, headers: dict[str, str] | None = None,
                                timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while prometheus_value(scrape(url, headers), "vllm:num_requests_running", 0.0) != 0:
        assert time.monotonic() < deadline, "vLLM still runs requests"
        time.sleep(0.25)


def complete_all(url: str, headers: dict[str, str] | None, bodies: list[dict[str, Any]]
                 ) -> int:
    """POST every body to /v1/completions at once; the completion tokens of all."""
    import concurrent.futures

    def one(body: dict[str, Any]) -> int:
        response = httpx.post(url + "/v1/completions", json=body, headers=headers or {},
                              timeout=120)
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["completion_tokens"])

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        return sum(pool.map(one, bodies))


def settled_counts(url: str, headers: dict[str, str] | None, done: Any,
                   timeout: float = 10.0) -> dict[str, float]:
    """The counts once ``done(counts)`` holds, or after ``timeout`` seconds (the caller then
    asserts): on a GPU the engine reads a step's k* a step later; on the CPU at once."""
    deadline = time.monotonic() + timeout
    while True:
        counts = engine_counts(scrape(url, headers))
        if done(counts) or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


def check_engine_metrics_add_up(url: str, model: str, headers: dict[str, str] | None = None,
                                engines: int = 1, requests: int = 4, tokens: int = 6,
                                off: dict[str, Any] | None = None) -> dict[str, float]:
    """The engine's Bregman metrics on the /metrics of the server at ``url`` (a real one):

    1. ``requests`` primal, dual and plain completions of exactly ``tokens`` tokens each, at
       once: the k* histogram's count grows by exactly the tokens decoded in each mode, plain
       requests add nothing, and every k* observed is that of the fixed top-2 support (the
       sum grows by 2 per token). ``off``: a plain request's fields (``{"bregman_mode":
       "off"}`` where the server has Bregman defaults).
    2. With ``engines`` > 1 (vLLM's data parallelism, one engine process per rank):
       ``2 * requests`` Bregman completions at once; every engine generated some of their
       tokens (vLLM's ``vllm:generation_tokens_total{engine}``), and the histogram's count,
       summed over the engine processes' files, grew by all of them.

    Returns the changes of step 1."""
    base = {"model": model, "prompt": "ROMEO:\n", "max_tokens": tokens, "temperature": 1.0,
            "ignore_eos": True}
    fields = {"primal": {"bregman_alpha": 1.5, "bregman_top_k": 2},
              "dual": {"bregman_mode": "dual", "bregman_alpha": 1.5, "bregman_top_k": 2},
              "plain": off or {}}
    wait_for_no_running_request(url, headers)
    before = engine_counts(scrape(url, headers))
    bodies = [{**base, **fields[kind], "seed": i} for i in range(requests) for kind in fields]
    generated = complete_all(url, headers, bodies)
    assert generated == 3 * requests * tokens
    expected = requests * tokens
    after = settled_counts(url, headers, lambda c: c["primal"] - before["primal"] >= expected
                           and c["dual"] - before["dual"] >= expected)
    change = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    assert change["primal"] == expected, change
    assert change["dual"] == expected, change  # plain requests added nothing to either
    assert change["primal_sum"] == change["dual_sum"] == 2 * expected, change
    assert change["failures"] == 0, change
    served = {key: value for key, value in change.items() if key.startswith("generated")}
    assert sum(served.values()) == generated, change  # vLLM's own count, over every engine
    if engines > 1:
        before = after
        bodies = [{**base, **fields[("primal", "dual")[i % 2]], "seed": i}
                  for i in range(2 * requests)]
        generated = complete_all(url, headers, bodies)
        total = before["primal"] + before["dual"] + generated
        after = settled_counts(url, headers, lambda c: c["primal"] + c["dual"] >= total)
        second = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
        served = {key: value for key, value in second.items() if key.startswith("generated")}
        assert len(served) == engines and all(value > 0 for value in served.values()), second
        assert second["primal"] + second["dual"] == sum(served.values()) == generated, second
    return change


# --- slow clients against the connection cap (issue 27, part 2) --------------------------------
#
# The attack: slow clients of five kinds that reconnect 0.1 s after each close, while
# clients that behave send completions. benchmarks/bench_connections.py runs it at full size.

MODEL = "models/tiny-llama"
SLOW_KINDS = ("idle", "slow-head", "slow-body-key", "slow-body-nokey", "chunked")


def _slow_request(kind: str, key: str) -> tuple[bytes, bytes]:
    """What a slow client of ``kind`` sends at once, and what it trickles byte by byte."""
    auth = f"Authorization: Bearer {key}\r\n".encode()
    start = b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    if kind == "idle":
        return b"", b""
    if kind == "slow-head":
        return b"", start + b"X-Filler: " + b"a" * 100_000
    if kind == "chunked":
        return start + auth + b"Transfer-Encoding: chunked\r\n\r\n", b"1\r\n \r\n" * 100_000
    with_key = auth if kind == "slow-body-key" else b""
    return start + with_key + b"Content-Length: 100000\r\n\r\n", b"{" + b" " * 99_999


async def _slow_client(kind: str, host: str, port: int, key: str, trickle: float,
                       reconnect: float, stop: float, counts: dict[str, int]) -> None:
    """One slow client until ``stop``: its request's first part at once, then a byte (a chunk)
    every ``trickle`` s; ``reconnect`` s after the server closes it, the same again."""
    loop = asyncio.get_running_loop()
    first, rest = _slow_request(kind, key)
    step = 8 if kind == "chunked" else 1
    while loop.time() < stop:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            counts["connect_failed"] += 1
            await asyncio.sleep(reconnect)
            continue
        counts["opened"] += 1
        sent = 0
        try:
            if first:
                writer.write(first)
            while loop.time() < stop:
                try:  # the server's answer or its close ends this connection
                    data = await asyncio.wait_for(reader.read(65536), trickle)
                except asyncio.TimeoutError:
                    data = None
                if data is not None:
                    if data[:12].startswith(b"HTTP/1.1 503"):
                        counts["answered_503"] += 1
                    if not data:
                        counts["closed_by_server"] += 1
                        break
                    continue
                if rest and sent < len(rest):
                    writer.write(rest[sent:sent + step])
                    sent += step
        except (ConnectionError, OSError):
            counts["closed_by_server"] += 1
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        await asyncio.sleep(reconnect)


async def _slow_clients(host: str, port: int, key: str, count: int, trickle: float,
                        reconnect: float, seconds: float) -> dict[str, int]:
    counts = dict.fromkeys(("opened", "connect_failed", "closed_by_server", "answered_503"), 0)
    stop = asyncio.get_running_loop().time() + seconds
    clients = []
    for i in range(count):
        clients.append(asyncio.create_task(_slow_client(
            SLOW_KINDS[i % len(SLOW_KINDS)], host, port, key, trickle, reconnect, stop, counts)))
        if i % 50 == 49:
            await asyncio.sleep(0)  # let the first ones connect while the rest start
    await asyncio.gather(*clients, return_exceptions=True)
    return counts


def _slow_process(args: tuple[Any, ...], results: Any) -> None:
    results.put(asyncio.run(_slow_clients(*args)))


def _legit_request(url: str, key: str) -> tuple[str, float]:
    """One completion on a fresh connection: (outcome, seconds)."""
    body = {"model": MODEL, "prompt": "ROMEO:\n", "max_tokens": 4, "temperature": 1.0}
    started = time.perf_counter()
    try:
        with httpx.Client(timeout=30, trust_env=False) as client:
            response = client.post(url + "/v1/completions", json=body,
                                   headers={"Authorization": f"Bearer {key}"})
        outcome = "ok" if response.status_code == 200 else str(response.status_code)
    except httpx.TimeoutException:
        outcome = "timeout"
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError,
            httpx.ConnectError) as error:
        outcome = "reset" if "reset" in str(error).lower() or isinstance(
            error, (httpx.ReadError, httpx.WriteError)) else type(error).__name__
    return outcome, time.perf_counter() - started


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def run_load(url: str, key: str, slow: int = 600, reconnect: float = 0.1, trickle: float = 1.0,
             seconds: float = 30.0, warmup: float = 3.0, legit_threads: int = 2
             ) -> dict[str, Any]:
    """``slow`` slow clients (the five kinds in equal shares, in a process of their own)
    against the server at ``url`` for ``warmup + seconds`` seconds; meanwhile, after
    ``warmup``, ``legit_threads`` threads each send completions (4 tokens, a fresh connection
    each) one after another. Returns the figures: legitimate requests, how many were served,
    how the others failed, the latency of those served, the slow clients' connections."""
    host, port = url.removeprefix("http://").split(":")
    results: Any = multiprocessing.get_context("spawn").Queue()
    attack = multiprocessing.get_context("spawn").Process(
        target=_slow_process, daemon=True,
        args=((host, int(port), key, slow, trickle, reconnect, warmup + seconds + 1.0), results))
    attack.start()
    outcomes: list[tuple[str, float]] = []
    lock = threading.Lock()
    try:
        time.sleep(warmup)
        stop = time.monotonic() + seconds

        def legit() -> None:
            while time.monotonic() < stop:
                outcome = _legit_request(url, key)
                with lock:
                    outcomes.append(outcome)

        with concurrent.futures.ThreadPoolExecutor(legit_threads) as pool:
            for future in [pool.submit(legit) for _ in range(legit_threads)]:
                future.result()
        slow_counts = results.get(timeout=warmup + seconds + 60)
    finally:
        attack.join(10)
        if attack.is_alive():
            attack.kill()
    served = [took for outcome, took in outcomes if outcome == "ok"]
    failures: dict[str, int] = {}
    for outcome, _ in outcomes:
        if outcome != "ok":
            failures[outcome] = failures.get(outcome, 0) + 1
    latency = {f"p{q}_ms": round(_percentile(served, q) * 1000, 1) for q in (50, 90)} \
        if served else {}
    if served:
        latency["max_ms"] = round(max(served) * 1000, 1)
        latency["mean_ms"] = round(statistics.fmean(served) * 1000, 1)
    return {"legit": len(outcomes), "served": len(served),
            "share": round(len(served) / len(outcomes), 3) if outcomes else None,
            "failures": failures, "latency": latency, "slow_clients": slow,
            "slow_connections": slow_counts}
