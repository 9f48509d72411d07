"""No engine outlives its server: whatever kills a server, at any moment, nothing of it is left.

vLLM 0.32's ``EngineCore`` watches no parent (vLLM issue 55510): killed with SIGKILL, an API
server left its ``EngineCore``, ``Worker`` and multiprocessing's resource tracker running for
good, and so did ``bregman-serve`` killed while its engine loaded (the server process lost the
parent-death signal's SIGTERM while vLLM was starting, and went on to serve). What each test
counts: the processes of the sessions it started (the launcher's, the server's) and every
descendant it saw, still running 20 s after the kill (the requirement; the mechanisms take at
most about 13 s: an orphaned engine is noticed within 0.5 s and killed 5 s later if vLLM's own
shutdown has not ended it, bregman-serve's server is killed with its process group 12 s after its
supervisor). Real processes throughout: `bregman-serve`, vLLM's own API server with the
middleware, an offline ``LLM`` in a script, each on the tiny model with a real CPU engine;
the mechanism alone (`bregman_vllm.lifeline`) with plain multiprocessing children, forked and
spawned.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from .test_server_support import (
    ROOT,
    alive,
    descendants,
    free_port,
    require_tiny_model,
    server_environment,
)

MODEL = "models/tiny-llama"
# (no torch.compile on a cold CI machine; long generations: server_environment allows them)
MODEL_LEN = 8192
ENGINE = ["--enforce-eager", "--max-num-seqs", "4"]
#: The drained request's context: the tiny model writes about 700 tokens/s on this machine, so a
#: whole one lasts well past the drain's 10 s (a longer context costs vLLM's start elsewhere).
DRAINED_LEN = 32768
#: The requirement: nothing of a killed server is left this many seconds after the kill.
LEFT_AFTER = 20.0

pytestmark = [pytest.mark.engine, pytest.mark.server]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _session_members(sessions: set[int]) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry)) in sessions and alive(int(entry)):
                    found.add(int(entry))
    return found


class Started:
    """A process started in a session of its own, with everything it starts: what is seen of
    it (descendants, their sessions) is remembered, so that what is left can be counted."""

    def __init__(self, command: list[str], log: Path, env: dict[str, str] | None = None
                 ) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=env or server_environment(), stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.seen: set[int] = set()
        self.sessions = {self.process.pid}

    def look(self) -> set[int]:
        current = descendants(self.process.pid)
        self.seen |= current
        for pid in current:
            with contextlib.suppress(OSError):
                self.sessions.add(os.getsid(pid))
        return current

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, reached: Callable[[Started], bool], what: str, timeout: float = 600
                 ) -> None:
        deadline = time.monotonic() + timeout
        while not reached(self):
            self.look()
            assert self.process.poll() is None, f"exited before {what}:\n{self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"not {what} in {timeout:g} s:\n" \
                f"{self.text()[-3000:]}"
            time.sleep(0.05)
        self.look()

    def left(self) -> set[int]:
        return {pid for pid in self.seen | {self.process.pid} if alive(pid)} \
            | _session_members(self.sessions)

    def left_after(self, seconds: float) -> set[int]:
        """What is still running ``seconds`` after now (sooner if nothing is)."""
        deadline = time.monotonic() + seconds
        while (left := self.left()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def kill_all(self) -> None:
        """Whatever happened in the test: nothing of it outlives it."""
        for pid in self.left():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.process.kill()
        self.process.wait()


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Callable[..., Started]]:
    require_tiny_model()
    made: list[Started] = []

    def start(command: list[str], name: str, env: dict[str, str] | None = None) -> Started:
        made.append(Started(command, tmp_path / f"{name}.log", env))
        return made[-1]

    yield start
    for one in made:
        one.kill_all()


def has_engine(started: Started) -> bool:
    return any(_cmdline(pid).startswith(b"VLLM::EngineCore") for pid in started.look())


def weights_loaded(started: Started) -> bool:
    """The worker has loaded the model (vLLM's log): the engine is profiling, sizing its KV
    cache and warming up."""
    return "Loading weights took" in started.text()


def healthy(port: int) -> Callable[[Started], bool]:
    def check(started: Started) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
        return False
    return check


def bregman_serve(started: Callable[..., Started], name: str, model_len: int = MODEL_LEN
                  ) -> tuple[Started, int]:
    port = free_port()
    return started([sys.executable, "-m", "bregman_server.cli", "--model", MODEL, "--port",
                    str(port), *ENGINE, "--max-model-len", str(model_len)], name), port


def server_process(launcher: Started) -> int:
    """The server process (``python -m bregman_server``) that bregman-serve supervises."""
    return next(pid for pid in launcher.look()
                if b"-m\0bregman_server\0" in _cmdline(pid) and alive(pid))


def stream_forever(port: int, model_len: int = MODEL_LEN) -> Callable[[Started], bool]:
    """A streamed completion of a whole context, which runs until the server goes; whether its
    first tokens have come (a request being served). The client's own bytes tell, not
    /metrics: on this 2-core machine vLLM's API server, with or without the middleware, answers
    no other request for seconds at a time while one long stream runs."""
    serving = threading.Event()

    def run() -> None:
        body = {"model": MODEL, "prompt": "Once", "max_tokens": model_len - 64,
                "ignore_eos": True, "stream": True}
        with contextlib.suppress(httpx.HTTPError), httpx.stream(
                "POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    serving.set()

    threading.Thread(target=run, daemon=True).start()
    return lambda started: serving.is_set()


def assert_nothing_left(started: Started, moment: str) -> None:
    killed = time.monotonic()
    left = started.left_after(LEFT_AFTER)
    names = sorted((pid, _cmdline(pid)[:40]) for pid in left)
    assert not left, f"{moment}: {len(left)} process(es) left {LEFT_AFTER:g} s after the " \
        f"kill: {names}\n{started.text()[-3000:]}"
    print(f"{moment}: nothing left {time.monotonic() - killed:.1f} s after the kill "
          f"({len(started.seen)} processes seen)")


# --- bregman-serve -------------------------------------------------------------------------------

@pytest.mark.parametrize(("victim", "moment"), [("bregman-serve", "loading"),
                                                ("server", "warming up"),
                                                ("server", "serving")])
def test_bregman_serve_or_its_server_killed_leaves_nothing(
        started: Callable[..., Started], victim: str, moment: str) -> None:
    """SIGKILL to bregman-serve (an impatient operator, a crashed launcher) once its engine
    process exists, or to its server process once the engine has loaded the weights or while
    it serves a request (an OOM kill): 4 processes were left before (the server, EngineCore,
    Worker, the resource tracker), 120 s later still there. (bregman-serve killed while
    serving: the draining test below.)"""
    launcher, port = bregman_serve(started, f"{victim}-{moment}")
    if moment == "serving":
        launcher.wait_for(healthy(port), "ready")
        launcher.wait_for(stream_forever(port), "serving a request")
    else:
        launcher.wait_for(has_engine if moment == "loading" else weights_loaded, moment)
    os.kill(launcher.process.pid if victim == "bregman-serve" else server_process(launcher),
            signal.SIGKILL)
    assert_nothing_left(launcher, f"{victim} killed while {moment}")


def test_bregman_serve_killed_while_serving_and_draining_leaves_nothing(
        started: Callable[..., Started]) -> None:
    """A request being served, SIGTERM (the drain begins, the request still open), then SIGKILL
    to bregman-serve: the server drains (10 s, the default) within its 12 s, then nothing of
    it is left."""
    launcher, port = bregman_serve(started, "draining", DRAINED_LEN)
    launcher.wait_for(healthy(port), "serving")
    launcher.wait_for(stream_forever(port, DRAINED_LEN), "serving a request")
    os.kill(launcher.process.pid, signal.SIGTERM)
    launcher.wait_for(lambda s: "shutting down" in s.text(), "draining")
    os.kill(launcher.process.pid, signal.SIGKILL)
    assert_nothing_left(launcher, "bregman-serve killed while draining")
    # The drain had the request to wait for, and ended it when its grace ran out.
    assert "ending 1 open request(s): shutdown" in launcher.text()


# --- vLLM's own server, an offline LLM: the engine follows its parent ----------------------------

def test_vllms_own_server_killed_while_serving_leaves_no_engine(
        started: Callable[..., Started]) -> None:
    """Plain vLLM with the middleware (vLLM's issue 55510: EngineCore, its Worker and the
    resource tracker were left for good): the engine notices its parent's death and ends."""
    port = free_port()
    server = started([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                      MODEL, "--port", str(port), *ENGINE, "--max-model-len", str(MODEL_LEN),
                      "--middleware", "bregman_server.middleware.BregmanMiddleware",
                      "--max-num-batched-tokens", str(MODEL_LEN),
                      "--no-enable-chunked-prefill"],
                     "vllm")
    server.wait_for(healthy(port), "serving")
    server.wait_for(stream_forever(port), "serving a request")
    os.kill(server.process.pid, signal.SIGKILL)
    assert_nothing_left(server, "vLLM's API server killed while serving")


OFFLINE = textwrap.dedent('''
    import os
    import sys

    from vllm import LLM, SamplingParams

    if __name__ == "__main__":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        llm = LLM(sys.argv[1], enforce_eager=True, max_model_len=256, max_num_seqs=4)
        params = SamplingParams(max_tokens=200, ignore_eos=True, extra_args={
            "bregman_mode": "primal", "bregman_lambda": 0.01})
        print("generating", flush=True)
        while True:
            llm.generate(["Once"], params, use_tqdm=False)
''')


def test_an_offline_llm_killed_while_generating_leaves_no_engine(
        started: Callable[..., Started], tmp_path: Path) -> None:
    script = tmp_path / "offline.py"
    script.write_text(OFFLINE)
    offline = started([sys.executable, str(script), MODEL], "offline")
    offline.wait_for(lambda s: "generating" in s.text(), "generating")
    os.kill(offline.process.pid, signal.SIGKILL)
    assert_nothing_left(offline, "an offline LLM's process killed while generating")


# --- the mechanism, without an engine ------------------------------------------------------------

CHILD = textwrap.dedent('''
    import multiprocessing
    import sys
    import time

    from bregman_vllm import lifeline


    def engine(ready, method):
        if method == "spawn":  # as vLLM calls its general plugins (a forked child: the hook)
            lifeline.follow_parent()
        ready.put(multiprocessing.current_process().pid)
        time.sleep(600)


    if __name__ == "__main__":
        method, name = sys.argv[1], sys.argv[2]
        lifeline.follow_parent()  # the parent: as vLLM's API server or an LLM's process
        context = multiprocessing.get_context(method)
        ready = context.Queue()
        child = context.Process(target=engine, args=(ready, method), name=name)
        child.start()
        print(ready.get(), flush=True)
        time.sleep(600)
''')


@pytest.mark.parametrize(("method", "name", "follows"), [
    ("spawn", "EngineCore", True), ("fork", "EngineCore_DP1", True),
    ("fork", "VllmWorker-0", True), ("spawn", "SomeoneElses", False)])
def test_an_engine_process_follows_its_parent_and_no_other(tmp_path: Path, method: str,
                                                           name: str, follows: bool) -> None:
    """A multiprocessing child named as vLLM names its engines ends within GRACE + the poll
    interval of its parent's SIGKILL (SIGTERM first: a plain child dies of it at once), spawned
    or forked (where vLLM calls no plugin again: multiprocessing's after-fork hook does); a child
    of any other name is left alone."""
    from bregman_vllm import lifeline

    script = tmp_path / "child.py"
    script.write_text(CHILD)
    parent = subprocess.Popen([sys.executable, str(script), method, name], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait()
        # The poll interval, and time for a loaded machine to run the watcher: a child that
        # follows dies of the SIGTERM at once (it has no handler); one that does not is still
        # there well after it would have.
        deadline = time.monotonic() + lifeline.POLL_INTERVAL + (5.0 if follows else 2.0)
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive(child) is not follows, (name, method)
    finally:
        with contextlib.suppress(OSError):
            os.killpg(parent.pid, signal.SIGKILL)
