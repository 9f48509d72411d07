"""``bregman-serve``: the command line (also ``python -m bregman_server.cli``).

vLLM in this process (default)::

    bregman-serve --model models/smollm2-135m-instruct [--port 8000] [any vLLM argument]

runs vLLM's own OpenAI server in this process with the Bregman middleware: one process, one
port (`bregman_server.engine`). Gateway::

    bregman-serve --upstream http://replica-a:8000 http://replica-b:8000 [--port 8000]

forwards to vLLM servers run elsewhere (`bregman_server.gateway`). Our own flags are parsed with
``parse_known_args`` (abbreviations off, so a vLLM flag is never mistaken for a prefix of ours);
every other argument goes to vLLM's own parser unchanged, in order. Flags win over
``BREGMAN_*`` environment variables.

Exit status: 0 after SIGTERM / SIGINT, 2 for bad arguments, 1 if vLLM could not start, 3 if the
vLLM engine died while serving.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from .settings import ServerSettings

logger = logging.getLogger("bregman_server")


def build_parser() -> argparse.ArgumentParser:
    """Our own flags. Defaults are None so that unset flags fall back to the environment."""
    parser = argparse.ArgumentParser(
        prog="bregman-serve",
        allow_abbrev=False,
        description="OpenAI-compatible server with Bregman decoding, in front of vLLM. Every "
        "argument not listed here goes to vLLM's own OpenAI server in this process "
        "(see `python -m vllm.entrypoints.openai.api_server --help`). Each flag can also "
        "be set with an environment variable BREGMAN_<FLAG> (e.g. BREGMAN_API_KEY).",
    )
    add = parser.add_argument
    mode = parser.add_argument_group("mode")
    mode.add_argument("--model", help="Model that vLLM serves in this process.")
    mode.add_argument("--upstream", nargs="+", metavar="URL",
                      help="Gateway mode: upstream vLLM server(s), round-robin over the healthy "
                      "ones (no engine in this process).")
    add("--host", help="Interface to listen on (default 127.0.0.1; 0.0.0.0 in containers).")
    add("--port", type=int, help="Port to listen on (default 8000).")
    add("--api-key", help="Require 'Authorization: Bearer <key>' on every route but /health "
        "(env BREGMAN_API_KEY keeps it out of the process list).")
    add("--upstream-api-key", help="Gateway: Bearer key for the upstream servers.")
    defaults = parser.add_argument_group(
        "server-wide Bregman defaults (a request's own fields win; \"off\" leaves requests "
        "that send no bregman field untouched)")
    defaults.add_argument("--default-mode", choices=["primal", "dual", "off"],
                          help='Default bregman_mode (default "off").')
    defaults.add_argument("--default-alpha", help='Default bregman_alpha (number, "inf", "-inf").')
    defaults.add_argument("--default-lambda", type=float, help="Default bregman_lambda (>= 0).")
    defaults.add_argument("--default-top-k", type=int, help="Default bregman_top_k.")
    defaults.add_argument("--default-k-max", type=int, help="Default bregman_k_max.")
    limits = parser.add_argument_group("limits and timeouts (clients)")
    limits.add_argument("--max-body-bytes", type=int, help="Largest request body (16 MiB).")
    limits.add_argument("--max-header-bytes", type=int,
                        help="Largest request line + headers (64 KiB).")
    limits.add_argument("--max-connections", type=int, help="Open client connections (1024).")
    limits.add_argument("--header-timeout", type=float,
                        help="Seconds to send a request head (10).")
    limits.add_argument("--body-timeout", type=float,
                        help="Longest silence while a body arrives, seconds (30).")
    limits.add_argument("--send-timeout", type=float,
                        help="Longest time a response may stay unread, seconds (60).")
    limits.add_argument("--keep-alive-timeout", type=float,
                        help="Idle keep-alive connections close after this, seconds (5).")
    limits.add_argument("--graceful-timeout", type=float,
                        help="On SIGTERM, seconds to let requests finish (10).")
    limits.add_argument("--engine-exit-grace", type=float,
                        help="If the engine dies: seconds of 503s before exit(3) (2).")
    gateway = parser.add_argument_group("gateway (--upstream)")
    gateway.add_argument("--connect-timeout", type=float, help="Upstream connect timeout (5 s).")
    gateway.add_argument("--read-timeout", type=float,
                         help="Upstream silence between two bytes, seconds (600).")
    gateway.add_argument("--request-timeout", type=float,
                         help="Total deadline of one upstream exchange, seconds (1800).")
    gateway.add_argument("--max-response-bytes", type=int,
                         help="Largest non-streaming upstream response (64 MiB).")
    gateway.add_argument("--upstream-max-connections", type=int,
                         help="Connections per upstream (256).")
    gateway.add_argument("--health-interval", type=float, help="Seconds between health checks.")
    gateway.add_argument("--health-timeout", type=float, help="Timeout of one health check.")
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
    if not settings.gateway and not settings.model:
        parser.error("--model is required (or --upstream URL ... for the gateway)")
    if settings.gateway and vllm_args:
        parser.error(f"unrecognized arguments: {' '.join(vllm_args)} (vLLM arguments are only "
                     "accepted when vLLM runs in this process, not with --upstream)")
    if settings.gateway and settings.model:
        logger.warning("--model %s is ignored by the gateway", settings.model)
    return settings, vllm_args


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO, health checks included.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``bregman-serve``."""
    settings, vllm_args = parse_args(argv)
    _configure_logging(settings.log_level)
    if settings.gateway:
        from .gateway import serve as serve_gateway

        return serve_gateway(settings)
    from .engine import serve as serve_engine

    return serve_engine(settings, vllm_args)


if __name__ == "__main__":
    sys.exit(main())
