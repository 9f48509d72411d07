"""The temperature sweep (`bregman-eval temperature-sweep`) on hand-made results: its
configurations, the paired statistics and their joint bootstrap, the report, the figures, the
command line and the progress lines (no server; the sweep's own run is docs/results)."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bregman_vllm.evaluation import cli, report, runner
from bregman_vllm.evaluation.configs import DecodingConfig, matched_baseline
from bregman_vllm.evaluation.figures import result_figures, sweep_figures
from bregman_vllm.evaluation.sweep import analyze, sweep_configs

TEMPERATURES = [0.7, 1.5]


def test_sweep_configs() -> None:
    configs = sweep_configs([0.7, 1.0, 1.5, 2.0], [1.5, 2.0], [0.01, 1e-4], k_max=50)
    assert len(configs) == 16
    assert {(c.temperature, c.alpha, c.lam) for c in configs} == {
        (t, a, lam) for t in (0.7, 1.0, 1.5, 2.0) for a in (1.5, 2.0) for lam in (0.01, 1e-4)}
    assert all(c.adaptive and c.mode == "primal" and c.k_max == 50 for c in configs)
    assert configs[0].label == "primal:1.5:0.01:kmax=50:T=0.7"
    with pytest.raises(ValueError):
        sweep_configs([0.0], [1.5], [0.01], 50)
    with pytest.raises(ValueError):
        sweep_configs([1.0], [], [0.01], 50)
    with pytest.raises(ValueError, match="alpha"):
        sweep_configs([1.0], [-1.0], [0.01], 50)  # the parameter model's range


def fake_result(seed: int = 0, n: int = 40) -> dict[str, Any]:
    """A run result with two (alpha, lambda) groups at two temperatures, per-prompt values drawn
    at random (one empty generation), and matched top-k baselines."""
    rng = np.random.default_rng(seed)
    configs = sweep_configs(TEMPERATURES, [1.5], [0.01, 1e-4], k_max=50)
    per_prompt: dict[str, Any] = {"human_ppl": list(rng.uniform(20, 40, n)),
                                  "human_rep": [int(v) for v in rng.random(n) < 0.1],
                                  "configs": {}}
    rows, matched, all_configs = [], {}, list(configs)
    for index, config in enumerate(configs):
        baseline = matched_baseline(config, 3 + index, "open")
        matched[config.label] = baseline.label
        all_configs.append(baseline)
        # Top-k's samples get more predictable than human text in proportion to T.
        for label, shift in ((config.label, 0.0), (baseline.label, -5.0 * config.temperature)):
            ppl = list(rng.uniform(10, 30, n) + shift)
            if label == config.label and index == 0:
                ppl[3] = None  # an empty generation has no perplexity
            per_prompt["configs"][label] = {"ppl": ppl,
                                            "rep": [int(v) for v in rng.random(n) < 0.3]}
            estimate = {"value": 1.0, "std": 0.1, "n": n}
            kstar = {"mean": 2.6 + index, "rounded": 3 + index, "std": 1.0, "entropy_bits": 1.5,
                     "histogram": {"2": 4, str(3 + index): 6}}
            rows.append({"config": label, "ppl": estimate, "ppl_gap": estimate, "rep": estimate,
                         "rep_gap": estimate, "mean_length": 64.0,
                         "kstar": kstar if label == config.label else None})
    meta = {"model": "fake", "seed": 0, "bootstrap_resamples": 50,
            "open": {"prompt_tokens": 35, "max_tokens": 64, "corpus": "data/x.jsonl"}}
    human = {"ppl": {"value": 30.0, "std": 1.0, "n": n}, "rep": {"value": 0.1, "std": 0.05},
             "mean_length": 64.0}
    return {"meta": meta, "configs": [c.as_dict() for c in all_configs],
            "open": {"results": rows, "matched": matched, "per_prompt": per_prompt,
                     "passages": n, "human": human}}


def gaps(result: dict[str, Any], label: str, index: np.ndarray | None = None,
         ) -> tuple[float, float]:
    values = result["open"]["per_prompt"]
    human = np.asarray(values["human_ppl"])
    ppl = np.asarray([math.nan if v is None else v for v in values["configs"][label]["ppl"]])
    rep = np.asarray(values["configs"][label]["rep"], dtype=float)
    human_rep = np.asarray(values["human_rep"], dtype=float)
    if index is not None:
        human, ppl, rep, human_rep = human[index], ppl[index], rep[index], human_rep[index]
    return float(np.nanmean(human - ppl)), float(np.mean(rep - human_rep))


def test_analyze_points_and_bootstrap() -> None:
    result = fake_result()
    sweep = analyze(result, resamples=50, seed=3)
    assert sweep["temperatures"] == TEMPERATURES and sweep["prompts"] == 40
    assert len(sweep["groups"]) == 2
    index = np.random.default_rng(3).integers(0, 40, size=(50, 40))
    for group in sweep["groups"]:
        assert [row["temperature"] for row in group["rows"]] == TEMPERATURES
        excess_draws = []
        for row in group["rows"]:
            b_ppl, b_rep = gaps(result, row["bregman"])
            t_ppl, t_rep = gaps(result, row["topk"])
            assert row["bregman_gaps"]["ppl_gap"]["value"] == pytest.approx(b_ppl)
            assert row["topk_gaps"]["rep_gap"]["value"] == pytest.approx(t_rep)
            assert row["excess"]["ppl_gap"]["value"] == pytest.approx(abs(t_ppl) - abs(b_ppl))
            assert row["excess"]["rep_gap"]["value"] == pytest.approx(abs(t_rep) - abs(b_rep))
            # The standard deviation is that of the same statistic on resampled prompts.
            draws = np.array([abs(gaps(result, row["topk"], i)[0])
                              - abs(gaps(result, row["bregman"], i)[0]) for i in index])
            assert row["excess"]["ppl_gap"]["std"] == pytest.approx(draws.std(ddof=1))
            excess_draws.append(draws)
            assert row["k"] == next(c["top_k"] for c in result["configs"]
                                    if c["label"] == row["topk"])
        growth = group["excess_growth"]["ppl_gap"]
        first, last = group["rows"][0], group["rows"][-1]
        assert growth["value"] == pytest.approx(last["excess"]["ppl_gap"]["value"]
                                                - first["excess"]["ppl_gap"]["value"])
        # Paired across temperatures: the std of the difference, not a sum of variances.
        assert growth["std"] == pytest.approx((excess_draws[1] - excess_draws[0]).std(ddof=1))
        for name in ("bregman", "topk"):
            key = f"{name}_gaps"
            assert group["degradation"][name]["ppl_gap"]["value"] == pytest.approx(
                abs(last[key]["ppl_gap"]["value"]) - abs(first[key]["ppl_gap"]["value"]))
    pooled = sweep["pooled"]["ppl_gap"]["excess"]
    for t in TEMPERATURES:
        values = [row["excess"]["ppl_gap"]["value"] for g in sweep["groups"]
                  for row in g["rows"] if row["temperature"] == t]
        assert pooled[f"{t:g}"]["value"] == pytest.approx(np.mean(values))
    # Top-k was made worse in proportion to T: its excess grows.
    assert sweep["pooled"]["ppl_gap"]["excess_growth"]["value"] > 0


def test_analyze_needs_per_prompt_values() -> None:
    result = fake_result()
    del result["open"]["per_prompt"]
    with pytest.raises(ValueError, match="per-prompt"):
        analyze(result)
    result = fake_result()
    result["open"]["matched"] = {}
    with pytest.raises(ValueError, match="matched"):
        analyze(result)


def test_report_and_figures(tmp_path: Path) -> None:
    result = fake_result()
    result["temperature_sweep"] = analyze(result, resamples=50)
    lines = "\n".join(report.sweep_section(result))
    assert "## Temperature sweep" in lines
    assert lines.count("### primal α=1.5") == 2
    assert "| T | mean k* | top-k k |" in lines and "Excess growth from T = 0.7 to T = 1.5" in lines
    assert "averaged over the configurations" in lines
    assert report.sweep_section({"configs": []}) == []
    made = sweep_figures(result["temperature_sweep"], tmp_path, "fake")
    assert [p.name for p in made] == ["sweep_ppl_gap.png", "sweep_rep_gap.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in made)
    # A sweep result draws its own figures, not gaps against k (it would mix temperatures).
    drawn = result_figures(result, tmp_path / "run")
    assert [p.name for p in drawn] == ["sweep_ppl_gap.png", "sweep_rep_gap.png",
                                       "kstar_hist.png"]


def test_report_command_recomputes_the_sweep(tmp_path: Path) -> None:
    result = fake_result()
    result["meta"].update(endpoint="http://x/v1", started="now", wall_s=1.0, concurrency=1)
    result["temperature_sweep"] = {"stale": True}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(result))
    assert cli.main(["report", str(path), "--no-figures"]) == 0
    rewritten = json.loads(path.read_text())
    assert rewritten["temperature_sweep"]["groups"]
    assert "## Temperature sweep" in (tmp_path / "results.md").read_text()


def test_sweep_command_line() -> None:
    argv = ["temperature-sweep", "--endpoint", "http://127.0.0.1:1/v1", "--passages", "10",
            "--max-tokens", "48", "--corpus", "tinyshakespeare"]
    args = cli.build_parser().parse_args(argv)
    options = cli.options_from_args(args, argv)
    assert options.tasks == ("open",) and options.matched
    assert len(options.configs) == 16 and options.kstar == "logprobs"
    assert options.min_continuation == 48  # every human continuation has the full length
    assert options.corpus.name == "input.txt"
    assert options.meta()["open"]["corpus"] == "data/tinyshakespeare/input.txt"
    assert options.extra["sweep"]["temperatures"] == [0.7, 1.0, 1.5, 2.0]
    run_args = cli.build_parser().parse_args(["run"])
    assert run_args.corpus.name == "passages.jsonl" and run_args.min_continuation == 16
    # The matched top-k needs k*: a sweep without it stops before any request.
    assert cli.main([*argv, "--kstar", "off"]) == 2


def test_progress_lines_without_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    bar = runner._progress(10, "open: sample", True)
    bar.mininterval = 0
    for _ in range(10):
        bar.update(1)
    bar.close()
    lines = [line for line in stream.getvalue().splitlines() if line]
    assert "\r" not in stream.getvalue()
    assert len(lines) >= 2 and lines[-1].startswith("open: sample: 100%")
    assert "10/10" in lines[-1]


def test_per_prompt_values_of_a_run() -> None:
    from bregman_vllm.evaluation.tasks import OpenSample, Passage

    passages = [Passage(0, [1], [5, 6, 5, 6], [-1.0, -1.0, -1.0, -1.0]),
                Passage(1, [1], [7, 8], [-2.0, -2.0])]
    config = DecodingConfig("topk", 1.0, top_k=3)
    samples = {config.label: [OpenSample(0, [], [2], "", "stop", []),
                              OpenSample(1, [3, 4, 3, 4], [3, 4, 3, 4], "t", "length",
                                         [-0.5] * 4)]}
    values = runner.per_prompt(passages, samples)
    assert values["human_ppl"] == pytest.approx([math.e, math.e ** 2])
    assert values["human_rep"] == [1, 0]
    assert values["configs"][config.label]["ppl"][0] is None
    assert values["configs"][config.label]["ppl"][1] == pytest.approx(math.exp(0.5))
    assert values["configs"][config.label]["rep"] == [0, 1]
