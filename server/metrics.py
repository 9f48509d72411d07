"""Prometheus metrics of the server, in prometheus_client's default registry, and the engine's.

In the in-process server they appear in vLLM's own ``/metrics`` next to ``vllm:*``:
`bregman_server.engine` sets ``PROMETHEUS_MULTIPROC_DIR`` before vLLM (or prometheus_client) is
imported, so these metrics, vLLM's, and the engine processes' ``bregman_*`` metrics
(`bregman_vllm.engine_metrics`: k*, exact-path rows, failures) are all written to that
directory and collected together. Under plain ``vllm serve --middleware ...`` with one API
server, `attach_engine_metrics` adds the engine processes' files to vLLM's registry.

Label values are bounded: ``endpoint`` is one of the routes that take Bregman fields or
"other", ``mode`` one of primal / dual / off / invalid / none.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from bregman_vllm.engine_metrics import EngineMetricsCollector, instance_directory

logger = logging.getLogger("bregman_server")

# Generations run for seconds: cover sub-millisecond refusals up to long streams.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0, 600.0)


class Metrics:
    """The server's counters, histograms and gauges (one instance per process)."""

    def __init__(self) -> None:
        self.requests = Counter(
            "bregman_server_requests", "Requests answered, by endpoint, Bregman mode and status "
            "(499: the client left first).", ["endpoint", "mode", "status"])
        self.latency = Histogram(
            "bregman_server_request_duration_seconds",
            "Time from request to the last byte of the response (end of stream for SSE).",
            ["endpoint", "mode"], buckets=_LATENCY_BUCKETS)
        self.in_flight = Gauge(
            "bregman_server_requests_in_flight", "Requests being served now.", ["endpoint"],
            multiprocess_mode="livesum")
        self.cut = Counter(
            "bregman_server_requests_cut",
            "Requests ended by the server: at the end of the shutdown grace, or when the "
            "engine died (reason: shutdown / engine_dead).", ["reason"])
        self._children: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        self._in_flight: dict[str, Any] = {}

    def in_flight_for(self, endpoint: str) -> Any:
        """The in-flight gauge of ``endpoint`` (label lookups cached)."""
        gauge = self._in_flight.get(endpoint)
        if gauge is None:
            gauge = self._in_flight[endpoint] = self.in_flight.labels(endpoint)
        return gauge

    def record(self, endpoint: str, mode: str, status: int, seconds: float) -> None:
        """Count one answered request and its duration."""
        key = (endpoint, mode, str(status))
        children = self._children.get(key)
        if children is None:  # labels() costs a lock and a dict lookup: do it once per key
            children = (self.requests.labels(*key), self.latency.labels(endpoint, mode))
            self._children[key] = children
        children[0].inc()
        children[1].observe(seconds)


_lock = threading.Lock()
_metrics: Metrics | None = None


def metrics() -> Metrics:
    """The process's `Metrics` (created on first use)."""
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = Metrics()
        return _metrics


_attached: dict[Path, EngineMetricsCollector] = {}


def attach_engine_metrics(app: Any) -> Path | None:
    """Show the engine processes' Bregman metrics on vLLM's /metrics of this API server; the
    directory to remove when the server stops, or None when there is nothing to do.

    With ``PROMETHEUS_MULTIPROC_DIR`` set, vLLM's /metrics collects that directory, where the
    engines write already. Otherwise (one API server, vLLM's default registry) this creates
    the directory of the engine's ``instance_id`` (`bregman_vllm.engine_metrics`), where the
    engine processes then write, and adds its files to the registry.
    """
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    engine = getattr(getattr(app, "state", None), "engine_client", None)
    instance = getattr(getattr(engine, "vllm_config", None), "instance_id", None)
    if not isinstance(instance, str) or not instance:
        return None
    directory = instance_directory(instance)
    with _lock:
        if directory in _attached:
            return directory
        try:
            directory.parent.mkdir(mode=0o700, exist_ok=True)
            if directory.parent.stat().st_uid != os.getuid():
                raise PermissionError(f"{directory.parent} belongs to another user")
            directory.mkdir(mode=0o700, exist_ok=True)
        except OSError as error:
            logger.warning("engine metrics not shown on /metrics: %s", error)
            return None
        collector = _attached[directory] = EngineMetricsCollector(directory)
        REGISTRY.register(collector)
    return directory


def detach_engine_metrics(directory: Path) -> None:
    """Undo `attach_engine_metrics` when the server stops: the collector and the files go."""
    with _lock:
        collector = _attached.pop(directory, None)
        if collector is not None:
            REGISTRY.unregister(collector)
    shutil.rmtree(directory, ignore_errors=True)
