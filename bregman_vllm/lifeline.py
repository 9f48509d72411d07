"""No engine outlives the process that started it: vLLM's engine processes end with their parent.

vLLM 0.32's ``EngineCore`` watches no parent (vLLM issue 55510): when the process that started it
dies without stopping it (the API server or an offline ``LLM``'s process killed with SIGKILL,
OOM-killed, or its launcher crashed), the ``EngineCore``, its ``Worker`` processes and
multiprocessing's resource tracker keep running for good; on a GPU they keep its memory, and the
next start fails. While it loads, an ``EngineCore`` even ignores SIGTERM (it only notes it) and
waits up to 5 minutes for its dead parent's handshake.

`follow_parent` runs in every vLLM process of the environment, whatever front end started it
(`bregman-serve`, ``vllm serve``, an offline ``LLM``): vLLM loads it as a general plugin (the
``vllm.general_plugins`` entry point ``bregman_lifeline``, which vLLM calls in its API server, in
each ``EngineCore`` and in each worker), and the Bregman logits processor calls it when it is
built (for deployments whose ``VLLM_PLUGINS`` leaves general plugins out). In an engine process
(multiprocessing's name `ENGINE_PROCESS_NAMES`: ``EngineCore``, ``EngineCore_DP<n>``,
``VllmWorker-<n>``) it starts one daemon thread that compares ``os.getppid()`` with the parent
that started the process (``multiprocessing.parent_process()``) every `POLL_INTERVAL` seconds;
the kernel reparents an orphan at once, so a change means the parent is gone (also when it died
before the thread started). Then `end_orphan`: SIGTERM to the process's main thread (vLLM's own
shutdown: the ``EngineCore`` stops its workers), and `GRACE` seconds later SIGKILL to whatever
of it and its descendants is left. Its resource tracker exits by itself once the last process
that holds its pipe has. Processes of other names (API servers, an offline ``LLM``'s own process,
a user's pool workers) are never touched. A polling thread, not prctl's parent-death signal: that
signal follows the parent *thread* that started the process, and fires when that thread ends.

vLLM's engine processes may be forked (CUDA's default) instead of spawned (CPU builds): a forked
child inherits vLLM's "plugins loaded" flag, so vLLM does not call the plugin again there. The
first call in a process therefore also registers `follow_parent` with multiprocessing's own
after-fork hooks (``multiprocessing.util.register_after_fork``), which multiprocessing runs in
each child it forks once the child knows its name, before its target: no code of ours runs
in a child that ``os.fork`` or ``subprocess`` makes for anything else.

Pure Python (psutil, which vLLM installs, at the end only): the plugin is imported in every vLLM
process, the API server included.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("bregman_vllm.lifeline")

#: multiprocessing names of the processes vLLM starts as engines (vLLM 0.32, 0.33: its engine
#: process manager names them "EngineCore" or "EngineCore_DP<rank>", its multiprocessing
#: executor "VllmWorker-<rank>").
ENGINE_PROCESS_NAMES = ("EngineCore", "VllmWorker")
#: Seconds between two looks at the parent: an orphan notices within this.
POLL_INTERVAL = 0.5
#: Seconds an orphaned engine gets for vLLM's own shutdown before it is killed.
GRACE = 5.0
_following: int | None = None  # the pid of the process whose parent is followed


class _Anchor:
    """What multiprocessing's after-fork registry holds (weakly) for `follow_parent`."""


_anchor: _Anchor | None = None


def is_engine_process(name: str) -> bool:
    """Whether a multiprocessing process name is one of vLLM's engine processes."""
    return name.startswith(ENGINE_PROCESS_NAMES)


def follow_parent() -> None:
    """In an engine process: end it when its parent dies (once per process). Elsewhere: only
    the at-fork hook, for engines forked from this process. The general plugin's entry point;
    never raises."""
    global _anchor
    try:
        if _anchor is None:  # (inherited by forked children, where it is registered already)
            _anchor = _Anchor()
            multiprocessing.util.register_after_fork(_anchor, lambda anchor: follow_parent())
        parent = multiprocessing.parent_process()
        if parent is not None and parent.pid is not None \
                and is_engine_process(multiprocessing.current_process().name):
            watch(parent.pid)
    except Exception:  # a plugin must never keep vLLM from starting
        logger.exception("cannot follow this engine's parent")


def watch(parent: int, on_orphaned: Callable[[int], None] | None = None,
          interval: float = POLL_INTERVAL) -> threading.Thread | None:
    """Start the daemon thread that calls ``on_orphaned(parent)`` (default `end_orphan`) once
    this process's parent is no longer ``parent``; None if this process already has one."""
    global _following
    if _following == os.getpid():
        return None
    _following = os.getpid()
    act = on_orphaned if on_orphaned is not None else end_orphan

    def run() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        act(parent)

    thread = threading.Thread(target=run, name="bregman-lifeline", daemon=True)
    thread.start()
    return thread


def end_orphan(parent: int, grace: float = GRACE, group: bool = False) -> None:
    """This process's parent (``parent``) is gone: SIGTERM its main thread (vLLM's shutdown),
    then, ``grace`` seconds later, SIGKILL what is left of it and its descendants (``group``:
    of its whole process group, for a process that leads a session of its own)."""
    name = multiprocessing.current_process().name
    logger.warning("%s (pid %d): the process that started it (pid %d) is gone; stopping it "
                   "(killed in %g s if still running)", name, os.getpid(), parent, grace)
    main = threading.main_thread()
    with contextlib.suppress(Exception):  # (a main thread that has ended: nothing to wake)
        if main.ident is not None and main.is_alive():
            # To the main thread itself, so that a blocking call there is interrupted.
            signal.pthread_kill(main.ident, signal.SIGTERM)
    time.sleep(grace)
    kill_descendants()
    if group:  # (this process too)
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def kill_descendants() -> None:
    """SIGKILL every live descendant of this process (its engine workers and theirs)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - vLLM installs psutil
        return
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
