"""``bregman-serve``: the command line (also ``python -m bregman_server.cli``).

::

    bregman-serve --model models/smollm2-135m-instruct [--port 8000] [any vLLM argument]

runs vLLM's own OpenAI server with the Bregman middleware (`bregman_server.engine`): one port,
several GPUs through vLLM's data parallelism, replicas behind vLLM's router (deploy/README.md).
Our own flags are parsed with ``parse_known_args`` (abbreviations off, so a vLLM flag is never
mistaken for a prefix of ours); every other argument goes to vLLM's own parser unchanged, in
order. Flags win over ``BREGMAN_*`` environment variables. Four of our flags are vLLM's too:
``--model``, ``--host`` and ``--port`` reach vLLM as given, and ``--log-level`` sets vLLM's log
level as well as ours; ``--api-key`` is ours alone (it guards every route).

The server runs in a child process in a session of its own (`supervise`): a SIGTERM sent to
bregman-serve's whole process group (``kill -- -PGID``, some supervisors) then reaches the server
once, through this process, and never vLLM's engine processes, which keep serving until the
drain ends. ``python -m bregman_server`` runs the server in the calling process instead.

Exit status: 0 after SIGTERM / SIGINT, 2 for bad arguments, 1 if vLLM could not start, 3 if the
vLLM engine died while serving.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import typing
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from .settings import ServerSettings

#: Fields shown in argparse groups, by the comment headings of `ServerSettings`.
_GROUPS = {
    "server-wide Bregman defaults (a request's own fields win; \"off\" leaves requests that "
    "send no bregman field untouched) and the largest support size": (
        "default_mode", "default_alpha", "default_lambda", "default_top_k", "default_k_max",
        "max_support"),
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
        "(see `vllm serve --help`). Each flag can also "
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
        choices = list(typing.get_args(annotation))
        keywords.update(choices=choices)
        if all(isinstance(choice, str) and choice.islower() for choice in choices):
            keywords.update(type=str.lower)  # vLLM's --log-level DEBUG is our debug
    elif field.default is not None and kinds == {int}:
        keywords.update(type=_int_or_none, metavar="{N,none}")  # "none" lifts the default
    elif annotation is int or kinds == {int}:
        keywords.update(type=int)
    elif annotation is float or kinds == {float}:
        keywords.update(type=float)
    return keywords


def _int_or_none(text: str) -> int | str:
    """An integer flag whose default "none" lifts (kept as the string for the settings)."""
    return "none" if text.strip().lower() == "none" else int(text)


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
    if namespace.log_level is not None:  # vLLM's flag too: its log level follows ours
        vllm_args = [*vllm_args, "--log-level", settings.log_level.upper()]
    return settings, vllm_args


def run(argv: Sequence[str] | None = None) -> int:
    """The server in this process (``python -m bregman_server``)."""
    settings, vllm_args = parse_args(argv)
    supervisor = os.environ.pop(SUPERVISOR_ENV, "")
    if supervisor.isdigit():
        follow_supervisor(int(supervisor))
    from .engine import serve

    return serve(settings, vllm_args)


#: Set by `supervise` for the server it starts: the supervisor's pid.
SUPERVISOR_ENV = "BREGMAN_SUPERVISOR_PID"
#: Seconds the server may take to stop once its supervisor is gone (the default drain, 10 s,
#: and the engine's stop fit), before its whole process group is killed.
ORPHAN_DEADLINE = 12.0


def follow_supervisor(supervisor: int, deadline: float = ORPHAN_DEADLINE,
                      group: bool = True) -> None:
    """If ``supervisor`` (this process's parent: bregman-serve, or the server that started
    this API server) dies, however it dies and whatever this process is doing (loading,
    warming up, serving, draining): `lifeline.end_orphan` with ``deadline`` for its grace,
    SIGTERM to this process (the drain; the kernel's parent-death signal sends one too, but
    vLLM may lose it while the engine loads), then SIGKILL to this process's group (``group``:
    the server, in a session of its own, with its engines and their helpers) or to it and its
    descendants, so that nothing of the session outlives bregman-serve by more than
    ``deadline`` seconds."""
    import functools

    from bregman_vllm.lifeline import end_orphan, watch

    watch(supervisor, on_orphaned=functools.partial(end_orphan, grace=deadline, group=group),
          interval=0.2)


#: Seconds the processes the server leaves behind get to exit before they are killed.
LEFTOVER_GRACE = 2.0
#: prctl(2) options (Linux): the signal a process gets when its parent dies; adopting the
#: orphans of one's descendants.
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def supervise(argv: Sequence[str]) -> int:
    """Run ``python -m bregman_server ARGV`` in a new session and wait for it; its exit status.

    SIGTERM and SIGINT are passed on to it (it drains). If this process dies, the server gets
    SIGTERM (prctl's parent-death signal). The server's orphans are this process's children
    (a subreaper): once the server has exited, they get `LEFTOVER_GRACE` seconds (e.g.
    multiprocessing's resource tracker, which cleans up shared memory when its pipe closes),
    then what is left of its session is killed, so nothing outlives bregman-serve.
    """
    import signal
    import subprocess

    parent = os.getpid()
    prctl = None
    if sys.platform.startswith("linux"):
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
        prctl(_PR_SET_CHILD_SUBREAPER, 1)

    def die_with_parent() -> None:  # in the child, between fork and exec
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # this process died before the line above
            os._exit(1)

    child = subprocess.Popen([sys.executable, "-m", "bregman_server", *argv],
                             start_new_session=True, preexec_fn=die_with_parent,
                             env={**os.environ, SUPERVISOR_ENV: str(parent)})

    def forward(signum: int, frame: object) -> None:
        child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    code = child.wait()
    deadline = time.monotonic() + LEFTOVER_GRACE
    with contextlib.suppress(ChildProcessError):  # no child left: nothing to kill
        while time.monotonic() < deadline:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
    return code if code >= 0 else 128 - code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``bregman-serve``: checks the arguments, then `supervise`."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    parse_args(arguments)  # exit status 2 here, before anything starts
    return supervise(arguments)


if __name__ == "__main__":
    sys.exit(main())
