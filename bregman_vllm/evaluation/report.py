"""Write an evaluation result as JSON and as markdown tables in the paper's layouts.

Tables (arXiv 2505.19371, Section 5 and Appendix H):

* open-ended generation: every configuration with its perplexity, repetition and their gaps to
  human text; and, for fixed-k rows, the gaps against k with one column per alpha (the data of
  the paper's Figure 3);
* GSM8K: accuracy of every configuration; and the paper's layout (Table 1):
  one row per temperature, per (mode, lambda) the adaptive alphas followed by their matched
  top-k baselines;
* adaptivity (Appendix H.5, Tables 11-20): per task, "mean (rounded)" and
  "std (entropy in bits)" of k*, one row per temperature, one column per (lambda, alpha).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def fmt(estimate: dict[str, Any] | None, digits: int = 2) -> str:
    """``value ± std`` (the paper's ``85.14±0.80``); an em dash when missing."""
    if not estimate or estimate.get("value") is None:
        return "—"
    value = f"{estimate['value']:.{digits}f}"
    std = estimate.get("std")
    return value if std is None else f"{value} ± {std:.{digits}f}"


def _table(header: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i == 0 else "--:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _configs(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["label"]: c for c in result["configs"]}


def _matched_to(task: dict[str, Any]) -> dict[str, str]:
    """For each top-k baseline of a task, the adaptive configurations it is matched to."""
    out: dict[str, list[str]] = {}
    for adaptive, baseline in (task.get("matched") or {}).items():
        out.setdefault(baseline, []).append(f"`{adaptive}`")
    return {baseline: ", ".join(names) for baseline, names in out.items()}


def _k_text(config: dict[str, Any]) -> str:
    if config.get("top_k") is not None:
        return str(config["top_k"])
    if config["kind"] == "bregman":
        return f"k* ≤ {config['k_max']}" if config.get("k_max") else "k*"
    return "V"


def _alpha_text(alpha: Any) -> str:
    return str(alpha) if isinstance(alpha, str) else f"{alpha:g}"


def _group_key(config: dict[str, Any]) -> tuple[str, float, Any]:
    return (config["mode"], config["lam"], config.get("k_max"))


def _group_title(key: tuple[str, float, Any], with_mode: bool) -> str:
    mode, lam, k_max = key
    title = f"λ={lam:g}"
    if with_mode:
        title = f"{mode} {title}"
    return title if k_max in (None, 50) else f"{title}, k_max={k_max}"


# ----------------------------------------------------------------------------- sections


def _header(result: dict[str, Any]) -> list[str]:
    meta = result["meta"]
    lines = [f"# Bregman decoding evaluation: `{meta.get('model')}`", ""]
    lines.append(f"Endpoint `{meta.get('endpoint')}`, started {meta.get('started')}, wall time "
                 f"{meta.get('wall_s')} s, seed {meta.get('seed')}, concurrency "
                 f"{meta.get('concurrency')}, bootstrap resamples "
                 f"{meta.get('bootstrap_resamples')}.")
    ks = meta.get("kstar") or {}
    sources = [name for name in ("logprobs", "local") if ks.get(name)]
    if sources:
        how = {"logprobs": "reported by the engine (count of finite processed logprobs)",
               "local": f"recomputed offline from `{ks.get('model_dir')}` "
                        f"({ks.get('dtype')}) with `bregman_decode`"}
        lines.append("k* per decoding step: " + "; ".join(how[s] for s in sources) + ".")
    if meta.get("command"):
        lines += ["", "Command:", "", "```", meta["command"], "```"]
    return [*lines, ""]


def open_section(result: dict[str, Any]) -> list[str]:
    task = result.get("open")
    if not task:
        return []
    meta = result["meta"]["open"]
    configs = _configs(result)
    human = task["human"]
    lines = [f"## Open-ended generation ({task['passages']} prompts of {meta['prompt_tokens']} "
             f"tokens, continuations of up to {meta['max_tokens']} tokens, corpus "
             f"`{meta['corpus']}`)", ""]
    lines.append(f"Human continuations: perplexity {fmt(human['ppl'])}, rep rate "
                 f"{fmt(human['rep'], 3)}, mean length {human['mean_length']:.1f} tokens. "
                 "Perplexity gap = E[ppl(human)] − E[ppl(generated)]; repetition gap = "
                 "P(rep(generated)) − P(rep(human)); closer to 0 is better.")
    lines.append("")
    matched_to = _matched_to(task)
    rows = []
    for row in task["results"]:
        config = configs[row["config"]]
        ks = row.get("kstar")
        name = f"`{row['config']}`"
        if row["config"] in matched_to:
            name += f" (matched to {matched_to[row['config']]})"
        rows.append([name, _k_text(config), f"{ks['mean']:.2f}" if ks else "—",
                     fmt(row["ppl"]), fmt(row["ppl_gap"]), fmt(row["rep"], 3),
                     fmt(row["rep_gap"], 3), f"{row['mean_length']:.1f}"])
    lines.append(_table(["configuration", "k", "mean k*", "ppl (generated)", "ppl gap",
                         "rep rate", "rep gap", "mean length"], rows))
    lines.append("")
    lines += _gaps_by_k(task, configs)
    return lines


def _gaps_by_k(task: dict[str, Any], configs: dict[str, dict[str, Any]]) -> list[str]:
    """The partial evaluation: one row per k, one column per alpha (top-k = alpha 1)."""
    cells: dict[tuple[float, str], dict[int, dict[str, Any]]] = {}
    for row in task["results"]:
        config = configs[row["config"]]
        if config.get("matched_to") or config.get("top_k") is None:
            continue
        if config["kind"] == "topk":
            column = "top-k (α=1)"
        elif config["kind"] == "bregman":
            column = f"{config['mode']} α={_alpha_text(config['alpha'])}"
        else:
            continue
        cells.setdefault((config["temperature"], column), {})[config["top_k"]] = row
    if not cells:
        return []
    lines = []
    for temperature in sorted({t for t, _ in cells}):
        columns = sorted((c for t, c in cells if t == temperature),
                         key=lambda c: (not c.startswith("top-k"), c))
        ks = sorted({k for (t, _), by_k in cells.items() if t == temperature for k in by_k})
        for metric, title, digits in (("ppl_gap", "Perplexity gap", 2),
                                      ("rep_gap", "Repetition gap", 3)):
            lines.append(f"### {title} against k (fixed k, T = {temperature:g})")
            lines.append("")
            rows = [[str(k)] + [fmt(cells[(temperature, c)].get(k, {}).get(metric), digits)
                                for c in columns] for k in ks]
            lines.append(_table(["k", *columns], rows))
            lines.append("")
    return lines


def gsm8k_section(result: dict[str, Any]) -> list[str]:
    task = result.get("gsm8k")
    if not task:
        return []
    meta = result["meta"]["gsm8k"]
    configs = _configs(result)
    lines = [f"## GSM8K ({task['problems']} problems, 8-shot chain of thought, up to "
             f"{meta['max_tokens']} tokens, exact match of the final number)", ""]
    matched_to = _matched_to(task)
    rows = []
    for row in task["results"]:
        config = configs[row["config"]]
        ks = row.get("kstar")
        rows.append([f"`{row['config']}`", _k_text(config), fmt(row["accuracy"]),
                     matched_to.get(row["config"], ""),
                     f"{ks['mean']:.2f}" if ks else "—", f"{row['mean_length']:.1f}"])
    lines.append(_table(["configuration", "k", "accuracy (%)", "matched to", "mean k*",
                         "mean length"], rows))
    lines.append("")
    lines += _gsm8k_paper_layout(task, configs)
    return lines


def _gsm8k_paper_layout(task: dict[str, Any], configs: dict[str, dict[str, Any]]) -> list[str]:
    """Table 1 of the paper: rows T; per (mode, lambda): alphas, then matched top-k."""
    by_label = {row["config"]: row for row in task["results"]}
    adaptive = [configs[label] for label in by_label if configs[label].get("adaptive")]
    if not adaptive:
        return []
    groups: dict[tuple[str, float, Any], list[float | str]] = {}
    for config in adaptive:
        alphas = groups.setdefault(_group_key(config), [])
        if config["alpha"] not in alphas:
            alphas.append(config["alpha"])
    with_mode = len({key[0] for key in groups}) > 1 or any(k[0] != "primal" for k in groups)
    temperatures = sorted({c["temperature"] for c in adaptive})
    header = ["T"]
    columns: list[tuple[str, tuple[str, float, Any], float | str]] = []
    for key, alphas in groups.items():
        alphas.sort(key=lambda a: float(a) if not isinstance(a, str) else math.inf)
        title = _group_title(key, with_mode)
        for alpha in alphas:
            header.append(f"{title} α={_alpha_text(alpha)}")
            columns.append(("bregman", key, alpha))
        for alpha in alphas:
            header.append(f"top-k ({title}, matched α={_alpha_text(alpha)})")
            columns.append(("matched", key, alpha))
    matched = task.get("matched", {})
    rows = []
    for temperature in temperatures:
        row = [f"{temperature:g}"]
        for kind, key, alpha in columns:
            config = next((c for c in adaptive if _group_key(c) == key and c["alpha"] == alpha
                           and c["temperature"] == temperature), None)
            if config is None:
                row.append("—")
                continue
            if kind == "bregman":
                row.append(fmt(by_label[config["label"]]["accuracy"]))
            else:
                label = matched.get(config["label"])
                hit = by_label.get(label) if label else None
                row.append(f"{fmt(hit['accuracy'])} (k={configs[label]['top_k']})"
                           if hit and label else "—")
        rows.append(row)
    return ["### GSM8K accuracy (%) in the paper's layout (adaptive k* vs matched top-k)", "",
            _table(header, rows), ""]


def adaptivity_section(result: dict[str, Any]) -> list[str]:
    """Appendix H.5 tables: mean (rounded) and std (entropy, bits) of k*, per task."""
    configs = _configs(result)
    lines: list[str] = []
    for task_name, title in (("gsm8k", "GSM8K"), ("open", "open-ended generation")):
        task = result.get(task_name)
        if not task:
            continue
        rows_by = {row["config"]: row for row in task["results"] if row.get("kstar")}
        if not rows_by:
            continue
        chosen = [configs[label] for label in rows_by]
        with_mode = any(c["mode"] != "primal" for c in chosen)
        columns: list[tuple[tuple[str, float, Any], float | str]] = []
        for config in chosen:
            key = (_group_key(config), config["alpha"])
            if key not in columns:
                columns.append(key)
        columns.sort(key=lambda c: (c[0][0], -c[0][1], str(c[0][2]), str(c[1])))
        header = ["T"] + [f"{_group_title(g, with_mode)} α={_alpha_text(a)}"
                          for g, a in columns]
        temperatures = sorted({c["temperature"] for c in chosen})
        mean_rows, spread_rows = [], []
        for temperature in temperatures:
            mean_row, spread_row = [f"{temperature:g}"], [f"{temperature:g}"]
            for group, alpha in columns:
                config = next((c for c in chosen if _group_key(c) == group
                               and c["alpha"] == alpha and c["temperature"] == temperature),
                              None)
                ks = rows_by[config["label"]]["kstar"] if config else None
                mean_row.append(f"{ks['mean']:.4f} ({ks['rounded']})" if ks else "—")
                spread_row.append(f"{ks['std']:.2f} ({ks['entropy_bits']:.2f})" if ks else "—")
            mean_rows.append(mean_row)
            spread_rows.append(spread_row)
        lines += [f"## Adaptivity on {title}: k* at every decoding step", "",
                  "Mean (rounded) k*:", "", _table(header, mean_rows), "",
                  "Standard deviation (entropy in bits) of k*:", "",
                  _table(header, spread_rows), ""]
        agreements = [(label, row["kstar"].get("agreement_with_local"))
                      for label, row in rows_by.items()
                      if row["kstar"].get("agreement_with_local") is not None]
        if agreements:
            lines.append("Agreement of engine-reported and offline-recomputed k* (fraction of "
                         "steps): " + ", ".join(f"`{label}` {value:.3f}"
                                                for label, value in agreements) + ".")
            lines.append("")
    return lines


def sweep_section(result: dict[str, Any]) -> list[str]:
    """The temperature sweep (`sweep.analyze`): per (alpha, lambda) one table against T, then
    the excess of top-k pooled over the configurations."""
    sweep = result.get("temperature_sweep")
    if not sweep:
        return []
    lines = ["## Temperature sweep: adaptive primal decoding vs matched top-k", "",
             f"{sweep['prompts']} prompts, standard deviations from one joint bootstrap over "
             f"prompts ({sweep['resamples']} resamples). Matched top-k: k = round(mean k*) of "
             "the adaptive configuration at the same T. Excess = |gap(top-k)| − "
             "|gap(adaptive)|: positive when top-k is further from human text.", ""]
    for group in sweep["groups"]:
        lines.append(f"### {group['mode']} α={group['alpha']:g}, λ={group['lam']:g}, "
                     f"k_max={group['k_max']}")
        lines.append("")
        rows = []
        for row in group["rows"]:
            kstar = row.get("kstar_mean")
            rows.append([f"{row['temperature']:g}",
                         "—" if kstar is None else f"{kstar:.2f}", str(row["k"]),
                         fmt(row["bregman_gaps"]["ppl_gap"]), fmt(row["topk_gaps"]["ppl_gap"]),
                         fmt(row["excess"]["ppl_gap"]),
                         fmt(row["bregman_gaps"]["rep_gap"], 3),
                         fmt(row["topk_gaps"]["rep_gap"], 3),
                         fmt(row["excess"]["rep_gap"], 3)])
        lines.append(_table(["T", "mean k*", "top-k k", "ppl gap (adaptive)",
                             "ppl gap (top-k)", "excess ppl", "rep gap (adaptive)",
                             "rep gap (top-k)", "excess rep"], rows))
        lines.append("")
        growth = group["excess_growth"]
        lines.append(f"Excess growth from T = {group['from_T']:g} to T = {group['to_T']:g}: "
                     f"perplexity {fmt(growth['ppl_gap'])}, repetition "
                     f"{fmt(growth['rep_gap'], 3)}.")
        lines.append("")
    pooled = sweep["pooled"]
    temperatures = list(pooled["ppl_gap"]["excess"])
    lines += ["### Excess of top-k, averaged over the configurations", "",
              _table(["T", "excess ppl", "excess rep"],
                     [[t, fmt(pooled["ppl_gap"]["excess"][t]),
                       fmt(pooled["rep_gap"]["excess"][t], 3)] for t in temperatures]), "",
              f"Growth of the average excess from T = {temperatures[0]} to T = "
              f"{temperatures[-1]}: perplexity {fmt(pooled['ppl_gap']['excess_growth'])}, "
              f"repetition {fmt(pooled['rep_gap']['excess_growth'], 3)}.", ""]
    return lines


def markdown_report(result: dict[str, Any]) -> str:
    """The whole report: header, temperature sweep, open-ended, GSM8K and adaptivity
    sections."""
    lines = (_header(result) + sweep_section(result) + open_section(result)
             + gsm8k_section(result) + adaptivity_section(result))
    return "\n".join(lines).rstrip() + "\n"


def write_outputs(result: dict[str, Any], samples: list[dict[str, Any]], out: Path,
                  ) -> dict[str, Path]:
    """results.json, results.md and samples.jsonl under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md",
             "samples": out / "samples.jsonl"}
    paths["json"].write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    paths["markdown"].write_text(markdown_report(result))
    with paths["samples"].open("w") as handle:
        for record in samples:
            handle.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
    return paths
