"""``bregman-serve``: the command line (also ``python -m bregman_server.cli``).

vLLM in this process (default)::

    bregman-serve --model models/smollm2-135m-instruct [--port 8000] [any vLLM argument]

runs vLLM's own OpenAI server in this process with the Bregman middleware: one process, one
port (`bregman_server.engine`); replicas scale behind vLLM's router (deploy/README.md). Our own
flags are parsed with ``parse_known_args`` (abbreviations off, so a vLLM flag is never mistaken
for a prefix of ours); every other argument goes to vLLM's own parser unchanged, in order. Flags
win over ``BREGMAN_*`` environment variables.

Exit status: 0 after SIGTERM / SIGINT, 2 for bad arguments, 1 if vLLM could not start, 3 if the
vLLM engine died while serving.
"""

from __future__ import annotations

import argparse
import logging
import sys
import typing
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from .settings import ServerSettings

logger = logging.getLogger("bregman_server")


#: Fields shown in argparse groups, by the comment headings of `ServerSettings`.
_GROUPS = {
    "server-wide Bregman defaults (a request's own fields win; \"off\" leaves requests that "
    "send no bregman field untouched)": (
        "default_mode", "default_alpha", "default_lambda", "default_top_k", "default_k_max"),
    "limits and timeouts (clients)": (
        "max_body_bytes", "max_header_bytes", "max_connections", "header_timeout",
        "body_timeout", "body_deadline", "send_timeout", "keep_alive_timeout", "graceful_timeout",
        "engine_exit_grace"),
}


def build_parser() -> argparse.ArgumentParser:
    """Our own flags, one per `ServerSettings` field (``--max-body-bytes`` for
    ``max_body_bytes``), with the field's type, choices, default and description: the settings
    model is the one place they are written. Parsed defaults are None so that unset flags fall
    back to the environment."""
    parser = argparse.ArgumentParser(
        prog="bregman-serve",
        allow_abbrev=False,
        description="OpenAI-compatible server with Bregman decoding, in front of vLLM. Every "
        "argument not listed here goes to vLLM's own OpenAI server in this process "
        "(see `python -m vllm.entrypoints.openai.api_server --help`). Each flag can also "
        "be set with an environment variable BREGMAN_<FLAG> (e.g. BREGMAN_API_KEY).",
    )
    groups = {}
    for title, names in _GROUPS.items():
        group = parser.add_argument_group(title)
        groups.update(dict.fromkeys(names, group))
    for name, field in ServerSettings.model_fields.items():
        target = groups.get(name, parser)
        target.add_argument("--" + name.replace("_", "-"), **_argument(field))
    return parser


def _argument(field: FieldInfo) -> dict[str, Any]:
    """argparse keywords for one settings field (pydantic validates the value afterwards)."""
    default = field.get_default(call_default_factory=True)
    shown = "" if default in (None, [], "") else f" (default {default})"
    keywords: dict[str, Any] = {"help": (field.description or "") + shown, "default": None}
    annotation = field.annotation
    kinds = {arg for arg in typing.get_args(annotation) if arg is not type(None)}
    if annotation is bool:
        keywords.update(action="store_true")
    elif typing.get_origin(annotation) is Literal:
        keywords.update(choices=list(typing.get_args(annotation)))
    elif annotation is int or kinds == {int}:
        keywords.update(type=int)
    elif annotation is float or kinds == {float}:
        keywords.update(type=float)
    return keywords


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
    if not settings.model:
        parser.error("--model is required")
    return settings, vllm_args


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``bregman-serve``."""
    settings, vllm_args = parse_args(argv)
    _configure_logging(settings.log_level)
    from .engine import serve as serve_engine

    return serve_engine(settings, vllm_args)


if __name__ == "__main__":
    sys.exit(main())
