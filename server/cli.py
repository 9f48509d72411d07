"""``bregman-serve``: the command line (also ``python -m server.cli``).

Embedded mode (default)::

    bregman-serve --model models/smollm2-135m-instruct [--port 8000] [any vLLM engine args]

starts vLLM's OpenAI server as a child on a loopback port, waits for its /health, then serves.
Upstream mode::

    bregman-serve --upstream http://vllm-a:8000 http://vllm-b:8000 [--port 8000]

forwards to vLLM servers run elsewhere. Our own flags are parsed with ``parse_known_args``
(abbreviations off, so a vLLM flag is never mistaken for a prefix of ours); every other argument
is forwarded to vLLM unchanged, in order. Flags win over ``BREGMAN_*`` environment variables.

Exit status: 0 after SIGTERM / SIGINT (both processes stopped), 2 for bad arguments, 1 if vLLM
could not start, 3 if the vLLM child died while serving (after ``--child-exit-grace`` seconds
of /health answering 503).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from .settings import ServerSettings

logger = logging.getLogger("bregman_server")

class Terminated(BaseException):
    """SIGTERM arrived: unwind (stopping the vLLM child) and exit 0."""


def build_parser() -> argparse.ArgumentParser:
    """Our own flags. Defaults are None so that unset flags fall back to the environment."""
    parser = argparse.ArgumentParser(
        prog="bregman-serve",
        allow_abbrev=False,
        description="OpenAI-compatible server with Bregman decoding, in front of vLLM. Every "
        "argument not listed here is forwarded unchanged to vLLM's OpenAI server (embedded "
        "mode): see `python -m vllm.entrypoints.openai.api_server --help`. Each flag can also "
        "be set with an environment variable BREGMAN_<FLAG> (e.g. BREGMAN_API_KEY).",
    )
    add = parser.add_argument
    mode = parser.add_argument_group("mode")
    mode.add_argument("--model", help="Model for the embedded vLLM child (embedded mode).")
    mode.add_argument("--upstream", nargs="+", metavar="URL",
                      help="Upstream vLLM server(s), round-robin over the healthy ones; "
                      "switches to upstream mode (no child is started).")
    add("--host", help="Interface to listen on (default 127.0.0.1; 0.0.0.0 in containers).")
    add("--port", type=int, help="Port to listen on (default 8000).")
    add("--api-key", help="Require 'Authorization: Bearer <key>' on /v1/* (env BREGMAN_API_KEY "
        "keeps it out of the process list).")
    add("--upstream-api-key", help="Bearer key for the upstream vLLM servers.")
    defaults = parser.add_argument_group(
        "server-wide Bregman defaults (a request's own fields win; \"off\" leaves requests "
        "that send no bregman field untouched)")
    defaults.add_argument("--default-mode", choices=["primal", "dual", "off"],
                          help='Default bregman_mode (default "off").')
    defaults.add_argument("--default-alpha", help='Default bregman_alpha (number, "inf", "-inf").')
    defaults.add_argument("--default-lambda", type=float, help="Default bregman_lambda (>= 0).")
    defaults.add_argument("--default-top-k", type=int, help="Default bregman_top_k.")
    defaults.add_argument("--default-k-max", type=int, help="Default bregman_k_max.")
    limits = parser.add_argument_group("limits and timeouts")
    limits.add_argument("--max-body-bytes", type=int, help="Largest request body (16 MiB).")
    limits.add_argument("--connect-timeout", type=float, help="Upstream connect timeout (5 s).")
    limits.add_argument("--read-timeout", type=float,
                        help="Upstream read timeout between two bytes (600 s).")
    limits.add_argument("--max-connections", type=int, help="Pooled connections per upstream.")
    limits.add_argument("--health-interval", type=float, help="Seconds between health checks.")
    limits.add_argument("--health-timeout", type=float, help="Timeout of one health check.")
    limits.add_argument("--graceful-timeout", type=float,
                        help="Seconds to let requests finish on shutdown (10 s).")
    child = parser.add_argument_group("embedded vLLM child")
    child.add_argument("--vllm-port", type=int, help="Loopback port of the child (0: free).")
    child.add_argument("--vllm-start-timeout", type=float,
                       help="Seconds to wait for the child's /health (900).")
    child.add_argument("--vllm-stop-timeout", type=float,
                       help="Seconds between SIGTERM and SIGKILL when stopping the child (20).")
    child.add_argument("--child-exit-grace", type=float,
                       help="If the child dies: seconds of 503 on /health before exit(3) (5).")
    add("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    add("--access-log", action="store_true", default=None, help="Log every request.")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[ServerSettings, list[str]]:
    """Our settings (flags over environment over defaults) and the arguments for vLLM.

    Exits with status 2 and a message for invalid arguments, like argparse.
    """
    parser = build_parser()
    namespace, vllm_args = parser.parse_known_args(argv)
    given: dict[str, Any] = {key: value for key, value in vars(namespace).items()
                             if value is not None}
    try:
        settings = ServerSettings(**given)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}"
            for err in exc.errors())
        parser.error(problems)
    if settings.embedded and not settings.model:
        parser.error("--model is required in embedded mode (or give --upstream URL ...)")
    if not settings.embedded and vllm_args:
        parser.error(f"unrecognized arguments: {' '.join(vllm_args)} (vLLM engine arguments "
                     "are only accepted in embedded mode)")
    if not settings.embedded and settings.model:
        logger.warning("--model %s is ignored in upstream mode", settings.model)
    return settings, vllm_args


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO, health checks included.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def _uvicorn_server(app: Any, settings: ServerSettings) -> Any:
    import uvicorn

    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level,
        access_log=settings.access_log, timeout_graceful_shutdown=settings.graceful_timeout,
        # Our body limit is enforced in the app; keep-alive like vLLM's default.
        timeout_keep_alive=5, lifespan="on")
    return uvicorn.Server(config)


def serve_upstream(settings: ServerSettings) -> int:
    """Upstream mode: serve until SIGTERM / SIGINT."""
    from .app import create_app

    pool = _pool(settings, settings.upstream, settings.upstream_api_key_value())
    _uvicorn_server(create_app(settings, pool), settings).run()
    return 0


def _pool(settings: ServerSettings, urls: list[str], api_key: str | None) -> Any:
    from .proxy import UpstreamPool

    return UpstreamPool(
        urls, connect_timeout=settings.connect_timeout, read_timeout=settings.read_timeout,
        max_connections=settings.max_connections, health_interval=settings.health_interval,
        health_timeout=settings.health_timeout, api_key=api_key)


def serve_embedded(settings: ServerSettings, vllm_args: list[str]) -> int:
    """Embedded mode: start vLLM, serve, stop vLLM. See the module docstring for exit codes."""
    from .app import create_app
    from .embedded import CHILD_DIED_EXIT_CODE, ChildStartError, EmbeddedVLLM

    assert settings.model is not None
    child = EmbeddedVLLM(
        settings.model, vllm_args, host=settings.vllm_host, port=settings.vllm_port,
        api_key=settings.upstream_api_key_value(), start_timeout=settings.vllm_start_timeout,
        stop_timeout=settings.vllm_stop_timeout, cpu_kvcache_gib=settings.cpu_kvcache_space_gib)
    exit_code = 0
    if not _port_free(settings.host, settings.port):
        # Say so now rather than after vLLM has spent minutes loading the model.
        logger.error("cannot listen on %s:%d: address in use", settings.host, settings.port)
        return 1
    try:
        child.start()
        child.wait_until_healthy()
        server: Any = None

        def on_child_exit(returncode: int) -> None:
            nonlocal exit_code
            exit_code = CHILD_DIED_EXIT_CODE
            logger.error("exiting with status %d in %g s (the vLLM child died)",
                         CHILD_DIED_EXIT_CODE, settings.child_exit_grace)
            asyncio.get_running_loop().call_later(
                settings.child_exit_grace, lambda: setattr(server, "should_exit", True))

        pool = _pool(settings, [child.url], child.api_key)
        server = _uvicorn_server(
            create_app(settings, pool, child=child, on_child_exit=on_child_exit), settings)
        server.run()
        if not server.started and exit_code == 0:
            exit_code = 1  # e.g. our port was taken
    except ChildStartError as exc:
        logger.error("%s", exc)
        exit_code = 1
    except (Terminated, KeyboardInterrupt):
        logger.info("stopping")
    finally:
        # A second Ctrl-C / SIGTERM must not interrupt the cleanup (it is bounded in time).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        child.stop()
    return exit_code


def _port_free(host: str, port: int) -> bool:
    """Whether we could bind host:port now (port 0 always can)."""
    import socket

    if port == 0:
        return True
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return True  # let uvicorn report the problem
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError:
            return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``bregman-serve``."""
    settings, vllm_args = parse_args(argv)
    _configure_logging(settings.log_level)
    # Uvicorn re-raises the signal that stopped it once it has shut down; this handler turns
    # that SIGTERM (and one that arrives while vLLM is still starting) into a clean unwind.
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if settings.embedded:
            return serve_embedded(settings, vllm_args)
        return serve_upstream(settings)
    except (Terminated, KeyboardInterrupt):
        return 0


if __name__ == "__main__":
    sys.exit(main())
