"""End to end: `bregman-eval run` and `plot` against a real server with the tiny model.

The fixture starts our server (`tests/test_server_support.ServerProcess`, vLLM's engine
included) on a loopback port with
``--logprobs-mode processed_logprobs`` (the engine then reports k* through its logprobs) and
``--dtype float32`` (so the offline transformers recomputation of k* sees the same numbers)
and without chunked prefill (see ENGINE_ARGS).
One short run covers both tasks, adaptive, fixed-k and matched top-k configurations and both k*
sources; the tests check the files it writes. Every process started is stopped at the end.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bregman_vllm.evaluation import cli

from .test_server_support import ServerProcess, require_tiny_model, shut_down

pytestmark = [pytest.mark.server, pytest.mark.timeout(480)]

MODEL = "models/tiny-llama"
# No chunked prefill: vLLM 0.32 on CPU crashes when a seeded request's prompt is prefilled in
# chunks ("CPU Generator does not use offset"), and the GSM8K prompts are long.
ENGINE_ARGS = ["--logprobs-mode", "processed_logprobs", "--max-logprobs", "64",
               "--dtype", "float32", "--max-num-seqs", "16",
               "--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048",
               "--enforce-eager"]  # no torch.compile: a fresh CI machine would compile for minutes
CONFIGS = ["primal:1.5:0.01", "dual:2:0.01:T=0.8@gsm8k"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_tiny_model()
    live = ServerProcess(["--model", MODEL, *ENGINE_ARGS],
                         tmp_path_factory.mktemp("eval-server") / "server.log")
    try:
        live.start().wait_healthy(timeout=300)
        yield live
    finally:
        shut_down(live)


@pytest.fixture(scope="module")
def run_dir(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("eval-run")
    argv = ["run", "--endpoint", server.url + "/v1", "--tasks", "open,gsm8k",
            *[arg for spec in CONFIGS for arg in ("--config", spec)],
            "--grid-k", "4", "--grid-alpha", "2",
            "--passages", "4", "--max-tokens", "24", "--limit", "3", "--gsm8k-max-tokens", "32",
            "--model-dir", MODEL, "--kstar", "both", "--concurrency", "8",
            "--resamples", "200", "--no-progress", "--out", str(out),
            "--ours"]  # our server's native form: bregman_* at the top level
    assert cli.main(argv) == 0
    return out


def _result(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "results.json").read_text())


def test_result_json_has_every_configuration(run_dir: Path) -> None:
    result = _result(run_dir)
    labels = [c["label"] for c in result["configs"]]
    assert labels[:4] == ["primal:1.5:0.01:kmax=50:T=1", "dual:2:0.01:kmax=50:T=0.8",
                          "topk:4:T=1", "primal:2:k=4:T=1"]
    # Matched top-k baselines were added, one per adaptive configuration and task.
    open_task, gsm8k = result["open"], result["gsm8k"]
    assert set(open_task["matched"]) == {"primal:1.5:0.01:kmax=50:T=1"}
    assert set(gsm8k["matched"]) == {"primal:1.5:0.01:kmax=50:T=1", "dual:2:0.01:kmax=50:T=0.8"}
    open_rows = {row["config"]: row for row in open_task["results"]}
    assert set(open_rows) == {"primal:1.5:0.01:kmax=50:T=1", "topk:4:T=1", "primal:2:k=4:T=1",
                              open_task["matched"]["primal:1.5:0.01:kmax=50:T=1"]}
    assert result["meta"]["model"] == MODEL and result["meta"]["wall_s"] > 0


def test_open_ended_metrics_are_sane(run_dir: Path) -> None:
    task = _result(run_dir)["open"]
    assert task["passages"] == 4
    human = task["human"]
    assert human["ppl"]["value"] > 1 and human["ppl"]["std"] > 0
    assert human["mean_length"] == 24
    for row in task["results"]:
        assert row["ppl"]["value"] > 1, row
        gap = human["ppl"]["value"] - row["ppl"]["value"]
        assert row["ppl_gap"]["value"] == pytest.approx(gap, rel=1e-9, abs=1e-9)
        assert 0 <= row["rep"]["value"] <= 1
        assert -1 <= row["rep_gap"]["value"] <= 1
        assert 0 < row["mean_length"] <= 24


def test_kstar_reported_by_the_engine_matches_the_offline_recomputation(run_dir: Path) -> None:
    result = _result(run_dir)
    for task in ("open", "gsm8k"):
        for row in result[task]["results"]:
            config = next(c for c in result["configs"] if c["label"] == row["config"])
            ks = row["kstar"]
            if not config["adaptive"]:
                assert ks is None
                continue
            assert ks["source"] == "logprobs"
            # The processor ran (adaptive, capped support), and both sources agree.
            assert 1 <= ks["minimum"] <= ks["mean"] <= ks["maximum"] <= 50
            assert ks["maximum"] > ks["minimum"]
            assert ks["std"] > 0 and ks["entropy_bits"] > 0
            assert ks["agreement_with_local"] >= 0.9, (task, row["config"], ks)
            assert ks["local"]["n"] == ks["n"]
            matched = result[task]["matched"][row["config"]]
            matched_config = next(c for c in result["configs"] if c["label"] == matched)
            assert matched_config["top_k"] == max(1, int(ks["mean"] + 0.5))
            assert matched_config["temperature"] == config["temperature"]


def test_gsm8k_rows(run_dir: Path) -> None:
    task = _result(run_dir)["gsm8k"]
    assert task["problems"] == 3
    assert task["mean_prompt_tokens"] > 500  # eight worked exemplars precede the question
    for row in task["results"]:
        assert 0 <= row["accuracy"]["value"] <= 100
        assert row["accuracy"]["n"] == 3
        assert 0 < row["mean_length"] <= 32


def test_samples_and_markdown(run_dir: Path) -> None:
    result = _result(run_dir)
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    expected = 4 * len(result["open"]["results"]) + 3 * len(result["gsm8k"]["results"])
    assert len(records) == expected
    assert all(r["text"] is not None for r in records)
    adaptive = [r for r in records if r["config"].startswith("primal:1.5:0.01")]
    assert adaptive and all(len(r["kstar"]) >= r["tokens"] for r in adaptive)
    markdown = (run_dir / "results.md").read_text()
    for heading in ("## Open-ended generation", "### Perplexity gap against k",
                    "### Repetition gap against k", "## GSM8K",
                    "### GSM8K accuracy (%) in the paper's layout",
                    "## Adaptivity on GSM8K", "Agreement of engine-reported"):
        assert heading in markdown
    assert "| k | top-k (α=1) | primal α=2 |" in markdown


def test_figures(run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each figure shows the numbers it is drawn from (read back from the figures themselves):
    the gaps figure's points are the result's (k, gap) pairs, the k* histogram's lines the
    result's histograms, the cost curves and their k* dots the independent reference's
    (tests/reference_search.py), the maps' lines the reference's maps."""
    from bregman_vllm.evaluation import figures

    from . import reference_search as rs

    for name in ("gaps_vs_k.png", "kstar_hist.png"):
        assert (run_dir / name).read_bytes()[:4] == b"\x89PNG"
    drawn: dict[str, Any] = {}
    save = figures._save

    def keep(fig: Any, path: Path) -> Path:
        drawn[Path(path).name] = fig
        return save(fig, path)

    monkeypatch.setattr(figures, "_save", keep)
    assert cli.main(["plot", "--result", str(run_dir / "results.json"), "--theory",
                     "--out", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert names == sorted(["alpha_reshape.png", "renorm_maps.png", "primal_vs_dual_peaked.png",
                            "cost_convexity.png", "gaps_vs_k.png", "kstar_hist.png"])
    assert sorted(drawn) == names
    result = _result(run_dir)
    configs = {c["label"]: c for c in result["configs"]}

    # Gaps against k: fixed-k rows at their k, adaptive rows at their mean k*.
    for ax, metric in zip(drawn["gaps_vs_k.png"].axes, ("ppl_gap", "rep_gap"), strict=True):
        shown = {(round(float(x), 9), round(float(y), 9)) for container in ax.containers
                 for x, y in zip(*container.lines[0].get_data(), strict=True)}
        want = set()
        for row in result["open"]["results"]:
            config = configs[row["config"]]
            if config["adaptive"]:
                want.add((round(row["kstar"]["mean"], 9), round(row[metric]["value"], 9)))
            elif config.get("top_k") is not None and not config.get("matched_to"):
                want.add((float(config["top_k"]), round(row[metric]["value"], 9)))
        assert shown == want, (metric, shown, want)

    # k* histogram: one line per adaptive row of each task, the fractions of its steps.
    lines = [line for line in drawn["kstar_hist.png"].axes[0].lines if line.get_label()[0] != "_"]
    want_lines = []
    for task in ("open", "gsm8k"):
        for row in result[task]["results"]:
            if row.get("kstar"):
                hist = {int(k): v for k, v in row["kstar"]["histogram"].items()}
                counts = np.array([hist.get(k, 0) for k in range(1, max(hist) + 1)], float)
                want_lines.append(counts / counts.sum())
    assert len(lines) == len(want_lines) > 0
    for line, want in zip(lines, want_lines, strict=True):
        np.testing.assert_allclose(line.get_ydata(), want, rtol=1e-12)

    # cost(k) curves and their k* dots (V = 80, lambda = 1/80, Zipf p) against the reference.
    log_p = np.log(figures.zipf(80, exponent=1.0))[None]
    for ax, mode in zip(drawn["cost_convexity.png"].axes, ("primal", "dual"), strict=True):
        curves = [line for line in ax.lines if len(line.get_xdata()) > 1]
        dots = [line for line in ax.lines if len(line.get_xdata()) == 1]
        assert curves and len(curves) == len(dots)
        for curve, dot in zip(curves, dots, strict=True):
            alpha = float(curve.get_label().split("=")[1].split("(")[0])
            ks = np.arange(1, 81)
            costs = np.array([rs.direct_cost(log_p, k, alpha, 1 / 80, mode)[0] for k in ks])
            np.testing.assert_allclose(curve.get_ydata(), costs, rtol=1e-9)
            k_star = int(rs.decode(log_p, alpha, 1 / 80, mode).k[0])
            assert dot.get_xdata()[0] == k_star, (mode, alpha)

    # The maps of Figure 2's input, line by line.
    for ax, mode in zip(drawn["renorm_maps.png"].axes, ("primal", "dual"), strict=True):
        maps = [line for line in ax.lines if line.get_label().startswith("alpha")]
        assert len(maps) >= 6
        for line in maps:
            alpha = float(line.get_label().split("=")[1])
            want = rs.renormalize(np.asarray(line.get_xdata()), alpha, mode)[0]
            np.testing.assert_allclose(line.get_ydata(), want, rtol=1e-9)
