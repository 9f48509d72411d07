"""The exact path: value-dependent candidate rounds and k* search, for what the fixed step leaves.

Rows reach it when the fixed-shape step (`step`) could not certify them (k* beyond the first
window, a near-tie within rounding, a Newton solve that had not converged) and for the
``EXACT`` family (`families`: alphas without a fixed-iteration solver, user generators). It is
the reference implementation the fixed step is tested against.

Pipeline, per batch of rows (vectorized over rows; loops run over rounds and probes):

1. Candidates: the W largest entries of each row, read from the scores (logits or
   probabilities) with the mass of everything else summed as positive terms: the same
   `candidates.Candidates` as the fixed-shape step's.
2. Support size. Fixed k: min(top_k, k_max, number of nonzero entries). Adaptive: the smallest k
   with G(k) <= lambda (`gaps`), in closed form over all k for (primal, 1), (primal, 3/2) and
   alpha = 2; otherwise, after a lower bound from the floor of every gap (`_floor_sizes`), by
   one window probe of the exact gaps of `PROBE_WINDOW` sizes (k* is usually small), then by
   multiplier probes (`_guided`): each solves one map T_m by its multiplier nu_m
   (`roots.Multiplier`: the primal's Newton, the dual's joint Newton) and weak duality bounds
   both neighbouring gaps by the entries' terms at nu_m, w(p_(m+1), nu_(m+1)) <= G(m) <=
   w(p_(m+1), nu_m) (`gaps.log_entry_term`), which decides k* >= m or k* <= m (or both);
   the next size is predicted from nu_m by a Halley step of the maps' equations (the first
   probe's, where k* is in the thousands, from a multiplier found without a map:
   `predict`); a bracket of two adjacent sizes is decided by the exact gap of the two maps
   held, with the ratios q_i / q'_i from the multipliers (no rounding of two normalized
   maps). A probe predicted next to k* also decides the sizes beside its own by series in
   its multiplier (`series`: their multipliers and exact gaps without another map). A few
   probes, one map each, where k* is in the tens of thousands. User generators (no
   multiplier) gallop and bisect on exact gaps (`_bisect`). Greedy property and
   k-convexity (Theorems 3.1, 3.2 and 3.3 of arXiv 2505.19371) make the first k with
   G(k) <= lambda the global minimizer. A row whose k* is not certified inside its W
   candidates goes to the next round with 8 W candidates (up to the whole row).
3. log T_k* on the support, written into the output by the step's writer
   (`write.write_support`).

Memory: a round holds a few float64 [rows, W] arrays; rounds whose width would exceed
`MEMORY_BUDGET` bytes run their rows in pieces, and finished rows are written out at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch

from .candidates import UNBOUNDED, Candidates, candidates, take
from .dual import dual_log_renorm, dual_multiplier
from .families import CLOSED_FORM_FAMILIES, CLOSED_GAP_FAMILIES, QUADRATIC_DUAL_FAMILIES, Family
from .gaps import dual_log_gap, log_entry_term, primal_log_gap
from .generators import (
    BregmanGenerator,
    generic_dual_renorm,
    generic_gap,
    generic_primal_renorm,
)
from .plan import DEFAULT_ROW_VALUES, ROW_DTYPES, ROW_FIELDS, make_plan, rows_family
from .predict import (
    NEAR_REACH,
    first_probe,
    moved_state,
    predicted_near,
    predicted_sizes,
    state_drift,
)
from .primal import (
    _normalized,
    closed_log_renorm,
    kl_log_renorm,
    newton_log_renorm,
    primal_multiplier,
    support_mask,
)
from .roots import Multiplier
from .series import SERIES_COLUMNS, SERIES_REACH, SERIES_SIZES, SeriesBounds, series_bounds
from .window import Decoded, closed_sizes, support_range
from .write import output_values, write_support

Tensor = torch.Tensor

#: Width of the first candidate set; rows whose k* is not certified inside it get 8x more.
INITIAL_CANDIDATES = 64
_GROWTH = 8
_FULL_SORT_FRACTION = 4
#: Bytes of float64 work arrays one chunk of a whole-row round may hold (about 8 per entry).
MEMORY_BUDGET = 256 * 1024 * 1024
#: Peak bytes of a whole-row round per entry (measured, output included: 357 for dual alpha 20
#: on peaked rows, 320 for dual alpha 2.5 and 304 for primal alpha 3 on flat rows, k* ~ 0.7-0.9 V:
#: the multiplier search's maps at the bracket's ends, warm starts and predictions).
_BYTES_PER_ENTRY = 400


class ExactPlan(NamedTuple):
    """Per-row parameters of the exact path (all [n] tensors; fixed_k / k_max: 0 = none), the
    rows' formula family (one plan group: decided once, by the plan; None with a user
    generator) and the other per-row values by name (`plan.ROW_FIELDS`, [n] tensors)."""

    mode: str
    alpha: Tensor
    lam: Tensor
    fixed_k: Tensor
    k_max: Tensor
    generator: BregmanGenerator | None = None
    family: Family | None = None
    values: Mapping[str, Tensor] = MappingProxyType({})


def exact_plan(mode: str, alpha: Tensor, lam: Tensor, fixed_k: Tensor, k_max: Tensor,
               generator: BregmanGenerator | None = None, family: Family | None = None,
               values: Mapping[str, Tensor] | None = None) -> ExactPlan:
    """The exact path's parameters. ``family``: the rows' family when the caller has it (a
    plan group); else the plan's (`plan.rows_family`). ``values``: the `plan.ROW_FIELDS`
    (default: their defaults)."""
    if family is None and generator is None:
        family = rows_family(mode, alpha.tolist(), bool((fixed_k > 0).all()))
    if values is None:
        values = {name: torch.full_like(fixed_k, default, dtype=ROW_DTYPES[name])
                  for name, default in zip(ROW_FIELDS, DEFAULT_ROW_VALUES, strict=True)}
    return ExactPlan(mode, alpha, lam, fixed_k, k_max, generator, family, values)

# ----------------------------------------------------------------------------- candidates


def _log_deficit(cand: Candidates, k: Tensor) -> Tensor:
    """log R_k for sizes k >= 1 (``[n, ...]`` like ``k``; `Candidates.deficit` holds R_1..R_W)."""
    flat = k.reshape(k.shape[0], -1)
    return torch.log(torch.gather(cand.deficit, 1, flat - 1)).reshape(k.shape)


# ----------------------------------------------------------------------------- renormalization


def _general(mode: str):
    """The map of every other alpha: primal Newton (eq. (4)), or the dual's nested root
    finding (Algorithm 1, eq. (5))."""
    if mode == "primal":
        return lambda lp, mk, a, ld, kk: newton_log_renorm(lp, mk, a, ld, kk)
    return lambda lp, mk, a, ld, kk: dual_log_renorm(lp, mk, a, ld, kk)


#: The map of each family on a fixed support (arguments: log p, support mask, alpha, log R, k).
_MAPS = {
    **{family: (lambda lp, mk, a, ld, kk, family=family:
                closed_log_renorm(family, lp, mk, ld, kk)) for family in CLOSED_FORM_FAMILIES},
    Family.POWER: lambda lp, mk, a, ld, kk: newton_log_renorm(lp, mk, a, ld, kk),
    Family.DUAL_THREE_HALVES: lambda lp, mk, a, ld, kk: dual_log_renorm(
        lp, mk, a, ld, kk, closed=Family.DUAL_THREE_HALVES),
    Family.DUAL_THREE: lambda lp, mk, a, ld, kk: dual_log_renorm(
        lp, mk, a, ld, kk, closed=Family.DUAL_THREE),
}


def log_renorm(family: Family | None, mode: str, log_p: Tensor, k: Tensor, alpha: Tensor,
               log_deficit: Tensor, generator: BregmanGenerator | None = None) -> Tensor:
    """T_alpha (eq. (4), primal) or T*_alpha (eq. (5), dual) on the top-k entries of each row,
    in log space, with the rows' family's map (`families`: closed forms of Proposition 4.1 and
    Appendix G.3, the quadratic dual maps, Newton or nested root finding for the others).

    Args:
        log_p: ``[..., K]`` log-probabilities sorted in decreasing order.
        k: ``[...]`` support sizes, 1 <= k <= K.
        alpha: ``[...]`` exponents.
        log_deficit: ``[...]`` log(1 - S_k), the mass left outside the support (-inf if none:
            every map is then the identity, the KL map q = p / S with S = 1).

    Returns:
        ``[..., K]`` log q, normalized, -inf at positions >= k.
    """
    if generator is not None:
        mask = support_mask(k, log_p.shape[-1])
        renorm = generic_primal_renorm if mode == "primal" else generic_dual_renorm
        return torch.log(renorm(torch.exp(log_p), mask, generator))
    shape = log_p.shape
    lp = log_p.reshape(-1, shape[-1])
    mk = support_mask(k, shape[-1]).reshape(-1, shape[-1])
    ld = log_deficit.reshape(-1)
    kk = k.reshape(-1)
    a = alpha.to(log_p.dtype).reshape(-1)
    out = torch.full_like(lp, -math.inf)
    none = torch.isneginf(ld)
    identity = none.nonzero().squeeze(-1)
    if identity.numel():
        out[identity] = kl_log_renorm(lp[identity], mk[identity])
    rest = (~none).nonzero().squeeze(-1)
    if rest.numel():
        apply = _MAPS.get(family) or _general(mode)
        out[rest] = apply(lp[rest], mk[rest], a[rest], ld[rest], kk[rest])
    return out.reshape(shape)


def renorm_rows(mode: str, log_p: Tensor, k: Tensor, alpha: Tensor, log_deficit: Tensor
                ) -> Tensor:
    """`log_renorm` for rows of any alphas (``[n]``, validated as fixed-k alphas): each row
    with its family, decided by the plan (`plan.make_plan`, one group per family)."""
    plan = make_plan(mode, alpha.reshape(-1), 0.0, top_k=k.reshape(-1), batch_shape=k.numel(),
                     vocab=log_p.shape[-1], device=log_p.device)
    out = torch.full_like(log_p, -math.inf)
    for group in plan.groups:
        index = group.rows_or_all(log_p.device)
        out[index] = log_renorm(group.family, mode, log_p[index], k[index], alpha[index],
                                log_deficit[index])
    return out


def _renorm_at(family: Family | None, mode: str, cand: Candidates, k: Tensor, alpha: Tensor,
               generator: BregmanGenerator | None = None) -> Tensor:
    """log T_k (per row, k >= 1) on the first max(k) candidate columns."""
    width = int(k.max())
    return log_renorm(family, mode, cand.log_x[:, :width], k, alpha, _log_deficit(cand, k),
                      generator)


#: Support sizes the first probe of an adaptive search covers at once (most k* are small).
PROBE_WINDOW = 16


def _window_exceeds(family: Family | None, mode: str, cand: Candidates, start: Tensor,
                    count: int, alpha: Tensor, lam: Tensor,
                    generator: BregmanGenerator | None = None
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """G(m) > lambda for m = start .. start + count - 1 per row ([n, count]), from the exact maps
    on the count + 1 consecutive supports (1 <= start, start + count <= candidates); also returns
    those maps (log T_m for m = start .. start + count, [n, count + 1, W]) and log G(m)
    ([n, count]). The maps are solved by their multipliers (`_solved`), whose log(q / p) give
    the gaps' ratios exactly (`gaps._log_ratios`); a user generator's by its generic maps."""
    sizes = start.unsqueeze(-1) + torch.arange(count + 1, device=start.device)  # [n, count + 1]
    width = int(sizes.max())
    log_p = cand.log_x[:, :width]
    n = log_p.shape[0]
    stacked = log_p.unsqueeze(1).expand(-1, count + 1, -1)
    rows = log_p.unsqueeze(1).expand(-1, count, -1)
    m = sizes[:, :-1]
    if generator is not None:
        maps = log_renorm(family, mode, stacked, sizes, alpha.unsqueeze(-1).expand(-1, count + 1),
                          _log_deficit(cand, sizes), generator)
        gap = generic_gap(mode, generator, torch.exp(rows), torch.exp(maps[:, :-1]),
                          torch.exp(maps[:, 1:]), m)
        return gap > lam.unsqueeze(-1), maps, torch.log(gap)
    solved = _solved(family, mode, stacked.reshape(n * (count + 1), width), sizes.reshape(-1),
                     alpha.repeat_interleave(count + 1, output_size=n * (count + 1)),
                     _log_deficit(cand, sizes).reshape(-1))
    shape = (n, count + 1, width)
    maps = _normalized(solved.log_q, support_mask(sizes.reshape(-1), width)).reshape(shape)
    lift = solved.lift.reshape(shape)
    log_q, log_q_next = maps[:, :-1], maps[:, 1:]
    rho = lift[:, :-1] - lift[:, 1:]
    a = alpha.unsqueeze(-1).expand(-1, count)
    if mode == "primal":
        log_gap = primal_log_gap(log_q, log_q_next, m, a, rho)
    else:
        log_gap = dual_log_gap(rows, log_q, log_q_next, m, a, rho)
    return log_gap > torch.log(lam).unsqueeze(-1), maps, log_gap


#: Probes guided by the multipliers (`_probe`) before the search only bisects.
GUIDED_PROBES = 8
#: Lower bound on k* from which the first probe goes where `predict` predicts k*: every row
#: the window hands over (its k* is past the window's 64 sizes). Measured at [8, 16384] over
#: the sweep of benchmarks/bench_core.py, against 256: the same outputs, launched ops -4 %
#: (realistic dual alpha 4, lambda 1e-22: -38 %), host syncs -5 %.
PREDICT_FROM = 64
#: The same for the primal below alpha = 1, whose prediction (a bisection in delta) costs more
#: than a few probes while k* is in the hundreds (measured at [8, 49152]: peaked rows 1.3x the
#: time with it from 256).
PREDICT_BELOW_ONE_FROM = 2048
#: Smallest |alpha - 1| predicted, per mode: next to alpha = 1 the floor is close to k*
#: (measured at [8, 49152]: dual alpha 1.001 to 1.05 1.2x the time with the prediction, 1.1 to
#: 1.4 from 0.7x to 1.2x by rows; primal alpha 1.05 to 1.3 0.6x to 1.0x, 1.001 1.15x).
PREDICT_DISTANCE = MappingProxyType({"primal": 0.05, "dual": 0.5})
#: Columns a probe values past twice its size, for its prediction (`_guided`).
_SPARE_COLUMNS = 64
#: A bracket this narrow is decided by one probe of all its sizes (user generators).
FINAL_WINDOW = 8


def _first_window(family: Family | None, mode: str, cand: Candidates, alpha: Tensor,
                  lam: Tensor, low: Tensor, high: Tensor, cache: Tensor, cached: Tensor,
                  rows: Tensor, generator: BregmanGenerator | None) -> None:
    """The ``rows`` at low = 1 (the first round, not raised by the floor): one window probe
    decides G(1 .. PROBE_WINDOW) at once from the exact maps (k* is usually small); updates
    ``low`` / ``high`` and keeps T_k* for the rows it resolved in ``cache`` (in place)."""
    active = (rows & (low < high)).nonzero().squeeze(-1)
    if active.numel() == 0:
        return
    lo, hi = low[active], high[active]
    count = int(min(PROBE_WINDOW, int((hi - lo).max())))
    sub = take(cand, active)
    start = torch.minimum(lo, hi - count).clamp_min(1)  # keep the window inside [1, hi]
    exceeds, maps, _ = _window_exceeds(family, mode, sub, start, count, alpha[active],
                                       lam[active], generator)
    m = start.unsqueeze(-1) + torch.arange(count, device=lo.device)
    # Sizes below low are known to exceed; at or beyond high the search stops by definition.
    stop = (~exceeds | (m >= hi.unsqueeze(-1))) & (m >= lo.unsqueeze(-1))
    first = torch.where(stop, m, hi.unsqueeze(-1)).amin(-1)
    covered = start + count  # every size below this was decided
    resolved = first < covered
    high[active] = torch.where(resolved, first, hi)
    low[active] = torch.where(resolved, first, torch.maximum(lo, covered))
    pick = (first - start).clamp(0, count).view(-1, 1, 1).expand(-1, 1, maps.shape[-1])
    chosen = torch.gather(maps, 1, pick).squeeze(1)
    cache[active, : chosen.shape[-1]] = torch.where(resolved.unsqueeze(-1), chosen,
                                                    cache[active, : chosen.shape[-1]])
    cached[active] = resolved


def _bisect(family: Family | None, mode: str, cand: Candidates, alpha: Tensor, lam: Tensor,
            low: Tensor, high: Tensor, cache: Tensor, cached: Tensor, galloping: Tensor,
            generator: BregmanGenerator | None) -> None:
    """Smallest k in [low, high] with G(k) <= lambda from exact gaps (two maps per probe): for
    user generators, whose maps have no multiplier to probe with. Galloping from low (m = low,
    low + 1, low + 3, ...) for ``galloping`` rows, bisection, and one probe of every size once
    the bracket is `FINAL_WINDOW` wide: O(log k*) probes. Updates the arguments in place."""
    step = torch.ones_like(low)
    width = cand.log_x.shape[-1]
    while True:
        active = (low < high).nonzero().squeeze(-1)
        if active.numel() == 0:
            return
        lo, hi = low[active], high[active]
        gal = galloping[active]
        m = torch.where(gal, torch.minimum(lo + step[active] - 1, hi - 1), (lo + hi) // 2)
        count = 1
        span = int((hi - lo).max())
        if span <= FINAL_WINDOW:  # every size left, at once
            m, count = lo, span
        count = min(count, width - 1)
        m = torch.minimum(m, torch.full_like(m, width - count))  # T_(m + count) exists
        exceeds, maps, _ = _window_exceeds(family, mode, take(cand, active), m, count,
                                           alpha[active], lam[active], generator)
        sizes = m.unsqueeze(-1) + torch.arange(count, device=m.device)
        inside = (sizes >= lo.unsqueeze(-1)) & (sizes < hi.unsqueeze(-1))
        # G is nonincreasing: the sizes that exceed raise low, the first that stops lowers high.
        found = torch.maximum(lo, torch.where(exceeds & inside, sizes + 1, 0).amax(-1))
        low[active] = found
        high[active] = torch.minimum(hi, torch.where(~exceeds & inside, sizes,
                                                     hi.unsqueeze(-1)).amin(-1))
        # A probe that decided k* holds T_k* among its maps (T_m .. T_(m + count)).
        offset = found - m
        hit = (high[active] == found) & (offset >= 0) & (offset <= count)
        if bool(hit.any()):
            rows = active[hit]
            pick = offset[hit].view(-1, 1, 1).expand(-1, 1, maps.shape[-1])
            cache[rows] = -math.inf
            cache[rows, : maps.shape[-1]] = torch.gather(maps[hit], 1, pick).squeeze(1)
            cached[rows] = True
        first = exceeds[:, 0]
        step[active] = torch.where(first & gal, step[active] * 2, step[active])
        galloping[active] = gal & first


class _Probe(NamedTuple):
    """A probe of support size m per row (`_probe`): log T_m ([r, C], normalized, -inf off the
    support) and its log(q / p) (``lift``, for exact gaps), what its multiplier certifies
    (``below``: G(m - 1) > lambda, so k* >= m; ``at``: G(m) <= lambda, so k* <= m), and, with a
    prediction, the next size to probe (``guess``) and what warm-starts a probe of any size j:
    the multiplier s_m, the predicted s_j - s_m in column j - 1 (``shift``, NaN without a
    prediction), and for the dual the inner unknowns and their drift in s
    (`predict.state_drift`)."""

    log_q: Tensor
    lift: Tensor
    below: Tensor
    at: Tensor
    guess: Tensor
    s: Tensor
    shift: Tensor
    state: Tensor | None
    drift: Tensor | None
    series: SeriesBounds | None = None


def _solved(family: Family | None, mode: str, log_p: Tensor, k: Tensor, alpha: Tensor,
            log_deficit: Tensor, start: Tensor | None = None, state: Tensor | None = None,
            past: int = 1) -> Multiplier:
    """The map of support size k by its multiplier (`roots.Multiplier`), every column valued
    (the support and ``past`` columns after it to the rounding floor); rows with no mass
    outside the support (log R = -inf) are the identity, q = p (with s = -inf and no
    derivatives)."""
    mask = support_mask(k, log_p.shape[-1])
    identity = torch.isneginf(log_deficit)
    log_deficit = torch.where(identity, 0.0, log_deficit)  # (solved, then replaced)
    a = alpha.to(log_p.dtype)
    if mode == "primal":
        solved = primal_multiplier(log_p, mask, a, log_deficit, k, start)
    else:
        closed = family if family in QUADRATIC_DUAL_FAMILIES else None
        solved = dual_multiplier(log_p, mask, a, log_deficit, k, closed, start, state, past)
    if not bool(identity.any()):
        return solved
    same = identity.unsqueeze(-1)
    return solved._replace(
        s=torch.where(identity, -math.inf, solved.s),
        log_q=torch.where(same, log_p, solved.log_q),
        rate=solved.rate.masked_fill(same, 0.0),
        curvature=solved.curvature.masked_fill(same, 0.0),
        lift=torch.where(same, torch.where(torch.isfinite(log_p), 0.0, -math.inf),
                         solved.lift))


def _probe(family: Family | None, mode: str, cand: Candidates, m: Tensor, alpha: Tensor,
           lam: Tensor, start: Tensor, state: Tensor | None, low: Tensor,
           predict: bool = True, near: bool = False) -> _Probe:
    """One map per row, T_m, by its multiplier nu_m, and what that multiplier decides.

    By weak duality (`gaps.log_entry_term`), w(p_(k+1), nu_(k+1)) <= G(k) <= w(p_(k+1), nu_k),
    with w increasing in p and in nu and nu_k decreasing in k, so the one multiplier nu_m gives

    * G(m - 1) >= w(p_m, nu_m): if that is > lambda, k* >= m (``below``);
    * G(m) <= w(p_(m+1), nu_m) <= w(p_m, nu_m): if either is <= lambda, k* <= m (``at``);

    at least one of the two holds. With k_B the last size whose ``below`` holds, k* is k_B or
    k_B + 1, and ``at`` holds at k_B + 1 (w(p_(k+1), nu_(k+1)) <= lambda there); a probe at
    k_B whose ``at`` fails leaves G(k_B) to the exact gap of T_(k_B) and T_(k_B + 1).

    With ``predict``, the next size: k_B as predicted from nu_m (`predict.predicted_sizes`;
    ``near``: m is itself a prediction, k* is expected next to it, `predict.predicted_near`).
    The columns are the candidates' first C (C >= m + 1 where the candidates have it);
    ``start`` / ``state``: warm starts for the solve (NaN: none); ``low``: known lower bounds
    on k* (no size below them is predicted).
    """
    width = cand.log_x.shape[-1]
    log_p = cand.log_x
    acol = alpha.to(log_p.dtype).unsqueeze(-1)
    # (whether any warm start is given, and the least known lower bound: one host read)
    cold, lowest = torch.stack([torch.isnan(start).all().to(low.dtype), low.min()]).tolist()
    warm = None if cold else start
    log_deficit = _log_deficit(cand, m)
    dual = mode == "dual"
    past = SERIES_COLUMNS if dual else 1
    solved = _solved(family, mode, log_p, m, alpha, log_deficit, warm, state, past)

    def series(guess: Tensor, shift: Tensor | None = None) -> SeriesBounds | None:
        # Only for rows the multiplier's bounds left open, where k* is predicted next to m
        # and (``shift``: the predicted s_j - s_m) the next size's multiplier is within the
        # series' reach: elsewhere it would decide nothing.
        near = ((guess - m).abs() <= SERIES_SIZES) & ~(below & at)
        if shift is not None:
            step = torch.gather(shift, 1, m.clamp_max(shift.shape[-1] - 1).unsqueeze(-1))
            near &= step.squeeze(-1).abs() <= SERIES_REACH
        rows = near.nonzero().squeeze(-1)
        if rows.numel() == 0:
            return None
        # (the primal's and the quadratic dual maps' columns are closed forms in s)
        exact_columns = m + past if dual and family not in QUADRATIC_DUAL_FAMILIES \
            else torch.full_like(m, width)
        if rows.numel() == m.numel():
            return series_bounds(mode, log_p, solved, m, alpha, lam, log_deficit, exact_columns)
        found = series_bounds(mode, log_p[rows], solved.take(rows), m[rows], alpha[rows],
                              lam[rows], log_deficit[rows], exact_columns[rows])
        every = SeriesBounds(torch.zeros_like(m), torch.full_like(m, torch.iinfo(m.dtype).max),
                             *(torch.full((m.numel(), t.shape[-1]), math.nan, dtype=t.dtype,
                                          device=t.device) for t in found[2:]))
        for full, part in zip(every, found, strict=True):
            full[rows] = part
        return every

    log_q = solved.log_q
    log_lam = torch.log(lam)
    pair = torch.stack([m - 1, m.clamp_max(width - 1)], -1)
    w_at, w_next = log_entry_term(mode, torch.gather(log_p, 1, pair), torch.gather(log_q, 1, pair),
                                  acol).unbind(-1)
    w_next = torch.where(m < width, w_next, math.inf)
    below = w_at > log_lam
    at = torch.minimum(w_at, w_next) <= log_lam
    normalized = _normalized(log_q, support_mask(m, width))
    if not predict:
        return _Probe(normalized, solved.lift, below, at, m, solved.s,
                      torch.full_like(log_q, math.nan), solved.state, state_drift(solved),
                      series(m))
    # Sizes below the known lower bound need no prediction: the sums over their columns
    # are carried in one piece, the rest column by column.
    skip = max(0, min(lowest - 1, width - 1))
    if not near:
        guess, shift = predicted_sizes(mode, log_p, cand.deficit, solved, alpha, lam, m, skip)
        return _Probe(normalized, solved.lift, below, at, guess, solved.s, shift, solved.state,
                      state_drift(solved), series(guess, shift))
    # k* is expected next to m: the series first, and a prediction only for the rows that it
    # and the multiplier's bounds leave open (`predict.predicted_near`).
    found = series(m)
    least = torch.where(below, m, 0)
    most = torch.where(at, m, torch.iinfo(m.dtype).max)
    if found is not None:
        least, most = torch.maximum(least, found.low), torch.minimum(most, found.high)
    guess, shift = m.clone(), torch.full_like(log_q, math.nan)
    rows = (least < most).nonzero().squeeze(-1)
    if rows.numel():
        guess[rows], shift[rows] = predicted_near(
            mode, log_p[rows], cand.deficit[rows],
            solved.take(rows), alpha[rows],
            lam[rows], m[rows], skip, m[rows])
    return _Probe(normalized, solved.lift, below, at, guess, solved.s, shift, solved.state,
                  state_drift(solved), found)


def _warm_start(size: Tensor, s: Tensor, shift: Tensor, state: Tensor | None,
                drift: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The start of a probe of support size ``size`` from an earlier probe's multiplier ``s``
    and predictions (`_Probe`): s + shift at that size (s where it predicted nothing), and for
    the dual each inner unknown moved to second order (`predict.moved_state`); NaN where there
    was no earlier probe."""
    moved = torch.gather(shift, 1, (size - 1).clamp(0, shift.shape[-1] - 1).unsqueeze(-1))
    moved = torch.where(torch.isnan(moved), 0.0, moved)  # (no prediction: s itself)
    start = s + moved.squeeze(-1)
    start = torch.where(torch.isfinite(start), start, math.nan)
    return start, None if state is None else moved_state(state, drift, moved)


def _exact_gap_at(mode: str, cand: Candidates, m: Tensor, alpha: Tensor, log_q: Tensor,
                  lift: Tensor, log_q_next: Tensor, lift_next: Tensor) -> Tensor:
    """log G(m) from T_m and T_(m+1) (``[r, W]``, with their log(q / p)), the exact gap
    formulas of `gaps` with exact ratios."""
    width = int(m.max()) + 1
    log_q, log_q_next = log_q[:, :width], log_q_next[:, :width]
    rho = lift[:, :width] - lift_next[:, :width]
    a = alpha.to(log_q.dtype)
    if mode == "primal":
        return primal_log_gap(log_q, log_q_next, m, a, rho)
    return dual_log_gap(cand.log_x[:, :width], log_q, log_q_next, m, a, rho)


def _guided(family: Family | None, mode: str, cand: Candidates, alpha: Tensor, lam: Tensor,
            low: Tensor, high: Tensor, cache: Tensor, cached: Tensor, open_end: Tensor) -> Tensor:
    """Smallest k in [low, high] with G(k) <= lambda, by multiplier probes (`_probe`): one map
    per probe, at the size its predecessor predicted (bisection after `GUIDED_PROBES`), the
    bracket narrowed by what each multiplier certifies; a bracket of two adjacent sizes whose
    maps the probes hold is decided by their exact gap. Each probe narrows the bracket or
    holds a map at one of its ends, so the search ends; the predictions, Halley steps of the
    maps' equations, land next to k* in a few probes.

    ``open_end`` rows (high is the end of the candidates, k* may lie past it) stop once a
    probe predicts k* past the candidates, with the lower bound certified so far, for a wider
    round. Updates low, high, cache and cached in place; returns which rows stopped so
    (``left``; their low is the certified bound)."""
    n, width = cand.log_x.shape
    dtype = cand.log_x.dtype
    ends = torch.full((4, n, width), -math.inf, dtype=dtype, device=low.device)
    low_map, low_lift, high_map, high_lift = ends.unbind(0)
    has_low = torch.zeros_like(low, dtype=torch.bool)
    has_high = torch.zeros_like(has_low)
    left = torch.zeros_like(has_low)
    guess = low.clone()
    # The last probe of each row: its multiplier, predicted shifts, (dual) inner unknowns and
    # drift: the next probe's warm start (`_warm_start`).
    last_s = torch.full((n,), math.nan, dtype=dtype, device=low.device)
    last_shift = torch.full_like(low_map, math.nan)
    last_drift = None if mode == "primal" else torch.zeros((2, n, width), dtype=dtype,
                                                            device=low.device)
    last_state = None if mode == "primal" else torch.full_like(low_map, math.nan)
    tries = torch.zeros_like(low)
    # The first probe where k* is predicted (`predict`), for the families it predicts (the
    # quadratic dual alphas solve a map in a few passes) and the alphas where the floor of the
    # gaps is far from k*; the primal's alphas above and below 1 apart (another scalar).
    predicted = (low >= torch.where(alpha < 1.0, PREDICT_BELOW_ONE_FROM, PREDICT_FROM)) \
        & (low < high) \
        & ((alpha - 1.0).abs() >= PREDICT_DISTANCE[mode]) & (family not in QUADRATIC_DUAL_FAMILIES)
    for rows in (predicted & (alpha > 1.0)).nonzero().squeeze(-1), \
            (predicted & (alpha < 1.0)).nonzero().squeeze(-1):
        if rows.numel() == 0:
            continue
        sub = take(cand, rows)
        first = first_probe(mode, sub.log_x, sub.deficit, alpha[rows], lam[rows], low[rows])
        # Predicted past the candidates, no boundary there: a wider round goes on from low at
        # once (a probe here would only certify what the floor did).
        past = open_end[rows] & (first.guess >= width)
        guess[rows] = torch.where(past, low[rows], first.guess)
        predicted[rows] = ~past
        left[rows] = past
        high[rows] = torch.where(past, low[rows], high[rows])
        columns = first.values.log_q.shape[-1]
        last_s[rows], last_shift[rows, :columns] = first.values.s, first.shift
        if last_state is not None:
            last_state[rows, :columns] = first.values.state
            last_drift[:, rows, :columns] = state_drift(first.values)
    while True:
        active = (low < high).nonzero().squeeze(-1)
        if active.numel() == 0:
            # A bracket that closed (low = high) at an end whose map the search holds has
            # T_k* already.
            rows = ((has_high | has_low) & ~(cached | left)).nonzero().squeeze(-1)
            if rows.numel():
                cache[rows] = torch.where(has_high[rows].unsqueeze(-1), high_map[rows],
                                          low_map[rows])
                cached.index_fill_(0, rows, True)
            return left
        lo, hi = low[active], high[active]
        pair = (hi == lo + 1) & has_low[active] & has_high[active]
        rows = active[pair.nonzero().squeeze(-1)]
        if rows.numel():  # the exact gap of the two maps held
            m = low[rows]
            log_gap = _exact_gap_at(mode, take(cand, rows), m, alpha[rows], low_map[rows],
                                    low_lift[rows], high_map[rows], high_lift[rows])
            stop = ~(log_gap > torch.log(lam[rows]))
            cache[rows] = torch.where(stop.unsqueeze(-1), low_map[rows], high_map[rows])
            cached.index_fill_(0, rows, True)
            found = torch.where(stop, m, m + 1)
            low[rows], high[rows] = found, found
            continue
        m = torch.where(tries[active] < GUIDED_PROBES, guess[active].clamp(lo, hi),
                        (lo + hi) // 2)
        m = torch.where((m == lo) & has_low[active], lo + 1, m)
        m = torch.where((m == hi) & has_high[active], hi - 1, m)
        # Rows of sizes far apart probe apart: a probe's columns follow its largest size.
        for part in _similar_sizes(m):
            rows, size = active[part], m[part]
            lo, hi = low[rows], high[rows]
            # The columns a probe values: its support, the next column, and as many again for
            # the prediction (a probe predicts at most twice its size: O(log k*) probes in any
            # case), or `NEAR_REACH` more for a probe put where k* is predicted; only the
            # first two where every bracket is down to two sizes (maps for an exact gap).
            # (a first probe where `predict` put it: k* is expected next to it, and its own
            # prediction reaches `NEAR_REACH` sizes past it, `predict.predicted_near`; the four
            # in one host read)
            ending, near, top, largest = torch.stack([
                (hi - lo <= 1).all().long(), (predicted[rows] & (tries[rows] == 0)).all().long(),
                hi.max(), size.max()]).tolist()
            reach = NEAR_REACH + _SPARE_COLUMNS if near else largest + _SPARE_COLUMNS
            columns = min(width, top + 1, largest + reach)
            # (a probe's series reads the sizes next to its own)
            columns = min(width, largest + SERIES_COLUMNS) if ending else columns
            sub = take(cand, rows)
            sub = sub._replace(log_x=sub.log_x[:, :columns])
            start, state = _warm_start(size, last_s[rows], last_shift[rows, :columns],
                                       None if last_state is None
                                       else last_state[rows, :columns],
                                       None if last_drift is None
                                       else last_drift[:, rows, :columns])
            probe = _probe(family, mode, sub, size, alpha[rows], lam[rows], start, state, lo,
                           not ending, near)
            log_q, lift = (torch.nn.functional.pad(t, (0, width - columns), value=-math.inf)
                           for t in (probe.log_q, probe.lift))
            # (each selection one host read: its positions index everything after)
            both = (probe.below & probe.at).nonzero().squeeze(-1)
            at = rows[both]
            cache[at] = log_q[both]
            cached.index_fill_(0, at, True)
            low[at], high[at] = size[both], size[both]
            only = (probe.below & ~probe.at).nonzero().squeeze(-1)
            at = rows[only]
            low[at], low_map[at], low_lift[at] = size[only], log_q[only], lift[only]
            has_low.index_fill_(0, at, True)
            only = (probe.at & ~probe.below).nonzero().squeeze(-1)
            at = rows[only]
            high[at], high_map[at], high_lift[at] = size[only], log_q[only], lift[only]
            has_high.index_fill_(0, at, True)
            if probe.series is not None:
                _take_series(family, mode, cand, probe, rows, size, alpha, (log_q, lift),
                             (low, high, has_low, has_high, low_map, low_lift, high_map,
                              high_lift, cache, cached))
            guess[rows], last_s[rows] = probe.guess, probe.s
            last_shift[rows, :columns] = probe.shift
            if last_state is not None and probe.state is not None:
                last_state[rows, :columns] = probe.state
                last_drift[:, rows, :columns] = probe.drift
            tries[rows] += 1
            # Past the candidates (predicted), no boundary there: a wider round goes on from
            # low.
            leave = open_end[rows] & (probe.guess >= width) & (high[rows] >= width) \
                & (low[rows] < high[rows])
            at = rows[leave.nonzero().squeeze(-1)]
            if at.numel():
                high[at] = low[at]
                left.index_fill_(0, at, True)


def _take_series(family: Family | None, mode: str, cand: Candidates, probe: _Probe,
                 rows: Tensor, size: Tensor, alpha: Tensor, maps: tuple[Tensor, Tensor],
                 state: tuple[Tensor, ...]) -> None:
    """Narrow the brackets of ``rows`` by what a probe's series decided of the sizes next to
    its own (`series.series_bounds`), in place on the search's ``state`` (low, high, the
    maps held at the ends, the cache of T_k*). An end moved to the probe's size holds its map;
    a row whose bracket closes at another size gets T_k* solved from the series' multiplier."""
    low, high, has_low, has_high, low_map, low_lift, high_map, high_lift, cache, cached = state
    log_q, lift = maps
    lo, hi = low[rows], high[rows]
    new_lo = torch.maximum(lo, probe.series.low)
    new_hi = torch.minimum(hi, probe.series.high)
    use = (lo < hi) & (new_lo <= new_hi)  # (a bracket the probe itself closed stays so)
    ends = ((use & (new_lo > lo), new_lo, low, has_low, low_map, low_lift),
            (use & (new_hi < hi), new_hi, high, has_high, high_map, high_lift))
    # (each selection one host read: its positions index everything after)
    for moved, end, bound, held, end_map, end_lift in ends:
        moved = moved.nonzero().squeeze(-1)
        if moved.numel() == 0:
            continue
        at, own = rows[moved], end[moved] == size[moved]
        bound[at], held[at] = end[moved], own
        mine = moved[own.nonzero().squeeze(-1)]  # an end moved to the probe's own size
        end_map[rows[mine]], end_lift[rows[mine]] = log_q[mine], lift[mine]
    closed = use & (new_lo == new_hi)
    own = (closed & (new_lo == size)).nonzero().squeeze(-1)
    cache[rows[own]] = log_q[own]
    cached.index_fill_(0, rows[own], True)
    other = (closed & (new_lo != size)).nonzero().squeeze(-1)
    if other.numel() == 0:
        return
    k = new_lo[other]
    shift = torch.gather(probe.series.shift[other], 1,
                         (k - size[other] + SERIES_SIZES).unsqueeze(-1)).squeeze(-1)
    columns = int(k.max()) + 1
    sub = take(cand, rows[other])
    log_p = sub.log_x[:, :min(columns, sub.log_x.shape[-1])]
    warm = None
    if probe.state is not None:
        columns = log_p.shape[-1]
        warm = moved_state(probe.state[other, :columns], probe.drift[:, other, :columns],
                            shift.unsqueeze(-1))
    solved = _solved(family, mode, log_p, k, alpha[rows[other]], _log_deficit(sub, k),
                     probe.s[other] + shift, warm)
    found = _normalized(solved.log_q, support_mask(k, log_p.shape[-1]))
    target = rows[other]
    cache.index_fill_(0, target, -math.inf)
    cache[target, :found.shape[-1]] = found
    cached.index_fill_(0, target, True)


#: Rows probe in two groups when that saves this share of the columns (`_similar_sizes`) and
#: the largest size is above `_SPLIT_FROM` (below it, a probe's launches cost more than its
#: columns).
_SPLIT_SAVING = 0.15
_SPLIT_FROM = 8192


def _similar_sizes(sizes: Tensor) -> list[Tensor]:
    """Positions of ``sizes`` (sorted) in one group, or in two (smaller sizes, larger sizes)
    where that saves `_SPLIT_SAVING` of the columns probed: a probe's work follows its largest
    size."""
    every = [torch.arange(sizes.numel(), device=sizes.device)]
    if int(sizes.max()) <= _SPLIT_FROM or sizes.numel() < 2:
        return every
    order = torch.argsort(sizes)
    values = sizes[order].tolist()
    count, largest = len(values), values[-1]
    cost, cut = min((i * values[i - 1] + (count - i) * largest, i) for i in range(1, count))
    if cost > (1.0 - _SPLIT_SAVING) * count * largest:
        return every
    # (`take` wants sorted positions)
    return [torch.sort(order[:cut]).values, torch.sort(order[cut:]).values]


def _search(family: Family | None, mode: str, cand: Candidates, alpha: Tensor, lam: Tensor,
            low: Tensor, high: Tensor, generator: BregmanGenerator | None = None,
            raised: Tensor | None = None, open_end: Tensor | None = None
            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Smallest k in [low, high] with G(k) <= lambda, where G(high) <= lambda is taken as given.

    Rows starting at low = 1 (and not ``raised`` by the floor): one window probe decides
    G(1 .. PROBE_WINDOW) at once (`_first_window`). Then multiplier probes (`_guided`: one map
    per probe, a few probes), or for user generators galloping and bisection on exact gaps
    (`_bisect`). ``open_end``: rows whose high is the end of the candidates, not a real
    boundary (k* may lie past it).

    Returns (k*, or for the rows that stopped (``left``) the certified lower bound, log T_k*
    for the rows the search resolved ([n, W]), which rows those are, ``left``).
    """
    low, high = low.clone(), high.clone()
    n, width = cand.log_x.shape
    raised = torch.zeros_like(low, dtype=torch.bool) if raised is None else raised
    open_end = torch.zeros_like(raised) if open_end is None else open_end
    cache = torch.full((n, width), -math.inf, dtype=cand.log_x.dtype, device=low.device)
    cached = torch.zeros_like(raised)
    first_round = (low == 1) & ~raised  # later rounds know k* >= low: no window probe
    _first_window(family, mode, cand, alpha, lam, low, high, cache, cached, first_round,
                  generator)
    if generator is not None:
        _bisect(family, mode, cand, alpha, lam, low, high, cache, cached, first_round.clone(),
                generator)
        return low, cache, cached, torch.zeros_like(raised)
    left = _guided(family, mode, cand, alpha, lam, low, high, cache, cached, open_end)
    return low, cache, cached, left


#: Sizes the floor of the gaps is evaluated at, about (`_floor_sizes`).
FLOOR_SIZES = 2048


def _floor_sizes(mode: str, cand: Candidates, alpha: Tensor, lam: Tensor) -> Tensor:
    """A lower bound on k* per row, from a floor of the cost gaps: G(k) >= floor(k) > lambda,
    hence k* > k (G is nonincreasing in k). Returns 1 + the last sampled k in 1 .. W - 1 whose
    floor is above lambda, or 1; W where that is k = W - 1 (k* >= W: the row needs a wider
    round, and no probe of this one).
    Exact, not a heuristic: where k* is large (tiny lambda, primal alpha near 0, dual alpha
    near 1) it starts the search next to k* and skips the probes of the rounds below it.

    The floor is the last term of G(k) (`gaps.log_entry_term`; the others are >= 0) at a lower
    bound q_lo of
    q' = T_(k+1)(p)_(k+1), with p = p_(k+1), R = R_(k+1), m = k + 1:

    * primal, d(0, q') = q'^alpha / alpha; q' >= p (T adds mass, eq. (4)), and for alpha > 1
      q'^b = p^b + c^b with c >= R/m (b >= 1) or (b R/m)^(1/b) (b < 1), the bracket of
      `primal.newton_log_renorm`;
    * dual, q'^(alpha-1) [(alpha-1)^2 (q' - p) + p] / (alpha (alpha-1)), increasing in q' >= p;
      by eq. (5), q'^(alpha-2) (q' - p) = nu with nu >= (R/m)^(alpha-1) for alpha >= 2 (so
      q' >= R/m) and nu >= R/m for alpha < 2 (so q' >= p + (R/m) p^(2-alpha)) (Theorem A.1).
    """
    width = cand.log_x.shape[-1]
    if width == 1:
        return torch.ones(alpha.shape[0], dtype=torch.long, device=alpha.device)
    a = alpha.unsqueeze(-1)
    b = a - 1.0
    log_lam = torch.log(lam).unsqueeze(-1)

    def bound(sizes: Tensor) -> Tensor:  # 1 + the last of ``sizes`` ([n, J]) above lambda
        log_p = cand.log_x.gather(1, sizes)  # p_(k+1)
        log_share = torch.log(cand.deficit.gather(1, sizes)) \
            - torch.log1p(sizes.to(log_p.dtype))  # R/m
        if mode == "primal":
            level = torch.where(b >= 1.0, log_share,
                                (torch.log(b.clamp_min(1e-300)) + log_share) / b.clamp_min(1e-300))
            log_q = torch.where(b > 0, torch.maximum(log_p, level), log_p)
        else:
            log_q = torch.where(a >= 2.0, torch.maximum(log_p, log_share),
                                torch.logaddexp(log_p, log_share + (1.0 - b) * log_p))
        above = log_entry_term(mode, log_p, log_q, a) > log_lam  # (zero entries: NaN, -inf)
        # G(k) > lambda at a size k means k* > k: G is nonincreasing in k (Theorem 3.3).
        return torch.where(above, sizes + 1, 1).amax(-1)

    # About `FLOOR_SIZES` evenly spaced sizes k in 1 .. W-1 and W-1, then every size of the
    # stride after the last one above lambda: the bound from every size, at a small part of
    # its cost (next to alpha = 1 the search starts there, next to k*).
    n = alpha.shape[0]
    stride = max(1, (width - 1) // FLOOR_SIZES)
    sizes = torch.arange(1, width, stride, device=alpha.device)
    if int(sizes[-1]) != width - 1:
        sizes = torch.cat([sizes, sizes.new_tensor([width - 1])])
    found = bound(sizes.expand(n, -1))
    if stride == 1:
        return found
    after = (found.unsqueeze(-1) + torch.arange(stride, device=alpha.device)).clamp_max(width - 1)
    return torch.maximum(found, bound(after))


def _support_sizes(plan: ExactPlan, cand: Candidates, rows: Tensor, low: Tensor) -> Decoded:
    """The support search of a candidate round for the plan's rows ``rows``: the same result
    as the fixed-shape step's (`window.Decoded`): the support size per row, log T_k where the
    search already computed it (-inf rows otherwise, and for fixed sizes), and which rows are
    not certified with these candidates (they need a wider round).

    ``low`` is a known lower bound on k* per row (from earlier rounds). The gap formula is the
    family's (closed forms over all sizes at once, or probes of the exact maps).
    """
    alpha, lam = plan.alpha[rows], plan.lam[rows]
    fixed, cap = plan.fixed_k[rows], plan.k_max[rows]
    width = cand.x.shape[-1]
    values = {name: value[rows] for name, value in plan.values.items()}
    values["size"] = torch.where(cap > 0, cap, UNBOUNDED)
    least, limit = support_range(cand, values)
    limit = limit.clamp_min(1)
    is_fixed = fixed > 0
    k = torch.where(is_fixed, torch.minimum(fixed, limit), 0)
    done = is_fixed & (k <= width)
    cache = torch.empty(k.shape[0], 0, dtype=cand.log_x.dtype, device=k.device)
    cached = torch.zeros_like(done)
    adaptive = (~is_fixed).nonzero().squeeze(-1)
    if adaptive.numel():
        hi = limit[adaptive]
        bounded = hi <= width  # the last size is a real boundary
        upper = torch.minimum(hi, torch.full_like(hi, width))
        lo = low[adaptive] if least is None else torch.maximum(low[adaptive], least[adaptive])
        lo = torch.minimum(lo, upper)
        sub = take(cand, adaptive)
        a, lm = alpha[adaptive], lam[adaptive]
        raised = torch.zeros_like(bounded)
        left = torch.zeros_like(bounded)  # rows the search left for a wider round
        closed = plan.family in CLOSED_GAP_FAMILIES  # every gap of the round at once
        if plan.generator is None and not closed:
            floor = _floor_sizes(plan.mode, sub, a, lm)
            floor = torch.minimum(floor, upper)
            raised = floor > lo
            lo = torch.maximum(lo, floor)
        if closed:  # the window's search over this round's candidates
            found = closed_sizes(plan.family, sub, lm, upper, width, lo)
        else:
            found, maps, have, left = _search(plan.family, plan.mode, sub, a, lm, lo, upper,
                                              plan.generator, raised, ~bounded)
            cache = torch.full((k.shape[0], maps.shape[-1]), -math.inf, dtype=maps.dtype,
                               device=maps.device)
            cache[adaptive] = maps
            cached[adaptive] = have
        k[adaptive] = found
        # Certified unless the search ran into the end of the candidate set without a boundary.
        done[adaptive] = ((found < width) | bounded) & ~left
    return Decoded(k, cache, ~done, computed=cached)


# ----------------------------------------------------------------------------- driver


def _final_maps(plan: ExactPlan, cand: Candidates, k: Tensor, alpha: Tensor, cache: Tensor,
                cached: Tensor) -> Tensor:
    """log T_k for every row: from the search's cache where it has it, else renormalized now."""
    todo = (~cached).nonzero().squeeze(-1)
    if todo.numel() == 0:
        return cache[:, : int(k.max())]
    fresh = _renorm_at(plan.family, plan.mode, take(cand, todo), k[todo], alpha[todo],
                       plan.generator)
    if todo.numel() == k.shape[0]:
        return fresh
    width = max(fresh.shape[-1], int(k.max()))
    out = torch.nn.functional.pad(cache[:, :width], (0, max(0, width - cache.shape[-1])),
                                  value=-math.inf)
    out[todo] = torch.nn.functional.pad(fresh, (0, width - fresh.shape[-1]), value=-math.inf)
    return out


class _Sink(NamedTuple):
    """Where finished rows go: ``out`` [N, V], ``k_out`` [N], ``done`` [N] (set for every
    finished row), how log q becomes the written values (`write.output_values`: the scores'
    dtype, logits scaled by the temperature) and ``clear`` (the value a row is reset to just
    before its support is written)."""

    out: Tensor
    k_out: Tensor
    done: Tensor | None
    logits: bool
    temperature: Tensor | None
    clear: float


def _decode_rows(scores: Tensor, plan: ExactPlan, sink: _Sink, pending: Tensor, low: Tensor,
                 scale: Tensor | None) -> None:
    """Decode the rows ``pending`` of ``scores`` ([N, V]) and write each round's supports into
    ``out`` and ``k_out`` as soon as they are known; rows that are not distributions (no
    positive mass, NaN or inf) are left alone. ``low`` ([N]) holds known lower bounds on k*.
    A round runs its rows in pieces small enough for its width to stay within `MEMORY_BUDGET`
    (only the whole-row rounds of flat rows are split).
    """
    vocab = scores.shape[-1]
    width = min(max(INITIAL_CANDIDATES, 2), vocab)
    widest = _widest(plan, pending, vocab)
    while pending.numel():
        if width < vocab:
            # Rows that need more candidates than this round has (a fixed k larger than its
            # width, or a k* known to be at least its width) wait for a wider round.
            ready = (plan.fixed_k[pending] <= width) & (low[pending] < width)
            now, later = pending[ready], pending[~ready]
        else:
            now, later = pending, pending[:0]
        piece = max(1, MEMORY_BUDGET // max(1, width * _BYTES_PER_ENTRY))
        for start in range(0, now.numel(), piece):
            again = _round(scores, plan, now[start:start + piece], width, low, sink, scale)
            later = torch.cat([later, again])
        pending = torch.sort(later).values
        grown = width * _GROWTH
        if grown * _FULL_SORT_FRACTION >= vocab:  # a top-k that large costs about a full sort
            grown = vocab
        # No wider than the rows' sizes need (a k_max, a fixed k: every row then finishes), and
        # wider than this round (a row whose k* is known to be its k_max, this round's width).
        width = min(vocab, max(min(grown, widest), width + 1))


def _widest(plan: ExactPlan, rows: Tensor, vocab: int) -> int:
    """The most candidates any of ``rows`` needs: its fixed k, else its k_max, else the whole
    row (one host read, once per call: a server's `--max-support` caps every row)."""
    if not rows.numel():
        return vocab
    fixed, cap = plan.fixed_k[rows], plan.k_max[rows]
    need = torch.where(fixed > 0, fixed, torch.where(cap > 0, cap, vocab))
    return min(int(need.max()), vocab)


def _round(scores: Tensor, plan: ExactPlan, now: Tensor, width: int, low: Tensor, sink: _Sink,
           scale: Tensor | None) -> Tensor:
    """One candidate round for the rows ``now``; returns the rows that need a wider one."""
    n, vocab = scores.shape
    every = now.numel() == n
    rows_now = scores if every else scores.index_select(0, now)  # no copy in the common case
    rows_scale = None if scale is None else (scale if every else scale.index_select(0, now))
    cand = candidates(rows_now, width, logits=sink.logits, scale=rows_scale)
    del rows_now
    if not bool(cand.valid.all()):
        good = cand.valid.nonzero().squeeze(-1)
        now, cand = now[good], take(cand, good)
    if now.numel() == 0:
        return now
    k, cache, uncertain, _, cached = _support_sizes(plan, cand, now, low[now])
    done = ~uncertain
    if width >= vocab:
        done = torch.ones_like(done)
    fin = done.nonzero().squeeze(-1)
    if fin.numel() == now.numel():  # every row certified: no copies of the candidates
        log_q = _final_maps(plan, cand, k, plan.alpha[now], cache, cached)
        _finish(sink, now, cand.index[:, : log_q.shape[-1]], log_q, k)
    elif fin.numel():
        rows = now[fin]
        sub = take(cand, fin)
        log_q = _final_maps(plan, sub, k[fin], plan.alpha[rows], cache[fin], cached[fin])
        _finish(sink, rows, sub.index[:, : log_q.shape[-1]], log_q, k[fin])
    again = (~done).nonzero().squeeze(-1)
    # G(k) > lambda for every k < width, or below the bound where the search left the round
    low[now[again]] = torch.minimum(k[again], torch.full_like(k[again], width))
    return now[again]


def _finish(sink: _Sink, rows: Tensor, index: Tensor, log_q: Tensor, k: Tensor) -> None:
    """Write finished rows (`write.write_support`); a NaN is an error, never an output."""
    if bool(torch.isnan(log_q).any()):
        raise FloatingPointError(
            f"the exact path produced NaN for {int(torch.isnan(log_q).any(-1).sum())} row(s)")
    temperature = None if sink.temperature is None else sink.temperature[rows]
    values = output_values(log_q, sink.logits, sink.out.dtype, temperature)
    write_support(sink.out, index, values, sink.clear, rows=rows)
    sink.k_out[rows] = k
    if sink.done is not None:
        sink.done[rows] = True


def decode_exact(out: Tensor, k_out: Tensor, scores: Tensor, plan: ExactPlan, *,
                 logits: bool, scale: Tensor | None = None, rows: Tensor | None = None,
                 low: Tensor | None = None, done: Tensor | None = None) -> None:
    """Decode the rows of ``scores`` ([n, V] logits, or probabilities with entries >= 0) with
    the exact path and write the supports into ``out`` ([n, V]: each finished row is reset to
    -inf (logits) or 0 before its support is written; a row the path never finishes, when it
    raises, keeps what it had) and the sizes into ``k_out``; rows that are not distributions
    are left as ``out`` has them. ``out`` may be ``scores`` itself: a row is read before it is
    written. ``scale`` ([n]): per-row inverse temperatures (logits; the values written are then
    T log q, `write.output_values`). ``done`` ([n] bool): set for every row finished.

    ``rows`` (sorted positions, default every row) limits the work to those rows, and ``low``
    ([n]) gives known lower bounds on their k* (default 1): a row whose k* is known to be at
    least the first round's width starts with a wider round. ``plan`` holds the parameters of
    all n rows.

    Memory: rounds over whole rows run in row pieces of at most `MEMORY_BUDGET` bytes, and
    every finished row is written out at once (no float64 [n, V] array is ever held).
    """
    n = scores.shape[0]
    pending = torch.arange(n, device=scores.device) if rows is None else rows
    bounds = torch.ones(n, dtype=torch.long, device=scores.device) if low is None \
        else low.clone()
    temperature = None if scale is None else torch.reciprocal(scale)
    sink = _Sink(out, k_out, done, logits, temperature, -math.inf if logits else 0.0)
    _decode_rows(scores, plan, sink, pending, bounds, scale)
