"""The math core against a float64 reference written from the paper (tests/reference.py).

Brute force over every support (greedy optimality, Theorems greedy_optimal / greedy-dual), exact
cost(k) for every k (k-convexity, Theorem 3.3, and the choice of k*), closed forms against
root finding, primal = dual at alpha in {1, 2}, dual KKT residuals (eq. ren-dual), the entmax
package as an outside check, continuity in alpha, and batched / float32 consistency.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from bregman_vllm import bregman_decode, bregman_decode_logits, renormalize
from bregman_vllm.core.dual import dual_log_renorm
from bregman_vllm.core.families import Family
from bregman_vllm.core.maps import log_renorm
from bregman_vllm.core.plan import exact_plan, make_plan
from bregman_vllm.core.primal import newton_log_renorm, support_mask, three_halves_log_renorm
from bregman_vllm.core.step import decode_exact

from . import reference as ref
from . import reference_search as rs


def renorm_rows(mode: str, log_p: torch.Tensor, k: torch.Tensor, alpha: torch.Tensor,
                log_deficit: torch.Tensor) -> torch.Tensor:
    """`maps.log_renorm` for rows of any alphas (fixed-k alphas), each row with the family the
    plan gives it (`plan.make_plan`, one group per family)."""
    plan = make_plan(mode, alpha.reshape(-1), 0.0, top_k=k.reshape(-1), batch_shape=k.numel(),
                     vocab=log_p.shape[-1], device=log_p.device)
    out = torch.full_like(log_p, -math.inf)
    for group in plan.groups:
        index = group.rows_or_all(log_p.device)
        out[index] = log_renorm(group.family, mode, log_p[index], k[index], alpha[index],
                                log_deficit[index])
    return out


F64 = torch.float64


def random_distribution(rng: random.Random, size: int, zeros: int = 0, ties: bool = False
                        ) -> list[float]:
    scale = rng.choice([0.5, 1.5, 3.0, 6.0])
    logits = [rng.gauss(0.0, scale) for _ in range(size)]
    if ties and size > 2:
        logits[1] = logits[0]
        logits[-1] = logits[-2]
    top = max(logits)
    weights = [math.exp(v - top) for v in logits]
    for i in rng.sample(range(size), min(zeros, size - 1)):
        weights[i] = 0.0
    total = sum(weights)
    return [w / total for w in weights]


PRIMAL_ALPHAS = [0.5, 1.0, 1.5, 2.0, 3.0]
DUAL_ALPHAS = [1.5, 2.0, 3.0, 5.0]


def cases():
    rng = random.Random(1234)
    out = []
    for mode, alphas in (("primal", PRIMAL_ALPHAS), ("dual", DUAL_ALPHAS)):
        for alpha in alphas:
            for trial in range(6):
                size = rng.randint(1, 8)
                p = random_distribution(rng, size, zeros=trial % 3, ties=trial == 4)
                lam = 10 ** rng.uniform(-4, 0)
                out.append(pytest.param(mode, alpha, p, lam, id=f"{mode}-{alpha}-{trial}"))
    return out


@pytest.mark.parametrize(("mode", "alpha", "p", "lam"), cases())
def test_greedy_optimality_against_brute_force(mode, alpha, p, lam):
    """The decoded support is a top-k set and attains the minimum over all 2^V supports."""
    out = bregman_decode(torch.tensor(p, dtype=F64), alpha=alpha, lam=lam, mode=mode)
    q = out.probs.tolist()
    support = [i for i, v in enumerate(q) if v > 0]
    assert len(support) == out.k.item()
    best, _ = ref.brute_force(p, alpha, lam, mode)
    found = ref.cost(p, support, alpha, lam, mode)
    assert found <= best + 1e-9 * (1 + abs(best))
    outside = [p[i] for i in range(len(p)) if i not in support]
    assert min(p[i] for i in support) >= max(outside, default=0.0)
    expected = ref.decoded(p, support, alpha, mode)
    assert max(abs(a - b) for a, b in zip(q, expected, strict=True)) < 1e-10


@pytest.mark.parametrize(("mode", "alpha", "p", "lam"), cases())
def test_cost_is_discretely_convex_and_k_star_minimizes_it(mode, alpha, p, lam):
    costs = ref.top_k_costs(p, alpha, lam, mode)
    for k in range(1, len(costs) - 1):
        assert costs[k + 1] - 2 * costs[k] + costs[k - 1] >= -1e-10
    k_star = bregman_decode(torch.tensor(p, dtype=F64), alpha=alpha, lam=lam, mode=mode).k.item()
    low = min(costs)
    assert costs[k_star - 1] <= low + 1e-10 * (1 + abs(low))
    # Ties go to the smaller support: k* is the first k with G(k) = cost(k) - cost(k+1) +
    # lambda <= lambda (the independent reference's binary search, tests/reference_search.py),
    # unless lambda is within rounding of a gap.
    with np.errstate(divide="ignore"):  # (zeros in p: -inf, entries outside every support)
        want = rs.decode(np.log(np.array(p))[None], alpha, lam, mode)
    assert k_star == int(want.k[0]) or want.margin(lam)[0] < 1e-9, (k_star, int(want.k[0]))


def test_k_star_on_a_long_flat_tail_needs_several_candidate_rounds():
    """k* in the hundreds: the candidate set grows (64 -> 512 -> ...) and stays exact."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5000, generator=g, dtype=F64) * 0.3
    p = torch.softmax(logits, -1)
    for alpha, gaps, lam in ((1.0, "kl", 3e-3), (2.0, "sq", 5e-6)):
        out = bregman_decode(p, alpha=alpha, lam=lam)
        ps = torch.sort(p, -1, descending=True).values
        s = torch.cumsum(ps, -1)
        r = 1 - s
        k = torch.arange(1, 5000, dtype=F64)
        if gaps == "kl":
            g_k = torch.log1p(ps[:, 1:] / s[:, :-1])
        else:
            g_k = (k * ps[:, 1:] + r[:, :-1]) ** 2 / (2 * k * (k + 1))
        stops = torch.nn.functional.pad(g_k <= lam, (0, 1), value=True)  # k = 5000 always
        expected = stops.to(torch.int64).argmax(-1) + 1
        assert (out.k == expected).all(), (alpha, out.k, expected)
        assert (out.k > 64).all() and (out.k < 5000).all()


def test_closed_forms_agree_with_root_finding():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(20, 12, generator=g, dtype=F64) * 2, -1)
    lp = torch.sort(torch.log(p), -1, descending=True).values
    k = torch.randint(1, 12, (20,), generator=g)
    mask = support_mask(k, 12)
    deficit = 1 - torch.where(mask, lp.exp(), 0.0).sum(-1)
    for alpha in (1.5, 2.0):
        a = torch.full((20,), alpha, dtype=F64)
        closed = renorm_rows("primal", lp, k, a, torch.log(deficit))
        newton = newton_log_renorm(lp, mask, a, torch.log(deficit), k)
        assert torch.allclose(closed.exp(), newton.exp(), atol=1e-14, rtol=0)
    three_halves = three_halves_log_renorm(lp, mask, torch.log(deficit), k)
    paper = []  # Proposition alpha-special-cases, verbatim: c = [sqrt(r^2 + k(1 - s)) - r] / k
    for row in range(20):
        x = lp[row, : k[row]].exp()
        r, s, kk = x.sqrt().sum(), x.sum(), k[row].item()
        c = (torch.sqrt(r * r + kk * (1 - s)) - r) / kk
        paper.append(torch.nn.functional.pad((x.sqrt() + c) ** 2, (0, 12 - kk)))
    assert torch.allclose(three_halves.exp(), torch.stack(paper), atol=1e-14)


@pytest.mark.parametrize("alpha", [0.3, 0.5, 1.25, 1.5, 2.0, 3.0, -2.0])
def test_primal_map_matches_reference_bisection(alpha):
    rng = random.Random(7)
    for _ in range(10):
        x = random_distribution(rng, 6, zeros=0)
        x = [v * rng.uniform(0.3, 1.0) for v in x]
        got = renormalize(torch.tensor(x, dtype=F64), alpha=alpha).tolist()
        want = ref.primal_project(x, alpha)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-11


@pytest.mark.parametrize("alpha", [1.1, 1.5, 2.5, 4.0, 8.0])
def test_dual_map_matches_reference_bisection(alpha):
    rng = random.Random(8)
    for _ in range(10):
        x = [v * rng.uniform(0.3, 1.0) for v in random_distribution(rng, 6)]
        got = renormalize(torch.tensor(x, dtype=F64), alpha=alpha, mode="dual").tolist()
        want = ref.dual_project(x, alpha)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-11


@pytest.mark.parametrize("alpha", [1.0001, 1.3, 1.5, 2.5, 3.0, 10.0, 50.0, 200.0])
def test_dual_map_kkt_residuals(alpha):
    """eq. (5): q_i^(alpha-2) (q_i - p_i) = nu for every i, and sum q = 1."""
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(50, 10, generator=g, dtype=F64) * 3, -1)
    p = torch.sort(p, -1, descending=True).values * 0.8
    k = torch.randint(1, 11, (50,), generator=g)
    mask = support_mask(k, 10)
    deficit = 1 - torch.where(mask, p, 0.0).sum(-1)
    q = renorm_rows("dual", torch.log(p), k, torch.full((50,), alpha, dtype=F64),
                    torch.log(deficit)).exp()
    assert torch.allclose(q.sum(-1), torch.ones(50, dtype=F64), atol=1e-14)
    moved = torch.where(mask, q - p, -1.0).argmax(-1, keepdim=True)
    qj, pj = q.gather(1, moved), p.gather(1, moved)
    log_nu = (alpha - 2) * torch.log(qj) + torch.log(qj - pj)
    predicted = torch.where(mask, p + torch.exp(log_nu + (2 - alpha) * torch.log(q)), 0.0)
    assert (torch.where(mask, q, 0.0) - predicted).abs().max() < 1e-13
    assert (torch.where(mask, q - p * (1 - 4e-15), 0.0) >= 0).all()  # q_i >= p_i (rounding)


@pytest.mark.parametrize("alpha", [1.5, 3.0])
def test_dual_closed_inner_solve_equals_nested_newton(alpha):
    """alpha in {3/2, 3}: the quadratic inner formula and the general inner Newton agree, zero
    entries in the support included."""
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(40, 12, generator=g, dtype=F64) * 4, -1)
    p[::3, -2:] = 0.0
    p = torch.sort(p / p.sum(-1, keepdim=True), -1, descending=True).values
    k = torch.randint(1, 13, (40,), generator=g)
    mask = support_mask(k, 12)
    log_deficit = torch.log1p(-torch.where(mask, p, 0.0).sum(-1).clamp_max(1 - 1e-300))
    a = torch.full((40,), alpha, dtype=F64)
    family = Family.DUAL_THREE_HALVES if alpha == 1.5 else Family.DUAL_THREE
    closed = dual_log_renorm(torch.log(p), mask, a, log_deficit, k, closed=family).exp()
    newton = dual_log_renorm(torch.log(p), mask, a, log_deficit, k).exp()
    assert not closed.isnan().any()
    assert (closed - newton).abs().max() < 1e-13
    assert torch.allclose(closed.sum(-1), torch.ones(40, dtype=F64), atol=1e-14)


def test_primal_equals_dual_at_alpha_one_and_two():
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(30, 200, generator=g) * 2.5, -1)
    for k in (1, 5, 40):
        primal = bregman_decode(p, alpha=1.0, lam=0.0, top_k=k)
        dual = bregman_decode(p, alpha=1.0, lam=0.0, top_k=k, mode="dual")
        assert torch.allclose(primal.probs, dual.probs, atol=1e-7)
    for lam in (1e-4, 1e-2, 0.3):
        primal = bregman_decode(p, alpha=2.0, lam=lam)
        dual = bregman_decode(p, alpha=2.0, lam=lam, mode="dual")
        assert torch.equal(primal.k, dual.k)
        assert torch.allclose(primal.probs, dual.probs, atol=1e-7)


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0, 3.0])
def test_primal_map_equals_entmax(alpha):
    """T_alpha(x) = entmax_alpha(x^(alpha-1) / (alpha-1)) on the support (outside check)."""
    entmax = pytest.importorskip("entmax")
    g = torch.Generator().manual_seed(4)
    x = torch.softmax(torch.randn(16, 9, generator=g, dtype=F64) * 2, -1) * 0.7
    scores = x ** (alpha - 1) / (alpha - 1)
    theirs = entmax.entmax_bisect(scores, alpha=alpha, n_iter=200)
    ours = renormalize(x, alpha=alpha)
    assert torch.allclose(ours, theirs, atol=1e-10)


def test_alpha_to_one_approaches_top_k_continuously():
    g = torch.Generator().manual_seed(5)
    x = torch.softmax(torch.randn(8, 12, generator=g, dtype=F64) * 2, -1) * 0.6
    kl = x / x.sum(-1, keepdim=True)
    previous = math.inf
    for eps in (1e-1, 1e-2, 1e-4, 1e-6, 1e-9, 1e-12):
        for sign in (1, -1):
            q = renormalize(x, alpha=1 + sign * eps)
            gap = (q - kl).abs().max().item()
            assert math.isfinite(gap) and gap < 2 * eps
        assert gap <= previous
        previous = gap


def test_large_alpha_approaches_water_filling_and_argmax_fill():
    x = torch.tensor([0.5, 0.2, 0.1, 0.05, 0.01, 0.005], dtype=F64)
    water = renormalize(x, alpha=math.inf)
    assert torch.allclose(water, torch.tensor([0.5, 0.2, 0.1, 0.2 / 3, 0.2 / 3, 0.2 / 3],
                                              dtype=F64), atol=1e-15)
    errors = [(renormalize(x, alpha=a) - water).abs().max().item() for a in (5, 50, 1000, 1e5)]
    assert all(math.isfinite(e) for e in errors)
    assert errors == sorted(errors, reverse=True) and errors[-1] < 1e-4
    fill = renormalize(x, alpha=-math.inf)
    assert torch.allclose(fill, x + torch.tensor([1 - x.sum(), 0, 0, 0, 0, 0], dtype=F64))
    errors = [(renormalize(x, alpha=a) - fill).abs().max().item() for a in (-5, -50, -1000)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < 1e-2


def test_large_alpha_adaptive_decoding_stays_finite():
    g = torch.Generator().manual_seed(6)
    p = torch.softmax(torch.randn(16, 3000, generator=g) * 3, -1)
    for mode in ("primal", "dual"):
        for alpha in (50.0, 1000.0):
            for lam in (0.0, 1e-12, 1e-3, 10.0):
                out = bregman_decode(p, alpha=alpha, lam=lam, mode=mode)
                assert torch.isfinite(out.probs).all()
                assert torch.allclose(out.probs.sum(-1), torch.ones(16), atol=1e-5)
                assert (out.k >= 1).all()


def test_argmax_tie_shares_the_deficit_at_minus_infinity():
    x = torch.tensor([0.3, 0.3, 0.1], dtype=F64)
    assert torch.allclose(renormalize(x, alpha=-math.inf),
                          torch.tensor([0.45, 0.45, 0.1], dtype=F64))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_lambda_zero_keeps_the_whole_support(dtype):
    """lambda = 0 (cost(k) decreasing in k): k* = every nonzero entry, renormalized; rows that are
    not distributions come back unchanged with k = 0. Every row or only some rows at lambda = 0."""
    g = torch.Generator().manual_seed(11)
    p = torch.softmax(torch.randn(6, 50, generator=g, dtype=F64) * 2, -1)
    p[1, 10:] = 0.0
    p[2] *= 3.0  # not normalized: normalized by its sum
    p[3, :] = 0.0  # no mass
    p[4, 7] = math.nan
    p[5, 0], p[5, 1:] = 1.0, 1e-44 if dtype == torch.float32 else 1e-320  # subnormal tail
    p = p.to(dtype)
    expected = p.double() / p.double().sum(-1, keepdim=True)
    for lam in (0.0, torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.1], dtype=F64)):
        out = bregman_decode(p, alpha=1.5, lam=lam)
        assert out.probs.dtype == dtype
        for row in (0, 1, 2):
            assert out.k[row] == (p[row] > 0).sum()
            assert (out.probs[row].double() - expected[row]).abs().max() < 1e-6
        assert out.k[3] == 0 and out.k[4] == 0
        assert torch.equal(out.probs[3], p[3])
        assert torch.equal(out.probs[4].isnan(), p[4].isnan())
        if isinstance(lam, float):
            assert out.k[5] == (out.probs[5] > 0).sum() and out.k[5] >= 1
        assert not out.probs[[0, 1, 2, 5]].isnan().any()


@pytest.mark.parametrize("mode", ["primal", "dual"])
def test_mixed_rows_in_one_batch_decode_as_each_row_alone(mode: str) -> None:
    """One batch holding lambda = 0 rows (whole support), a fixed top-k row and adaptive rows of
    several alphas: the plan's row groups and distinct alphas (derived once per plan) must give
    every row exactly what it gets alone."""
    generator = torch.Generator().manual_seed(3)
    p = torch.softmax(2 * torch.randn(6, 60, generator=generator, dtype=torch.float64), -1)
    alpha = [1.5, 1.5, 2.0, 3.0, 1.5, 2.0]
    lam = [0.0, 0.01, 0.0, 0.001, 0.05, 0.01]
    top_k = [0, 0, 5, 0, 0, 0]
    out = bregman_decode(p, alpha=torch.tensor(alpha), lam=torch.tensor(lam), mode=mode,
                         top_k=torch.tensor(top_k))
    for row in range(6):
        alone = bregman_decode(p[row], alpha=alpha[row], lam=lam[row], mode=mode,
                               top_k=top_k[row] or None)
        assert int(out.k[row]) == int(alone.k)
        torch.testing.assert_close(out.probs[row], alone.probs, rtol=0, atol=1e-12)
    assert int(out.k[0]) == 60  # lambda = 0: the whole support


def test_exact_path_rows_that_wait_for_a_wider_round_keep_their_own_probabilities() -> None:
    """Regression: in one call of the exact path, a fixed-k row wider than a round waits for a
    later one while an adaptive row is sent on; when every row met again in one round they came
    back in another order, and the round read ``p`` as if they were in order (each row got the
    other's probabilities). (The step calls the exact path per group, where this cannot occur;
    the exact path is also the reference that tests and benchmarks call directly.)"""
    generator = torch.Generator().manual_seed(0)
    flat = torch.softmax(torch.randn(1, 3000, generator=generator) * 0.3, -1)
    peaked = torch.softmax(torch.randn(1, 3000, generator=generator) * 5, -1)
    p = torch.cat([flat, peaked]).to(F64)

    def exact(rows: slice, lam: list[float], fixed: list[int]):
        n = len(lam)
        out, k = torch.zeros(n, 3000, dtype=F64), torch.zeros(n, dtype=torch.long)
        plan = exact_plan("primal", torch.full((n,), 0.5, dtype=F64),
                          torch.tensor(lam, dtype=F64), torch.tensor(fixed),
                          torch.zeros(n, dtype=torch.long))
        decode_exact(out, k, p[rows], plan, logits=False)
        return out, k

    both, k_both = exact(slice(0, 2), [1e-9, 0.0], [0, 1000])
    for row, (lam, fixed) in enumerate(((1e-9, 0), (0.0, 1000))):
        alone, k_alone = exact(slice(row, row + 1), [lam], [fixed])
        assert int(k_both[row]) == int(k_alone[0])
        torch.testing.assert_close(both[row], alone[0], rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- extreme parameters

#: Every end of the parameter model's ranges (`bregman_vllm.params`): alpha next to 0, next to 1
#: and at +-1e8, lambda from the smallest subnormal to the largest double, k_max / top_k 1 and
#: 2^31 - 1. (mode, alpha, lambda, top_k, k_max).
TINY, HUGE, BIGGEST = 5e-324, 1e8, 1.7976931348623157e308
EXTREMES = [
    *[("primal", a, lam, 0, 0) for a in (TINY, 1e-8, HUGE) for lam in (TINY, 1e-2, BIGGEST)],
    *[("dual", a, lam, 0, 0) for a in (1 + 2**-52, 1 + 1e-9, HUGE)
      for lam in (TINY, 1e-2, BIGGEST)],
    ("dual", 1 + 1e-9, 1e9, 0, 0),  # k* < V next to alpha = 1
    ("primal", HUGE, 1e-12, 0, 1), ("dual", HUGE, 0.0, 0, 2**31 - 1),
    ("primal", 1.5, 0.0, 0, 2), ("dual", 1.5, TINY, 0, 1),
    *[("primal", a, 0.0, top, 0) for a in (-HUGE, -TINY, TINY, HUGE, -math.inf, math.inf)
      for top in (1, 3)],
    ("primal", 1.5, 0.0, 2**31 - 1, 0),
    *[("dual", a, 0.0, 3, 0) for a in (1.0, 1 + 2**-52, HUGE, math.inf)],
]


@pytest.mark.parametrize(("mode", "alpha", "lam", "top_k", "k_max"), EXTREMES,
                         ids=[f"{m}-{a:g}-{lam:g}-top{t}-cap{c}" for m, a, lam, t, c in EXTREMES])
def test_every_end_of_the_parameter_ranges_decodes_exactly(mode, alpha, lam, top_k, k_max):
    """Each extreme valid value gives a finite distribution equal to the minimizer of problem
    (2) / (3) computed with enough digits (`reference.precise_decode`, mpmath): the same support
    size, and total variation at most `families.KEEP_ALL_TOLERANCE` (the lambda -> 0 limit's
    bound) plus rounding."""
    from bregman_vllm.core.families import KEEP_ALL_TOLERANCE

    p = [0.45, 0.25, 0.15, 0.1, 0.04, 0.01]
    out = bregman_decode(torch.tensor(p, dtype=F64), alpha=alpha, lam=lam, mode=mode,
                         top_k=top_k or None, k_max=k_max or None)
    q = out.probs.tolist()
    assert all(math.isfinite(v) and v >= 0 for v in q)
    if math.isinf(alpha):  # the limits themselves: Proposition 4.1's closed forms
        x = p[:top_k]
        rest = 1.0 - sum(x)
        if alpha > 0:
            want = [max(v, c) for v in x for c in [_water_level(x, rest)]]
        else:
            want = [x[0] + rest, *x[1:]]
        k_ref, q_ref = top_k, want + [0.0] * (len(p) - top_k)
    else:
        k_ref, q_ref = ref.precise_decode(p, alpha, lam, mode, top_k=top_k, k_max=k_max)
    assert int(out.k) == k_ref
    distance = 0.5 * sum(abs(a - b) for a, b in zip(q, q_ref, strict=True))
    assert distance <= KEEP_ALL_TOLERANCE + 1e-12, (q, q_ref)


def _water_level(x: list[float], rest: float) -> float:
    """c with sum_i max(x_i, c) = sum(x) + rest (water-filling, Proposition 4.1)."""
    xs = sorted(x)
    for j in range(len(xs)):  # the j smallest entries under water
        c = (sum(xs[:j + 1]) + rest) / (j + 1)
        if j + 1 == len(xs) or c <= xs[j + 1]:
            return c
    return 0.0


@pytest.mark.parametrize(("mode", "alpha", "lam", "top_k", "k_max"),
                         [case for case in EXTREMES if case[0] == "dual" or case[1] < 1e-3])
def test_extreme_parameters_on_a_large_vocabulary_stay_cheap_and_finite(mode, alpha, lam,
                                                                        top_k, k_max):
    """The same extremes at [4, 16384] float32 logits (real-sized rows): finite, normalized,
    equal to the float64 decode; rows whose lambda cannot drop a token within the tolerance
    are the lambda -> 0 limit (`families.keeps_all`: every token kept, no search)."""
    from bregman_vllm.core.families import Family, keeps_all

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 16384, generator=g) * torch.tensor([[0.3], [3.0], [5.0], [7.0]])
    kwargs = dict(alpha=alpha, lam=lam, mode=mode, top_k=top_k or None, k_max=k_max or None)
    out, k = bregman_decode_logits(logits, return_k=True, **kwargs)
    assert not out.isnan().any()
    torch.testing.assert_close(torch.logsumexp(out.double(), -1), torch.zeros(4, dtype=F64),
                               rtol=0, atol=1e-5)
    want = bregman_decode(torch.softmax(logits.double(), -1), **kwargs)
    assert torch.equal(k, want.k)
    assert (out.double().exp() - want.probs).abs().max() <= 1e-5  # float32 logits
    if not top_k and not k_max and keeps_all(mode, alpha, lam, 16384):
        plan = make_plan(mode, alpha, lam, batch_shape=4, vocab=16384, device="cpu")
        assert [group.family for group in plan.groups] == [Family.KEEP_ALL]


def test_the_keep_all_limit_bound_holds_where_it_is_used():
    """`families.keeps_all` decides from (mode, alpha, lambda, V) alone; where it says yes, the
    exact answer drops at most the tolerance: checked against the exact path (no limit) on
    rows with a long tail of tiny tokens."""
    from bregman_vllm.core.families import KEEP_ALL_TOLERANCE, keeps_all

    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(3, 3000, generator=g, dtype=F64) * 4, -1)
    checked = 0
    for mode, alpha, lam in (("dual", 1 + 1e-13, 1e-2), ("dual", 1 + 1e-15, 10.0),
                             ("primal", 1e-3, 10.0), ("primal", 0.05, 1e-30),
                             ("primal", 1.5, 1e-300), ("dual", 3.0, 1e-300)):
        assert keeps_all(mode, alpha, lam, 3000)
        out = torch.zeros_like(p)
        k = torch.zeros(3, dtype=torch.long)
        rows = torch.zeros(3, dtype=torch.long)
        plan = exact_plan(mode, torch.full((3,), alpha, dtype=F64),
                          torch.full((3,), lam, dtype=F64), rows, rows)
        decode_exact(out, k, p, plan, logits=False)
        distance = 0.5 * (out - p).abs().sum(-1)
        assert (distance <= KEEP_ALL_TOLERANCE + 1e-12).all(), (mode, alpha, lam, distance)
        checked += 1
    assert not keeps_all("dual", 1 + 1e-6, 1e-2, 3000)
    assert not keeps_all("primal", 1.5, 1e-9, 3000)
    assert checked == 6


@pytest.mark.parametrize("value", [1e308, -1e308, 1.0000001e8, -3e9])
def test_alphas_beyond_the_limit_are_refused_everywhere_with_the_reason(value):
    from bregman_vllm import BregmanParamError, BregmanParams

    for mode in ("primal", "dual"):
        for top_k in (None, 5):
            allowed = mode == "primal" or value > 1
            with pytest.raises(BregmanParamError, match="alpha") as error:
                BregmanParams(mode=mode, alpha=value, top_k=top_k)
            if allowed and not (mode == "primal" and top_k is None and value < 0):
                assert "above 1e8" in str(error.value)
            with pytest.raises(BregmanParamError):
                bregman_decode(torch.tensor([0.6, 0.4]), alpha=value, lam=0.1, mode=mode,
                               top_k=top_k)
    BregmanParams(alpha=1e8)
    BregmanParams(alpha=-1e8, top_k=5)
    BregmanParams(mode="dual", alpha=math.inf, top_k=5)


# ----------------------------------------------------------------------------- the tail


def _tail_row(dtype: torch.dtype = F64, floor: float = 1e-60) -> torch.Tensor:
    """Issue 25's row: 50 ordinary probabilities and 14 between 1e-40 and ``floor``, two pairs
    of them tied, in a fixed shuffled order; 58 entries are kept, so the support holds all
    but the mass of the 6 smallest (a deficit of about 1e-55)."""
    g = torch.Generator().manual_seed(1)  # (a row the old window decoded to 54 entries)
    ordinary = torch.softmax(torch.randn(50, generator=g, dtype=F64) * 2, -1) * (1 - 1e-39)
    exponents = -40.0 + (math.log10(floor) + 40.0) * torch.rand(14, generator=g, dtype=F64)
    tail = torch.sort(10.0 ** exponents, descending=True).values
    tail[2], tail[5] = tail[1], tail[4]  # (ties inside the support, away from its edge)
    p = torch.cat([ordinary, tail])
    return p[torch.randperm(64, generator=g)].to(dtype)


TAIL_FAMILIES = [("dual", 1.5), ("dual", 2.0), ("dual", 2.5), ("dual", 3.0), ("primal", 1.25),
                 ("primal", 1.5), ("primal", 2.0), ("primal", 3.0), ("primal", 0.5)]


@pytest.mark.parametrize(("mode", "alpha"), TAIL_FAMILIES)
def test_maps_are_exact_in_the_tail(mode, alpha):
    """Regression (issue 25): on a row whose support reaches probabilities of 1e-60 with a
    deficit of 1e-55, dual alpha = 3/2 with k_max = 58 returned k = 58 with 52 to 57 positive
    entries (q_i < p_i in the tail: the window's Newton met sum q = 1 only to rounding). Every
    family now keeps all 58 entries, each q_i >= p_i (both maps only add mass, eqs. (4), (5)),
    the window's solvers and the exact path's agree entry by entry, and q is the independent
    reference's map (tests/reference_search.py) entry by entry within 1e-12 relative, for every
    family: the maps' equations (q^(alpha-2) (q - p) = nu dual, q^b - p^b = c^b primal) where
    the lifts are resolved (alpha >= 2), q = p to rounding where they are not (alpha < 2: the
    1e-55 deficit lifts no entry by more than 1e-25 of itself)."""
    p = _tail_row()
    order = torch.sort(p, descending=True).indices
    ps = p[order[:58]]
    for sizes in ({"k_max": 58}, {"top_k": 58}):
        out = bregman_decode(p, alpha=alpha, lam=0.0, mode=mode, **sizes)
        assert int(out.k) == 58
        q = out.probs[order[:58]]
        assert (out.probs > 0).sum() == 58 and (q > 0).all()
        # (to the rounding of log q, |log q| ulps: maps are solved and written in log space)
        assert (q >= ps * (1 - 1e-13)).all(), (q / ps).min()
        # the exact path's multiplier forms (`exact.log_renorm`, family EXACT) on the same row
        log_p = torch.log(ps).unsqueeze(0)
        deficit = torch.log(p[order[58:]].sum()).view(1)
        general = log_renorm(Family.EXACT, mode, log_p, torch.tensor([58]),
                             torch.tensor([alpha], dtype=F64), deficit).exp()[0]
        assert ((q - general).abs() / general).max() < 1e-12
        # The maps' equations, through the independent reference (tests/reference_search.py:
        # the map solved in log space from the deficit, entry by entry relative), for every
        # family: q - p cancels in float64 for most entries of most families, so the equation
        # cannot be checked on q itself there.
        want = rs.renormalize_sorted(torch.log(ps).numpy()[None], np.array([58]),
                                     deficit.numpy(), alpha, mode)[0]
        assert np.abs(q.numpy() / np.exp(want) - 1.0).max() < 1e-12


@pytest.mark.parametrize(("mode", "alpha"), TAIL_FAMILIES)
def test_float32_rows_at_the_floor_keep_every_support_entry(mode, alpha):
    """The same row in float32, its tail between 1e-38 and the smallest subnormal (1.4e-45):
    every kept entry stays positive and at least p (written in float32), k = 58."""
    p = _tail_row(torch.float32, floor=2e-45)
    order = torch.sort(p.double(), descending=True).indices
    out = bregman_decode(p, alpha=alpha, lam=0.0, mode=mode, k_max=58)
    assert out.probs.dtype == torch.float32
    kept = int((p > 0).sum().clamp_max(58))
    assert int(out.k) == kept
    q = out.probs[order[:kept]]
    assert (q > 0).all() and (q >= p[order[:kept]]).all()
    assert (out.probs > 0).sum() == kept
