"""Counting the processor's failures: a Prometheus counter and a rate-limited warning.

`apply()` never raises (an exception inside a logits processor would fail every request on the
engine), so a failure must be visible some other way. Each failed row (and each request whose
parameters fail validation inside the engine, which then gets plain sampling) is counted in

    bregman_processor_failures_total{interface="v1"|"v2"}

(prometheus_client's default registry of the engine process; with ``PROMETHEUS_MULTIPROC_DIR``
set before vLLM starts, as `bregman-serve` does, the API server's /metrics shows it), and a
warning with the running count is logged at most once per `WARNING_INTERVAL` seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

logger = logging.getLogger("bregman_vllm.adapter")

#: Seconds between two failure warnings (the count keeps running in between).
WARNING_INTERVAL = 60.0

_lock = threading.Lock()
_counter: Any = None
_total = 0
_last_warning = -float("inf")


def failures_total() -> int:
    """Rows left undecoded by a failure since this process started."""
    return _total


def _prometheus_counter() -> Any:
    global _counter
    if _counter is None:
        try:
            from prometheus_client import Counter
        except ImportError:  # pragma: no cover - vLLM installs prometheus_client
            _counter = False
        else:
            try:
                _counter = Counter(
                    "bregman_processor_failures",
                    "Rows whose Bregman decoding failed in a step; their logits were left as "
                    "they were (plain sampling for that step).",
                    ["interface"])
            except ValueError:  # already registered (e.g. a module reload): reuse it
                from prometheus_client import REGISTRY

                _counter = REGISTRY._names_to_collectors.get("bregman_processor_failures",
                                                            False)
    return _counter


def register(interface: str) -> None:
    """Show the failure counter of ``interface`` from the start (at 0), so that a scraper can
    tell "no failure" from "not counted"."""
    counter = _prometheus_counter()
    if counter:
        counter.labels(interface)


def record_failure(rows: int, interface: str, error: BaseException) -> None:
    """Count ``rows`` rows left undecoded by ``error`` and warn (rate-limited)."""
    global _total, _last_warning
    counter = _prometheus_counter()
    if counter:
        counter.labels(interface).inc(rows)
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
