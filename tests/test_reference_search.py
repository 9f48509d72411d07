"""The core, the Triton kernels and the processor against an independent float64 reference at
real vocabulary sizes (2,048 and 4,096 entries).

The reference (`tests/reference_search.py`) is written from the paper alone and shares no code
with `bregman_vllm`: the maps of eqs. (4) and (5) by root finding in log space (the dual by
Algorithm 1's nested root finding), k* by the paper's binary search over k on the cost gap
G(k) = cost(k) - cost(k+1) + lambda, computed as a sum of nonnegative terms (no cancellation at
k* in the thousands). It is first checked itself: against the brute-force reference
(`tests/reference.py`, every support of at most 8 entries), Proposition 4.1's closed forms,
45-digit mpmath costs at a few hundred entries, and the definition of the cost.

Then every family is compared with it through the public calls only (`bregman_decode`,
`bregman_decode_logits`, `renormalize`; the torch step on the CPU), and the kernels under
Triton's interpreter (`kernels.decode_plan(scores, make_plan(...))`): primal and dual, alpha below
1, next to 1, 3/2, 2, 3, large, +-inf (fixed k), fixed k, k_max, with k* inside the first window
(< 64) and far past it (hundreds to thousands), on flat and peaked rows, at temperatures other
than 1. The processor in a real engine is compared in `tests/test_processor.py`
(``test_processed_distributions_match_the_independent_reference``).

What must agree: k* on every row whose lambda is not within 1e-9 (relative) of a cost gap (the
reference reports that margin; lambda is chosen between two gaps of one row, so every case
has a row with k* at the target); q entry by entry, relative (entries down to 1e-300). A core
that keeps every token where lambda cannot drop 1e-9 of mass (README, "Bounded cost") may keep
more than k*, within that total variation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from bregman_vllm import bregman_decode, bregman_decode_logits, kernels, renormalize
from bregman_vllm.core.plan import make_plan

from . import reference as ref
from . import reference_search as rs

F64 = torch.float64
#: Row scales of the test logits: flat (0.3) to peaked (8): k* from the whole vocabulary to 1.
SCALES = (0.3, 1.0, 2.0, 3.0, 5.0, 8.0)
#: The row whose k* is set to the target by the choice of lambda.
TARGET_ROW = 3
#: Float64 paths: q relative per entry. The core's own float64 steps agree to about 1e-12.
RTOL = 1e-9
#: Within this relative distance of a cost gap, lambda leaves k* to rounding.
TIE = 1e-9
#: README, "Bounded cost": rows where lambda cannot drop more than this total variation keep
#: every token.
KEEP_ALL_TV = 1e-9


def logits_rows(vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((len(SCALES), vocab)) * np.array(SCALES)[:, None]


def lam_for(logits: np.ndarray, alpha: float, mode: str, target: int) -> float:
    """A lambda strictly between G(target - 1) and G(target) of `TARGET_ROW` (their geometric
    mean): k* = target there, far from a tie."""
    row = logits[TARGET_ROW:TARGET_ROW + 1]
    low = rs.log_gap(row, target, alpha, mode)[0]
    high = rs.log_gap(row, target - 1, alpha, mode)[0] if target > 1 else low + 4.0
    lam = math.exp(0.5 * (low + high))
    assert 0 < lam < math.inf and low < math.log(lam) < high, (alpha, mode, target, low, high)
    return lam


def compare(got_q: np.ndarray, got_k: np.ndarray, want: rs.Decoded, lam: float, *,
            rtol: float = RTOL, tie: float = TIE, label: str = "",
            log_p: np.ndarray | None = None) -> float:
    """Row by row: the same k* (unless lambda is within ``tie`` of a gap there, or the core
    kept every token within `KEEP_ALL_TV`), the same support, q within ``rtol`` relative.
    With ``log_p`` (the rows decoded), supports may differ by tokens tied in p at the
    support's edge (a bfloat16 model's logits tie often), q then compared as sorted values.
    Returns the worst relative error of q over the rows compared."""
    margins = want.margin(lam)
    worst = 0.0
    for row in range(len(got_k)):
        k, k_ref = int(got_k[row]), int(want.k[row])
        q, q_ref = got_q[row], want.q[row]
        where = f"{label} row {row}: k {k}, reference {k_ref}, margin {margins[row]:.2e}"
        assert np.all(np.isfinite(q)) and np.all(q >= 0), where
        if k != k_ref:
            if margins[row] < tie and abs(k - k_ref) == 1:
                continue  # a tie within rounding: either size is optimal
            tv = 0.5 * np.abs(q - q_ref).sum()
            assert k > k_ref and tv <= KEEP_ALL_TV + 1e-12, f"{where}, tv {tv:.2e}"
            continue
        on = q_ref > 0
        if log_p is not None and not np.array_equal(q > 0, on):
            edge = np.min(log_p[row][on])  # the smallest p kept by the reference
            swapped = (q > 0) != on
            assert np.all(np.abs(log_p[row][swapped] - edge) <= 1e-6), \
                f"{where}: different supports, not by ties at the edge"
            q, q_ref = np.sort(q)[::-1], np.sort(q_ref)[::-1]
            on = q_ref > 0
        assert np.array_equal(q > 0, on), f"{where}: different supports"
        error = float(np.max(np.abs(q[on] - q_ref[on]) / q_ref[on]))
        assert error <= rtol, f"{where}: q relative error {error:.2e}"
        worst = max(worst, error)
    return worst


# ----------------------------------------------------------------------------- the reference


SMALL = [("primal", a) for a in (0.3, 0.5, 0.9, 1.0, 1.001, 1.05, 1.5, 2.0, 3.0, 10.0)] + \
    [("dual", a) for a in (1.001, 1.5, 3.0, 10.0)]


@pytest.mark.parametrize(("mode", "alpha"), SMALL, ids=[f"{m}-{a:g}" for m, a in SMALL])
def test_reference_matches_the_brute_force_reference_at_small_sizes(mode, alpha):
    """k* and q against `tests/reference.py`: the minimum over every support (greedy property,
    Theorems 3.1, 3.2) and its bisection maps; each gap G(k) against the difference of its
    costs; the map of a sub-probability vector against its bisection map. Primal rows of 7
    entries, dual rows of 5 (its nested bisection in pure Python is slow)."""
    rng = np.random.default_rng(7)
    size, rows = (7, 6) if mode == "primal" else (5, 2)
    for _ in range(rows):
        p = rng.random(size) ** 4
        p /= p.sum()
        lam = 10 ** rng.uniform(-4, -1)
        costs = ref.top_k_costs(list(p), alpha, lam, mode)
        got = rs.decode(np.log(p)[None], alpha, lam, mode)
        best, support = ref.brute_force(list(p), alpha, lam, mode)
        assert int(got.k[0]) == len(support), (p, lam, costs)
        cost = rs.direct_cost(np.log(p)[None], got.k, alpha, lam, mode)[0]
        assert abs(cost - best) <= 1e-12 * (1 + abs(best)) / min(1.0, abs(alpha - 1) or 1.0)
        want = ref.decoded(list(p), support, alpha, mode)
        np.testing.assert_allclose(got.q[0], want, rtol=1e-12, atol=1e-15)
        gaps = np.exp(rs.log_gap(np.tile(np.log(p), (size - 1, 1)), np.arange(1, size), alpha,
                                 mode))
        differences = np.array(costs[:-1]) - np.array(costs[1:]) + lam
        # The brute-force costs are plain float64 sums whose terms grow as 1 / (alpha - 1):
        # their differences keep about 1e-16 / |alpha - 1| absolute.
        np.testing.assert_allclose(gaps, differences, rtol=1e-9,
                                   atol=1e-15 / min(1.0, abs(alpha - 1.0) or 1.0))
        x = rng.random(size - 1) ** 3
        x *= rng.uniform(0.2, 0.99) / x.sum()
        np.testing.assert_allclose(rs.renormalize(x, alpha, mode)[0],
                                   ref.project(list(x), alpha, mode), rtol=1e-12)


def test_reference_maps_match_the_closed_forms_and_limits():
    """Proposition 4.1: the root-found maps at alpha = 1, 3/2, 2 equal the closed forms;
    water-filling and the argmax fill are the maps' limits (alpha = +-1e4 within 1e-3); the
    dual map equals the primal one at alpha in {1, 2, inf} (Appendix "Illustrating primal and
    dual renormalization") and tends to water-filling."""
    rng = np.random.default_rng(3)
    x = rng.random((4, 300)) ** 3
    x *= rng.uniform(0.1, 0.95, (4, 1)) / x.sum(-1, keepdims=True)
    for alpha in (1.0, 1.5, 2.0):
        np.testing.assert_allclose(rs.renormalize(x, alpha), rs.closed_form(x, alpha),
                                   rtol=1e-12)
    for alpha in (1.0, 2.0):
        np.testing.assert_allclose(rs.renormalize(x, alpha, "dual"), rs.renormalize(x, alpha),
                                   rtol=1e-12)
    assert np.max(np.abs(rs.renormalize(x, 1.5, "dual") / rs.renormalize(x, 1.5) - 1)) > 1e-3
    for alpha in (math.inf, -math.inf):
        np.testing.assert_allclose(rs.renormalize(x, alpha), rs.closed_form(x, alpha),
                                   rtol=1e-12)
        limit = rs.renormalize(x, math.copysign(1e4, alpha))
        assert np.max(np.abs(limit - rs.closed_form(x, alpha))) < 1e-3
    np.testing.assert_allclose(rs.renormalize(x, math.inf, "dual"), rs.closed_form(x, math.inf),
                               rtol=1e-12)
    assert np.max(np.abs(rs.renormalize(x, 1e4, "dual") - rs.closed_form(x, math.inf))) < 1e-3


def _mp_gap(p: list, k: int, alpha: float, mode: str) -> float:
    """cost(k) - cost(k+1) + lambda in 45-digit arithmetic, by the definitions: the primal map
    by bisection on log nu (eq. (4)), the dual by nested bisection (Algorithm 1)."""
    import mpmath

    a = mpmath.mpf(alpha)

    def phi(v):
        return v**a / (a * (a - 1))

    def dphi(v):
        return v ** (a - 1) / (a - 1)

    def d(x, y):
        return phi(x) - phi(y) - dphi(y) * (x - y)

    def primal(x):
        b = a - 1
        if b > 0:  # q^b = x^b + nu, nu = e^(b m) > 0, bisection on m
            low, high = mpmath.mpf(-1e5), mpmath.mpf(0)
            for _ in range(200):
                m = (low + high) / 2
                over = sum((v**b + mpmath.exp(b * m)) ** (1 / b) for v in x) > 1
                low, high = (low, m) if over else (m, high)
            nu = mpmath.exp(b * (low + high) / 2)
            return [(v**b + nu) ** (1 / b) for v in x]
        low, high = mpmath.mpf(0), max(x) ** b  # q^b = x^b - w, 0 < w < max(x)^b
        for _ in range(200):
            w = (low + high) / 2
            over = sum((v**b - w) ** (1 / b) for v in x) > 1
            low, high = (low, w) if over else (w, high)
        w = (low + high) / 2
        return [(v**b - w) ** (1 / b) for v in x]

    def dual(x):
        def entry(v, log_nu):  # y^(a-2) (y - v) = nu, y = v + e^l
            low, high = mpmath.log(v) - 300, mpmath.log(1 - v)
            for _ in range(120):
                m = (low + high) / 2
                over = (a - 2) * mpmath.log(v + mpmath.exp(m)) + m > log_nu
                low, high = (low, m) if over else (m, high)
            return v + mpmath.exp((low + high) / 2)

        low, high = mpmath.mpf(-300), mpmath.log(1 - max(x))
        for _ in range(140):
            m = (low + high) / 2
            over = sum(entry(v, m) for v in x) > 1
            low, high = (low, m) if over else (m, high)
        return [entry(v, (low + high) / 2) for v in x]

    def cost(size):
        x = p[:size]
        if mode == "primal":
            return sum(d(q, v) for q, v in zip(primal(x), x, strict=True)) + \
                sum(v**a / a for v in p[size:])
        return sum(d(v, q) for q, v in zip(dual(x), x, strict=True)) + \
            sum(phi(v) for v in p[size:])

    with mpmath.workdps(45):
        return float(cost(k) - cost(k + 1))


@pytest.mark.parametrize(("mode", "alpha", "size", "k"),
                         [("primal", 1.001, 300, 250), ("primal", 3.0, 300, 280),
                          ("primal", 0.5, 300, 290), ("dual", 3.0, 10, 8)])
def test_reference_gaps_deep_in_the_tail_match_high_precision_costs(mode, alpha, size, k):
    """G(k) deep in the tail (k* of hundreds: G(k) is 1e-8 to 1e-13 of the costs), where the
    float64 difference of two costs keeps few digits, against the costs' difference in 45-digit
    arithmetic: within 1e-13 relative (the dual's nested bisection in mpmath keeps it to 10
    entries)."""
    import mpmath

    rng = np.random.default_rng(11)
    log_p = rng.standard_normal(size) * 1.5
    with mpmath.workdps(60):
        p = sorted((mpmath.exp(mpmath.mpf(v)) for v in log_p), reverse=True)
        total = sum(p)
        p = [v / total for v in p]
    got = math.exp(rs.log_gap(log_p[None], k, alpha, mode)[0])
    want = _mp_gap(p, k, alpha, mode)
    assert abs(got / want - 1) < 1e-13, (got, want)


@pytest.mark.parametrize("alpha", [1.001, 1.000001])
def test_high_precision_reference_agrees_next_to_alpha_one(alpha):
    """`reference.precise_decode` (mpmath) and this reference agree on k* and q where the
    primal level is tiny (e^-7000 at alpha = 1.001; it once bisected on [0, 1] and kept every
    token)."""
    rng = np.random.default_rng(5)
    for _ in range(3):
        p = rng.random(8) ** 3
        p /= p.sum()
        k, q = ref.precise_decode(list(p), alpha, 1e-3, "primal")
        got = rs.decode(np.log(p)[None], alpha, 1e-3)
        assert int(got.k[0]) == k
        np.testing.assert_allclose(got.q[0], q, rtol=1e-12, atol=1e-300)


def test_reference_is_finite_at_the_ends_of_its_ranges():
    """alpha 1000 and 1 + 1e-6, p down to e^-700: no overflow, no NaN, rows summing to 1."""
    rng = np.random.default_rng(2)
    log_p = rng.standard_normal((4, 2048)) * 40.0  # entries down to about e^-700
    for mode, alpha, lam in (("primal", 1000.0, 1e-300), ("primal", 1 + 1e-6, 1e-4),
                             ("primal", 0.01, 1e-2), ("dual", 1 + 1e-6, 1e-4),
                             ("dual", 1000.0, 1e-300), ("primal", 1000.0, 0.0)):
        got = rs.decode(log_p, alpha, lam, mode)
        assert not np.isnan(got.log_q).any(), (mode, alpha)
        np.testing.assert_allclose(got.q.sum(-1), 1.0, rtol=1e-12)
        assert np.all((got.k >= 1) & (got.k <= 2048))


# ----------------------------------------------------------------------------- the core


@dataclass(frozen=True)
class Case:
    mode: str
    alpha: float
    target: int = 0  # adaptive: lambda puts k* = target on TARGET_ROW (0: lam as given)
    lam: float = 0.0
    top_k: int | None = None
    k_max: int | None = None
    temperature: float = 1.0
    vocab: int = 2048

    @property
    def id(self) -> str:
        parts = [self.mode, f"{self.alpha:g}"]
        parts += [f"k*{self.target}"] if self.target else []
        parts += [f"lam{self.lam:g}"] if not self.target and self.top_k is None else []
        parts += [f"top{self.top_k}"] if self.top_k else []
        parts += [f"cap{self.k_max}"] if self.k_max else []
        parts += [f"T{self.temperature:g}"] if self.temperature != 1.0 else []
        return "-".join([*parts, f"V{self.vocab}"])


ADAPTIVE_PRIMAL = (0.5, 1.0, 1.001, 1.05, 1.5, 2.0, 3.0, 10.0, 20.0)
ADAPTIVE_DUAL = (1.001, 1.05, 1.5, 2.0, 3.0, 10.0, 20.0)
CORE_CASES = [
    # k* inside the first window (20) and far past it (1000 of 4096)
    *[Case("primal", a, target=t, vocab=4096 if t == 1000 else 2048)
      for a in ADAPTIVE_PRIMAL for t in (20, 1000)],
    *[Case("dual", a, target=t, vocab=4096 if t == 1000 else 2048)
      for a in ADAPTIVE_DUAL for t in (20, 1000)],
    # alpha = 1000: every gap but the first few is below the smallest double
    Case("primal", 1000.0, lam=1e-300), Case("primal", 1000.0, lam=5e-324),
    # k_max below and above the window, below k*
    Case("primal", 1.5, target=1000, k_max=40), Case("primal", 3.0, target=1000, k_max=700),
    Case("dual", 1.5, target=1000, k_max=40), Case("dual", 3.0, target=1000, k_max=700),
    Case("primal", 0.5, target=500, k_max=300),
    # fixed k: generalized top-k, every map
    *[Case("primal", a, top_k=t) for a in (math.inf, -math.inf, -2.0, 0.5, 1.0, 1.5, 2.0, 3.0,
                                           1000.0) for t in (20, 1000)],
    *[Case("dual", a, top_k=t) for a in (1.0, 1.5, 3.0, 10.0, math.inf) for t in (20, 1000)],
    # temperatures: the core decodes softmax(logits / T)
    Case("primal", 1.5, target=300, temperature=0.7), Case("dual", 3.0, target=30, temperature=1.5),
    Case("primal", 2.0, top_k=100, temperature=0.5),
]


def _reference(case: Case, logits: np.ndarray) -> tuple[rs.Decoded, float]:
    scaled = logits / case.temperature
    lam = lam_for(scaled, case.alpha, case.mode, case.target) if case.target else case.lam
    want = rs.decode(scaled, case.alpha, lam, case.mode, top_k=case.top_k, k_max=case.k_max)
    if case.target and case.k_max is None:
        assert want.k[TARGET_ROW] == case.target
    return want, lam


@pytest.mark.parametrize("case", CORE_CASES, ids=[c.id for c in CORE_CASES])
def test_public_calls_match_the_independent_reference(case):
    """`bregman_decode_logits` and `bregman_decode` on six float64 rows from flat to peaked:
    k* and q as the reference's."""
    logits = logits_rows(case.vocab, seed=len(case.id))
    want, lam = _reference(case, logits)
    scaled = torch.tensor(logits / case.temperature, dtype=F64)
    kwargs = {"alpha": case.alpha, "lam": lam, "mode": case.mode, "top_k": case.top_k,
              "k_max": case.k_max}
    out, k = bregman_decode_logits(scaled, return_k=True, **kwargs)
    compare(out.exp().numpy(), k.numpy(), want, lam, label=f"logits {case.id}")
    probs = bregman_decode(torch.softmax(scaled, -1), **kwargs)
    compare(probs.probs.numpy(), probs.k.numpy(), want, lam, label=f"probs {case.id}")


@pytest.mark.parametrize(("mode", "alpha", "lam"), [
    ("primal", 3.0, 1e-9), ("primal", 1.5, 1e-7), ("primal", 1.0, 1e-5), ("dual", 3.0, 1e-9),
    ("dual", 1.5, 1e-7)])
def test_per_row_caps_in_one_batch_match_the_independent_reference(mode, alpha, lam):
    """Rows with and without k_max in one call (as the processor's batches mix requests), k*
    in the hundreds to thousands without a cap: each row as the reference decodes it with its
    own cap (0: none). (Found by the engine test: a row capped at 100 beside an uncapped one
    of the same family decoded 102 tokens, primal alpha 3.)"""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 4096)) * np.array([1.0, 1.0, 2.0, 0.5, 1.0, 3.0])[:, None]
    caps = [0, 100, 40, 0, 700, 30]
    out, k = bregman_decode_logits(torch.tensor(logits), alpha=alpha, lam=lam, mode=mode,
                                   k_max=torch.tensor(caps), return_k=True)
    for row, cap in enumerate(caps):
        want = rs.decode(logits[row:row + 1], alpha, lam, mode, k_max=cap or None)
        compare(out[row:row + 1].exp().numpy(), k[row:row + 1].numpy(), want, lam,
                label=f"{mode} {alpha} row {row} k_max {cap}")


RENORMALIZE = [("primal", a) for a in (-2.0, 0.5, 1.0, 1.001, 1.5, 2.0, 3.0, 20.0, 1000.0,
                                       math.inf, -math.inf)] + \
    [("dual", a) for a in (1.0, 1.001, 1.5, 2.0, 3.0, 20.0, math.inf)]


@pytest.mark.parametrize(("mode", "alpha"), RENORMALIZE, ids=[f"{m}-{a:g}" for m, a in RENORMALIZE])
def test_renormalize_matches_the_independent_reference(mode, alpha):
    """`renormalize` of 2,048-entry sub-probability rows (deficits 1e-6 to 0.9, entries down
    to 1e-40) as the reference's map, relative per entry."""
    rng = np.random.default_rng(int(abs(alpha) * 1000) % 2**32 if math.isfinite(alpha) else 9)
    log_x = rng.standard_normal((4, 2048)) * np.array([[0.5], [2.0], [4.0], [8.0]])
    log_x -= np.log(np.exp(log_x).sum(-1, keepdims=True))
    log_x += np.log(np.array([[0.1], [0.5], [0.99], [1 - 1e-6]]))
    x = np.exp(log_x)
    got = renormalize(torch.tensor(x, dtype=F64), alpha=alpha, mode=mode).numpy()
    want = rs.renormalize(x, alpha, mode)
    error = np.max(np.abs(got - want) / want)
    assert error <= RTOL, f"relative error {error:.2e}"


# ----------------------------------------------------------------------------- the kernels


#: One batch per mode, a row per case (its own logits row, lambda, k selection): the kernels'
#: families, windows, search and wide passes in one launch sequence each.
KERNEL_ROWS = {
    "primal": [(1.0, 20, None, None), (1.0, 600, None, None), (1.5, 20, None, None),
               (1.5, 1000, None, None), (2.0, 30, None, None), (2.0, 800, None, None),
               (3.0, 20, None, None), (3.0, 400, None, None), (1.25, 40, None, None),
               (0.5, 20, None, None), (1.05, 300, None, None), (10.0, 15, None, None),
               (1.5, 1000, None, 50), (3.0, 800, None, 40),
               (math.inf, 0, 20, None), (-math.inf, 0, 20, None), (1.5, 0, 300, None),
               (3.0, 0, 50, None), (1.0, 0, 64, None)],
    "dual": [(1.5, 20, None, None), (1.5, 700, None, None), (3.0, 20, None, None),
             (3.0, 500, None, None), (2.0, 40, None, None), (1.05, 30, None, None),
             (10.0, 20, None, None), (3.0, 800, None, 40), (1.5, 0, 20, None),
             (3.0, 0, 100, None), (math.inf, 0, 30, None)],
}


@pytest.mark.parametrize("mode", ["primal", "dual"])
def test_kernels_match_the_independent_reference(mode):
    """`kernels.decode_plan` (Triton; the interpreter on a CPU) on float32 logits of 2,048
    entries, one row per family and k selection: k* and q as the reference's on the same
    float32 values, q within 2e-5 relative (the kernels write float32 log q)."""
    rows = KERNEL_ROWS[mode]
    vocab = 2048
    rng = np.random.default_rng(21 if mode == "primal" else 22)
    scales = rng.choice([1.0, 2.0, 3.0, 5.0], size=len(rows))
    logits = (rng.standard_normal((len(rows), vocab)) * scales[:, None]).astype(np.float32)
    values = logits.astype(np.float64)
    lams, wants = [], []
    for row, (alpha, target, top_k, k_max) in enumerate(rows):
        line = values[row:row + 1]
        lam = 0.0
        if target:
            # lambda between the gaps at the target of this row itself
            low = rs.log_gap(line, target, alpha, mode)[0]
            high = rs.log_gap(line, target - 1, alpha, mode)[0]
            lam = math.exp(0.5 * (low + high))
        lams.append(lam)
        wants.append(rs.decode(line, alpha, lam, mode, top_k=top_k, k_max=k_max))
    plan = make_plan(mode, [r[0] for r in rows], lams, [r[2] or 0 for r in rows],
                     [r[3] or 0 for r in rows], batch_shape=(len(rows),), vocab=vocab,
                     device="cpu")
    result = kernels.decode_plan(torch.tensor(logits), plan, logits=True)
    q = result.out.double().exp().numpy()
    for row, want in enumerate(wants):
        # float32 logits: lambda is at least ~1e-3 (relative, in logs) from both gaps here
        compare(q[row:row + 1], result.k[row:row + 1].numpy(), want, lams[row], rtol=2e-5,
                tie=1e-5, label=f"{mode} kernel row {row} {rows[row]}")
