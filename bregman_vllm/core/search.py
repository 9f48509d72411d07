"""The search: the support size k* of the rows the fixed window cannot decide, and their maps.

Rows reach it when the window (`window`, or the kernels') could not certify them (k* past the
window, a near-tie within rounding, a Newton solve that had not converged), for the families
without a window formula (`families`), and for user generators; `step.decode_exact` feeds it
rounds of candidates (the W largest entries of each row, sorted, with the deficits R_k of every
size; wider rounds for rows whose k* passes them, probed from where the last round's pointed)
and writes what it finds. It is the reference the window and the kernels are tested against.
Paper: arXiv 2505.19371; cost(k) (eq. (6)) is discretely convex (Theorem 3.3), so with the
gaps G(k) = cost(k) - cost(k + 1) + lambda (`gaps`) k* = min {k : G(k) <= lambda}, ties to the
smaller support (Algorithm 2).

Pipeline of one round (`support_sizes`), vectorized over rows (loops run over probes):

1. A bracket lo <= k* <= hi: lo from the window (every size it saw had G > lambda) and the
   floor of the gaps, hi = min(k_max, the positive entries).
2. Probes on the multiplier (`_probe`). The map T_k of eq. (4) or (5) has one scalar s_k
   (primal: the water level, or log of the top entry's lift below alpha = 1; dual: log nu),
   decreasing in k, and at any trial s every entry j has a value q_j(s), hence the term
   w_j(s) = w(p_j, s) of the gaps (`gaps.log_entry_term`), increasing in s and in p_j. Weak
   duality gives G(j - 1) >= w_j(s_j) and G(j) <= w_(j+1)(s_j). So one pass over the
   candidates at s certifies, with n the sizes whose maps need a larger scalar (the mass
   their entries get at s is short of R_k: s < s_k) and c the entries with w_j(s) > lambda,

       min(n, c) <= k* <= max(n + 1, c)

   (a size j <= n with j <= c has G(j - 1) >= w_j(s) > lambda; a size j > n with j >= c has
   G(j) <= w_(j+1)(s) <= lambda). The next s is a safeguarded Newton step on
   D(s) = log w_(m+1)(s) - log lambda, m = n + 1 the size whose scalar s is, inside the bracket
   of s that the signs of D keep; its slope counts how m moves with s. A few probes bring the
   bracket of k* down to one or two sizes, none needing a map.
3. The last sizes by exact gaps (`_settle`): where a few are left, by the gaps' series about
   the last probe's s (`_series`, `gaps.series_gap`: no map solved); the others from the maps
   T_m and T_(m+1) (`maps.solved`, warm-started at the last probe's scalar), all at once where
   at most `SETTLE` sizes are left, else by Algorithm 2's binary search. User generators (no
   multiplier) take this binary search from the start, on their generic maps. The families
   with closed-form gaps (`families.CLOSED_GAP_FAMILIES`) read every gap of a round at once
   (`window.closed_sizes`).
4. log T_k* kept from the last exact gap where it has it (else `step` solves it, `maps`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .candidates import UNBOUNDED, Candidates, take
from .dual import INNER_STEPS, dual_range, dual_values
from .families import CLOSED_GAP_FAMILIES, QUADRATIC_DUAL_FAMILIES, Family
from .gaps import consecutive_gaps, log_entry_term, series_gap
from .generators import BregmanGenerator
from .maps import log_deficit
from .plan import ExactPlan
from .primal import level_range, normalized, primal_values, support_mask, top_range, top_values
from .roots import Multiplier
from .window import closed_sizes, support_range

Tensor = torch.Tensor

#: Probes on the multiplier before the search leaves the rest to exact gaps, and the dual's
#: Newton steps of its inner equations per probe: while steering (from the shaped start), then.
PROBES = 40
STEER_STEPS, PROBE_STEPS = 1, 2
#: |D| at which the probes' Newton steps aim, on alternating sides of the root (`_probe`), and
#: below which the dual's probes solve their inner equations (above it, for at most `STEERING`
#: probes, they only steer).
STRADDLE = 1e-6
STEER = 0.1
STEERING = 3
#: Sizes the exact gaps decide at once (`_settle`); a wider bracket is halved first, and
#: brackets of different widths are, past `SHORT_MAPS` candidates.
SETTLE, SHORT_MAPS = 4, 512
#: Distance of log G from log lambda, per unit of |log lambda| + 1, within which the series gap
#: (`_series`) decides nothing (25x its largest error measured within `gaps.SERIES_REACH`), and
#: the sizes it is tried from (below, adjacent sizes' scalars are rarely that close).
SERIES_TOLERANCE = 1e-8
SERIES_FROM = 4096
#: Rounding bound of a sum of n positive float64 terms, per term (recursive summation).
SUM_ROUNDING = 2.3e-16
#: Relative rounding bound of log w against log lambda, per unit of |log lambda| + 1.
TERM_ROUNDING = 1e-12


# ----------------------------------------------------------------------------- 3. probes


class _Rows(NamedTuple):
    """The search's view of its candidates: log p (-inf for zeros), log p with 0 there, which
    are positive, p, R_k, alpha as a column, log lambda."""

    log_p: Tensor
    lp: Tensor
    finite: Tensor
    p: Tensor
    deficit: Tensor
    alpha: Tensor
    log_lam: Tensor

    @classmethod
    def of(cls, cand: Candidates, alpha: Tensor, lam: Tensor) -> _Rows:
        finite = torch.isfinite(cand.log_x)
        return cls(cand.log_x, torch.where(finite, cand.log_x, 0.0), finite, cand.x,
                   cand.deficit, alpha.to(cand.x.dtype).unsqueeze(-1), torch.log(lam))

    def cut(self, rows: Tensor | slice, columns: int | None = None) -> _Rows:  # (first columns)
        return _Rows(*(t[rows, :columns] if t.dim() == 2 and t.shape[-1] > 1 else t[rows]
                       for t in self))


def _values(kind: int, family: Family | None, rows: _Rows, s: Tensor,
            start: Tensor | None, steps: int) -> tuple[Multiplier, Tensor]:
    """Every candidate's value at the scalar s (`roots.Multiplier`) and which rows have them
    exact: the dual's inner roots get ``steps`` Newton steps from ``start`` (None or NaN: from
    the shaped approximation, `dual._shaped_inner`)."""
    beta = rows.alpha - 1.0
    if kind:
        values = primal_values(rows.lp, rows.finite, beta, s, kind == 1)
        return values, torch.ones_like(s, dtype=torch.bool)
    closed = family if family in QUADRATIC_DUAL_FAMILIES else None
    return dual_values(rows.lp, rows.finite, beta, s, start, closed, steps)


def _ends(kind: int, rows: _Rows, size: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The scalar of ``size``: a lower bound (from its deficit) and a start near it; and an
    upper bound of every size's scalar (size 1's)."""
    log_r = log_deficit(rows, size)  # (reads only the deficits, which _Rows has)
    beta = rows.alpha.squeeze(-1) - 1.0
    if kind == 1:
        return level_range(rows.lp[:, 0], beta, log_r, size)
    if kind == 2:
        return top_range(rows.lp[:, 0], log_r)
    return dual_range(rows.lp, rows.finite, rows.alpha - 1.0, log_r, size)


class _Probe(NamedTuple):
    """What one probe at s certifies and where it points: the bracket of k* (none where not
    exact), the size m whose scalar s is (capped), D(s) and the Newton step on it."""

    low: Tensor
    high: Tensor
    size: Tensor
    residual: Tensor
    step: Tensor
    values: Multiplier
    exact: Tensor


def _probe(mode: str, kind: int, family: Family | None, rows: _Rows, s: Tensor,
           start: Tensor | None, steps: int = PROBE_STEPS) -> _Probe:
    """One probe at s (module docstring, step 2): every candidate's value, the sizes whose
    scalars lie above s (n) and the entries whose terms exceed lambda (c), each counted only
    where rounding cannot have decided it."""
    width = rows.p.shape[-1]
    values, exact = _values(kind, family, rows, s, start, steps)
    q = torch.exp(values.log_q)
    # sum_(i<=k) q_i - p_i against R_k: both sums of positive terms (`primal._added`).
    added = torch.where(rows.finite, rows.p * torch.expm1(values.lift), q).cumsum(-1)
    margin = rows.deficit * (SUM_ROUNDING * width + 1e-15)
    above_s = (added < rows.deficit - margin).sum(-1)  # sizes 1 .. n: s_k > s, surely
    maybe = (added < rows.deficit + margin).sum(-1)  # sizes past it: s_k <= s, surely
    log_w = log_entry_term(mode, rows.log_p, values.log_q, rows.alpha)
    tolerance = (TERM_ROUNDING * (1.0 + rows.log_lam.abs())).unsqueeze(-1)
    exceeds = (log_w > rows.log_lam.unsqueeze(-1) + tolerance).sum(-1)
    may_exceed = (log_w > rows.log_lam.unsqueeze(-1) - tolerance).sum(-1)
    low = torch.where(exact, torch.minimum(above_s, exceeds), 0)
    # An upper bound needs the size past it and the entry after it among the candidates.
    known = (maybe < width) & (may_exceed < width) & exact
    high = torch.where(known, torch.maximum(maybe + 1, may_exceed), UNBOUNDED)
    # D(s) at the size m whose scalar s is, and its slope: at fixed m, d log w / d log q times
    # the rate; m moves by -sum_(i<=m) q_i rate_i / q_(m+1) per unit of s (where the mass
    # added at s crosses R_m).
    size = (added < rows.deficit).sum(-1) + 1
    m = size.clamp(1, width - 1).unsqueeze(-1)
    residual = log_w.gather(1, m).squeeze(-1) - rows.log_lam
    at_m = [t.gather(1, m).squeeze(-1) for t in (values.lift, values.rate, q, rows.finite)]
    # d log w / d log q at fixed p: alpha (primal, zero entries); beta + beta^2 / (beta^2 +
    # (1 - beta^2) p / q) (dual, from w = q^beta [beta^2 (q - p) + p] / (alpha beta)).
    a, b, ratio = rows.alpha.squeeze(-1), rows.alpha.squeeze(-1) - 1.0, torch.exp(-at_m[0])
    dual = (mode == "dual") & at_m[3]
    slope_q = torch.where(dual, b + b * b / (b * b + (1.0 - b * b) * ratio), a) * at_m[1]
    inside = torch.arange(width, device=s.device) < m
    moves = -torch.where(inside, q * values.rate, 0.0).sum(-1) / at_m[2]
    # (d log w_j / d j over a stencil of about m / 64 entries: adjacent entries of long
    # supports differ by noise)
    reach = (m // 64).clamp_min(1)
    ahead, behind = (m + reach).clamp_max(width - 1), (m - reach).clamp_min(0)
    per_entry = (log_w.gather(1, ahead) - log_w.gather(1, behind)) / (ahead - behind)
    slope = slope_q + per_entry.squeeze(-1) * moves
    # Newton aims just across the root (D = -+`STRADDLE`): near it the probes alternate sides
    # by a margin far above the counts' rounding, each certifying its side of the bracket.
    target = torch.where(residual > 0, -STRADDLE, STRADDLE)
    # (no step from a size past the candidates: D is not known there)
    step = torch.where(size < width, (target - residual) / slope, math.nan)
    return _Probe(low, high, m.squeeze(-1), residual, step, values, exact)


def _warm(kind: int, values: Multiplier, old: Tensor, new: Tensor) -> Tensor | None:
    """The dual's inner unknowns at a new s, to first order from the last probe's (d u / d s
    is the rate); None where the step is too long for it (the shaped start)."""
    if kind or values.state is None:
        return None
    u = torch.exp(values.state)
    moved = u + values.rate * (new - old).unsqueeze(-1)
    return torch.where(moved > 0.5 * u, torch.log(moved.clamp_min(1e-300)), math.nan)


class _Walk(NamedTuple):
    """The probes' state per row still searching: its index, s, the bracket of s (D < 0 below,
    D > 0 above) with D there (NaN: not probed), the last probe's side, stale probes in a row."""

    index: Tensor
    s: Tensor
    s_low: Tensor
    s_high: Tensor
    d_low: Tensor
    d_high: Tensor
    above: Tensor
    stale: Tensor

    def take(self, keep: Tensor) -> _Walk:
        return _Walk(*(t[keep] for t in self))


def _search(mode: str, kind: int, family: Family | None, rows: _Rows, low: Tensor,
            high: Tensor, aim: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor,
                                                 Tensor]:
    """Probes on the multiplier (module docstring, step 2) for rows of one kind, from ``aim``
    where a narrower round's probes pointed (else near the scalar of ``low``), until their
    bracket [low, high] of k* is one size wide, or at most `SETTLE` wide and no longer
    narrowing (or three probes in a row: ties), or known to pass the candidates, or pointed
    past them. Returns (low, high, the last probe's scalar and the dual's inner unknowns there
    (warm starts), which rows were pointed past the candidates: a wider round's, and the
    scalar their last Newton step aimed at, NaN if none)."""
    n, width = rows.p.shape
    low, high = low.clone(), high.clone()
    top_size = torch.minimum(high, torch.full_like(high, width)).sub(1).clamp_min(1)
    s_low, _, s_high = _ends(kind, rows, top_size)
    # The first probe near the scalar of the lowest size k* may have (the extreme rows' k* is
    # often next to the floor of the gaps), or where a narrower round's pointed (one read).
    s = aim if not bool(aim.isnan().any()) else torch.where(
        aim.isnan(), _ends(kind, rows, torch.minimum(low.clamp_min(1), top_size))[1], aim)
    s = torch.minimum(torch.maximum(s, s_low), s_high)
    last = s.clone()
    state = None if kind else torch.full_like(rows.p, math.nan)
    nan = torch.full_like(s, math.nan)
    ahead = nan.clone()
    walk = _Walk(torch.arange(n, device=low.device), s, s_low, s_high, nan, nan,
                 torch.zeros_like(low, dtype=torch.bool), torch.zeros_like(low))
    sub, start, steps, steering = rows, None, STEER_STEPS, True  # (`_values`)
    full = columns = width
    wider = torch.zeros_like(low, dtype=torch.bool)
    for probe in range(PROBES):
        found = _probe(mode, kind, family, sub, walk.s, start, steps)
        i, s = walk.index, walk.s
        # (the counts bound k* without the cap; a capped row's k* is min(k*, cap), Theorem 3.3)
        hi = torch.minimum(high[i], found.high)
        lo = torch.minimum(torch.maximum(low[i], found.low), hi)
        narrowed = (lo > low[i]) | (hi < high[i])
        low[i], high[i], last[i] = lo, hi, s
        if state is not None and found.values.state is not None:
            state[i, : sub.p.shape[-1]] = found.values.state
        # D increases with s; only exact values move the bracket of s (steering ones may put
        # D's root elsewhere). (Illinois: an end kept twice in a row counts half, so regula
        # falsi cannot stall.)
        above, below = (found.residual > 0) & found.exact, (found.residual <= 0) & found.exact
        d_low = torch.where(above & walk.above, 0.5 * walk.d_low, walk.d_low)
        d_high = torch.where(below & ~walk.above, 0.5 * walk.d_high, walk.d_high)
        s_high, d_high = torch.where(above, s, walk.s_high), torch.where(above, found.residual,
                                                                         d_high)
        s_low, d_low = torch.where(below, s, walk.s_low), torch.where(below, found.residual, d_low)
        above = torch.where(found.exact, above, walk.above)
        proposal = s + found.step
        inside = (proposal > s_low) & (proposal < s_high)  # (False for NaN and +-inf too)
        # Else regula falsi between the bracket's ends (bisection while one has no D).
        share = torch.nan_to_num((d_low / (d_low - d_high)).clamp(0.05, 0.95), nan=0.5)
        stale = torch.where(narrowed | ~found.exact, 0, walk.stale + 1)
        # (a steering probe with no step in the bracket probes again where it is, exactly)
        fallback = torch.where(found.exact, s_low + share * (s_high - s_low), s)
        walk = _Walk(i, torch.where(inside, proposal, fallback), s_low, s_high, d_low, d_high,
                     above, stale)
        # (an exact probe whose D points past the candidates, the bracket past them too: at
        # their end, or its Newton step below every candidate size's scalar: a wider round's)
        past = found.exact & (found.residual > 0) & (hi > width) & (
            ((found.size >= width - 1) & (columns == full))
            | ((proposal < s_low) & d_low.isnan() & (not steering)))
        wider[i], ahead[i] = past, torch.where(past, proposal, math.nan)
        go = (hi - lo > 1) & (narrowed | ((hi - lo > SETTLE) & (stale < 3))) & ~past \
            & (s_high - s_low > 1e-14 * (1.0 + s.abs())) & ((hi <= width) | (lo < width - 1))
        keep = go.nonzero().squeeze(-1)
        if keep.numel() == 0:
            break
        start = _warm(kind, found.values, s, walk.s)
        # Columns past every bracket's end play no part in the next probes (one host read);
        # the first exact probes take those up to twice the sizes steering reached, and the
        # whole bracket again where they run into the end (a probe is certified on any prefix).
        widest, far, reached = torch.stack([
            hi[keep].max().to(s.dtype), found.residual[keep].abs().max(),
            found.size[keep].max().to(s.dtype)]).tolist()
        need = min(full, int(widest) + 2)
        solve = far < STEER or probe + 1 >= STEERING  # (steering ends near the root, or soon)
        if steering and solve:  # (its first probe solves until the inner roots are exact)
            columns, steps, steering = min(need, 2 * int(reached) + 64), INNER_STEPS, False
        elif not steering:
            columns = need if reached + 1 >= columns else min(columns, need)
            steps = PROBE_STEPS
        if keep.numel() < go.numel() or columns != sub.p.shape[-1]:
            walk = walk.take(keep)
            sub = rows.cut(walk.index, columns)
            if start is not None:  # (NaN: no warm start, past the last probe's columns)
                start = torch.nn.functional.pad(start[keep, :columns],
                                                (0, columns - min(columns, start.shape[-1])),
                                                value=math.nan)
    return low, high, last, state, wider, ahead


# ----------------------------------------------------------------------------- 4. exact gaps


def _series(kind: int, family: Family | None, mode: str, cand: Candidates, alpha: Tensor,
            lam: Tensor, low: Tensor, high: Tensor, s: Tensor, state: Tensor | None
            ) -> tuple[Tensor, Tensor, Tensor]:
    """k* of rows of one kind of scalar whose bracket [low, high] is a few sizes by the gaps'
    series about the last probe's s (`gaps.series_gap`; the values there exact within
    `PROBE_STEPS` inner steps), where it holds and every log G in the bracket is farther than
    `SERIES_TOLERANCE` from log lambda. Returns (k, log T_k [n, C], which rows it decided)."""
    count = int((high - low).max())
    columns = min(cand.log_x.shape[-1], int(low.max()) + count + 1)
    rows = _Rows.of(cand, alpha, lam).cut(slice(None), columns)
    if kind == 2:  # (in delta itself, as the maps' solvers take it)
        values, exact = top_values(rows.lp, rows.finite, rows.alpha - 1.0, s), s.isfinite()
    else:
        values, exact = _values(kind, family, rows, s,
                                None if state is None else state[:, :columns], PROBE_STEPS)
    sizes = (low.unsqueeze(-1) + torch.arange(count + 1, device=low.device)).clamp_max(columns)
    log_gap, holds, map_of = series_gap(mode, rows.log_p, values, rows.alpha - 1.0, sizes,
                                        log_deficit(cand, sizes))
    lam_col = rows.log_lam.unsqueeze(-1)
    inside = sizes[:, :-1] < high.unsqueeze(-1)
    far = ((log_gap - lam_col).abs() > SERIES_TOLERANCE * (1.0 + lam_col.abs())) & holds
    above = ((log_gap > lam_col) & inside).sum(-1)  # (G is nonincreasing)
    return low + above, normalized(map_of(above), support_mask(low + above, columns)), \
        exact & (far | ~inside).all(-1) & s.isfinite()


def _settle(family: Family | None, mode: str, cand: Candidates, alpha: Tensor, lam: Tensor,
            low: Tensor, high: Tensor, generator: BregmanGenerator | None,
            s: Tensor | None, state: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The smallest k in [low, high] with G(k) <= lambda (or high) by exact gaps: rows with a
    few sizes left by the series (`_series`) first; every size at once where every row has the
    same few left (at most `SETTLE`; or a few, `SHORT_MAPS`); else Algorithm 2's binary search,
    one gap per step. ``high``
    must be within the candidates. Returns (k, log T_k where a gap's maps held it ([n, W],
    -inf rows otherwise), which rows have it)."""
    low, high = low.clone(), high.clone()
    n, width = cand.log_x.shape
    cache = torch.full((n, width), -math.inf, dtype=cand.log_x.dtype, device=low.device)
    cached = torch.zeros_like(low, dtype=torch.bool)
    log_lam = torch.log(lam)
    few = (high > low) & (high - low <= SETTLE) & (low >= SERIES_FROM) & (s is not None)
    for kind in (0,) if mode == "dual" else (1, 2):  # (the search's common end: a few left)
        rows = (few & ((alpha > 1.0) == (kind < 2))).nonzero().squeeze(-1)
        if rows.numel():
            k, maps, decided = _series(kind, family, mode, take(cand, rows), alpha[rows],
                                       lam[rows], low[rows], high[rows], s[rows],
                                       None if state is None else state[rows])
            rows, k, maps = rows[decided], k[decided], maps[decided]
            low[rows], high[rows], cached[rows] = k, k, True
            cache[rows, : maps.shape[-1]] = maps
    while True:
        active = (low < high).nonzero().squeeze(-1)
        if active.numel() == 0:
            return low, cache, cached & (low == high)
        lo, hi = low[active], high[active]
        span = hi - lo
        widest = int(span.max())  # (all at once: the same few left, or a few on short maps)
        every = widest <= SETTLE and (int(span.min()) == widest or width <= SHORT_MAPS)
        count, first = (widest, lo) if every else (1, lo + span // 2)
        first = torch.minimum(first, hi - 1).clamp_max(width - count)  # T_(first + count) exists
        log_gap, maps = consecutive_gaps(
            family, mode, take(cand, active), first, count, alpha[active], lam[active],
            generator, None if s is None else s[active], None if state is None else state[active])
        sizes = first.unsqueeze(-1) + torch.arange(count, device=lo.device)
        inside = (sizes >= lo.unsqueeze(-1)) & (sizes < hi.unsqueeze(-1))
        exceeds = log_gap > log_lam[active].unsqueeze(-1)
        # G is nonincreasing: sizes that exceed raise low, the first that does not lowers high.
        new_lo = torch.maximum(lo, torch.where(exceeds & inside, sizes + 1, 0).amax(-1))
        new_hi = torch.minimum(hi, torch.where(~exceeds & inside, sizes, hi.unsqueeze(-1))
                               .amin(-1))
        low[active], high[active] = new_lo, new_hi
        offset = new_lo - first
        hit = (new_lo == new_hi) & (offset >= 0) & (offset <= count)
        pick = offset.clamp(0, count).view(-1, 1, 1).expand(-1, 1, maps.shape[-1])
        chosen = torch.gather(maps, 1, pick).squeeze(1)
        cache[active, : chosen.shape[-1]] = torch.where(hit.unsqueeze(-1), chosen,
                                                        cache[active, : chosen.shape[-1]])
        cached[active] = hit


# ----------------------------------------------------------------------------- rounds


def support_sizes(plan: ExactPlan, cand: Candidates, rows: Tensor, low: Tensor, aim: Tensor
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The support sizes of one round's rows ``rows`` (``low``: their certified lower bounds;
    ``aim``: where a narrower round's probes aimed, NaN if none): fixed sizes, or the adaptive
    k* by the closed-form gaps, the probes and the exact gaps. Returns (k, log T_k where the
    search holds it [n, W], which rows have it, which rows are finished: the others need a
    wider round, with ``k`` their certified lower bound, and where their probes aimed)."""
    n, width = cand.x.shape
    ahead = torch.full_like(aim, math.nan)
    alpha, lam = plan.alpha[rows], plan.lam[rows]
    fixed, cap = plan.fixed_k[rows], plan.k_max[rows]
    values = {name: value[rows] for name, value in plan.values.items()}
    values["size"] = torch.where(cap > 0, cap, UNBOUNDED)
    limit = support_range(cand, values)[1].clamp_min(1)
    k = torch.where(fixed > 0, torch.minimum(fixed, limit), 0)
    done = (fixed > 0) & (k <= width)
    cache = torch.full((n, width), -math.inf, dtype=cand.x.dtype, device=k.device)
    cached = torch.zeros_like(done)
    adaptive = (fixed <= 0).nonzero().squeeze(-1)
    if adaptive.numel() == 0:
        return k, cache, cached, done, ahead
    sub = take(cand, adaptive)
    lo = torch.minimum(low[adaptive].clamp_min(1), limit[adaptive])
    hi = limit[adaptive]
    a, lm = alpha[adaptive], lam[adaptive]
    if plan.family in CLOSED_GAP_FAMILIES and plan.generator is None:
        found = closed_sizes(plan.family, sub, lm, hi, width, lo)
        k[adaptive] = found
        done[adaptive] = (found < width) | (hi <= width)
        return k, cache, cached, done, ahead
    s = state = None
    wider = torch.zeros_like(lo, dtype=torch.bool)
    if plan.generator is None:
        lo, hi, s, state, wider, ahead[adaptive] = _search_rows(plan, sub, a, lm, lo, hi,
                                                                aim[adaptive])
    # Every row settles inside this round but those whose k* is known to pass it.
    past = ((hi > width) & (lo >= width - 1)) | wider
    hi = torch.minimum(hi, torch.full_like(hi, width))
    found = lo.clone()
    part = (~past).nonzero().squeeze(-1)
    if part.numel():
        settled, maps, have = _settle(plan.family, plan.mode, take(sub, part), a[part],
                                      lm[part], lo[part], hi[part], plan.generator,
                                      None if s is None else s[part],
                                      None if state is None else state[part])
        found[part] = settled
        cache[adaptive[part]] = maps
        cached[adaptive[part]] = have
    k[adaptive] = found
    # A row that ran into the end of the candidates goes on in a wider round (``k``: its
    # certified lower bound).
    done[adaptive] = ~past & ((found < width) | (limit[adaptive] <= width))
    return k, cache, cached, done, ahead


def _search_rows(plan: ExactPlan, cand: Candidates, alpha: Tensor, lam: Tensor, lo: Tensor,
                 hi: Tensor, aim: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor, Tensor]:
    """The floor of the gaps and the probes (`_search`, per kind of scalar) for adaptive rows
    with multipliers. Returns their bracket of k*, warm starts for the maps of `_settle`
    (scalar, dual inner unknowns), which rows the probes pointed past the candidates and the
    scalar they aimed at there."""
    width = cand.x.shape[-1]
    # Which scalar each row's map has: 0 the dual's log nu, 1 the primal's water level (alpha >
    # 1), 2 the primal's log delta (alpha < 1).
    kinds = torch.zeros_like(alpha, dtype=torch.long) if plan.mode == "dual" else \
        torch.where(alpha > 1.0, 1, 2)
    rows = _Rows.of(cand, alpha, lam)
    # The floor: every scalar is at least that of no deficit, where q = p, so an entry whose
    # term exceeds lambda there has G(j - 1) > lambda (w increases with s).
    floor = log_entry_term(plan.mode, rows.log_p, rows.log_p, rows.alpha)
    tolerance = TERM_ROUNDING * (1.0 + rows.log_lam.abs())
    lo = torch.maximum(lo, torch.minimum(
        (floor > (rows.log_lam + tolerance).unsqueeze(-1)).sum(-1), hi))
    s = torch.full_like(alpha, math.nan)  # (no warm start for rows without probes)
    state = torch.full_like(cand.x, math.nan) if plan.mode == "dual" else None
    wider = torch.zeros_like(lo, dtype=torch.bool)
    for kind in kinds.unique().tolist():
        # (rows whose k* is known to pass the candidates wait for a wider round)
        part = ((kinds == kind) & (hi - lo > 1) & ((hi <= width) | (lo < width - 1))
                ).nonzero().squeeze(-1)
        if part.numel() == 0:
            continue
        got = _search(plan.mode, kind, plan.family, rows.cut(part), lo[part], hi[part], aim[part])
        # (the maps' solvers take delta itself below alpha = 1, `primal.primal_multiplier`)
        lo[part], hi[part] = got[0], got[1]
        s[part] = got[2].exp() if kind == 2 else got[2]
        if got[3] is not None:
            state[part] = got[3]
        wider[part], aim[part] = got[4], got[5]
    return lo, hi, s, state, wider, aim


__all__ = ["SETTLE", "support_sizes"]
