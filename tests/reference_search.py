"""A float64 reference for Bregman decoding at real vocabulary sizes, written from the paper.

Noarov, Mallick, Wang et al., "Foundations of Top-k Decoding for Language Models" (arXiv
2505.19371), with phi_alpha(x) = x^alpha / (alpha (alpha - 1)) (Section 4; alpha = 1:
x log x). Independent of `bregman_vllm` (imports nothing of it; numpy float64 only), vectorized
over the rows of a batch that share one parameter set, so that it runs at [8, 4096] in about
a second. `tests/reference.py` (brute force over every support, at most 8 entries) checks it at
small sizes (`tests/test_reference_search.py`).

What it computes, each from the paper's definitions:

- The primal map T_alpha (eq. (4), Definition 4.1): q_i^(alpha-1) = p_i^(alpha-1) + nu, with
  nu found by safeguarded Newton steps inside a bracket that is exact by monotonicity
  (`_primal`), in log space, so that alpha = 1000 or 1 + 1e-6 and p = 1e-300 neither over- nor
  underflow. alpha = 1 is p / S (Section 4); +inf water-filling and -inf the argmax fill are
  Proposition 4.1's limits, computed as such (`_water`, `_argmax`); the closed forms of
  Proposition 4.1 (alpha = 3/2, 2) are only a cross-check (`closed_form`).
- The dual map T*_alpha (eq. (5), Theorem A.1, Algorithm 1) for alpha > 1: the nested root
  finding of Algorithm 1, an outer root on nu in (0, M], M = phi''(1)(1 - max x), and per
  entry the inner root of phi''(y)(y - x) = y^(alpha-2)(y - x) = nu on y in (x, 1] (`_dual`),
  both in log space; alpha = 1 is p / S; alpha = +inf water-filling (Appendix "Illustrating
  primal and dual renormalization": the maps coincide at 1, 2 and inf).
- The cost gap G(k) = cost(k) - cost(k+1) + lambda = Div_k - Div_(k+1) of eq.
  (regularised-cost) with Div_k = D(T_k(p), p) (primal) or D(p, T*_k(p)) (dual), as a sum of
  nonnegative terms each computed without cancellation (`log_gap`, derivation there), in log
  space; and k* by the paper's discrete binary search (Algorithm "Discrete Binary Search"):
  by Theorem 3.3 (k-convexity) k* is the first k with G(k) <= lambda (cost(k+1) >= cost(k):
  ties go to the smaller k), capped by k_max (convexity again: min(k*, k_max)). A fixed top_k
  is generalized top-k (Definition 2.2).

`direct_cost` computes cost(k) by the definition itself (Algorithm "Regularized Sparse
Primal/Dual Bregman Decoding"'s ComputeCost), for the cross-check of `log_gap` at moderate
parameters, where the difference of two costs is still accurate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Array = np.ndarray

#: Safeguarded Newton: at most this many steps (bisection of an exact bracket when a Newton step
#: leaves it). It stops after a Newton step below STEP_TOLERANCE relative (convergence is
#: quadratic there, so that step lands at rounding level: demanding a smaller one never ends
#: where rounding in f is larger than the step, e.g. dual alpha = 1.001) or once the bracket is
#: below BRACKET_TOLERANCE relative.
MAX_STEPS = 200
STEP_TOLERANCE = 1e-11
BRACKET_TOLERANCE = 4e-16
#: The series of `log_g` is used where max(1, c) |u| <= SERIES_RADIUS, with SERIES_TERMS terms:
#: the omitted terms are below 3^60 / 60! ~ 1e-53 of the first.
SERIES_RADIUS = 3.0
SERIES_TERMS = 60


# ----------------------------------------------------------------------------- scalar functions


def _softplus(s: Array) -> Array:
    """log(1 + e^s) without overflow."""
    return np.maximum(s, 0.0) + np.log1p(np.exp(-np.abs(s)))


def _sigmoid(s: Array) -> Array:
    e = np.exp(-np.abs(s))
    return np.where(s >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _log_expm1(z: Array) -> Array:
    """log(e^z - 1) for z > 0, without overflow (large z) or cancellation (small z)."""
    with np.errstate(divide="ignore"):
        return z + np.log(-np.expm1(-z))


def _log_diff(la: Array, lb: Array) -> Array:
    """log(e^la - e^lb) for la >= lb (-inf where they are equal)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = la + np.log(-np.expm1(np.minimum(lb - la, 0.0)))
    return np.where(lb >= la, -np.inf, out)


def _logsumexp(x: Array, axis: int = -1) -> Array:
    top = np.max(x, axis=axis, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        out = np.log(np.sum(np.exp(x - top), axis=axis, keepdims=True)) + top
    return np.squeeze(out, axis=axis)


def log_g(c: float, u: Array) -> Array:
    """log g_c(u) for u >= 0, where g_c(u) = (e^(cu) - 1 - cu - c (e^u - 1 - u)) / (c (c - 1))
    (c > 0; c = 1: u e^u - e^u + 1), so that the Bregman divergence of phi_c (Section 4) is
    d(x, y) = y^c g_c(log(x / y)) for x, y > 0.

    g_c(u) = sum_(n >= 2) u^n / n! (1 + c + ... + c^(n-2)): positive terms for u >= 0, summed as
    such where max(1, c) u <= 3 (no cancellation at u -> 0, where the closed form cancels to
    nothing). Elsewhere the closed form in logs, arranged so that the subtraction loses about
    a digit at most: c g = e^u (e^((c-1)u) - 1) / (c - 1) - (e^u - 1) for c > 1/2 (c = 1:
    e^u u - (e^u - 1)), (1 - c) g = (e^u - 1) - (e^(cu) - 1) / c for c <= 1/2."""
    u = np.asarray(u, dtype=np.float64)
    u = np.maximum(u, 0.0)
    out = np.full(u.shape, -np.inf)
    scale = max(1.0, c)
    near = (u > 0) & (u * scale <= SERIES_RADIUS)
    if near.any():
        v = u[near]
        # g = u^2 sum_n B_n, B_n = C_n u^(n-2) / n!, C_n = 1 + c C_(n-1): B_(n+1) = Q_(n+1) +
        # (c u / (n + 1)) B_n with Q_n = u^(n-2) / n! (u^2 factored out: no underflow).
        q = np.full(v.shape, 0.5)
        b = q.copy()
        total = b.copy()
        for n in range(2, SERIES_TERMS):
            q = q * v / (n + 1)
            b = q + (c * v / (n + 1)) * b
            total = total + b
        out[near] = 2.0 * np.log(v) + np.log(total)
    far = u * scale > SERIES_RADIUS
    if far.any():
        v = u[far]
        if c > 0.5:
            b = c - 1.0
            if b > 0:
                log_e = _log_expm1(b * v) - math.log(b)
            elif b < 0:
                log_e = np.log(-np.expm1(b * v)) - math.log(-b)
            else:
                log_e = np.log(v)
            out[far] = _log_diff(v + log_e, _log_expm1(v)) - math.log(c)
        else:
            out[far] = _log_diff(_log_expm1(v), _log_expm1(c * v) - math.log(c)) - \
                math.log(1.0 - c)
    return out


def log_divergence(log_x: Array, log_y: Array, alpha: float) -> Array:
    """log d_phi(x, y) for phi_alpha (Section 2.2, Section 4), x, y >= 0, alpha > 0, in logs;
    accurate (relative) for x >= y (`log_g`), less so for x < y (used by cross-checks only)."""
    log_x, log_y = np.broadcast_arrays(np.asarray(log_x, float), np.asarray(log_y, float))
    out = np.full(log_x.shape, -np.inf)
    both = np.isfinite(log_x) & np.isfinite(log_y)
    up = both & (log_x >= log_y)
    out[up] = alpha * log_y[up] + log_g(alpha, log_x[up] - log_y[up])
    down = both & (log_x < log_y)
    if down.any():  # d(x, y) = y^a g(u), u < 0: the defining formula, in float64
        x, y = np.exp(log_x[down]), np.exp(log_y[down])
        if alpha == 1.0:
            value = x * np.log(x / y) - x + y
        else:
            value = (x**alpha - y**alpha - alpha * y ** (alpha - 1) * (x - y)) / \
                (alpha * (alpha - 1))
        with np.errstate(divide="ignore"):
            out[down] = np.log(np.maximum(value, 0.0))
    zero_x = ~np.isfinite(log_x) & np.isfinite(log_y)  # d(0, y) = y^a / a (phi(0) = 0, a > 0)
    out[zero_x] = alpha * log_y[zero_x] - math.log(alpha)
    zero_y = np.isfinite(log_x) & ~np.isfinite(log_y)  # d(x, 0) = phi(x) (phi'(0) = 0, a > 1)
    if alpha > 1:
        out[zero_y] = alpha * log_x[zero_y] - math.log(alpha * (alpha - 1))
    else:
        out[zero_y] = np.inf
    return out


# ----------------------------------------------------------------------------- root finding


def _solve(f: Callable[[Array], tuple[Array, Array]], z: Array, lo: Array, hi: Array
           ) -> Array:
    """The root of an increasing f in [lo, hi] (f(lo) <= 0 <= f(hi)), elementwise: Newton
    steps, a bisection whenever one leaves the bracket, the bracket kept by f's sign."""
    z = np.clip(z, lo, hi)
    for _ in range(MAX_STEPS):
        value, slope = f(z)
        lo = np.where(value <= 0, z, lo)
        hi = np.where(value >= 0, z, hi)
        with np.errstate(divide="ignore", invalid="ignore"):
            new = z - value / slope
        scale = 1.0 + np.abs(z)
        # A step at rounding level may cross the bracket's end that z itself just became; a
        # larger one onto or past an end bisects (f's rounding can make Newton bounce between
        # the ends where f' is tiny).
        small = np.abs(new - z) <= STEP_TOLERANCE * scale
        outside = ~((new > lo) & (new < hi)) & ~small
        new = np.where(outside, 0.5 * (lo + hi), np.clip(new, lo, hi))
        done = small | (value == 0) | (hi - lo <= BRACKET_TOLERANCE * scale)
        z = new
        if done.all():
            return z
    raise AssertionError("reference root finding did not converge")


# ----------------------------------------------------------------------------- maps


def _support(log_x: Array, k: Array) -> Array:
    """The mask of the first k entries of each row."""
    return np.arange(log_x.shape[-1])[None, :] < np.asarray(k)[:, None]


def _lifts(log_x: Array, g: Array, valid: Array) -> Array:
    """log(q_i - x_i) = log x_i + log(e^g_i - 1), -inf past k."""
    with np.errstate(divide="ignore"):
        return np.where(valid, log_x + _log_expm1(np.maximum(g, 0.0)), -np.inf)


def _primal(log_x: Array, k: Array, log_r: Array, alpha: float) -> tuple[Array, Array]:
    """T_alpha (eq. (4), Definition 4.1) of the first k entries of each row of ``log_x`` (log
    of a sub-probability vector with deficit R = e^log_r = 1 - sum x): (log q, g) with
    g = log(q / x) >= 0 (the map adds mass), both -inf / 0 past k.

    The multiplier solves sum_i (q_i - x_i) = R, each term computed from g_i without
    cancellation (sum_i q_i = 1 would leave a deficit of 1e-11 to the rounding of 1).
    b = alpha - 1 > 0: q_i^b = x_i^b + c^b, nu = c^b >= 0, so g_i = softplus(b (log c -
    log x_i)) / b, increasing in log c; the root is bracketed by the levels at which each entry
    alone would take the mean share R / k (every other entry then takes less, resp. more).
    b < 0 (alpha < 1, and alpha < 0 for a fixed k): q_i^b = x_i^b - w, 0 < w < x_1^b,
    parametrized by s = log q_1 of the largest entry: with m = 1 - (x_1 / q_1)^|b| and
    r_i = (x_i / x_1)^|b|, g_i = -log(1 - r_i m) / |b| (no pole next to w = x_1^b, where q_1
    takes nearly all of R); q_i - x_i grows with x_i (d q_i / d x_i = (q_i / x_i)^(1-b) >= 1),
    so s is bracketed by log(x_1 + R / k) and log(x_1 + R). b = 0 (alpha = 1): q = x / S."""
    valid = _support(log_x, k)
    lx = np.where(valid, log_x, log_x[:, :1])  # finite stand-ins past k, masked at the end
    kk = np.asarray(k, dtype=np.float64)[:, None]
    b = alpha - 1.0
    full = ~np.isfinite(log_r)  # no deficit: T(x) = x
    lr = np.where(full, 0.0, log_r)[:, None]
    if b == 0.0:
        total = _logsumexp(np.where(valid, lx, -np.inf))[:, None]
        g = np.broadcast_to(np.log1p(np.exp(lr - total)), lx.shape)  # log(1 + R / S)
    elif b > 0:
        share = lr - np.log(kk) - lx  # log(R / (k x_i))
        ends = np.where(valid, lx + _log_expm1(b * _softplus(share)) / b, np.nan)

        def f(z: Array) -> tuple[Array, Array]:
            g = _softplus(b * (z - lx)) / b
            lift = _lifts(lx, g, valid)
            total = _logsumexp(lift)[:, None]
            weight = np.exp(lx + g - total) * _sigmoid(b * (z - lx))
            return total - lr, np.sum(np.where(valid, weight, 0.0), -1, keepdims=True)

        lo, hi = np.nanmin(ends, -1, keepdims=True), np.nanmax(ends, -1, keepdims=True)
        z = _solve(f, 0.5 * (lo + hi), lo, hi)
        g = _softplus(b * (z - lx)) / b
    else:
        a = -b
        top = lx[:, :1]
        with np.errstate(divide="ignore"):
            rest = np.log(-np.expm1(np.minimum(a * (lx - top), 0.0)))  # log(1 - r_i)

        def lift_of(s: Array) -> tuple[Array, Array]:
            """(g, dg/ds): 1 - r m = (1 - r) + r (1 - m), two nonnegative terms (1 - m is
            7e-9 where q_1 takes nearly all of R at alpha = -2: 1 - m itself cancels)."""
            log_one = np.logaddexp(rest, a * (lx - s))
            g = -log_one / a
            return g, np.exp(a * (lx - s) - log_one)

        def f(s: Array) -> tuple[Array, Array]:
            g, slope = lift_of(s)
            lift = _lifts(lx, g, valid)
            total = _logsumexp(lift)[:, None]
            weight = np.exp(lx + g - total) * slope
            return total - lr, np.sum(np.where(valid, weight, 0.0), -1, keepdims=True)

        lo = np.logaddexp(top, lr - np.log(kk))
        hi = np.logaddexp(top, lr)
        s = _solve(f, 0.5 * (lo + hi), lo, hi)
        g, _ = lift_of(s)
    g = np.where(full[:, None] | ~valid, 0.0, g)
    return np.where(valid, lx + g, -np.inf), g


def _dual(log_x: Array, k: Array, log_r: Array, alpha: float
          ) -> tuple[Array, Array, Array]:
    """T*_alpha (eq. (5), Theorem A.1, Algorithm 1) of the first k entries of each row, alpha >
    1: (log q, g = log(q / x), log(q - x)), -inf / 0 / -inf past k.

    Inner root (per entry, for a multiplier nu): y^(alpha-2) (y - x) = nu with y = x + delta,
    in l = log delta: h(l) = (alpha - 2) logaddexp(log x, l) + l - log nu = 0, increasing (slope
    1 + (alpha - 2) sigma(l - log x) >= min(1, alpha - 1) > 0: dual validity, Lemma 4.1); its
    piecewise-linear model (max in place of logaddexp) has the root l0, and logaddexp - max is
    in [0, log 2], which brackets the root within |alpha - 2| log 2 / min(1, alpha - 1) of l0.
    Outer root (Algorithm 1's search on nu in (0, M]): sum_i delta_i(nu) = R, increasing in nu
    (Lemma B.1), bracketed by the multipliers at which each entry alone would take the mean
    share R / k, the upper end also by Theorem A.1's M = phi''(1)(1 - max x) (phi''(1) = 1)."""
    valid = _support(log_x, k)
    lx = np.where(valid, log_x, log_x[:, :1])
    kk = np.asarray(k, dtype=np.float64)[:, None]
    full = ~np.isfinite(log_r)
    lr = np.where(full, 0.0, log_r)[:, None]
    if alpha == 1.0:
        lq, g = _primal(log_x, k, log_r, 1.0)
        return lq, g, _lifts(lx, g, valid & ~full[:, None])
    c = alpha - 2.0
    width = abs(c) * math.log(2.0) / min(1.0, alpha - 1.0)

    def inner(z: Array) -> tuple[Array, Array]:
        """(l, dl/dz) per entry for log nu = z (one per row). h is concave for alpha < 2 and
        convex for alpha > 2 (logaddexp is convex), so Newton steps from l0, the bracket's end
        on the side where the tangent stays on that side, approach the root monotonically."""
        l0 = np.where(z <= (alpha - 1.0) * lx, z - c * lx, z / (alpha - 1.0))
        lo, hi = (l0 - width, l0) if c >= 0 else (l0, l0 + width)

        def h(l: Array) -> tuple[Array, Array]:
            return c * np.logaddexp(lx, l) + l - z, 1.0 + c * _sigmoid(l - lx)

        l = _solve(h, l0, lo, hi)
        return l, 1.0 / (1.0 + c * _sigmoid(l - lx))

    mean = lr - np.log(kk)
    ends = np.where(valid, c * np.logaddexp(lx, mean) + mean, np.nan)
    lo, hi = np.nanmin(ends, -1, keepdims=True), np.nanmax(ends, -1, keepdims=True)
    top = np.max(np.where(valid, lx, -np.inf), -1, keepdims=True)
    with np.errstate(divide="ignore"):
        hi = np.maximum(np.minimum(hi, np.log(-np.expm1(np.minimum(top, -1e-300)))), lo)

    def outer(z: Array) -> tuple[Array, Array]:
        l, dl = inner(z)
        l = np.where(valid, l, -np.inf)
        total = _logsumexp(l)[:, None]
        weight = np.exp(l - total) * dl
        return total - lr, np.sum(np.where(valid, weight, 0.0), -1, keepdims=True)

    z = _solve(outer, 0.5 * (lo + hi), lo, hi)
    l, _ = inner(z)
    l = np.where(full[:, None] | ~valid, -np.inf, l)
    g = np.where(valid, _softplus(l - lx), 0.0)
    return np.where(valid, lx + g, -np.inf), g, l


def _water(log_x: Array, k: Array, log_r: Array) -> Array:
    """T_inf (Proposition 4.1, water-filling): q_i = max(x_i, c), sum q = 1, on sorted rows:
    the level is c_j = (R + sum_(i >= j) x_i) / (k - j) for the first j with x_j <= c_j."""
    valid = _support(log_x, k)
    x = np.where(valid, np.exp(log_x), 0.0)
    r = np.where(np.isfinite(log_r), np.exp(log_r), 0.0)[:, None]
    tail = np.cumsum(x[:, ::-1], axis=-1)[:, ::-1]
    count = np.asarray(k)[:, None] - np.arange(x.shape[-1])[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        level = (r + tail) / count
    first = np.argmax(valid & (x <= level), axis=-1)
    c = np.take_along_axis(level, first[:, None], -1)
    with np.errstate(divide="ignore"):
        return np.where(valid, np.log(np.maximum(x, c)), -np.inf)


def _argmax(log_x: Array, k: Array, log_r: Array) -> Array:
    """T_-inf (Proposition 4.1): the deficit goes to the (first) largest entry."""
    valid = _support(log_x, k)
    lq = np.where(valid, log_x, -np.inf)
    lq[:, 0] = np.logaddexp(lq[:, 0], log_r)  # rows are sorted: the first is the largest
    return lq


def renormalize_sorted(log_x: Array, k: Array, log_r: Array, alpha: float, mode: str
                       ) -> Array:
    """log of the map of the first k entries of each row of ``log_x`` (sorted descending, log
    of a sub-probability vector whose deficit is e^log_r), -inf past k."""
    if alpha == math.inf:
        return _water(log_x, k, log_r)
    if mode == "primal":
        if alpha == -math.inf:
            return _argmax(log_x, k, log_r)
        return _primal(log_x, k, log_r, alpha)[0]
    if not alpha >= 1:
        raise ValueError(f"dual maps need alpha >= 1 (Lemma 4.1), got {alpha}")
    return _dual(log_x, k, log_r, alpha)[0]


def renormalize(x: Array, alpha: float, mode: str = "primal") -> Array:
    """T_alpha / T*_alpha of each row of ``x`` (entries > 0, row sums <= 1), every entry in the
    support, in x's order (float64)."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float64))
    order = np.argsort(-x, axis=-1, kind="stable")
    xs = np.take_along_axis(x, order, -1)
    deficit = 1.0 - xs.sum(-1)
    with np.errstate(divide="ignore"):
        log_r = np.where(deficit > 0, np.log(np.maximum(deficit, 1e-320)), -np.inf)
        lq = renormalize_sorted(np.log(xs), np.full(len(x), x.shape[-1]), log_r, alpha, mode)
    out = np.empty_like(xs)
    np.put_along_axis(out, order, np.exp(lq), -1)
    return out


def closed_form(x: Array, alpha: float) -> Array:
    """Proposition 4.1's closed forms of the primal map (alpha in {-inf, 1, 3/2, 2, inf}), for
    cross-checks only (they cancel for deficits near 0): rows of x, every entry kept."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float64))
    k = x.shape[-1]
    s = x.sum(-1, keepdims=True)
    if alpha == 1.0:
        return x / s
    if alpha == 2.0:
        return x + (1.0 - s) / k
    if alpha == 1.5:
        r = np.sqrt(x).sum(-1, keepdims=True)
        return (np.sqrt(x) + (np.sqrt(r**2 + k * (1.0 - s)) - r) / k) ** 2
    if alpha == -math.inf:
        out = x.copy()
        top = np.argmax(x, -1)
        out[np.arange(len(x)), top] += 1.0 - s[:, 0]
        return out
    if alpha == math.inf:  # the level: sum_i max(x_i, c) = 1, bisection
        low, high = np.zeros_like(s), np.ones_like(s)
        for _ in range(200):
            middle = 0.5 * (low + high)
            over = np.maximum(x, middle).sum(-1, keepdims=True) > 1.0
            high, low = np.where(over, middle, high), np.where(over, low, middle)
        return np.maximum(x, 0.5 * (low + high))
    raise ValueError(f"no closed form for alpha = {alpha}")


# ----------------------------------------------------------------------------- gaps and k*


@dataclass
class _Sorted:
    """Rows sorted descending, normalized: log p, the tail sums' logs, positive counts."""

    log_p: Array  # [n, V] sorted descending
    order: Array  # [n, V] the sort permutation
    log_tail: Array  # [n, V + 1]: log sum_(j >= i) p_j
    positive: Array  # [n] number of entries > 0

    @classmethod
    def of(cls, log_p: Array) -> _Sorted:
        log_p = np.atleast_2d(np.asarray(log_p, dtype=np.float64))
        if np.isnan(log_p).any() or (log_p == np.inf).any():
            raise ValueError("log-probabilities must be finite or -inf")
        log_p = log_p - _logsumexp(log_p)[:, None]
        order = np.argsort(-log_p, axis=-1, kind="stable")
        lp = np.take_along_axis(log_p, order, -1)
        # Tail sums of the sorted row from its own terms, in logs (a deficit of 1e-30 is not
        # 1 - (1 - 1e-30), and one of e^-800 is not 0).
        tail = np.logaddexp.accumulate(lp[:, ::-1], axis=-1)[:, ::-1]
        tail = np.concatenate([tail, np.full((len(lp), 1), -np.inf)], -1)
        return cls(lp, order, tail, np.sum(np.isfinite(lp), -1))

    def deficit(self, k: Array) -> Array:
        """log(1 - sum of the top k) = log of the tail past k."""
        return np.take_along_axis(self.log_tail, np.asarray(k)[:, None], -1)[:, 0]


def _log_gap_sorted(rows: _Sorted, k: Array, alpha: float, mode: str) -> Array:
    """log G(k) per row, 1 <= k < positive (see `log_gap`). Works on the first max(k) + 1
    columns only."""
    k = np.asarray(k)
    width = int(k.max()) + 1
    lp = rows.log_p[:, :width]
    valid = _support(lp, k)
    # u_i = log(q_i / q'_i) = g_i - g'_i: the lifts' difference (not that of two logs of q).
    if mode == "primal":
        _, g = _primal(lp, k, rows.deficit(k), alpha)
        lq1, g1 = _primal(lp, k + 1, rows.deficit(k + 1), alpha)
        last = np.take_along_axis(lq1, k[:, None], -1)[:, 0]
        u = np.where(valid, np.maximum(g - g1, 0.0), 0.0)
        terms = np.where(valid, alpha * np.where(valid, lq1, 0.0) + log_g(alpha, u), -np.inf)
        return np.logaddexp(_logsumexp(terms), alpha * last - math.log(alpha))
    _, g, _ = _dual(lp, k, rows.deficit(k), alpha)
    lq1, g1, ld1 = _dual(lp, k + 1, rows.deficit(k + 1), alpha)
    safe = np.where(valid, lq1, 0.0)
    u = np.where(valid, np.maximum(g - g1, 0.0), 0.0)
    a = alpha
    # A_i = q'^(a-1) [(a-1) q' g_a(u) - (a-2) p g_(a-1)(u)]: both parts >= 0 for a <= 2; for
    # a > 2 the first is at least (a-1)/(a-2) times the second (g_a >= g_(a-1), q' >= p).
    first = math.log(a - 1.0) + safe + log_g(a, u)
    if a == 2.0:
        inner = first
    else:
        second = math.log(abs(a - 2.0)) + np.where(valid, lp, 0.0) + log_g(a - 1.0, u)
        inner = np.logaddexp(first, second) if a < 2 else _log_diff(first, second)
    terms = np.where(valid, (a - 1.0) * safe + inner, -np.inf)
    # B = q'^(a-1) [(a-1)^2 (q' - p) + p] / (a (a-1)) for the entry k+1 (q' - p from the solve).
    last_q = np.take_along_axis(lq1, k[:, None], -1)[:, 0]
    last_d = np.take_along_axis(ld1, k[:, None], -1)[:, 0]
    last_p = np.take_along_axis(lp, k[:, None], -1)[:, 0]
    last = (a - 1.0) * last_q - math.log(a * (a - 1.0)) + \
        np.logaddexp(2.0 * math.log(a - 1.0) + last_d, last_p)
    return np.logaddexp(_logsumexp(terms), last)


def log_gap(log_p: Array, k: Array | int, alpha: float, mode: str = "primal") -> Array:
    """log G(k) = log(cost(k) - cost(k+1) + lambda) = log(Div_k - Div_(k+1)) per row, for
    1 <= k < (number of positive entries); primal alpha > 0, dual alpha > 1.

    With q = T_k(p) (zero at k+1) and q' = T_(k+1)(p), u_i = log(q_i / q'_i) >= 0 (removing an
    entry raises the multiplier, and every entry of the map with it: eqs. (4), (5)):

    Primal: the three-point identity D(q, p) - D(q', p) - D(q, q') = sum_i (q_i - q'_i)
    (phi'(q'_i) - phi'(p_i)) is nu' sum_i (q_i - q'_i) = 0 by eq. (4) (phi'(q'_i) - phi'(p_i) = nu'
    on the k + 1 entries, both maps sum to 1), so G(k) = D(q, q') = sum_(i <= k) q'_i^a g_a(u_i)
    + q'_(k+1)^a / a: nonnegative terms (`log_g`).

    Dual: G(k) = sum_(i <= k) [d(p_i, q_i) - d(p_i, q'_i)] + d(p_(k+1), 0) - d(p_(k+1), q'_(k+1)),
    and subtracting nu' (sum_(i <= k) (q_i - q'_i) - q'_(k+1)) = 0 entry by entry:
    A_i = d(p, q) - d(p, q') - nu' (q - q') = integral_q'^q [phi''(y)(y - p) - nu'] dy >= 0
    (the integrand is 0 at q' by eq. (5) and increasing: dual validity), which is
    q'^a K_a(u) - p q'^(a-1) K_(a-1)(u) with K_c(u) = (e^(cu) - 1)/c - (e^u - 1) = (c - 1) g_c(u);
    B = d(p, 0) - d(p, q') + nu' q' = integral_0^q' [nu' - phi''(y)(y - p)] dy >= 0, which is
    q'^(a-1) [(a-1)^2 (q' - p) + p] / (a (a-1)) with q' - p from the inner solve itself."""
    rows = _Sorted.of(log_p)
    k = np.broadcast_to(np.asarray(k), rows.positive.shape).astype(np.int64)
    if np.any(k < 1) or np.any(k >= rows.positive):
        raise ValueError("log_gap needs 1 <= k < number of positive entries")
    return _log_gap_sorted(rows, k, float(alpha), mode)


@dataclass
class Decoded:
    """A batch decoded by the reference."""

    k: Array  # [n] the support size
    log_q: Array  # [n, V] log of the decoded distribution in the input's order, -inf off support
    #: log G(k* - 1) (> log lambda; +inf for k* = 1 or a fixed k) and log G(k*) (<= log lambda;
    #: -inf at the limit or for a fixed k): how far lambda is from a tie.
    log_gap_below: Array
    log_gap_at: Array

    @property
    def q(self) -> Array:
        return np.exp(self.log_q)

    def margin(self, lam: float) -> Array:
        """min(log G(k*-1) - log lambda, log lambda - log G(k*)): a k* another float64
        implementation may get differently only where this is near 0."""
        ll = math.log(lam) if lam > 0 else -np.inf
        with np.errstate(invalid="ignore"):
            return np.nan_to_num(np.minimum(self.log_gap_below - ll, ll - self.log_gap_at),
                                 nan=np.inf)


def _check(alpha: float, mode: str, fixed: bool) -> None:
    if mode not in ("primal", "dual"):
        raise ValueError(f"mode must be primal or dual, got {mode!r}")
    if math.isnan(alpha) or alpha == 0:
        raise ValueError(f"alpha must be a nonzero number, got {alpha}")
    if not fixed and not (0 < alpha < math.inf if mode == "primal" else 1 < alpha < math.inf):
        raise ValueError(f"adaptive {mode} decoding needs alpha in "
                         f"{'(0, inf)' if mode == 'primal' else '(1, inf)'}, got {alpha}")
    if mode == "dual" and alpha < 1:
        raise ValueError(f"dual maps need alpha >= 1, got {alpha}")


def decode(log_p: Array, alpha: float, lam: float = 0.0, mode: str = "primal", *,
           top_k: int | None = None, k_max: int | None = None) -> Decoded:
    """Bregman decoding (problem (2), eq. (3)) of each row of ``log_p`` ([n, V] log-probabilities,
    normalized here; -inf entries are zeros): k* by the binary search of Algorithm "Discrete
    Binary Search" on G(k) <= lambda (ties to the smaller k), capped by ``k_max``, or the fixed
    ``top_k`` (Definition 2.2, clamped to the positive entries), then the map on the top k*."""
    alpha = float(alpha)
    _check(alpha, mode, top_k is not None)
    rows = _Sorted.of(log_p)
    n = len(rows.positive)
    limit = rows.positive.copy()
    if k_max is not None:
        limit = np.minimum(limit, int(k_max))
    below = np.full(n, np.inf)
    at = np.full(n, -np.inf)
    if top_k is not None:
        k = np.minimum(rows.positive, int(top_k))
    else:
        log_lam = math.log(lam) if lam > 0 else -math.inf
        # First k in [1, limit - 1] with G(k) <= lambda, else limit: bisection on (lo, hi]
        # with G(lo) > lambda (lo = 0: none yet) and G(hi) <= lambda (hi = limit: none yet).
        lo, hi = np.zeros(n, np.int64), limit.astype(np.int64)
        while True:
            active = hi - lo > 1
            if not active.any():
                break
            m = np.where(active, (lo + hi) // 2, 1)
            rows_at = np.flatnonzero(active)
            sub = _Sorted(rows.log_p[rows_at], rows.order[rows_at], rows.log_tail[rows_at],
                          rows.positive[rows_at])
            gap = _log_gap_sorted(sub, m[rows_at], alpha, mode)
            small = gap <= log_lam
            hi[rows_at] = np.where(small, m[rows_at], hi[rows_at])
            lo[rows_at] = np.where(small, lo[rows_at], m[rows_at])
            at[rows_at] = np.where(small, gap, at[rows_at])
            below[rows_at] = np.where(small, below[rows_at], gap)
        k = hi
    width = int(k.max())
    lq = renormalize_sorted(rows.log_p[:, :width], k, rows.deficit(k), alpha, mode)
    full = np.full(rows.log_p.shape, -np.inf)
    full[:, :width] = lq
    out = np.empty_like(full)
    np.put_along_axis(out, rows.order, full, -1)
    return Decoded(k, out, below, at)


def decode_logits(logits: Array, alpha: float, lam: float = 0.0, mode: str = "primal", *,
                  top_k: int | None = None, k_max: int | None = None,
                  temperature: float = 1.0) -> Decoded:
    """`decode` of softmax(logits / temperature), in float64 from the logits' values."""
    logits = np.atleast_2d(np.asarray(logits, dtype=np.float64)) / temperature
    return decode(logits, alpha, lam, mode, top_k=top_k, k_max=k_max)


def direct_cost(log_p: Array, k: Array | int, alpha: float, lam: float, mode: str = "primal"
                ) -> Array:
    """cost(k) (eq. (regularised-cost)) by its definition, D(T_k(p), p) + lambda k (primal) or
    D(p, T*_k(p)) + lambda k (dual), summed over the whole row: for cross-checks of `log_gap`
    where the costs are moderate (the difference of two costs cancels where G is tiny)."""
    rows = _Sorted.of(log_p)
    k = np.broadcast_to(np.asarray(k), rows.positive.shape).astype(np.int64)
    lq = renormalize_sorted(rows.log_p, k, rows.deficit(k), float(alpha), mode)
    if mode == "primal":
        div = log_divergence(lq, rows.log_p, alpha)
    else:
        div = log_divergence(rows.log_p, lq, alpha)
    return np.sum(np.exp(div), -1) + lam * k
