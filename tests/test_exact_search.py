"""The exact path's search by multipliers (issue 18, part 3): what one map's multiplier bounds,
the joint Newton of the dual map, and how few maps the search solves for k* in the thousands.

References: `tests/reference.py` (float64, written from the paper) for the bounds; maps that
share no code with the search for k* (the primal's generic linear-space bisection of
`core.generators`, the dual's nested root finding of Algorithm 1, `dual._nested`), the latter
also for the joint Newton.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from bregman_vllm import bregman_decode, bregman_decode_logits
from bregman_vllm.core import dual, exact, predict
from bregman_vllm.core.candidates import candidates
from bregman_vllm.core.families import Family
from bregman_vllm.core.gaps import dual_log_gap, log_entry_term
from bregman_vllm.core.generators import AlphaGenerator, generic_gap, generic_primal_renorm
from bregman_vllm.core.primal import _normalized, support_mask

from . import reference as ref

F64 = torch.float64


def _sorted_row(rng: random.Random, size: int, scale: float) -> list[float]:
    logits = sorted((rng.gauss(0.0, scale) for _ in range(size)), reverse=True)
    top = logits[0]
    weights = [math.exp(v - top) for v in logits]
    total = sum(weights)
    return [w / total for w in weights]


def _solve(mode: str, cand, k: int, alpha: float):
    sizes = torch.tensor([k])
    return exact._solved(Family.EXACT, mode, cand.log_x, sizes, torch.tensor([alpha], dtype=F64),
                         exact._log_deficit(cand, sizes))


@pytest.mark.parametrize(("mode", "alpha"), [("primal", 0.5), ("primal", 1.5), ("primal", 3.0),
                                             ("primal", 12.0), ("dual", 1.3), ("dual", 2.5),
                                             ("dual", 6.0)])
def test_one_multiplier_brackets_the_cost_gap(mode, alpha):
    """Weak duality (`gaps.log_entry_term`): w(p_(k+1), nu_(k+1)) <= G(k) <= w(p_(k+1), nu_k),
    with G(k) = cost(k) - cost(k + 1) at lambda = 0 from the float64 reference's costs."""
    rng = random.Random(11)
    for scale in (0.5, 1.5, 3.0):
        p = _sorted_row(rng, 7, scale)
        costs = ref.top_k_costs(p, alpha, 0.0, mode)
        cand = candidates(torch.tensor([p], dtype=F64), 7)
        solved = [None] + [_solve(mode, cand, k, alpha) for k in range(1, 8)]
        a = torch.tensor(alpha, dtype=F64)
        for k in range(1, 7):
            gap = costs[k - 1] - costs[k]
            p_next = cand.log_x[0, k]
            lower = math.exp(log_entry_term(mode, p_next, solved[k + 1].log_q[0, k], a))
            upper = math.exp(log_entry_term(mode, p_next, solved[k].log_q[0, k], a))
            slack = 1e-9 * abs(gap) + 1e-13
            assert lower <= gap + slack, (k, lower, gap)
            assert gap <= upper + slack, (k, gap, upper)
            assert lower <= upper


@pytest.mark.parametrize("alpha", [1.001, 1.3, 2.5, 7.0, 20.0, 1e4, 1e8])
def test_joint_newton_equals_the_nested_root_finding(alpha, monkeypatch):
    """The dual map by the joint Newton (`dual._joint_newton`) equals Algorithm 1's nested
    root finding to rounding, on rows with zeros past the support; with no joint iterations
    every row takes the nested fallback and gives the same maps."""
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(12, 300, generator=g, dtype=F64)
                      * torch.tensor([0.3, 2.0, 6.0] * 4, dtype=F64).unsqueeze(-1), -1)
    p[::4, -3:] = 0.0
    p = torch.sort(p / p.sum(-1, keepdim=True), -1, descending=True).values
    log_p = torch.log(p)
    k = torch.tensor([1, 2, 5, 30, 100, 200, 250, 299, 300, 150, 10, 297])
    mask = support_mask(k, 300)
    log_deficit = torch.log1p(-torch.where(mask, p, 0.0).sum(-1).clamp_max(1 - 1e-300))
    full = torch.isneginf(log_deficit)  # supports holding every positive entry: the identity
    rows = (~full).nonzero().squeeze(-1)
    lp, mk, ld, kk = log_p[rows], mask[rows], log_deficit[rows], k[rows]
    a = torch.full((rows.numel(),), alpha, dtype=F64)
    joint = dual.dual_multiplier(lp, mk, a, ld, kk)
    beta = (a - 1.0).unsqueeze(-1)
    finite = torch.isfinite(lp)
    zero = torch.where(finite, lp, 0.0)
    low, high, first = dual._outer_bracket(zero, finite, mk, beta, ld, kk)
    s, z = dual._nested(zero, finite, mk, beta, ld, first, dual._inner_start(beta, zero, first),
                        low, high, None)
    nested = _normalized(torch.where(finite, zero + torch.exp(z), s.unsqueeze(-1) / beta), mk)
    ours = _normalized(joint.log_q, mk)
    assert not ours.isnan().any()
    assert (ours.exp() - nested.exp()).abs().max() < 1e-13
    # lift is log(q / p) (log q at zero entries), exact where q - p is tiny
    same = torch.where(finite, zero + joint.lift, joint.lift)
    torch.testing.assert_close(same[mk], joint.log_q[mk], rtol=0, atol=1e-12)
    monkeypatch.setattr(dual, "JOINT_ITERATIONS", 0)
    fallback = _normalized(dual.dual_multiplier(lp, mk, a, ld, kk).log_q, mk)
    assert (fallback.exp() - nested.exp()).abs().max() < 1e-13


@pytest.mark.parametrize("alpha", [1.2, 2.5, 20.0])
def test_a_warm_start_from_the_neighbouring_size_gives_the_same_map(alpha):
    g = torch.Generator().manual_seed(8)
    p = torch.sort(torch.softmax(torch.randn(3, 2000, generator=g, dtype=F64) * 2, -1), -1,
                   descending=True).values
    cand = candidates(p, 2000)
    a = torch.full((3,), alpha, dtype=F64)
    k = torch.tensor([400, 900, 1500])
    near = exact._solved(Family.EXACT, "dual", cand.log_x, k, a, exact._log_deficit(cand, k))
    cold = exact._solved(Family.EXACT, "dual", cand.log_x, k + 1, a,
                         exact._log_deficit(cand, k + 1))
    warm = exact._solved(Family.EXACT, "dual", cand.log_x, k + 1, a,
                         exact._log_deficit(cand, k + 1), near.s, near.state)
    mask = support_mask(k + 1, 2000)
    torch.testing.assert_close(_normalized(warm.log_q, mask).exp(),
                               _normalized(cold.log_q, mask).exp(), rtol=0, atol=1e-14)


def _certificate(mode: str, p: torch.Tensor, k: int, alpha: float) -> tuple[float, ...]:
    """G(k - 1) and G(k) (G(k) only up to the last positive entry) of one row from maps that
    share no code with the search's: the primal's generic linear-space bisection
    (`generators.generic_primal_renorm`, `generic_gap`), the dual's nested root finding of
    Algorithm 1 (`dual._nested`, safeguarded Newton in log space) with its exact ratios."""
    x = torch.sort(p, descending=True).values.unsqueeze(0)
    width = x.shape[-1]
    sizes = [m for m in (k - 1, k, k + 1) if 1 <= m <= width]
    if mode == "primal":
        gen = AlphaGenerator(alpha)
        maps = {m: generic_primal_renorm(x, support_mask(torch.tensor([m]), width), gen)
                for m in sizes}
        return tuple(float(generic_gap(mode, gen, x, maps[m], maps[m + 1], torch.tensor([m])))
                     for m in (k - 1, k) if m in maps and m + 1 in maps)
    log_x = torch.log(x)
    finite = torch.isfinite(log_x)
    zero = torch.where(finite, log_x, 0.0)
    beta = torch.tensor([[alpha - 1.0]], dtype=F64)
    maps, lifts = {}, {}
    for m in sizes:
        size = torch.tensor([m])
        mask = support_mask(size, width)
        deficit = torch.log1p(-torch.where(mask, x, 0.0).sum(-1).clamp_max(1 - 1e-300))
        low, high, first = dual._outer_bracket(zero, finite, mask, beta, deficit, size)
        s, z = dual._nested(zero, finite, mask, beta, deficit, first,
                            dual._inner_start(beta, zero, first), low, high, None)
        lifts[m] = torch.exp(z)
        maps[m] = _normalized(torch.where(finite, zero + lifts[m], s / beta), mask)
    a = torch.tensor([alpha], dtype=F64)
    return tuple(float(dual_log_gap(log_x, maps[m], maps[m + 1], torch.tensor([m]), a,
                                    lifts[m] - lifts[m + 1]).exp())
                 for m in (k - 1, k) if m in maps and m + 1 in maps)


@pytest.mark.parametrize(("mode", "alpha", "lam"), [
    ("dual", 2.5, 2e-10), ("dual", 1.3, 3e-5), ("dual", 7.0, 1e-26), ("dual", 3.0, 1e-12),
    ("primal", 3.0, 1e-12), ("primal", 0.5, 0.03), ("primal", 7.5, 1e-28)])
def test_k_star_in_the_thousands_is_certified_by_independent_maps(mode, alpha, lam):
    """Rows whose k* is in the thousands (several candidate rounds, multiplier probes): maps
    solved without the search's code (`_certificate`) certify every k*: G(k* - 1) > lambda
    >= G(k*)."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4000, generator=g, dtype=F64) * torch.tensor(
        [[0.3], [0.6], [1.0]], dtype=F64)
    p = torch.softmax(logits, -1)
    out = bregman_decode(p, alpha=alpha, lam=lam, mode=mode)
    assert not out.probs.isnan().any()
    assert (out.k > 64).all() and (out.k < 4000).any(), out.k  # past the first window
    for row in range(3):
        k = int(out.k[row])
        gaps = _certificate(mode, p[row], k, alpha)
        assert gaps[0] > lam * (1 + 1e-9), (row, k, gaps)
        if k < 4000:
            assert gaps[1] <= lam * (1 + 1e-9), (row, k, gaps)


def test_exact_gaps_from_the_multipliers_stay_monotone_where_normalized_maps_do_not():
    """A long support of a peaked row with a tiny lambda (dual alpha 4, k* in the thousands,
    G ~ 1e-40): the head entries' ratios q_i / q'_i differ from 1 by ~1e-20, below the
    rounding of two normalized maps. From those maps the gap formula is noise (not
    nonincreasing in k, against Theorem 3.3); from the multipliers' log(q / p) it is
    nonincreasing and inside the bounds of one multiplier."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 8192, generator=g, dtype=F64) * 5.0
    cand = candidates(logits, 8192, logits=True)
    alpha = 4.0
    sizes = range(5734, 5740)
    solved = {k: _solve("dual", cand, k, alpha) for k in (*sizes, sizes[-1] + 1)}
    normalized = {k: _normalized(v.log_q, support_mask(torch.tensor([k]), 8192))
                  for k, v in solved.items()}
    a = torch.tensor([alpha], dtype=F64)
    exact_gaps, noisy_gaps = [], []
    for k in sizes:
        m = torch.tensor([k])
        rho = solved[k].lift - solved[k + 1].lift
        exact_gaps.append(float(dual_log_gap(cand.log_x, normalized[k], normalized[k + 1], m,
                                             a, rho)))
        noisy_gaps.append(float(dual_log_gap(cand.log_x, normalized[k], normalized[k + 1], m,
                                             a)))
        lower = float(log_entry_term("dual", cand.log_x[0, k], solved[k + 1].log_q[0, k], a))
        upper = float(log_entry_term("dual", cand.log_x[0, k], solved[k].log_q[0, k], a))
        assert lower - 1e-9 <= exact_gaps[-1] <= upper + 1e-9
    assert all(b <= a + 1e-9 for a, b in itertools.pairwise(exact_gaps))
    assert max(noisy_gaps) > max(exact_gaps) + 5.0  # the normalized maps' noise (log scale)


def _counting(monkeypatch) -> dict[str, int]:
    """Count the multiplier probes and the joint Newton iterations of the next calls."""
    counts = {"probes": 0, "solves": 0}
    probe, joint = exact._probe, dual._joint_newton

    def counted_probe(*args, **kwargs):
        counts["probes"] += 1
        return probe(*args, **kwargs)

    def counted_joint(*args, **kwargs):
        counts["solves"] += 1
        return joint(*args, **kwargs)

    monkeypatch.setattr(exact, "_probe", counted_probe)
    monkeypatch.setattr(dual, "_joint_newton", counted_joint)
    return counts


@pytest.mark.parametrize(("mode", "alpha", "lam", "spread"), [
    ("dual", 2.5, 1e-12, 0.3), ("dual", 20.0, 1e-100, 0.3), ("dual", 4.0, 1e-40, 5.0),
    ("primal", 3.0, 1e-12, 0.3)])
def test_k_star_in_the_tens_of_thousands_takes_a_few_probes(mode, alpha, lam, spread,
                                                            monkeypatch):
    """The multiplier probes' predictions (Halley steps of the maps' equations) land next to
    k*: at most 6 probes, one map each, for k* in the tens of thousands (a count the CPU can
    make for the GPU). Before, the search solved up to three maps per probe for 13 probes."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 49152, generator=g) * spread
    counts = _counting(monkeypatch)
    out, k = bregman_decode_logits(logits, alpha=alpha, lam=lam, mode=mode, return_k=True)
    assert torch.isfinite(torch.logsumexp(out.double(), -1)).all()
    assert (k > 4096).all(), k  # the whole-row round
    assert counts["probes"] <= 6, counts


@pytest.mark.parametrize(("mode", "alpha", "family"), [
    ("dual", 10.0, Family.EXACT), ("dual", 2.5, Family.EXACT), ("dual", 1.05, Family.EXACT),
    ("dual", 1.5, Family.DUAL_THREE_HALVES), ("dual", 3.0, Family.DUAL_THREE),
    ("primal", 0.3, Family.POWER), ("primal", 3.0, Family.POWER), ("primal", 20.0, Family.POWER)])
def test_series_gaps_equal_the_exact_gaps_of_two_maps(mode, alpha, family):
    """One solve at m gives the gaps of the sizes next to it by series in its multiplier
    (`series.series_bounds`): equal to the exact gap of the two maps each solved alone (the
    search's `_exact_gap_at`) to well within the tolerance it decides with, on peaked and flat
    rows, at sizes from hundreds to thousands; and the shifts s_j - s_m equal the maps' own."""
    from bregman_vllm.core import series

    g = torch.Generator().manual_seed(3)
    logits = torch.cat([torch.randn(2, 8192, generator=g, dtype=F64) * 5.0,
                        torch.randn(2, 8192, generator=g, dtype=F64) * 0.3])
    cand = candidates(logits, 8192, logits=True)
    a = torch.full((4,), alpha, dtype=F64)
    past = series.SERIES_COLUMNS
    checked = 0
    for m0 in (300, 2000, 6000):
        m = torch.full((4,), m0)
        log_deficit = exact._log_deficit(cand, m)
        solved = exact._solved(family, mode, cand.log_x, m, a, log_deficit, past=past)
        exact_columns = m + past if (mode, family) == ("dual", Family.EXACT) \
            else torch.full_like(m, 8192)
        tiny = torch.full((4,), 1e-30, dtype=F64)
        bounds = series.series_bounds(mode, cand.log_x, solved, m, a, tiny, log_deficit,
                                      exact_columns)
        for d in (-8, -1, 0, 1, 4):
            j = m + d
            one = exact._solved(family, mode, cand.log_x, j, a, exact._log_deficit(cand, j))
            two = exact._solved(family, mode, cand.log_x, j + 1, a,
                                exact._log_deficit(cand, j + 1))
            maps = [_normalized(x.log_q, support_mask(k, 8192)) for x, k in ((one, j),
                                                                            (two, j + 1))]
            log_gap = exact._exact_gap_at(mode, cand, j, a, maps[0], one.lift, maps[1],
                                          two.lift)
            column = d + series.SERIES_SIZES
            known = torch.isfinite(bounds.log_gap[:, column])
            checked += int(known.sum())
            error = (bounds.log_gap[:, column] - log_gap)[known].abs()
            assert (error <= series.SERIES_TOLERANCE / 10).all(), (m0, d, error)
            shift = bounds.shift[:, column][known] - (one.s - solved.s)[known]
            assert (shift.abs() <= 1e-6).all(), (m0, d, shift)
    assert checked >= 10, checked  # (the series reaches sizes at each of these rows' scales)


def test_one_dual_solve_decides_k_star_next_to_it(monkeypatch):
    """The issue's attack row (dual alpha 10, lambda 1e-100, k* in the tens of thousands): the
    probe at the predicted size decides k* by the series (no exact gap of two maps, no probe
    of the next size), with fewer probes than without the series and the same k* and output
    as the search without it (which decides by exact gaps)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 49152, generator=g) * torch.tensor([[3.5], [5.0]])
    gaps = {"exact": 0}
    exact_gap = exact._exact_gap_at

    def counted(*args):
        gaps["exact"] += 1
        return exact_gap(*args)

    monkeypatch.setattr(exact, "_exact_gap_at", counted)
    counts = _counting(monkeypatch)
    out, k = bregman_decode_logits(logits, alpha=10.0, lam=1e-100, mode="dual", return_k=True)
    assert torch.isfinite(torch.logsumexp(out.double(), -1)).all()
    assert (k > 4096).all() and (k < 49152).all(), k
    assert gaps["exact"] == 0, gaps
    with_series = counts["probes"]
    monkeypatch.setattr(exact, "SERIES_SIZES", -1)  # (no size is ever predicted within -1)
    counts["probes"] = 0
    plain, k_plain = bregman_decode_logits(logits, alpha=10.0, lam=1e-100, mode="dual",
                                           return_k=True)
    assert torch.equal(k, k_plain) and torch.equal(out, plain)
    assert with_series < counts["probes"], (with_series, counts)


@pytest.mark.parametrize(("mode", "alpha", "lam", "spread"), [
    ("dual", 10.0, 1e-100, 4.0), ("dual", 20.0, 1e-240, 5.0), ("dual", 4.0, 1e-16, 0.3),
    ("dual", 2.5, 1e-12, 0.3), ("primal", 20.0, 1e-240, 5.0), ("primal", 3.0, 1e-12, 0.3),
    ("primal", 1.2, 4e-6, 0.3), ("primal", 0.3, 0.17, 0.3)])
def test_the_first_probe_goes_where_k_star_is_predicted(mode, alpha, lam, spread, monkeypatch):
    """`predict.start_values`: the multiplier at which the support it
    fills has its next term at lambda, found without a map, predicts k* within the series'
    reach; the search then takes fewer probes, or (dual) as many with fewer passes over the
    columns (inner-root evaluations, each a pass over [n, C]), than from the floor of the gaps
    (`exact.PREDICT_FROM` and `PREDICT_BELOW_ONE_FROM` past every size: the search without
    it), with the same k* and output.
    (Measured: 1 or 2 probes against 2 to 4, about half the passes.)"""
    from bregman_vllm.core import series

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 16384, generator=g) * spread
    counts = _counting(monkeypatch)
    terms = dual._inner_terms
    passes = [0.0]

    def counted_terms(beta, z, *args, **kwargs):
        passes[0] += z.numel() / logits.numel()
        return terms(beta, z, *args, **kwargs)

    monkeypatch.setattr(dual, "_inner_terms", counted_terms)
    out, k = bregman_decode_logits(logits, alpha=alpha, lam=lam, mode=mode, return_k=True)
    assert torch.isfinite(torch.logsumexp(out.double(), -1)).all()
    assert (k > 512).all() and (k < 16384).all(), k
    predicted, predicted_passes = counts["probes"], passes[0]
    cand = candidates(logits, 16384, logits=True)
    a, lm = torch.full((2,), alpha, dtype=F64), torch.full((2,), lam, dtype=F64)
    start, _ = predict.start_values(mode, cand.log_x, cand.deficit, a, lm)
    columns = start.log_q.shape[-1]  # (twice the support it filled, and some)
    guess, _ = predict.predicted_sizes(mode, cand.log_x[:, :columns], cand.deficit, start, a,
                                       lm, torch.full((2,), 256), 255)
    assert ((guess - k).abs() <= series.SERIES_SIZES).all(), (guess, k)
    monkeypatch.setattr(exact, "PREDICT_FROM", 1 << 40)
    monkeypatch.setattr(exact, "PREDICT_BELOW_ONE_FROM", 1 << 40)
    counts["probes"], passes[0] = 0, 0.0
    plain, k_plain = bregman_decode_logits(logits, alpha=alpha, lam=lam, mode=mode,
                                           return_k=True)
    assert torch.equal(k, k_plain) and torch.equal(out, plain)
    assert predicted <= counts["probes"], (predicted, counts)
    assert predicted < counts["probes"] or predicted_passes < passes[0], (
        predicted, counts, predicted_passes, passes[0])


@pytest.mark.parametrize(("mode", "alpha", "lam", "spread"), [
    ("dual", 10.0, 1e-100, 4.0), ("dual", 2.5, 1e-12, 0.3), ("primal", 3.0, 1e-12, 0.3),
    ("primal", 0.3, 0.17, 0.3)])
def test_the_bisection_two_steps_at_a_time_is_the_one_step_bisection(mode, alpha, lam, spread,
                                                                      monkeypatch):
    """`predict._bisected` tests the midpoint and both quarter points of its bracket at once:
    the same points and brackets as `predict.SEARCH_STEPS` steps one at a time (s~ and the
    support filled at it bit for bit, against the plain loop written here), in fewer launched
    ops (`DispatchCounter`: a GPU's launches, counted on the CPU; measured 0.6x for the dual's
    shaped roots, 0.75x for the primal's closed forms)."""
    from bregman_vllm.diagnostics import DispatchCounter

    g = torch.Generator().manual_seed(3)
    cand = candidates(torch.randn(3, 16384, generator=g) * spread, 16384, logits=True)
    a = torch.full((3,), alpha, dtype=F64)
    lm = torch.tensor([lam, lam * 1e-3, lam * 1e3], dtype=F64)
    calls: list[tuple] = []
    bisected = predict._bisected

    def kept(*args, **kwargs):
        calls.append((args, kwargs))
        return bisected(*args, **kwargs)

    monkeypatch.setattr(predict, "_bisected", kept)
    predict._guessed(mode, cand.log_x, cand.deficit, a, lm)
    (args, kwargs), = calls
    _, log_p, deficit, alpha_, beta, log_lam, low, lift, zero, *rest = args
    high = rest[0] if rest else kwargs.get("high", torch.zeros_like(low))
    with DispatchCounter() as paired:
        s, filled = bisected(*args, **kwargs)

    def one_step_at_a_time() -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal low, high
        stride = predict._stride(log_p.shape[-1])
        lp, r = log_p[:, ::stride], deficit[:, ::stride]
        finite = torch.isfinite(lp)
        p = torch.exp(lp)
        lp = torch.where(finite, lp, 0.0)
        for _ in range(predict.SEARCH_STEPS):
            mid = 0.5 * (low + high)
            rise, level = lift(mid, lp, beta), zero(mid, beta)
            log_q = torch.where(finite, lp + rise, level)
            added = torch.where(finite, p * torch.expm1(rise), torch.exp(level))
            count = (torch.cumsum(added, -1) * stride <= r).sum(-1)
            at = count.clamp_max(lp.shape[-1] - 1).unsqueeze(-1)
            w = log_entry_term(mode, torch.where(finite, lp, -math.inf).gather(1, at),
                               log_q.gather(1, at), alpha_).squeeze(-1)
            big = (w > log_lam) & (count < lp.shape[-1])
            high, low = torch.where(big, mid, high), torch.where(big, low, mid)
        return 0.5 * (low + high), count * stride

    with DispatchCounter() as single:
        s_single, filled_single = one_step_at_a_time()
    assert torch.equal(s, s_single) and torch.equal(filled, filled_single), (s, s_single)
    # (one row alone: the same as in the batch)
    alone = predict._guessed(mode, cand.log_x[:1], cand.deficit[:1], a[:1], lm[:1])
    assert torch.equal(alone[0], s[:1]) and torch.equal(alone[1], filled[:1]), alone
    assert len(set(filled.tolist())) == 3, filled  # (three lambdas, three supports)
    assert paired.launches < 0.8 * single.launches, (paired.launches, single.launches)


def test_rows_predicted_past_a_rounds_candidates_leave_it_without_a_probe(monkeypatch):
    """A candidate round (4096 of 49152 entries) whose first probe predicts k* past its
    candidates sends the rows to the wider round at once: one probe in all, where k* is,
    not a probe at the floor first (which only certified what the floor did). Two rows of
    dual alpha 4, lambda 1e-20 with k* about 5000 (the floor in that round: about 2500)."""
    g = torch.Generator().manual_seed(0)
    scale = 3.0 + 4.0 * torch.rand(8, 1, generator=g)
    logits = (torch.randn(8, 49152, generator=g) * scale)[2:4]
    probes: list[tuple[int, list[int]]] = []
    probe = exact._probe

    def counted(family, mode, cand, m, *args, **kwargs):
        probes.append((cand.log_x.shape[-1], m.tolist()))
        return probe(family, mode, cand, m, *args, **kwargs)

    monkeypatch.setattr(exact, "_probe", counted)
    out, k = bregman_decode_logits(logits, alpha=4.0, lam=1e-20, mode="dual", return_k=True)
    assert (k > 4096).all() and torch.isfinite(torch.logsumexp(out.double(), -1)).all(), k
    assert len(probes) == 1 and probes[0][0] > 4096, probes
    sizes = torch.tensor(probes[0][1])
    assert ((sizes - k).abs() <= 1).all(), (probes, k)


def test_a_bracket_closed_at_a_held_map_is_not_solved_again(monkeypatch):
    """A probe at m leaves k* >= m + 1 (its series reaches no size above it), the next probe
    at m + 1 finds G(m + 1) <= lambda: the bracket closes at the map that probe holds, T_k*,
    which is the output (no solve of T_k* from cold after the search: measured 6 joint Newton
    passes over the row). A row of the attack (dual alpha 10, lambda 1e-100) at [1, 49152]."""
    g = torch.Generator().manual_seed(0)
    scale = 3.0 + 4.0 * torch.rand(8, 1, generator=g)
    logits = (torch.randn(8, 49152, generator=g) * scale)[2:3]
    solves: list[list[int]] = []
    renorm = exact._renorm_at

    def counted(*args, **kwargs):
        solves.append(args[3].tolist())
        return renorm(*args, **kwargs)

    monkeypatch.setattr(exact, "_renorm_at", counted)
    out, k = bregman_decode_logits(logits, alpha=10.0, lam=1e-100, mode="dual", return_k=True)
    assert solves == [] and 40000 < int(k) < 49152, (solves, k)
    cand = candidates(logits, 49152, logits=True)
    fresh = renorm(Family.EXACT, "dual", cand, k, torch.tensor([10.0], dtype=F64))
    kept = out[0, cand.index[0, : int(k)]]  # (float32 logits: log q written as float32)
    assert torch.equal(kept, fresh[0, : int(k)].to(kept.dtype))


@pytest.mark.parametrize(("mode", "alpha", "lam"), [("dual", 4.0, 1e-16), ("primal", 3.0, 1e-12)])
def test_a_prediction_next_to_the_expected_size_values_only_the_columns_there(
        mode, alpha, lam, monkeypatch):
    """`predict.predicted_near`: the sizes `predict.predicted_sizes` predicts from a
    multiplier's values, with the entry terms and Halley steps of 2 x `NEAR_REACH` + 1
    columns per row (not of every column) where k* is expected next to a given size; where it
    is not
    (the guess at an end of those columns), the whole row's prediction: the same guesses."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 16384, generator=g) * 0.3
    cand = candidates(logits, 16384, logits=True)
    a, lm = torch.full((2,), alpha, dtype=F64), torch.full((2,), lam, dtype=F64)
    start, filled = predict.start_values(mode, cand.log_x, cand.deficit, a, lm)
    log_p = cand.log_x[:, :start.log_q.shape[-1]]  # (twice the support it filled, and some)
    assert (filled > 4 * predict.NEAR_REACH).all(), filled
    valued = [0]
    terms = predict.log_entry_term

    def counted(mode, log_p, *args):
        valued[0] += log_p.shape[-1]
        return terms(mode, log_p, *args)

    monkeypatch.setattr(predict, "log_entry_term", counted)
    low = torch.full((2,), 256)
    whole = predict.predicted_sizes(mode, log_p, cand.deficit, start, a, lm, low, 255)
    every = valued[0]
    valued[0] = 0
    near = predict.predicted_near(mode, log_p, cand.deficit, start, a, lm, low, 255,
                                  whole[0])
    assert torch.equal(near[0], whole[0]), (near[0], whole[0])
    assert valued[0] == 2 * predict.NEAR_REACH + 1 < every // 8, (valued, every)
    rows = torch.arange(2)
    inside = torch.isfinite(near[1]).nonzero()
    # (the same shifts, but for the rounding of sums carried in one piece)
    assert torch.allclose(near[1][inside[:, 0], inside[:, 1]],
                          whole[1][inside[:, 0], inside[:, 1]], rtol=1e-9, atol=0)
    assert inside.numel() and not torch.isfinite(near[1][rows, -1]).any()
    # Expected far below k*: the guess at the first column valued, so the whole row again.
    valued[0] = 0
    far = predict.predicted_near(mode, log_p, cand.deficit, start, a, lm, low, 255,
                                 whole[0] // 2)
    assert torch.equal(far[0], whole[0]) and valued[0] > every, (far[0], whole[0], valued)


def test_the_next_probe_starts_from_inner_unknowns_moved_to_second_order(monkeypatch):
    """Between two probes of dual alpha 20 the multiplier moves by about 1 (a hundred sizes
    apart); the inner unknowns moved to second order in s (`predict.moved_state`) start the
    joint Newton closer to its root than y moved to first order (the start before): fewer
    passes over the columns for the same map."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 8192, generator=g) * torch.tensor([[4.0], [6.0]])
    cand = candidates(logits, 8192, logits=True)
    a = torch.full((2,), 20.0, dtype=F64)
    first, second = torch.tensor([6000, 5000]), torch.tensor([6100, 5100])
    near = exact._solved(Family.EXACT, "dual", cand.log_x, first, a,
                         exact._log_deficit(cand, first))
    target = exact._solved(Family.EXACT, "dual", cand.log_x, second, a,
                           exact._log_deficit(cand, second))
    shift = (target.s - near.s).unsqueeze(-1)
    assert (shift.abs() > 0.3).all(), shift
    y = torch.exp(near.state)
    ahead = y + near.rate * shift
    starts = {"first order": torch.where(ahead > 0.5 * y, torch.log(ahead), near.state),
              "second order": predict.moved_state(near.state, predict.state_drift(near), shift)}
    passes = {}
    terms = dual._inner_terms
    for name, state in starts.items():
        count = [0]

        def counted(*args, count=count, **kwargs):
            count[0] += 1
            return terms(*args, **kwargs)

        monkeypatch.setattr(dual, "_inner_terms", counted)
        solved = exact._solved(Family.EXACT, "dual", cand.log_x, second, a,
                               exact._log_deficit(cand, second), target.s.clone(), state)
        assert torch.allclose(solved.s, target.s, rtol=0, atol=1e-12)
        passes[name] = count[0]
    assert passes["second order"] < passes["first order"], passes


def test_a_round_is_no_wider_than_its_rows_sizes_need(monkeypatch):
    """Candidate rounds grow 8x, up to the whole row, but no wider than the widest k_max or
    fixed k among the rows left (`exact._widest`): rows capped at 200, which the step hands over
    with k* >= 64 known, decode in one round of 200 (it was 512; the server's `--max-support`
    gives every request such a cap), with
    the k* and the values of a decode whose rounds are not cut (checked against the same call
    with one round of the whole row); a row whose k* is known to be its k_max (the width of a
    round) still gets a wider round, and finishes."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 4096, generator=g) * 0.3  # flat: k* in the thousands uncapped
    widths: list[int] = []
    real = exact.candidates

    def recorded(scores, width, **kwargs):
        widths.append(width)
        return real(scores, width, **kwargs)

    monkeypatch.setattr(exact, "candidates", recorded)
    _, k = bregman_decode_logits(logits, alpha=3.0, lam=1e-12, k_max=200, return_k=True)
    assert widths == [200] and torch.equal(k, torch.full_like(k, 200)), (widths, k)
    mixed = dict(alpha=3.0, lam=torch.tensor([1e-12, 1e-12, 1e-12, 0.05]),
                 k_max=torch.tensor([200, 100, 150, 0]))
    widths.clear()
    out_mixed, k_mixed = bregman_decode_logits(logits, **mixed, return_k=True)
    assert widths[-1] <= 512 and max(widths) == widths[-1], widths
    monkeypatch.setattr(exact, "INITIAL_CANDIDATES", 4096)  # one round, the whole row
    whole, k_whole = bregman_decode_logits(logits, **mixed, return_k=True)
    assert torch.equal(k_mixed, k_whole)
    torch.testing.assert_close(out_mixed, whole, rtol=0, atol=1e-6)
    monkeypatch.undo()
    # k* known to be 64 = k_max = the first round's width: the next round is 65 wide.
    plan = exact.exact_plan("primal", torch.tensor([3.0], dtype=F64), torch.tensor([1e-12],
                            dtype=F64), torch.tensor([0]), torch.tensor([64]))
    scores = logits[:1].clone()
    k_out = torch.zeros(1, dtype=torch.long)
    exact.decode_exact(scores, k_out, logits[:1], plan, logits=True, low=torch.tensor([64]))
    assert int(k_out) == 64 and int(torch.isfinite(scores).sum()) == 64


@pytest.mark.parametrize("width", [100, 192, 512, 700])
def test_a_wide_round_takes_one_top_k_on_a_cpu_with_the_same_candidates(width, monkeypatch):
    """On a CPU a round that would gather a quarter of the row or more again takes one plain
    top-k instead (`candidates.PLAIN_TOP_K_FRACTION`): the same candidates and deficits, to the
    rounding of the mass left outside (summed in another order), as the two-stage selection's
    (still what other devices run), on logits and on probabilities with ties."""
    from bregman_vllm.core import candidates as module

    g = torch.Generator().manual_seed(width)
    logits = torch.randn(3, 49152, generator=g) * torch.tensor([[0.3], [3.0], [8.0]])
    probs = torch.softmax(logits, -1)
    probs[0, :300] = probs[0, 0]  # ties across the selection's edge
    for scores, is_logits in ((logits, True), (probs, False)):
        plain = module.candidates(scores, width, logits=is_logits)
        monkeypatch.setattr(module, "PLAIN_TOP_K_FRACTION", {})
        blocks = module.candidates(scores, width, logits=is_logits)
        monkeypatch.undo()
        # (x is normalized by the mass inside plus the mass outside, summed in another order)
        torch.testing.assert_close(plain.x, blocks.x, rtol=1e-6, atol=0)
        torch.testing.assert_close(plain.deficit, blocks.deficit, rtol=1e-6, atol=0)
        for row in (1, 2):  # no ties: the same entries (a tie may be broken either way)
            assert torch.equal(plain.index[row].sort().values, blocks.index[row].sort().values)
        assert torch.equal(plain.valid, blocks.valid) and torch.equal(plain.known, blocks.known)


@pytest.mark.parametrize("alpha", [2.5, 4.0])
def test_a_support_far_below_k_star_starts_the_dual_map_at_its_brackets_end(alpha,
                                                                            monkeypatch):
    """A support holding little of the mass (flat rows capped at k_max = 256 where k* is in the
    thousands, what a server's `--max-support` makes common): the shaped start's own root lies
    past the end of the exact equation's bracket, and `_shaped_start` starts there at once (its
    Newton bisected towards that end for all 100 steps, 3/4 of the call's time); the map
    equals Algorithm 1's nested root finding to rounding."""
    from bregman_vllm.core import roots

    g = torch.Generator().manual_seed(8)
    p = torch.softmax(torch.randn(4, 4096, generator=g, dtype=F64) * 0.3, -1)
    p = torch.sort(p, -1, descending=True).values
    log_p, k = torch.log(p), torch.full((4,), 256)
    mask = support_mask(k, 4096)
    log_deficit = torch.log1p(-torch.where(mask, p, 0.0).sum(-1))
    assert bool((log_deficit > math.log(0.8)).all())  # more than 80% of the mass outside
    steps: list[int] = []
    solve = roots.safeguarded_newton

    def counted(evaluate, x, low, high, moved=None):
        calls = [0]

        def each(value):
            calls[0] += 1
            return evaluate(value)

        try:
            return solve(each, x, low, high, moved)
        finally:
            steps.append(calls[0])

    monkeypatch.setattr(dual, "safeguarded_newton", counted)
    a = torch.full((4,), alpha, dtype=F64)
    joint = dual.dual_multiplier(log_p, mask, a, log_deficit, k)
    assert steps and max(steps) <= 3, steps
    beta = (a - 1.0).unsqueeze(-1)
    finite = torch.isfinite(log_p)
    low, high, first = dual._outer_bracket(log_p, finite, mask, beta, log_deficit, k)
    _, z = dual._nested(log_p, finite, mask, beta, log_deficit, first,
                        dual._inner_start(beta, log_p, first), low, high, None)
    nested = _normalized(log_p + torch.exp(z), mask)
    ours = _normalized(joint.log_q, mask)
    assert (ours.exp() - nested.exp()).abs().max() < 1e-13
