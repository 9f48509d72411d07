"""The paper's explanatory figures (arXiv 2505.19371), and the text-generation figure from an
evaluation result.

Each function writes one PNG (matplotlib, Agg backend) and returns its path:

* `plot_alpha_reshape`   the figure of Section 1 (it has no caption, hence no number): how
                         alpha reshapes a Zipf-like distribution after selecting k = 10 tokens
                         (primal alpha in {0.25, 1, 2.5}; alpha = 1 is top-k).
* `plot_renorm_maps`     Figure 2: primal T_alpha and dual T*_alpha applied to
                         x = 0.67 / sum(i/k) [1, (k-1)/k, ..., 1/k], k = 100.
* `plot_peaked`          Figure 4 (Appendix G.3) on the peaked vector [0.1, 0.001 x 4]: both
                         families agree at alpha in {1, 2, inf}.
* `plot_cost_curves`     Figure 6 (Appendix G.5): the discrete convexity of
                         cost(k) = Div(T_k(p) padded with zeros, p) + lambda k against k,
                         primal and dual, V = 80, lambda = 1/80, with the minimizer k* that
                         `bregman_decode` returns marked on each curve.
* `plot_gaps_vs_k`       Figure 3 (text generation): perplexity and repetition gaps against k from
                         an evaluation result (fixed-k rows; adaptive rows at their mean k*).
* `plot_kstar_hist`      the distribution of k* of each adaptive configuration in a result.
* `plot_temperature_sweep`  the temperature claim: one metric's gap against T, adaptive primal
                         decoding vs its matched top-k, one panel per (alpha, lambda).

Divergences are computed directly in float64 from the generator
phi_alpha(x) = x^alpha / (alpha (alpha - 1)) (alpha = 1: x log x):
d(x, y) = phi(x) - phi(y) - phi'(y) (x - y); primal Div(q, p) = sum_i d(q_i, p_i), dual
Div(q, p) = sum_i d(p_i, q_i).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display

import matplotlib.pyplot as plt
import numpy as np
import torch

from .. import bregman_decode, renormalize

_DPI = 150


def zipf(vocab: int, exponent: float = 1.1) -> np.ndarray:
    """A Zipf-like distribution p_i proportional to i^-exponent (sorted decreasingly)."""
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    weights = ranks ** -exponent
    return weights / weights.sum()


def renorm(x: Sequence[float], alpha: float, mode: str) -> np.ndarray:
    """T_alpha (primal) or T*_alpha (dual) of a sub-probability vector, via the math core."""
    out = renormalize(torch.tensor(np.array(x, dtype=np.float64)), alpha=alpha, mode=mode)
    return out.numpy()


# ----------------------------------------------------------------------------- divergences


def phi(x: np.ndarray, alpha: float) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if alpha == 1.0:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(x > 0, x * np.log(np.where(x > 0, x, 1.0)), 0.0)
    return x ** alpha / (alpha * (alpha - 1.0))


def dphi(y: np.ndarray, alpha: float) -> np.ndarray:
    y = np.asarray(y, dtype=np.float64)
    with np.errstate(divide="ignore"):
        if alpha == 1.0:
            return np.log(y) + 1.0
        return y ** (alpha - 1.0) / (alpha - 1.0)


def bregman_d(x: np.ndarray, y: np.ndarray, alpha: float) -> np.ndarray:
    """Elementwise d_phi(x, y) = phi(x) - phi(y) - phi'(y) (x - y) for phi_alpha."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    slope = dphi(y, alpha)
    with np.errstate(invalid="ignore"):
        # Where x == y the linear term is 0 even if phi'(y) is infinite (y = 0, alpha < 1).
        linear = np.where(x == y, 0.0, slope * (x - y))
    return phi(x, alpha) - phi(y, alpha) - linear


def cost_curve(p: np.ndarray, alpha: float, lam: float, mode: str) -> np.ndarray:
    """cost(k) for k = 1..V (eq. (6)): the divergence between p and its top-k
    renormalization padded with zeros, plus lambda k (p sorted decreasingly, all > 0)."""
    p = np.sort(np.asarray(p, dtype=np.float64))[::-1]
    vocab = p.size
    costs = np.empty(vocab)
    for k in range(1, vocab + 1):
        q = np.zeros(vocab)
        q[:k] = renorm(p[:k], alpha, mode)
        d = bregman_d(q, p, alpha) if mode == "primal" else bregman_d(p, q, alpha)
        costs[k - 1] = d.sum() + lam * k
    return costs


# ----------------------------------------------------------------------------- theory figures


def plot_alpha_reshape(path: Path, *, vocab: int = 100, k: int = 10, shown: int = 15,
                       alphas: Sequence[float] = (0.25, 1.0, 2.5)) -> Path:
    """The figure of Section 1 (uncaptioned, so unnumbered): the top-k distribution after
    primal alpha-renormalization (k = 10) of a Zipf-like p over ``vocab`` tokens (the first
    ``shown`` ranks are drawn)."""
    p = zipf(vocab, exponent=1.0)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    positions = np.arange(1, shown + 1)
    width = 0.8 / (len(alphas) + 1)
    ax.bar(positions - 0.4 + width / 2, p[:shown], width, color="0.6", label="original p")
    colors = plt.cm.viridis(np.linspace(0.1, 0.85, len(alphas)))
    for j, alpha in enumerate(alphas):
        q = np.zeros(vocab)
        q[:k] = renorm(p[:k], alpha, "primal")
        name = f"alpha = {alpha:g}" + (" (top-k)" if alpha == 1.0 else "")
        ax.bar(positions - 0.4 + (j + 1.5) * width, q[:shown], width, color=colors[j],
               label=name)
    ax.axvline(k + 0.5, color="k", ls=":", lw=1)
    ax.text(k + 0.6, ax.get_ylim()[1] * 0.6, f"k = {k}: tokens\nbeyond are\ndropped",
            fontsize=8, va="top")
    ax.set_xlabel(f"token rank i (first {shown} of V = {vocab})")
    ax.set_ylabel("probability")
    ax.set_xticks(positions)
    ax.set_title(f"Primal Bregman alpha-decoding of a Zipf-like distribution (k = {k})")
    ax.legend()
    return _save(fig, path)


def plot_renorm_maps(path: Path, *, k: int = 100,
                     primal_alphas: Sequence[float] = (0.5, 1.0, 1.5, 2.0, 3.0, 10.0, math.inf),
                     dual_alphas: Sequence[float] = (1.0, 1.5, 2.0, 3.0, 10.0, math.inf)) -> Path:
    """Primal T_alpha (left) and dual T*_alpha (right) on the linear input vector of Figure 2."""
    ramp = np.arange(k, 0, -1, dtype=np.float64) / k  # [1, (k-1)/k, ..., 1/k]
    x = 0.67 * ramp / ramp.sum()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    for ax, mode, alphas in ((axes[0], "primal", primal_alphas), (axes[1], "dual", dual_alphas)):
        colors = plt.cm.plasma(np.linspace(0.05, 0.85, len(alphas)))
        for color, alpha in zip(colors, alphas, strict=True):
            ax.plot(x, renorm(x, alpha, mode), color=color, label=f"alpha = {_a(alpha)}")
        ax.plot(x, x, color="0.5", ls="--", lw=1, label="identity (x)")
        ax.set_xlabel("original value x_i")
        ax.set_title(f"{mode} renormalization {'T_alpha' if mode == 'primal' else 'T*_alpha'}"
                     f" (k = {k}, sum x = 0.67)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("renormalized value")
    return _save(fig, path)


def plot_peaked(path: Path, *, alphas: np.ndarray | None = None) -> Path:
    """Figure 4 (Appendix G.3) on v = [0.1, 0.001, 0.001, 0.001, 0.001]: what primal and dual
    renormalization make of the large value (left) and of each small value (right)."""
    v = np.array([0.1, 0.001, 0.001, 0.001, 0.001])
    grid = alphas if alphas is not None else np.concatenate(
        [np.linspace(1.0, 2.0, 21), np.geomspace(2.05, 50.0, 40)])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, style in (("primal", "-"), ("dual", "--")):
        values = np.array([renorm(v, float(a), mode) for a in grid])
        axes[0].plot(grid, values[:, 0], style, label=mode)
        axes[1].plot(grid, values[:, 1], style, label=mode)
    for ax, which, limit in ((axes[0], "0.1", 0.2), (axes[1], "0.001", 0.2)):
        ax.axhline(limit, color="0.5", ls=":", lw=1, label="alpha = inf (uniform)")
        for special in (1.0, 2.0):
            ax.axvline(special, color="0.8", lw=1)
        ax.set_xscale("log")
        ax.set_xlabel("alpha (log scale)")
        ax.set_ylabel(f"renormalized value of {which}")
        ax.set_title(f"the {'large' if which == '0.1' else 'small'} entry {which}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("Primal vs dual renormalization of [0.1, 0.001, 0.001, 0.001, 0.001] "
                 "(they coincide at alpha = 1, 2, inf)")
    return _save(fig, path)


def plot_cost_curves(path: Path, *, vocab: int = 80, lam: float | None = None,
                     primal_alphas: Sequence[float] = (1.0, 1.5, 2.0, 3.0, 5.0),
                     dual_alphas: Sequence[float] = (1.5, 2.0, 3.0, 5.0)) -> Path:
    """cost(k) against k for primal and dual alpha-decoding (V = 80, lambda = 1/80), each
    curve's minimizer marked; it equals the k* of `bregman_decode` (k-convexity)."""
    lam = 1.0 / vocab if lam is None else lam
    p = zipf(vocab, exponent=1.0)
    ks = np.arange(1, vocab + 1)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for ax, mode, alphas in ((axes[0], "primal", primal_alphas), (axes[1], "dual", dual_alphas)):
        colors = plt.cm.viridis(np.linspace(0.05, 0.85, len(alphas)))
        for color, alpha in zip(colors, alphas, strict=True):
            costs = cost_curve(p, alpha, lam, mode)
            k_star = int(bregman_decode(torch.tensor(p.copy()), alpha=alpha, lam=lam, mode=mode).k)
            ax.plot(ks, costs, color=color, label=f"alpha = {alpha:g} (k* = {k_star})")
            ax.plot([k_star], [costs[k_star - 1]], "o", color=color, ms=5)
        ax.set_xlabel("k (number of kept tokens)")
        ax.set_ylabel("cost(k) = Div + lambda k")
        ax.set_title(f"{mode}: V = {vocab}, lambda = 1/{round(1 / lam)}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("Discrete convexity of cost(k) (Zipf p, dots: k* from bregman_decode)")
    return _save(fig, path)


# ----------------------------------------------------------------------------- result figures


def _open_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    return list((result.get("open") or {}).get("results") or [])


def _series_key(config: dict[str, Any]) -> str | None:
    """Which line of the gaps figure a fixed-k row belongs to."""
    if config["kind"] == "topk" and not config.get("matched_to"):
        return f"top-k (alpha = 1), T={config['temperature']:g}"
    if config["kind"] == "bregman" and config.get("top_k") is not None:
        return f"{config['mode']} alpha = {config['alpha']}, T={config['temperature']:g}"
    return None


def plot_gaps_vs_k(result: dict[str, Any], path: Path) -> Path | None:
    """Perplexity gap and repetition gap against k (the paper's Figure 3).

    Fixed-k rows (top-k and generalized top-k) form one line per alpha; adaptive rows are drawn
    as single points at their mean k* (horizontal bar: std of k*). Returns None when the result
    has no open-ended rows.
    """
    rows = _open_rows(result)
    if not rows:
        return None
    configs = {c["label"]: c for c in result["configs"]}
    series: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    adaptive: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for row in rows:
        config = configs[row["config"]]
        key = _series_key(config)
        if key is not None:
            series.setdefault(key, []).append((int(config["top_k"]), row))
        elif config.get("adaptive") and row.get("kstar"):
            adaptive.append((config, row))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    metrics = (("ppl_gap", "perplexity gap  E[ppl(human)] - E[ppl(gen)]"),
               ("rep_gap", "repetition gap  P(rep gen) - P(rep human)"))
    markers = "osD^v<>"
    for ax, (metric, ylabel) in zip(axes, metrics, strict=True):
        for j, (name, points) in enumerate(sorted(series.items())):
            points.sort(key=lambda item: item[0])
            ks = [k for k, _ in points]
            ys = [row[metric]["value"] for _, row in points]
            errs = [row[metric]["std"] for _, row in points]
            ax.errorbar(ks, ys, yerr=errs, marker=markers[j % len(markers)], capsize=3,
                        label=name)
        for config, row in adaptive:
            ks = row["kstar"]
            ax.errorbar([ks["mean"]], [row[metric]["value"]], yerr=[row[metric]["std"]],
                        xerr=[ks["std"]], fmt="*", ms=10, capsize=2,
                        label=f"adaptive {config['label']} (at mean k*)")
        ax.axhline(0.0, color="0.5", lw=1, ls=":")
        ax.set_xlabel("k")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    model = result.get("meta", {}).get("model", "")
    n = (result.get("open") or {}).get("passages", "?")
    fig.suptitle(f"Open-ended generation, {model}: gaps to human text "
                 f"({n} prompts; error bars: bootstrap std)")
    return _save(fig, path)


def plot_kstar_hist(result: dict[str, Any], path: Path) -> Path | None:
    """Histogram of k* over all decoding steps for each adaptive configuration and task."""
    entries = []
    for task in ("open", "gsm8k"):
        for row in (result.get(task) or {}).get("results") or []:
            if row.get("kstar"):
                entries.append((task, row["config"], row["kstar"]))
    if not entries:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.4))
    for task, label, stats in entries:
        hist = {int(k): v for k, v in stats["histogram"].items()}
        ks = np.arange(1, max(hist) + 1)
        counts = np.array([hist.get(int(k), 0) for k in ks], dtype=np.float64)
        ax.plot(ks, counts / counts.sum(), marker="o", ms=3,
                ls="-" if task == "open" else "--",
                label=f"{task}: {label} (mean {stats['mean']:.2f}, "
                      f"H = {stats['entropy_bits']:.2f} bits)")
    ax.set_xlabel("k* (support size chosen at a decoding step)")
    ax.set_ylabel("fraction of steps")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title("Adaptivity: distribution of k*")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_temperature_sweep(sweep: dict[str, Any], metric: str, path: Path,
                           title: str = "") -> Path:
    """``metric``'s gap (``ppl_gap`` or ``rep_gap``) against the temperature for each
    (alpha, lambda) of a sweep (`sweep.analyze`): adaptive primal decoding (solid) and its
    matched top-k (dashed, labelled with k at each T), bootstrap std as error bars."""
    groups = sweep["groups"]
    columns = min(2, len(groups))
    rows = math.ceil(len(groups) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.6 * columns, 4.0 * rows), squeeze=False,
                             sharex=True)
    names = {"ppl_gap": "perplexity gap  E[ppl(human)] - E[ppl(gen)]",
             "rep_gap": "repetition gap  P(rep gen) - P(rep human)"}
    for ax, group in zip(axes.flat, groups, strict=False):
        ts = [row["temperature"] for row in group["rows"]]
        for key, style, label in (("bregman_gaps", "-o", "adaptive primal"),
                                  ("topk_gaps", "--s", "matched top-k")):
            ys = [row[key][metric]["value"] for row in group["rows"]]
            errs = [row[key][metric]["std"] or 0.0 for row in group["rows"]]
            ax.errorbar(ts, ys, yerr=errs, fmt=style, capsize=3, label=label)
        for row in group["rows"]:
            value = row["topk_gaps"][metric]["value"]
            if value is not None:
                ax.annotate(f"k={row['k']}", (row["temperature"], value), fontsize=7,
                            textcoords="offset points", xytext=(4, -10))
        ax.axhline(0.0, color="0.5", lw=1, ls=":")
        ax.set_title(f"alpha = {group['alpha']:g}, lambda = {group['lam']:g}, "
                     f"k_max = {group['k_max']}", fontsize=10)
        ax.set_xlabel("temperature T")
        ax.set_ylabel(names.get(metric, metric), fontsize=8)
        ax.set_xticks(ts)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    fig.suptitle(title or f"{names.get(metric, metric).split('  ')[0]} against temperature "
                 f"({sweep['prompts']} prompts; error bars: bootstrap std)")
    return _save(fig, path)


def sweep_figures(sweep: dict[str, Any], out: Path, model: str = "") -> list[Path]:
    """The two figures of a temperature sweep: sweep_ppl_gap.png and sweep_rep_gap.png."""
    made = []
    model = Path(model).name if model else ""  # a served path: its last component
    for metric, name in (("ppl_gap", "Perplexity gap"), ("rep_gap", "Repetition gap")):
        title = (f"{name} against T: adaptive primal vs matched top-k"
                 f"{' (' + model + ')' if model else ''}\n{sweep['prompts']} prompts; "
                 "error bars: bootstrap std")
        made.append(plot_temperature_sweep(sweep, metric, out / f"sweep_{metric}.png", title))
    return made


def theory_figures(out: Path) -> list[Path]:
    """The four figures that need no evaluation result."""
    out.mkdir(parents=True, exist_ok=True)
    return [
        plot_alpha_reshape(out / "alpha_reshape.png"),
        plot_renorm_maps(out / "renorm_maps.png"),
        plot_peaked(out / "primal_vs_dual_peaked.png"),
        plot_cost_curves(out / "cost_convexity.png"),
    ]


def result_figures(result: dict[str, Any], out: Path) -> list[Path]:
    """The figures drawn from an evaluation result (those that apply)."""
    out.mkdir(parents=True, exist_ok=True)
    if result.get("temperature_sweep"):
        # gaps against k would mix every temperature in one panel: the sweep has its own.
        made = [*sweep_figures(result["temperature_sweep"], out,
                               str(result.get("meta", {}).get("model", ""))),
                plot_kstar_hist(result, out / "kstar_hist.png")]
    else:
        made = [plot_gaps_vs_k(result, out / "gaps_vs_k.png"),
                plot_kstar_hist(result, out / "kstar_hist.png")]
    return [p for p in made if p is not None]


def _a(alpha: float) -> str:
    return "inf" if math.isinf(alpha) else f"{alpha:g}"


def _save(fig: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path
