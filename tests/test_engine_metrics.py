"""The engine's Bregman metrics (k* histogram, exact-path rows, failures), without an engine.

* the processor's steady-state ``apply()`` dispatches no more host syncs (and no more ops) with
  the metrics than without them (`DispatchCounter`; on CPU the device-to-host copy of k is the
  tensor itself, so this shows that nothing else on the step needs the device's values);
* every Bregman row of a step is one observation of its mode, with its k*; plain rows none;
* the exact path's rows: the step counts its uncertified rows at its own sync, the plan its
  exact-family rows;
* the queue reads a step only once its copy is complete, in order, and an idle engine's last
  steps are read by the background thread (CUDA events stood in by objects with ``query`` and
  ``synchronize``: the only part that needs a GPU);
* two real engine processes (forked) write files of their own in one directory and the API
  server's collector adds them up;
* the Grafana dashboard in deploy/ is a valid dashboard whose queries name only metrics that
  exist (the names defined here; tests/test_server.py checks them against live scrapes).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext

from bregman_vllm import engine_metrics as em
from bregman_vllm.adapter import BregmanLogitsProcessor, telemetry
from bregman_vllm.core.plan import plan_requests
from bregman_vllm.core.step import decode_step
from bregman_vllm.diagnostics import MIXED_FAMILIES, DispatchCounter
from bregman_vllm.params import BregmanParams

from .v2_state import v2_request_state

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana-dashboard.json"
BATCH, VOCAB = 32, 4096

PRIMAL = {"bregman_alpha": 1.5, "bregman_lambda": 1e-2}
DUAL = {"bregman_mode": "dual", "bregman_alpha": 1.5, "bregman_lambda": 1e-2}
EXACT_FAMILY = {"bregman_mode": "dual", "bregman_alpha": 2.5, "bregman_lambda": 1e-2}
PAST_WINDOW = {"bregman_alpha": 1.5, "bregman_lambda": 1e-9}  # k* near V on flat rows


class EngineConfig:
    """Stands in for VllmConfig (no instance_id: nothing is written to disk)."""


class MetricsOff:
    """The processor's recorder, switched off."""

    def record(self, *args: object) -> None:
        return None


def logits_for(seed: int = 0, batch: int = BATCH, flat_rows: tuple[int, ...] = ()
               ) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(batch, VOCAB, generator=g) * (3 + 4 * torch.rand(batch, 1, generator=g))
    for row in flat_rows:
        out[row] = torch.randn(VOCAB, generator=g) * 1e-3
    return out


def v1_processor(configs: list[dict | None]) -> BregmanLogitsProcessor:
    proc = BregmanLogitsProcessor(EngineConfig(), torch.device("cpu"), False)
    added = [(i, SamplingParams(temperature=1.0, extra_args=configs[i % len(configs)]), None, [])
             for i in range(BATCH)]
    proc.update_state(BatchUpdate(BATCH, [], added, []))
    return proc


def v2_processor(configs: list[dict | None]) -> tuple[BregmanLogitsProcessor, LogitsContext]:
    """V2 with vLLM's own LogitsContext and request state (built on the CPU:
    `tests/v2_state.py`)."""
    proc = BregmanLogitsProcessor(EngineConfig(), v2_request_state(BATCH, VOCAB))
    for slot in range(BATCH):
        proc.add_request(slot, SamplingParams(temperature=0.8,
                                              extra_args=configs[slot % len(configs)]))
    order = list(reversed(range(BATCH)))
    mapping = torch.tensor(order, dtype=torch.int32)
    ctx = LogitsContext(
        expanded_idx_mapping=mapping, idx_mapping=mapping, idx_mapping_np=np.array(order),
        expanded_local_pos=torch.zeros(BATCH, dtype=torch.int32),
        input_ids=torch.zeros(BATCH, dtype=torch.int32), pos=torch.zeros(BATCH, dtype=torch.int32),
        seq_lens_upper_bound_np=np.ones(BATCH, dtype=np.int64))
    return proc, ctx


def scrape(values: dict) -> str:
    registry = CollectorRegistry()
    registry.register(em.InProcessCollector(lambda: values))
    return generate_latest(registry).decode()


def sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        match = re.match(r"^([\w:]+)(\{[^}]*\})?\s+(\S+)$", line)
        if match and match.group(1) == name:
            found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(match.group(3))
    return total


def counts() -> dict[str, float]:
    text = scrape(telemetry.totals())
    out = {}
    for mode in em.MODES:
        out[mode] = sample(text, "bregman_support_size_count", mode=mode)
        out[f"{mode}_sum"] = sample(text, "bregman_support_size_sum", mode=mode)
    for reason in em.EXACT_REASONS:
        out[reason] = sample(text, "bregman_exact_path_rows_total", reason=reason)
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in after}


# ----------------------------------------------------------------------------- syncs


CONFIGS = {
    "primal": [PRIMAL],
    "past the window": [PAST_WINDOW],  # the step syncs once: its own sync, nothing more
    "mixed": [*MIXED_FAMILIES, EXACT_FAMILY, DUAL],
}


@pytest.mark.parametrize("interface", ["v1", "v2"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_steady_state_apply_has_no_more_syncs_with_the_metrics_than_without(interface, name):
    configs = [c or None for c in CONFIGS[name]]
    flat = tuple(range(0, BATCH, 3)) if name != "primal" else ()
    logits = logits_for(flat_rows=flat)
    measured = {}
    for metrics in (True, False):
        if interface == "v1":
            proc = v1_processor(configs)
            call = lambda proc=proc: proc.apply(logits.clone())  # noqa: E731
        else:
            proc, ctx = v2_processor(configs)
            call = lambda proc=proc, ctx=ctx: proc.apply(logits.clone(), ctx)  # noqa: E731
        if not metrics:
            proc.recorder = MetricsOff()
        call()  # the plan, once per batch change
        before = counts()
        with DispatchCounter() as counter:
            call()
        measured[metrics] = counter
        if metrics:  # the step was counted (not skipped)
            assert sum(delta(counts(), before)[mode] for mode in em.MODES) > 0
    on, off = measured[True], measured[False]
    assert on.syncs == off.syncs, (dict(on.sync_ops), dict(off.sync_ops))
    if name == "primal":  # every row certified: the step's own sync at most
        assert on.syncs <= 1
    else:  # flat rows and an exact family: the exact path's rounds, the same with or without
        assert on.syncs > 1
    # Nothing of the metrics runs on the device's tensors (on a GPU: one copy of k more).
    assert on.launches == off.launches, (on.launch_ops - off.launch_ops)


def test_the_step_counts_uncertified_rows_at_its_own_sync():
    """`StepResult.exact_rows` is read at the step's one sync: every flat row's k* is past the
    window (all handed to the exact path); peaked rows need none, and that step syncs once."""
    logits = logits_for(flat_rows=tuple(range(BATCH)))
    plan = plan_requests([(row, BregmanParams.from_mapping(PAST_WINDOW))
                          for row in range(BATCH)], batch=BATCH, vocab=VOCAB, device="cpu")
    assert decode_step(logits.clone(), plan, logits=True).exact_rows == BATCH
    peaked_plan = plan_requests([(row, BregmanParams.from_mapping(PRIMAL)) for row in range(BATCH)],
                                batch=BATCH, vocab=VOCAB, device="cpu")
    peaked_logits = logits_for()
    decode_step(peaked_logits.clone(), peaked_plan, logits=True)  # warm the constant caches
    with DispatchCounter() as counter:
        peaked = decode_step(peaked_logits, peaked_plan, logits=True)
    assert peaked.exact_rows == 0
    assert counter.syncs <= 1, dict(counter.sync_ops)


# ----------------------------------------------------------------------------- what is counted


@pytest.mark.parametrize("interface", ["v1", "v2"])
def test_every_bregman_row_is_one_observation_of_its_mode(interface):
    configs = [PRIMAL, None, DUAL, EXACT_FAMILY, PAST_WINDOW, {"bregman_top_k": 7}]
    rows = {mode: 0 for mode in ("primal", "dual", "plain")}
    for slot in range(BATCH):
        config = configs[slot % len(configs)]
        rows["plain" if config is None else config.get("bregman_mode", "primal")] += 1
    exact_family = sum(1 for slot in range(BATCH) if configs[slot % len(configs)] is EXACT_FAMILY)
    past = [slot for slot in range(BATCH) if configs[slot % len(configs)] is PAST_WINDOW]
    if interface == "v1":
        proc = v1_processor(configs)
        positions = list(range(BATCH))
    else:
        proc, ctx = v2_processor(configs)
        positions = list(ctx.idx_mapping_np)  # row i holds slot positions[i]
    steps, kept = 3, {"primal": 0.0, "dual": 0.0}
    before = counts()
    for step in range(steps):
        logits = logits_for(seed=step, flat_rows=tuple(
            i for i, slot in enumerate(positions) if slot in past))
        out = proc.apply(logits.clone()) if interface == "v1" else \
            proc.apply(logits.clone(), ctx)
        for i, slot in enumerate(positions):
            config = configs[slot % len(configs)]
            if config is not None:
                kept[config.get("bregman_mode", "primal")] += float(torch.isfinite(out[i]).sum())
    change = delta(counts(), before)
    assert change["primal"] == steps * rows["primal"]
    assert change["dual"] == steps * rows["dual"]
    assert change["primal_sum"] == kept["primal"]  # k* is the support that was written
    assert change["dual_sum"] == kept["dual"]
    assert change["family"] == steps * exact_family
    assert change["uncertified"] == steps * len(past)


def test_histogram_buckets_are_powers_of_two_up_to_2_17():
    values = {}
    engine = telemetry._Engine()
    engine.values = values
    sizes = np.array([1, 2, 3, 4, 5, 64, 65, 2**17, 2**17 + 1, 200000])
    engine._count(sizes, np.ones(len(sizes), dtype=np.int8))
    text = scrape(values)
    expected = {"1.0": 1, "2.0": 2, "4.0": 4, "8.0": 5, "64.0": 6, "128.0": 7,
                "131072.0": 8, "+Inf": 10}
    for bound, count in expected.items():
        assert sample(text, "bregman_support_size_bucket", mode="primal", le=bound) == count
    assert sample(text, "bregman_support_size_sum", mode="primal") == float(sizes.sum())
    assert len(em.SUPPORT_BUCKETS) == 18 and em.SUPPORT_BUCKETS[-1] == 2**17


def test_failures_are_counted_and_shown_from_the_start(monkeypatch):
    proc = v1_processor([PRIMAL])
    text = scrape(telemetry.totals())
    assert "bregman_processor_failures_total{interface=\"v1\"}" in text
    before = sample(text, "bregman_processor_failures_total", interface="v1")
    from bregman_vllm.adapter import processor as processor_module

    monkeypatch.setattr(processor_module, "decode_step", lambda *a, **k: 1 / 0)
    monkeypatch.setattr(telemetry, "_last_warning", math.inf)
    proc.apply(logits_for())
    after = sample(scrape(telemetry.totals()), "bregman_processor_failures_total",
                   interface="v1")
    assert after == before + BATCH


# ----------------------------------------------------------------------------- a step later


class FakeEvent:
    """A CUDA event stood in: ``query`` never blocks, ``synchronize`` waits (here: completes)."""

    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def test_a_step_is_read_once_its_copy_is_complete_in_order():
    engine = telemetry._Engine()
    modes = np.array([1, 2, 0], dtype=np.int8)
    first, second = FakeEvent(), FakeEvent()
    engine.thread = object()  # no background thread here (tested below)
    engine.queue(telemetry._Pending(torch.tensor([3, 5, 9]), modes, first))
    assert engine.values == {} and len(engine.pending) == 1  # the copy is in flight
    second.done = True
    engine.queue(telemetry._Pending(torch.tensor([1, 1, 1]), modes, second))
    assert engine.values == {} and len(engine.pending) == 2  # in order: the first is not done
    first.done = True
    engine.queue(telemetry._Pending(torch.tensor([2, 2, 2]), modes, None))
    assert not engine.pending and first.waited == second.waited == 0  # never waited for
    text = scrape(engine.values)
    assert sample(text, "bregman_support_size_count", mode="primal") == 3
    assert sample(text, "bregman_support_size_sum", mode="primal") == 3 + 1 + 2
    assert sample(text, "bregman_support_size_sum", mode="dual") == 5 + 1 + 2


def test_an_idle_engine_s_last_steps_are_read_by_the_background_thread(monkeypatch):
    monkeypatch.setattr(telemetry, "LOOK_INTERVAL", 0.01)
    engine = telemetry._Engine()
    event = FakeEvent()
    engine.queue(telemetry._Pending(torch.tensor([4, 4]), np.array([1, 1], np.int8), event))
    assert engine.thread is not None  # started by the first entry with an event
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with engine.lock:  # the thread pops an entry, then counts it, holding the lock
            if not engine.pending:
                break
        time.sleep(0.01)
    assert not engine.pending and event.waited >= 1  # waited for in that thread
    assert sample(scrape(engine.values), "bregman_support_size_sum", mode="primal") == 8


# ----------------------------------------------------------------------------- several processes


def test_each_engine_process_writes_its_own_files_and_the_server_adds_them_up(tmp_path):
    """Two engine processes' totals (their `_Engine`s, told apart by pid as in vLLM's engine
    processes; tests/test_server.py runs real ones with data parallelism) in one directory:
    a pair of files each, summed by the API server's collector."""
    kept = 0.0
    for pid, seed in ((10001, 1), (10002, 2)):
        engine = telemetry._Engine()
        engine.pid = pid
        engine.target(tmp_path)
        engine.show(em.every_series("v1"))  # at 0 from the start
        k = torch.tensor([3, 7, 0, 5]) * seed
        with engine.lock:
            engine.queue(telemetry._Pending(k, np.array([1, 2, 0, 2], np.int8), None))
        kept += float(k[[0, 1, 3]].sum())
    files = sorted(path.name for path in tmp_path.iterdir())
    assert files == ["counter_bregman-10001.db", "counter_bregman-10002.db",
                     "histogram_bregman-10001.db", "histogram_bregman-10002.db"]
    registry = CollectorRegistry()
    registry.register(em.EngineMetricsCollector(tmp_path))
    text = generate_latest(registry).decode()
    assert sample(text, "bregman_support_size_count") == 6  # 3 Bregman rows in each
    assert sample(text, "bregman_support_size_count", mode="dual") == 4
    assert sample(text, "bregman_support_size_sum") == kept
    assert sample(text, "bregman_support_size_bucket", mode="primal", le="4.0") == 1
    assert sample(text, "bregman_support_size_bucket", mode="primal", le="8.0") == 2
    assert sample(text, "bregman_processor_failures_total", interface="v1") == 0  # shown
    assert "bregman_processor_failures_total" in text


# ----------------------------------------------------------------------------- the dashboard


#: Metrics the dashboard may name besides ours: vLLM's (checked live in tests/test_server.py).
VLLM_METRICS = {"vllm:generation_tokens_total"}
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                 "or", "unless", "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions,
    keywords, label names (inside braces or a by/without/on/ignoring list) or durations."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "{}", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "[]", text)  # ranges ($__rate_interval, 5m)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][\w:]*", text):
        word, rest = match.group(0), text[match.end():].lstrip()
        if word in _PROMQL_WORDS or rest.startswith("("):
            continue
        if text[:match.start()].endswith("$"):  # a dashboard variable
            continue
        names.add(word)
    return names


def dashboard_queries(dashboard: dict) -> list[str]:
    panels = list(dashboard["panels"])
    for panel in dashboard["panels"]:
        panels += panel.get("panels", [])
    exprs = [target["expr"] for panel in panels for target in panel.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":  # Grafana's label_values(METRIC, LABEL): the metric
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            exprs.append(re.sub(r"^label_values\((.+),\s*\w+\)$", r"\1", query))
    return exprs


def test_dashboard_is_a_valid_grafana_dashboard():
    dashboard = json.loads(DASHBOARD.read_text())
    assert isinstance(dashboard["title"], str) and dashboard["title"]
    assert re.fullmatch(r"[\w-]{1,40}", dashboard["uid"])
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert {"from", "to"} <= set(dashboard["time"])
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    kinds = {"timeseries", "heatmap", "stat", "row", "text", "bargauge", "gauge"}
    for panel in dashboard["panels"]:
        assert panel["type"] in kinds, panel["type"]
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= set(grid) and grid["x"] + grid["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel["targets"]
        for target in panel["targets"]:
            assert target["expr"] and target["refId"]
            assert target["datasource"] == panel["datasource"] == {
                "type": "prometheus", "uid": "${datasource}"}
    variables = {var["name"]: var for var in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"


def test_dashboard_queries_name_only_metrics_that_exist():
    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    named = set().union(*(promql_metric_names(expr) for expr in queries))
    assert named <= em.SAMPLE_NAMES | VLLM_METRICS, named - em.SAMPLE_NAMES - VLLM_METRICS
    # What the issue asks the dashboard to show.
    assert {"bregman_support_size_bucket", "bregman_support_size_count",
            "bregman_exact_path_rows_total", "bregman_processor_failures_total",
            "vllm:generation_tokens_total"} <= named
    # The names are those a scrape of the engine metrics shows.
    shown = {match.group(1) for match in re.finditer(r"^([\w:]+)[{ ]", scrape(
        {series: 0.0 for series in em.every_series("v1")}), re.M)}
    assert shown >= em.SAMPLE_NAMES


def test_promql_metric_names():
    assert promql_metric_names(
        'sum by (le) (rate(bregman_support_size_bucket{mode=~"$mode"}[$__rate_interval]))'
        ' / on() group_left sum(rate(vllm:generation_tokens_total[5m]))') == {
        "bregman_support_size_bucket", "vllm:generation_tokens_total"}
    assert promql_metric_names("histogram_quantile(0.9, sum by (le, mode) (rate(x_bucket[1m])))"
                               ) == {"x_bucket"}


def test_greedy_rows_are_neither_decoded_nor_counted_under_v1():
    """vLLM's V1 sampler takes greedy rows' argmax before the processor runs; the processor
    skips them (as under V2), so they are not counted as Bregman-decoded tokens."""
    proc = BregmanLogitsProcessor(EngineConfig(), torch.device("cpu"), False)
    added = [(0, SamplingParams(temperature=0.0, extra_args=PRIMAL), None, []),
             (1, SamplingParams(temperature=1.0, extra_args=PRIMAL), None, [])]
    proc.update_state(BatchUpdate(2, [], added, []))
    logits = logits_for(batch=2)
    before = counts()
    out = proc.apply(logits.clone())
    assert torch.equal(out[0], logits[0]) and not torch.equal(out[1], logits[1])
    assert delta(counts(), before)["primal"] == 1


def test_plain_vllm_middleware_shows_the_engine_files_while_the_server_runs(monkeypatch):
    """The middleware's lifespan under plain vLLM (no PROMETHEUS_MULTIPROC_DIR): the instance's
    directory exists and its files are in the registry while the server runs, and are gone
    after it stops. (tests/test_server.py checks a real vLLM server's /metrics.)"""
    import asyncio

    from bregman_server import metrics as server_metrics
    from bregman_server.middleware import BregmanMiddleware
    from bregman_server.settings import ServerSettings
    from prometheus_client import REGISTRY

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    instance = f"unit-{os.getpid()}-{time.monotonic_ns()}"
    directory = em.instance_directory(instance)
    app_state = SimpleNamespace(engine_client=SimpleNamespace(
        vllm_config=SimpleNamespace(instance_id=instance)))
    seen = {}

    async def app(scope, receive, send):  # stands in for vLLM's app: runs its lifespan
        assert (await receive())["type"] == "lifespan.startup"
        seen["during"] = directory.is_dir()
        engine = telemetry._Engine()  # an engine process writing there
        engine.pid = 424242
        engine.target(directory)
        engine.show(em.every_series("v1"))
        registry = CollectorRegistry()  # what the attached collector adds to vLLM's registry
        registry.register(server_metrics._attached[directory])
        seen["shown"] = registry.get_sample_value("bregman_processor_failures_total",
                                                  {"interface": "v1"})
        seen["registered"] = server_metrics._attached[directory] in REGISTRY._collector_to_names
        await send({"type": "lifespan.startup.complete"})
        assert (await receive())["type"] == "lifespan.shutdown"
        await send({"type": "lifespan.shutdown.complete"})

    messages = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])

    async def receive():
        return next(messages)

    async def send(message):
        return None

    middleware = BregmanMiddleware(app, ServerSettings())
    asyncio.run(middleware({"type": "lifespan", "app": SimpleNamespace(state=app_state)},
                           receive, send))
    assert seen == {"during": True, "shown": 0.0, "registered": True}
    assert not directory.exists() and directory not in server_metrics._attached
