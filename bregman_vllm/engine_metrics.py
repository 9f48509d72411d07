"""The engine's Bregman metrics on /metrics: names, buckets, and how they travel to the API server.

The logits processor runs in vLLM's engine process (one per data-parallel rank), while
``/metrics`` is answered by the API server process, whose prometheus registry is another one.
The engine side (`bregman_vllm.adapter.telemetry`) keeps running totals in memory and writes
them into files in prometheus_client's multiprocess format (``counter_bregman-PID.db``,
``histogram_bregman-PID.db``: one pair per engine process); the API server reads every file of
the directory and sums them (`EngineMetricsCollector`, prometheus_client's own multiprocess
merge), so data-parallel ranks add up. The directory both sides agree on:

* ``PROMETHEUS_MULTIPROC_DIR`` when it is set. `bregman-serve` sets it before vLLM starts, and
  vLLM sets it itself when it runs several API servers; engine processes inherit it, and
  vLLM's /metrics then collects that directory already (nothing more to do).
* Otherwise (plain ``vllm serve --middleware bregman_server.middleware.BregmanMiddleware``,
  one API server): `instance_directory` of the engine's ``VllmConfig.instance_id``, which the
  API server's config and every engine process's copy share. The middleware creates it when
  the server starts, adds an `EngineMetricsCollector` for it to vLLM's registry, and removes
  it when the server stops; the engine looks for it (about once a second) and writes there
  once it exists. An offline ``LLM(...)`` has no such server: nothing is written to disk, and
  the totals show in the engine process's own default registry (`InProcessCollector`).

Only bounded label values: ``mode`` (primal, dual), ``reason`` (family, uncertified),
``interface`` (v1, v2). This module imports neither torch nor vLLM.
"""

from __future__ import annotations

import functools
import glob
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .params import DECODING_MODES

#: Metric names (prometheus_client's names: counters show as ``NAME_total``).
SUPPORT_SIZE = "bregman_support_size"
EXACT_ROWS = "bregman_exact_path_rows"
FAILURES = "bregman_processor_failures"
HELD = "bregman_support_held"

#: Upper bounds of the k* histogram: 1, 2, 4, ..., 2^17 (then +Inf, for vocabularies beyond).
SUPPORT_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(18))
MODES = DECODING_MODES
EXACT_REASONS = ("family", "uncertified")
INTERFACES = ("v1", "v2")

HELP = {
    SUPPORT_SIZE: "Support size k* of each Bregman-decoded token (one observation per decoded "
                  "row and step), by mode.",
    EXACT_ROWS: "Rows decoded by the exact path: reason=family for alphas without a "
                "fixed-shape formula, reason=uncertified for rows the fixed-shape step could "
                "not certify.",
    FAILURES: "Rows whose Bregman decoding failed in a step; their logits were left as they "
              "were (plain sampling for that step).",
    HELD: "Adaptive Bregman-decoded rows whose support k* was held at their k_max (the "
          "server's largest support size, when the request sent no bregman_k_max), by mode.",
}

#: The sample names these metrics show on /metrics (what a dashboard may query).
SAMPLE_NAMES = frozenset({
    f"{SUPPORT_SIZE}_bucket", f"{SUPPORT_SIZE}_count", f"{SUPPORT_SIZE}_sum",
    f"{EXACT_ROWS}_total", f"{FAILURES}_total", f"{HELD}_total",
})

#: The files of the engine processes, in any directory (other metrics' files are not ours).
FILE_GLOB = "*_bregman-*.db"

#: A series: (file kind, prometheus_client multiprocess key).
Series = tuple[str, str]


def file_name(kind: str, pid: int) -> str:
    """One engine process's file of one kind ("counter" or "histogram"). prometheus_client
    reads the kind from the part before the first underscore; "bregman-" keeps our files apart
    from those prometheus_client itself writes for the same process (``counter_PID.db``)."""
    return f"{kind}_bregman-{pid}.db"


def instance_directory(instance_id: str) -> Path:
    """The directory of one vLLM server without ``PROMETHEUS_MULTIPROC_DIR`` (see above)."""
    safe = "".join(c for c in str(instance_id) if c.isalnum() or c in "-_") or "default"
    return Path(tempfile.gettempdir()) / f"bregman-vllm-metrics-{os.getuid()}" / safe


def shared_directory(instance_id: str | None) -> Path | None:
    """Where this process's engine metrics go: ``PROMETHEUS_MULTIPROC_DIR``, else the
    instance's directory, else None (no server to read them)."""
    multiproc = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if multiproc:
        return Path(multiproc)
    return instance_directory(instance_id) if instance_id else None


def _key(metric: str, sample: str, labels: Mapping[str, str]) -> str:
    from prometheus_client.mmap_dict import mmap_key

    return mmap_key(metric, sample, list(labels), list(labels.values()), HELP[metric])


def _bound(value: float) -> str:
    from prometheus_client.utils import floatToGoString

    return floatToGoString(value)


@functools.cache
def support_bucket(mode: str, index: int) -> Series:
    """The (non-cumulative) count of bucket ``index`` of `SUPPORT_BUCKETS` (+Inf past them)."""
    bound = SUPPORT_BUCKETS[index] if index < len(SUPPORT_BUCKETS) else float("inf")
    return "histogram", _key(SUPPORT_SIZE, f"{SUPPORT_SIZE}_bucket",
                             {"mode": mode, "le": _bound(bound)})


@functools.cache
def support_sum(mode: str) -> Series:
    return "histogram", _key(SUPPORT_SIZE, f"{SUPPORT_SIZE}_sum", {"mode": mode})


@functools.cache
def exact_rows(reason: str) -> Series:
    return "counter", _key(EXACT_ROWS, f"{EXACT_ROWS}_total", {"reason": reason})


@functools.cache
def held(mode: str) -> Series:
    return "counter", _key(HELD, f"{HELD}_total", {"mode": mode})


@functools.cache
def failures(interface: str) -> Series:
    return "counter", _key(FAILURES, f"{FAILURES}_total", {"interface": interface})


def every_series(interface: str) -> Iterator[Series]:
    """The series an engine shows from its start, at 0 (so that "none" and "not counted" differ
    on a dashboard)."""
    for mode in MODES:
        for index in range(len(SUPPORT_BUCKETS) + 1):
            yield support_bucket(mode, index)
        yield support_sum(mode)
        yield held(mode)
    for reason in EXACT_REASONS:
        yield exact_rows(reason)
    yield failures(interface)


class MetricsFiles:
    """One engine process's files in ``directory`` (prometheus_client's mmap format)."""

    def __init__(self, directory: Path, pid: int) -> None:
        from prometheus_client.mmap_dict import MmapedDict

        self.files = {kind: MmapedDict(str(directory / file_name(kind, pid)))
                      for kind in ("counter", "histogram")}

    def write(self, values: Iterable[tuple[Series, float]]) -> None:
        for (kind, key), value in values:
            self.files[kind].write_value(key, value, 0.0)

    def close(self) -> None:
        for mmaped in self.files.values():
            mmaped.close()


class EngineMetricsCollector:
    """The engine processes' files in ``directory``, summed over processes with
    prometheus_client's multiprocess merge (histogram buckets made cumulative, ``_count``
    added). A collector for vLLM's registry in the API server process."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def describe(self) -> list:
        return []  # names unknown until files exist: never checked against the registry's

    def collect(self) -> Iterable[Any]:
        from prometheus_client.multiprocess import MultiProcessCollector

        files = glob.glob(str(self.directory / FILE_GLOB))
        return MultiProcessCollector.merge(files, accumulate=True) if files else []


class InProcessCollector:
    """This process's totals for its own default registry: offline use, where no API server
    reads files. ``source()`` gives the totals (series -> value), or None while they are in
    files (collected by the server then, never twice)."""

    def __init__(self, source: Callable[[], Mapping[Series, float] | None]) -> None:
        self.source = source

    def describe(self) -> list:
        return []

    def collect(self) -> Iterable[Any]:
        values = self.source()
        if values is None:
            return []
        from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily

        shown: list[Any] = []
        for metric, label, options, series in (
                (EXACT_ROWS, "reason", EXACT_REASONS, exact_rows),
                (FAILURES, "interface", INTERFACES, failures),
                (HELD, "mode", MODES, held)):
            family = CounterMetricFamily(metric, HELP[metric], labels=[label])
            for option in options:
                value = values.get(series(option))
                if value is not None:
                    family.add_metric([option], value)
            shown.append(family)
        histogram = HistogramMetricFamily(SUPPORT_SIZE, HELP[SUPPORT_SIZE], labels=["mode"])
        for mode in MODES:
            if support_sum(mode) not in values:
                continue
            running, buckets = 0.0, []
            for index in range(len(SUPPORT_BUCKETS) + 1):
                running += values.get(support_bucket(mode, index), 0.0)
                bound = SUPPORT_BUCKETS[index] if index < len(SUPPORT_BUCKETS) else float("inf")
                buckets.append((_bound(bound), running))
            histogram.add_metric([mode], buckets, values[support_sum(mode)])
        shown.append(histogram)
        return shown
