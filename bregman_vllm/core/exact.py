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
   alpha = 2, otherwise by one window probe of `PROBE_WINDOW` sizes, then galloping and binary
   search on the sign of G(m) - lambda, each probe solving T_m and T_(m+1) to the rounding
   floor (`roots`) and evaluating G(m) as a sum of nonnegative terms (the Bregman Pythagorean
   identity). Greedy property and k-convexity (Theorems 3.1, 3.2 and 3.3 of arXiv 2505.19371)
   make the first k with G(k) <= lambda the global minimizer. A row whose k* is not certified
   inside its W candidates goes to the next round with 8 W candidates (up to the whole row).
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
from .dual import nested_log_renorm
from .families import CLOSED_FORM_FAMILIES, CLOSED_GAP_FAMILIES, Family
from .gaps import dual_log_gap, primal_log_gap
from .generators import (
    BregmanGenerator,
    generic_dual_renorm,
    generic_gap,
    generic_primal_renorm,
)
from .plan import DEFAULT_ROW_VALUES, ROW_DTYPES, ROW_FIELDS, make_plan, rows_family
from .primal import closed_log_renorm, kl_log_renorm, newton_log_renorm, support_mask
from .window import Decoded, closed_sizes, support_range
from .write import output_values, write_support

Tensor = torch.Tensor

#: Width of the first candidate set; rows whose k* is not certified inside it get 8x more.
INITIAL_CANDIDATES = 64
_GROWTH = 8
_FULL_SORT_FRACTION = 4
#: Bytes of float64 work arrays one chunk of a whole-row round may hold (about 8 per entry).
MEMORY_BUDGET = 256 * 1024 * 1024
_BYTES_PER_ENTRY = 320  # peak of a whole-row round, per entry (measured: 266 for dual 3/2, k* = V)


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
    return lambda lp, mk, a, ld, kk: nested_log_renorm(lp, mk, a, ld, kk)


#: The map of each family on a fixed support (arguments: log p, support mask, alpha, log R, k).
_MAPS = {
    **{family: (lambda lp, mk, a, ld, kk, family=family:
                closed_log_renorm(family, lp, mk, ld, kk)) for family in CLOSED_FORM_FAMILIES},
    Family.POWER: lambda lp, mk, a, ld, kk: newton_log_renorm(lp, mk, a, ld, kk),
    Family.DUAL_THREE_HALVES: lambda lp, mk, a, ld, kk: nested_log_renorm(
        lp, mk, a, ld, kk, closed=Family.DUAL_THREE_HALVES),
    Family.DUAL_THREE: lambda lp, mk, a, ld, kk: nested_log_renorm(
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
    ([n, count])."""
    sizes = start.unsqueeze(-1) + torch.arange(count + 1, device=start.device)  # [n, count + 1]
    width = int(sizes.max())
    log_p = cand.log_x[:, :width]
    maps = log_renorm(family, mode, log_p.unsqueeze(1).expand(-1, count + 1, -1), sizes,
                      alpha.unsqueeze(-1).expand(-1, count + 1), _log_deficit(cand, sizes),
                      generator)
    log_q, log_q_next = maps[:, :-1], maps[:, 1:]
    m = sizes[:, :-1]
    a = alpha.unsqueeze(-1).expand(-1, count)
    rows = log_p.unsqueeze(1).expand(-1, count, -1)
    if generator is not None:
        gap = generic_gap(mode, generator, torch.exp(rows), torch.exp(log_q),
                          torch.exp(log_q_next), m)
        return gap > lam.unsqueeze(-1), maps, torch.log(gap)
    if mode == "primal":
        log_gap = primal_log_gap(log_q, log_q_next, m, a)
    else:
        log_gap = dual_log_gap(rows, log_q, log_q_next, m, a)
    return log_gap > torch.log(lam).unsqueeze(-1), maps, log_gap


#: Probes per row guided by the gap floor (`_floor_sizes`) before the search only bisects.
MODEL_PROBES = 10
#: A bracket this narrow is decided by one probe of all its sizes.
FINAL_WINDOW = 8


class _Probed(NamedTuple):
    """Per row, log G and log floor at the sizes of its last two probes (``last``, ``before``;
    size 0 where there was none)."""

    k_last: Tensor
    gap_last: Tensor
    floor_last: Tensor
    k_before: Tensor
    gap_before: Tensor
    floor_before: Tensor


def _model_guess(log_floor: Tensor, probed: _Probed, log_lam: Tensor, lo: Tensor) -> Tensor:
    """The floor's guess of k*: log G(k) taken as an affine function of log floor(k) through
    the row's last two probes (a secant step in the floor's coordinate; after one probe,
    log G - log floor is taken as constant; before any, G as the floor itself), and the
    smallest size k >= lo where that is at most lambda (the width of the candidates when none
    is). The floor is led by p_(k+1)^alpha like G (`_floor_sizes`), so log G is close to affine
    in it and the guess lands next to k*. ``log_floor``: [n, W - 1], column j the floor of
    size j + 1."""
    last, before = probed.k_last > 0, probed.k_before > 0
    span = probed.floor_last - probed.floor_before
    slope = (probed.gap_last - probed.gap_before) / torch.where(span != 0, span, 1.0)
    secant = probed.floor_last + (log_lam - probed.gap_last) / torch.where(
        slope > 0, slope, 1.0)
    # (a slope far from 1 is the noise of two close probes: the constant ratio instead)
    usable = before & (span != 0) & (slope > 0.25) & (slope < 4.0) & torch.isfinite(secant)
    shifted = log_lam - (probed.gap_last - probed.floor_last)
    target = torch.where(usable, secant, torch.where(last, shifted, log_lam))
    sizes = torch.arange(1, log_floor.shape[-1] + 1, device=log_floor.device)
    fits = (log_floor <= target.unsqueeze(-1)) & (sizes >= lo.unsqueeze(-1))
    return torch.where(fits, sizes, log_floor.shape[-1] + 1).amin(-1)


def _measured(probed: _Probed, rows: Tensor, sizes: Tensor, exceeds: Tensor, log_gap: Tensor,
              log_floor: Tensor) -> None:
    """Record, for the rows ``rows``, one size of their probe of ``sizes`` ([r, c],
    consecutive, in 1 .. W - 1): the largest that exceeds lambda, else the smallest."""
    floor = torch.gather(log_floor[rows], 1, (sizes - 1).clamp(0, log_floor.shape[-1] - 1))
    good = torch.isfinite(log_gap) & torch.isfinite(floor)
    over = torch.where(exceeds & good, sizes, 0).amax(-1)
    under = torch.where(~exceeds & good, sizes, 2**62).amin(-1)
    size = torch.where(over > 0, over, under)
    new = (size > 0) & (size < 2**62)
    col = (size - sizes[:, 0]).clamp(0, sizes.shape[1] - 1).unsqueeze(-1)
    values = (size, torch.gather(log_gap, 1, col)[:, 0], torch.gather(floor, 1, col)[:, 0])
    for now, old, value in zip(probed[:3], probed[3:], values, strict=True):
        old[rows] = torch.where(new, now[rows], old[rows])
        now[rows] = torch.where(new, value.to(now.dtype), now[rows])


def _search(family: Family | None, mode: str, cand: Candidates, alpha: Tensor, lam: Tensor,
            low: Tensor, high: Tensor, generator: BregmanGenerator | None = None,
            raised: Tensor | None = None, log_floor: Tensor | None = None,
            open_end: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Smallest k in [low, high] with G(k) <= lambda, where G(high) <= lambda is taken as given.

    Rows starting at low = 1: one window probe decides G(1 .. WINDOW) at once (k* is usually
    small). Then, with the floor of every gap (``log_floor``, `_floor_sizes`): up to
    `MODEL_PROBES` probes of the two sizes around the floor's guess of k* (`_model_guess`,
    the floor scaled by the ratio G / floor the row's probes measured; rows whose low comes
    from the floor (``raised``) start with ratio 1: a probe at low itself), then bisection: at
    most MODEL_PROBES + 2 log2(high - low) + 1 probes, a few where the floor tracks G (it
    does on every row measured). Without a floor (a user generator): galloping (m = low,
    low + 1, low + 3, ...) and bisection, O(log k*) probes. All rows advance together; each
    probe runs only on the rows still searching.

    ``open_end``: rows whose high is the end of the candidates, not a real boundary (k* may
    lie past it): once their probes put the floor's guess past the candidates, they stop with
    the lower bound their probes certified (``left``), for a wider round to go on from.

    Returns (k*, or for the rows that stopped (``left``) the certified lower bound, log T_k*
    for the rows the window resolved ([n, W]), which rows those are, ``left``).
    """
    low, high = low.clone(), high.clone()
    raised = torch.zeros_like(low, dtype=torch.bool) if raised is None else raised
    left = torch.zeros_like(low, dtype=torch.bool)
    certified = torch.zeros_like(low)
    open_end = left if open_end is None else open_end
    cache = torch.empty(low.shape[0], 0, dtype=cand.log_x.dtype, device=low.device)
    cached = torch.zeros_like(low, dtype=torch.bool)
    guided = raised.clone() if log_floor is not None else torch.zeros_like(raised)
    zero, nothing = torch.zeros_like(low), torch.zeros_like(lam)
    probed = _Probed(zero, nothing, nothing.clone(), zero.clone(), nothing.clone(),
                     nothing.clone())
    log_lam = torch.log(lam)
    first_round = (low == 1) & ~raised  # later rounds know k* >= low: no window probe
    active = ((low < high) & first_round).nonzero().squeeze(-1)
    if active.numel():
        lo, hi = low[active], high[active]
        count = int(min(PROBE_WINDOW, int((hi - lo).max())))
        sub = take(cand, active)
        start = torch.minimum(lo, hi - count).clamp_min(1)  # keep the window inside [1, hi]
        exceeds, maps, log_gap = _window_exceeds(family, mode, sub, start, count, alpha[active],
                                                 lam[active], generator)
        m = start.unsqueeze(-1) + torch.arange(count, device=lo.device)
        # Sizes below low are known to exceed; at or beyond high the search stops by definition.
        stop = (~exceeds | (m >= hi.unsqueeze(-1))) & (m >= lo.unsqueeze(-1))
        first = torch.where(stop, m, hi.unsqueeze(-1)).amin(-1)
        covered = start + count  # every size below this was decided
        resolved = first < covered
        high[active] = torch.where(resolved, first, hi)
        low[active] = torch.where(resolved, first, torch.maximum(lo, covered))
        # The window already holds T_k* for the rows it resolved: keep it for the output.
        pick = (first - start).clamp(0, count).view(-1, 1, 1).expand(-1, 1, maps.shape[-1])
        cache = torch.full((low.shape[0], maps.shape[-1]), -math.inf, dtype=maps.dtype,
                           device=maps.device)
        cache[active] = torch.gather(maps, 1, pick).squeeze(1)
        cached[active] = resolved
        if log_floor is not None:
            _measured(probed, active, m, exceeds, log_gap, log_floor)
            guided[active] = True
    step = torch.ones_like(low)
    galloping = first_round & ~guided
    tries = torch.zeros_like(low)
    width = cand.log_x.shape[-1]
    while True:
        active = (low < high).nonzero().squeeze(-1)
        if active.numel() == 0:
            return torch.where(left, certified, low), cache, cached, left
        lo, hi = low[active], high[active]
        gal = galloping[active]
        model = guided[active] & (tries[active] < MODEL_PROBES)
        m = torch.where(gal, torch.minimum(lo + step[active] - 1, hi - 1), (lo + hi) // 2)
        count = 1
        if bool(model.any()):
            guess = _model_guess(log_floor[active], _Probed(*(t[active] for t in probed)),
                                 log_lam[active], lo)
            # Past the candidates, after a probe measured the ratio: a wider round's (exact:
            # it starts at the low certified here).
            leave = model & (guess >= width) & open_end[active] & (probed.k_last[active] > 0)
            if bool(leave.any()):
                rows = active[leave]
                left[rows], certified[rows] = True, lo[leave]
                low[rows] = high[rows]
                keep = (~leave).nonzero().squeeze(-1)
                if keep.numel() == 0:
                    continue
                active, lo, hi, gal, model, guess, m = (
                    t[keep] for t in (active, lo, hi, gal, model, guess, m))
            # The two sizes around the guess (k* = guess when G(guess - 1) > lambda >= G(guess));
            # the first probe of rows raised by the floor: the floor's size alone (often k*).
            count = 2 if bool((model & (probed.k_last[active] > 0)).any()) else 1
            m = torch.where(model, (guess - count + 1).clamp(lo, hi - 1), m)
        span = int((hi - lo).max())
        if span <= FINAL_WINDOW:  # every size left, at once
            m, count = lo, span
        count = min(count, width - 1)
        m = torch.minimum(m, torch.full_like(m, width - count))  # T_(m + count) exists
        sub = take(cand, active)
        exceeds, maps, log_gap = _window_exceeds(family, mode, sub, m, count, alpha[active],
                                                 lam[active], generator)
        sizes = m.unsqueeze(-1) + torch.arange(count, device=m.device)
        inside = (sizes >= lo.unsqueeze(-1)) & (sizes < hi.unsqueeze(-1))
        # G is nonincreasing: the sizes that exceed raise low, the first that stops lowers high.
        found = torch.maximum(lo, torch.where(exceeds & inside, sizes + 1, 0).amax(-1))
        low[active] = found
        high[active] = torch.minimum(hi, torch.where(~exceeds & inside, sizes,
                                                     hi.unsqueeze(-1)).amin(-1))
        # A probe that decided k* holds T_k* among its maps (T_m .. T_(m + count)): keep it
        # for the output instead of solving it again.
        offset = found - m
        hit = (high[active] == found) & (offset >= 0) & (offset <= count)
        if bool(hit.any()):
            if cache.shape[-1] < maps.shape[-1]:
                cache = torch.nn.functional.pad(cache, (0, maps.shape[-1] - cache.shape[-1]),
                                                value=-math.inf)
            rows = active[hit]
            pick = offset[hit].view(-1, 1, 1).expand(-1, 1, maps.shape[-1])
            cache[rows] = -math.inf
            cache[rows, : maps.shape[-1]] = torch.gather(maps[hit], 1, pick).squeeze(1)
            cached[rows] = True
        if log_floor is not None:
            _measured(probed, active, sizes, exceeds, log_gap, log_floor)
        tries[active] += 1
        first = exceeds[:, 0]
        step[active] = torch.where(first & gal, step[active] * 2, step[active])
        galloping[active] = gal & first
        # Past the guided probes: gallop up from low while no size has stopped, else bisect.
        galloping[active] |= guided[active] & (tries[active] == MODEL_PROBES) \
            & (high[active] == hi)


def _floor_sizes(mode: str, cand: Candidates, alpha: Tensor, lam: Tensor
                 ) -> tuple[Tensor, Tensor | None]:
    """A lower bound on k* per row, from a floor of every cost gap: G(k) > lambda, hence
    k* > k, until the floor reaches lambda. Returns the first k in 1 .. W - 1 whose floor is at
    most lambda, else W (k* >= W: the row needs a wider round, and no probe of this one), and
    the log of the floor of every size 1 .. W - 1 ([n, W - 1]; None for W = 1).
    Exact, not a heuristic: where k* is large (tiny lambda, primal alpha near 0, dual alpha
    near 1) it starts the search next to k* and skips the probes of the rounds below it.

    The floor is the last term of G(k) (`gaps`; the others are >= 0) at a lower bound q_lo of
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
        return torch.ones(alpha.shape[0], dtype=torch.long, device=alpha.device), None
    a = alpha.unsqueeze(-1)
    b = a - 1.0
    log_p = cand.log_x[:, 1:]  # p_(k+1), k = 1 .. W-1
    sizes = torch.arange(1, width, device=log_p.device)
    log_share = torch.log(cand.deficit[:, 1:]) - torch.log1p(sizes.to(log_p.dtype))  # R/m
    if mode == "primal":
        level = torch.where(b >= 1.0, log_share, (torch.log(b.clamp_min(1e-300)) + log_share)
                            / b.clamp_min(1e-300))
        log_q = torch.where(b > 0, torch.maximum(log_p, level), log_p)
        log_floor = a * log_q - torch.log(a)
    else:
        log_q = torch.where(a >= 2.0, torch.maximum(log_p, log_share),
                            torch.logaddexp(log_p, log_share + (1.0 - b) * log_p))
        moved = log_p + torch.log(torch.expm1((log_q - log_p).clamp_min(0.0)))  # q' - p
        inner = torch.logaddexp(2.0 * torch.log(b) + moved, log_p)
        log_floor = b * log_q + inner - torch.log(a * b)
    below = ~(log_floor > torch.log(lam).unsqueeze(-1))  # (zero entries: NaN or -inf)
    return torch.where(below, sizes, width).amin(-1), log_floor


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
        log_floor = None
        closed = plan.family in CLOSED_GAP_FAMILIES  # every gap of the round at once
        if plan.generator is None and not closed:
            floor, log_floor = _floor_sizes(plan.mode, sub, a, lm)
            floor = torch.minimum(floor, upper)
            raised = floor > lo
            lo = torch.maximum(lo, floor)
        if closed:  # the window's search over this round's candidates
            found = closed_sizes(plan.family, sub, lm, upper, width, lo)
        else:
            found, maps, have, left = _search(plan.family, plan.mode, sub, a, lm, lo, upper,
                                              plan.generator, raised, log_floor, ~bounded)
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
        width *= _GROWTH
        if width * _FULL_SORT_FRACTION >= vocab:  # a top-k that large costs about a full sort
            width = vocab


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
