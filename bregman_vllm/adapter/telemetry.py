"""What the processor shows an operator, from the engine process: failures, k* and the exact path.

Three metrics (`bregman_vllm.engine_metrics` defines them and explains how they reach the API
server's /metrics, summed over the engine processes of data-parallel ranks):

    bregman_support_size{mode}              histogram of k*, one observation per Bregman-decoded
                                            token (buckets 1, 2, 4, ..., 2^17, +Inf)
    bregman_exact_path_rows_total{reason}   rows the exact path decoded: "family" (an alpha
                                            without a fixed-shape formula) or "uncertified"
    bregman_processor_failures_total{interface}
    bregman_support_held_total{mode}        adaptive rows whose k* was held at their k_max (the
                                            server's largest support size when the request
                                            sent none): where the bound binds

**Failures.** `apply()` never raises (an exception inside a logits processor would fail every
request on the engine), so a failure must be visible some other way. Each failed row (and each
request whose parameters fail validation inside the engine, which then gets plain sampling) is
counted (`record_failure`), and a warning with the running count is logged at most once per
`WARNING_INTERVAL` seconds.

**k* and the exact path, per step** (`StepRecorder.record`, called by the processor right after
the core's step with the plan, the per-row k and the step's exact-path row count; under Model
Runner V2 with the kernels, which has no plan, `StepRecorder.record_rows` with each row's mode
and the exact-path rows the step counted), with no host sync:

1. once per plan, on the host: each row's mode (0 for rows of plain requests) and the number
   of rows whose family is decoded by the exact path;
2. the exact-path rows: the plan's (host) and the rows the step could not certify (counted by
   the core at the step's own sync);
3. k [N]: on CUDA, a non-blocking copy into pinned host memory and a CUDA event, queued. The
   queue is read a step later, at the next `record()`, for entries whose event has completed
   (``Event.query()`` never blocks), and by a background thread that waits on the events when
   the engine goes idle (so the last step of a burst is counted too). On CPU k is on the host
   already and is read at once: the same queue, every entry ready;
4. reading an entry: the rows with k >= 1 and a Bregman mode, bucketed with numpy on the
   host, are added to this process's running totals, which are written to its files; so are
   the rows whose k equals their cap (the adaptive rows' k_max, given per row by the processor
   from its requests; 0 for fixed-k rows and rows without one): their support was held.

Greedy requests (temperature 0) take the argmax whatever a processor does; they are not decoded
and not counted. Each row of a step is counted: with speculative decoding that is every scored
position, and with chunked prefill a prompt's partial chunks (whose tokens vLLM discards) too.
Under tensor parallelism every rank runs the processor on the same rows: only rank 0 counts.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import engine_metrics as em
from ..core.families import Family

if TYPE_CHECKING:
    from ..core.plan import Plan

logger = logging.getLogger("bregman_vllm.adapter")

#: Seconds between two failure warnings (the count keeps running in between).
WARNING_INTERVAL = 60.0
#: Seconds between two looks for the shared directory, and between two wake-ups of the
#: background thread.
LOOK_INTERVAL = 1.0
#: Steps whose k may wait in the queue; past this (a GPU that many steps behind the host, which
#: vLLM never is: it reads each step's sampled tokens) the oldest is waited for.
MAX_PENDING = 64

_NB = len(em.SUPPORT_BUCKETS) + 1  # histogram buckets, +Inf included
_BUCKETS = [em.support_bucket(mode, index) for mode in em.MODES for index in range(_NB)]
_SUMS = [em.support_sum(mode) for mode in em.MODES]

_lock = threading.Lock()
_total = 0
_last_warning = -float("inf")


class _NeverRaise:
    """Telemetry never takes decoding down: its own errors are logged once and dropped."""

    _logged = False

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> bool:
        if error is not None and isinstance(error, Exception):
            if not _NeverRaise._logged:
                _NeverRaise._logged = True
                logger.warning("Bregman telemetry failed (metrics may be incomplete)",
                               exc_info=error)
            return True
        return False


def failures_total() -> int:
    """Rows left undecoded by a failure since this process started."""
    return _total


def totals() -> dict[em.Series, float]:
    """This process's running totals (series -> value), whether or not they are in files."""
    engine = _engine()
    with engine.lock:
        return dict(engine.values)


def register(interface: str) -> None:
    """Show this engine's series from the start (at 0), so that a scraper can tell "none"
    from "not counted"."""
    with _NeverRaise():
        _engine().show(em.every_series(interface))


def record_failure(rows: int, interface: str, error: BaseException) -> None:
    """Count ``rows`` rows left undecoded by ``error`` and warn (rate-limited)."""
    global _total, _last_warning
    with _NeverRaise():
        engine = _engine()
        with engine.lock:
            engine.add(em.failures(interface), rows)
            engine.publish()
    with _lock:
        _total += rows
        now = time.monotonic()
        if now - _last_warning < WARNING_INTERVAL:
            return
        _last_warning = now
        total = _total
    logger.warning(
        "Bregman decoding failed for %d row(s) (%d since start); their logits were left "
        "unchanged this step (or kept the fixed step's uncertified answer when the exact path "
        "failed; or, for parameters that failed validation, every step): %s: %s",
        rows, total, type(error).__name__, error,
        exc_info=error if logger.isEnabledFor(logging.DEBUG) else None)


@dataclass
class _Pending:
    k: torch.Tensor  # [N] on the host (pinned on CUDA; being copied until ``event``)
    modes: np.ndarray | torch.Tensor  # [N] 0 = not a Bregman row, else 1 + index in MODES
    event: Any  # torch.cuda.Event, or None when ``k`` is ready
    caps: np.ndarray | None = None  # [N] the adaptive rows' k_max (0: none), on the host


class _Engine:
    """This process's running totals, its files and the queue of steps not yet read."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.RLock()
        self.values: dict[em.Series, float] = {}
        self.dirty: set[em.Series] = set()
        self.directory: Path | None = None
        self.files: em.MetricsFiles | None = None
        self.next_look = 0.0
        self.pending: collections.deque[_Pending] = collections.deque()
        self.thread: threading.Thread | None = None

    # --- totals and files (callers hold ``lock``) -------------------------------------------

    def add(self, series: em.Series, amount: float) -> None:
        self.values[series] = self.values.get(series, 0.0) + amount
        self.dirty.add(series)

    def show(self, series: Any) -> None:
        with self.lock:
            for one in series:
                self.values.setdefault(one, 0.0)
                self.dirty.add(one)
            self.publish()

    def publish(self) -> None:
        """Write what changed to the files (once the shared directory exists)."""
        if self.files is None and not self._look():
            return
        assert self.files is not None
        self.files.write((series, self.values[series]) for series in self.dirty)
        self.dirty.clear()

    def _look(self) -> bool:
        now = time.monotonic()
        if self.directory is None or now < self.next_look:
            return False
        self.next_look = now + LOOK_INTERVAL
        if not self.directory.is_dir():
            return False
        self.files = em.MetricsFiles(self.directory, self.pid)
        self.dirty = set(self.values)  # everything counted so far
        return True

    def target(self, directory: Path | None) -> None:
        """Where this process's totals go (the first processor's choice)."""
        with self.lock:
            if self.directory is None and directory is not None:
                self.directory = directory
                self._start()

    def in_process(self) -> dict[em.Series, float] | None:
        """The totals for this process's own registry, or None while they are in files."""
        with self.lock:
            return None if self.files is not None else dict(self.values)

    # --- the queue ----------------------------------------------------------------------------

    def queue(self, entry: _Pending) -> None:
        with self.lock:
            self.pending.append(entry)
            if entry.event is not None:
                self._start()
            while len(self.pending) > MAX_PENDING:  # never in vLLM (see MAX_PENDING)
                self.pending[0].event.synchronize()
                self.drain()
            self.drain()
            self.publish()

    def drain(self) -> None:
        """Read the entries whose copy has completed, in order; never blocks."""
        while self.pending:
            entry = self.pending[0]
            if entry.event is not None and not entry.event.query():
                return
            self.pending.popleft()
            modes = entry.modes
            self._count(entry.k.numpy(), modes if isinstance(modes, np.ndarray)
                        else modes.numpy(), entry.caps)

    def _count(self, k: np.ndarray, modes: np.ndarray, caps: np.ndarray | None = None) -> None:
        chosen = (modes > 0) & (k > 0)
        if not chosen.any():
            return
        if caps is not None and len(caps) == len(k):
            held = chosen & (caps > 0) & (k == caps)
            if held.any():
                per_mode = np.bincount(modes[held].astype(np.intp) - 1, minlength=len(em.MODES))
                for index in np.flatnonzero(per_mode):
                    self.add(em.held(em.MODES[index]), float(per_mode[index]))
        sizes = k[chosen]
        mode = modes[chosen].astype(np.intp) - 1
        # Bucket i holds 2^(i-1) < k <= 2^i: the binary exponent of k - 1 (exact for integers).
        bucket = np.minimum(np.frexp((sizes - 1).astype(np.float64))[1], _NB - 1)
        counts = np.bincount(mode * _NB + bucket, minlength=len(_BUCKETS))
        sums = np.bincount(mode, weights=sizes.astype(np.float64), minlength=len(_SUMS))
        for index in np.flatnonzero(counts):
            self.add(_BUCKETS[index], float(counts[index]))
        for index in np.flatnonzero(sums):
            self.add(_SUMS[index], float(sums[index]))

    # --- the background thread ----------------------------------------------------------------

    def _start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="bregman-metrics",
                                           daemon=True)
            self.thread.start()

    def _run(self) -> None:
        """Reads the steps left in the queue when the engine goes idle (waiting on their CUDA
        events here, never on the decoding thread) and finds the shared directory."""
        while True:
            time.sleep(LOOK_INTERVAL)
            with self.lock:
                first = self.pending[0] if self.pending else None
            with _NeverRaise():
                if first is not None and first.event is not None:
                    first.event.synchronize()
                with self.lock:
                    self.drain()
                    self.publish()


_engines: dict[int, _Engine] = {}
_engines_lock = threading.Lock()


def _engine() -> _Engine:
    """This process's `_Engine` (a forked child gets its own, starting from zero)."""
    pid = os.getpid()
    engine = _engines.get(pid)
    if engine is None:
        with _engines_lock:
            engine = _engines.get(pid)
            if engine is None:
                engine = _engines[pid] = _Engine()
                _register_in_process()
    return engine


_registered = False


def _register_in_process() -> None:
    global _registered
    if _registered:  # once per module: the collector reads the current process's totals
        return
    _registered = True
    from prometheus_client import REGISTRY

    REGISTRY.register(em.InProcessCollector(lambda: _engine().in_process()))


def _tensor_parallel_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # no distributed state (tests, benchmarks): a single rank
        return 0


class StepRecorder:
    """k* and the exact-path rows of each step of one processor (see the module docstring)."""

    def __init__(self, vllm_config: Any, device: torch.device | str, interface: str) -> None:
        self.device = torch.device(device)
        self.interface = interface
        self._plan: Plan | None = None
        self._modes = np.zeros(0, dtype=np.int8)
        self._family_rows = 0
        self._counts: bool | None = None  # tensor-parallel rank 0 (decided at the first step)
        with _NeverRaise():
            instance = getattr(vllm_config, "instance_id", None)
            _engine().target(em.shared_directory(instance if isinstance(instance, str) else None))
        register(interface)

    def record(self, plan: Plan, k: torch.Tensor, exact_rows: int,
               caps: np.ndarray | None = None) -> None:
        """Count one step: ``k`` [plan.batch] and ``exact_rows`` (the rows it handed to the
        exact path, `core.step.StepResult`) from the core's step; ``caps`` [plan.batch] the
        adaptive rows' k_max (0: none), for the held rows."""
        with _NeverRaise():
            if self._counts is None:
                self._counts = _tensor_parallel_rank() == 0
            if not self._counts:
                return
            if plan is not self._plan:
                self._prepare(plan)
            self._queue(k, self._modes, self._family_rows, exact_rows, caps)

    def record_rows(self, k: torch.Tensor, modes: np.ndarray | torch.Tensor,
                    caps: np.ndarray | None = None) -> None:
        """Count one step of a plan-less processor (Model Runner V2 with the kernels, which
        send no row to the host's exact path): ``modes`` per row (1 + index in MODES, 0 for
        rows of plain requests; on the host, or a device tensor copied with ``k``), ``caps`` as
        in `record` (None: held rows not counted this step)."""
        with _NeverRaise():
            if self._counts is None:
                self._counts = _tensor_parallel_rank() == 0
            if self._counts:
                self._queue(k, modes, 0, 0, caps)

    def _queue(self, k: torch.Tensor, modes: np.ndarray | torch.Tensor, family_rows: int,
               exact_rows: int, caps: np.ndarray | None = None) -> None:
        if self.device.type == "cuda":
            host = k.to("cpu", non_blocking=True)  # into pinned memory, asynchronously
            if isinstance(modes, torch.Tensor):
                modes = modes.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = k, None
        engine = _engine()
        with engine.lock:
            if family_rows:
                engine.add(em.exact_rows("family"), family_rows)
            if exact_rows:
                engine.add(em.exact_rows("uncertified"), exact_rows)
            engine.queue(_Pending(host, modes, event, caps))

    def _prepare(self, plan: Plan) -> None:
        """Per plan, on the host: each row's mode and the rows of exact-path families."""
        modes = np.zeros(plan.batch, dtype=np.int8)
        family_rows = 0
        for group in plan.groups:
            if group.rows is None:
                rows: Any = slice(None)
            elif group.host_rows is not None:
                rows = list(group.host_rows)
            else:  # a plan made without host positions (never the processor's)
                rows = group.rows.tolist()
            modes[rows] = em.MODES.index(group.mode) + 1
            if group.family is Family.EXACT:
                family_rows += group.count
        self._plan, self._modes, self._family_rows = plan, modes, family_rows
