"""The temperature claim: does top-k degrade faster than adaptive primal decoding as T grows?

The paper (arXiv 2505.19371, Section 5, Table 1) finds that at higher temperature top-k with
k = round(mean k*) loses more accuracy than the adaptive primal decoder it is matched to. The
sweep measures the same comparison on open-ended generation, where a small model is meaningful:

1. `sweep_configs`: adaptive primal alpha-decoding for every (alpha, lambda, T), k* <= k_max;
   the run (`runner`) samples them all on the same prompts, measures k* at every step and adds
   each configuration's matched top-k baseline, k = round(mean k*) of that (alpha, lambda, T);
2. `analyze`: for every (alpha, lambda, T) the perplexity and repetition gaps of the adaptive
   decoder and of its matched top-k, and the **excess** of top-k,
   ``excess = |gap(top-k)| - |gap(Bregman)|`` (> 0: top-k is further from human text);
   the **degradation** of each decoder, ``|gap(T)| - |gap(T_min)|``, and the **growth of the
   excess**, ``excess(T_max) - excess(T_min)`` (> 0: top-k degrades faster as T grows);
3. every standard deviation comes from one joint bootstrap over prompts (1000 resamples): each
   resample draws prompt indices once and recomputes every number above, so differences across
   configurations and temperatures are paired, as the prompts and request seeds are shared.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .configs import DecodingConfig
from .metrics import BOOTSTRAP_RESAMPLES

METRICS: tuple[tuple[str, str], ...] = (("ppl_gap", "perplexity gap"),
                                         ("rep_gap", "repetition gap"))


def sweep_configs(temperatures: Sequence[float], alphas: Sequence[float],
                  lambdas: Sequence[float], k_max: int | None, mode: str = "primal",
                  ) -> list[DecodingConfig]:
    """Adaptive configurations for every (alpha, lambda, T), ordered by T then lambda, alpha."""
    if not temperatures or not alphas or not lambdas:
        raise ValueError("the sweep needs at least one temperature, alpha and lambda")
    configs = []
    for temperature in temperatures:
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be a positive number, got {temperature}")
        for lam in lambdas:
            for alpha in alphas:
                config = DecodingConfig("bregman", float(temperature), mode=mode,
                                        alpha=float(alpha), lam=float(lam), k_max=k_max)
                config.request_fields()  # the parameter model's checks (BregmanParamError)
                configs.append(config)
    return configs


def _gap_columns(per_prompt: dict[str, Any], label: str) -> dict[str, np.ndarray]:
    """Per-prompt contributions whose means are the gaps: human ppl - generated ppl (NaN for an
    empty generation, left out of its mean as in the result rows) and generated rep - human
    rep."""
    values = per_prompt["configs"][label]
    human_ppl = np.asarray(per_prompt["human_ppl"], dtype=np.float64)
    gen_ppl = np.asarray([math.nan if v is None else v for v in values["ppl"]],
                         dtype=np.float64)
    rep = np.asarray(values["rep"], dtype=np.float64)
    human_rep = np.asarray(per_prompt["human_rep"], dtype=np.float64)
    return {"ppl_gap": human_ppl - gen_ppl, "rep_gap": rep - human_rep}


def _nanmean(values: np.ndarray) -> np.ndarray:
    """Mean over the last axis ignoring NaN (NaN when a row has no value)."""
    count = np.sum(~np.isnan(values), axis=-1)
    total = np.nansum(values, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def _estimate(point: float, draws: np.ndarray) -> dict[str, float | None]:
    draws = draws[np.isfinite(draws)]
    std = float(draws.std(ddof=1)) if draws.size > 1 else None
    return {"value": float(point) if math.isfinite(point) else None, "std": std}


def analyze(result: dict[str, Any], *, resamples: int = BOOTSTRAP_RESAMPLES,
            seed: int = 0) -> dict[str, Any]:
    """The sweep's numbers from a run result (its ``open`` task with ``per_prompt`` values).

    Returns ``{"temperatures", "groups": [{alpha, lam, mode, k_max, rows: [{T, bregman,
    topk, k, kstar_mean, excess: {metric: estimate}}], degradation, excess_growth}],
    "pooled": {...}}`` where an estimate is ``{value, std}``.
    """
    task = result.get("open") or {}
    per_prompt = task.get("per_prompt")
    if not per_prompt:
        raise ValueError("the result has no per-prompt open-ended values (run it again with "
                         "this version of bregman-eval)")
    configs = {c["label"]: c for c in result["configs"]}
    matched = task.get("matched") or {}
    rows_by_label = {row["config"]: row for row in task["results"]}
    adaptive = [configs[label] for label in rows_by_label
                if configs[label].get("adaptive") and label in matched]
    if not adaptive:
        raise ValueError("the result has no adaptive configuration with a matched top-k")
    n = len(per_prompt["human_ppl"])
    rng = np.random.default_rng(seed)
    index = rng.integers(0, n, size=(max(resamples, 0), n))

    def point_and_draws(label: str) -> dict[str, tuple[float, np.ndarray]]:
        out = {}
        for metric, column in _gap_columns(per_prompt, label).items():
            out[metric] = (float(_nanmean(column)), _nanmean(column[index]))
        return out

    groups: dict[tuple[str, float, float, Any], list[dict[str, Any]]] = {}
    for config in adaptive:
        key = (config["mode"], float(config["alpha"]), float(config["lam"]), config["k_max"])
        groups.setdefault(key, []).append(config)
    temperatures = sorted({c["temperature"] for c in adaptive})
    out_groups = []
    pooled_excess: dict[str, dict[float, list[tuple[float, np.ndarray]]]] = {
        metric: {} for metric, _ in METRICS}
    for (mode, alpha, lam, k_max), members in groups.items():
        members.sort(key=lambda c: c["temperature"])
        rows = []
        series: dict[str, dict[str, list[tuple[float, np.ndarray]]]] = {
            name: {metric: [] for metric, _ in METRICS} for name in ("bregman", "topk", "excess")}
        for config in members:
            baseline = matched[config["label"]]
            breg, topk = point_and_draws(config["label"]), point_and_draws(baseline)
            excess = {}
            for metric, _ in METRICS:
                b_point, b_draws = breg[metric]
                t_point, t_draws = topk[metric]
                e_point = abs(t_point) - abs(b_point)
                e_draws = np.abs(t_draws) - np.abs(b_draws)
                excess[metric] = _estimate(e_point, e_draws)
                series["bregman"][metric].append((abs(b_point), np.abs(b_draws)))
                series["topk"][metric].append((abs(t_point), np.abs(t_draws)))
                series["excess"][metric].append((e_point, e_draws))
                pooled_excess[metric].setdefault(config["temperature"], []).append(
                    (e_point, e_draws))
            kstar = rows_by_label[config["label"]].get("kstar") or {}
            rows.append({
                "temperature": config["temperature"],
                "bregman": config["label"], "topk": baseline,
                "k": configs[baseline]["top_k"], "kstar_mean": kstar.get("mean"),
                "bregman_gaps": {m: _estimate(*breg[m]) for m, _ in METRICS},
                "topk_gaps": {m: _estimate(*topk[m]) for m, _ in METRICS},
                "excess": excess,
            })
        degradation = {}
        for name in ("bregman", "topk"):
            degradation[name] = {
                metric: _estimate(points[-1][0] - points[0][0], points[-1][1] - points[0][1])
                for metric, points in series[name].items()}
        growth = {metric: _estimate(points[-1][0] - points[0][0], points[-1][1] - points[0][1])
                  for metric, points in series["excess"].items()}
        out_groups.append({"mode": mode, "alpha": alpha, "lam": lam, "k_max": k_max,
                           "rows": rows, "degradation": degradation, "excess_growth": growth,
                           "from_T": members[0]["temperature"],
                           "to_T": members[-1]["temperature"]})
    pooled: dict[str, Any] = {}
    for metric, by_t in pooled_excess.items():
        per_t = {}
        for temperature in temperatures:
            items = by_t.get(temperature, [])
            if items:
                per_t[temperature] = (float(np.mean([p for p, _ in items])),
                                      np.mean(np.stack([d for _, d in items]), axis=0))
        present = sorted(per_t)
        first, last = per_t[present[0]], per_t[present[-1]]
        pooled[metric] = {
            "excess": {f"{t:g}": _estimate(*per_t[t]) for t in present},
            "excess_growth": _estimate(last[0] - first[0], last[1] - first[1]),
        }
    return {"temperatures": temperatures, "prompts": n, "resamples": resamples,
            "groups": out_groups, "pooled": pooled}
