"""A float64 reference for Bregman decoding, written directly from the paper.

Independent of `bregman_vllm` (plain Python floats, no torch): the alpha-family generator of
Section 4, the Bregman divergence of Section 2.2, the primal projection of eq. (4) and
the dual projection of eq. (5) by bisection (Algorithm 1), and the
problem (2) itself by brute force over every support.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

STEPS = 200


def phi(x: float, a: float) -> float:
    if a == 1.0:
        return x * math.log(x) if x > 0 else 0.0
    if x == 0.0:
        return math.inf if a < 0 else 0.0
    return x**a / (a * (a - 1.0))


def dphi(x: float, a: float) -> float:
    if a == 1.0:
        return math.log(x) + 1.0 if x > 0 else -math.inf
    if x == 0.0:
        return 0.0 if a > 1 else -math.inf
    return x ** (a - 1.0) / (a - 1.0)


def inv_dphi(y: float, a: float) -> float:
    """(phi')^-1 extended by 0 below phi'(0) and 1 above phi'(1) (Section sec:renorm)."""
    if y >= dphi(1.0, a):
        return 1.0
    if a == 1.0:
        return math.exp(y - 1.0)
    base = (a - 1.0) * y
    if base <= 0.0:
        return 0.0
    return base ** (1.0 / (a - 1.0))


def breg(x: float, y: float, a: float) -> float:
    """d_phi(x, y) = phi(x) - phi(y) - phi'(y) (x - y)."""
    if x == y:
        return 0.0
    return phi(x, a) - phi(y, a) - dphi(y, a) * (x - y)


def primal_project(x: Sequence[float], a: float) -> list[float]:
    """argmin_{q in simplex} sum_i d(q_i, x_i): q_i = f^-1(f(x_i) + nu), eq. (4)."""
    if a == 1.0:
        s = sum(x)
        return [v / s for v in x]
    f = [dphi(v, a) for v in x]
    low, high = 0.0, max(0.0, dphi(1.0, a) - max(f))
    for _ in range(STEPS):
        middle = 0.5 * (low + high)
        if sum(inv_dphi(v + middle, a) for v in f) > 1.0:
            high = middle
        else:
            low = middle
    q = [inv_dphi(v + high, a) for v in f]
    total = sum(q)
    return [v / total for v in q]


def dual_project(x: Sequence[float], a: float) -> list[float]:
    """argmin_{q in simplex} sum_i d(x_i, q_i): phi''(q_i)(q_i - x_i) = nu, eq. (5)."""
    if sum(x) >= 1.0:
        return list(x)
    if a == 1.0:
        s = sum(x)
        return [v / s for v in x]

    def solve(target: float, v: float) -> float:
        low, high = v, 1.0
        for _ in range(STEPS):
            middle = 0.5 * (low + high)
            if middle ** (a - 2.0) * (middle - v) < target:
                low = middle
            else:
                high = middle
        return 0.5 * (low + high)

    low, high = 0.0, 1.0 - max(x)  # nu in (0, phi''(1)(1 - max x)], Theorem A.1
    for _ in range(STEPS):
        middle = 0.5 * (low + high)
        if sum(solve(middle, v) for v in x) > 1.0:
            high = middle
        else:
            low = middle
    q = [solve(0.5 * (low + high), v) for v in x]
    total = sum(q)
    return [v / total for v in q]


def project(x: Sequence[float], a: float, mode: str) -> list[float]:
    return primal_project(x, a) if mode == "primal" else dual_project(x, a)


def decoded(p: Sequence[float], support: Sequence[int], a: float, mode: str) -> list[float]:
    """The minimizer of problem (2) restricted to a support, as a full-length vector."""
    q = project([p[i] for i in support], a, mode)
    out = [0.0] * len(p)
    for i, v in zip(support, q, strict=True):
        out[i] = v
    return out


def cost(p: Sequence[float], support: Sequence[int], a: float, lam: float, mode: str) -> float:
    """Div(q, p) + lam |support| with q the projection on the support (eq. regularised-cost)."""
    q = decoded(p, support, a, mode)
    if mode == "primal":
        div = sum(breg(qi, pi, a) for qi, pi in zip(q, p, strict=True))
    else:
        div = sum(breg(pi, qi, a) for qi, pi in zip(q, p, strict=True))
    return div + lam * len(support)


def brute_force(p: Sequence[float], a: float, lam: float, mode: str
                ) -> tuple[float, tuple[int, ...]]:
    """min over every nonempty support of positive entries (problem sp-br)."""
    positive = [i for i, v in enumerate(p) if v > 0]
    best = (math.inf, ())
    for size in range(1, len(positive) + 1):
        for support in itertools.combinations(positive, size):
            value = cost(p, support, a, lam, mode)
            if value < best[0]:
                best = (value, support)
    return best


def top_k_costs(p: Sequence[float], a: float, lam: float, mode: str) -> list[float]:
    """cost(k) for the top-k supports, k = 1..(number of positive entries)."""
    order = sorted((i for i, v in enumerate(p) if v > 0), key=lambda i: -p[i])
    return [cost(p, order[:k], a, lam, mode) for k in range(1, len(order) + 1)]


# ----------------------------------------------------------------------------- high precision


def precise_decode(p: Sequence[float], a: float, lam: float, mode: str, *, top_k: int = 0,
                   k_max: int = 0, digits: int = 0) -> tuple[int, list[float]]:
    """(k*, q) of problem (2) / (3) in mpmath arithmetic, for the parameters where float64
    formulas cancel (alpha next to 1, next to 0 or huge): the same definitions as above
    (Section 4's phi_alpha, eqs. (4) and (5) by bisection, cost(k) over the top-k supports, which
    the greedy property makes sufficient) with enough digits for 1 / alpha and 1 / (alpha - 1).
    ``digits`` overrides the precision. Returns floats."""
    import mpmath

    # Digits: 1 / alpha and 1 / (alpha - 1) multiply the cost terms that cancel in phi.
    scale = max(math.log10(abs(a)) if math.isfinite(a) else 0.0, -math.log10(abs(a)),
                -math.log10(abs(a - 1.0)) if a != 1.0 else 0.0)
    with mpmath.workdps(digits or 30 + int(scale)):
        steps = 90  # bisection to 2^-90 of the bracket: q to about 1e-27
        epsilon = mpmath.mpf(10) ** (-30)
        A, one, zero = mpmath.mpf(a), mpmath.mpf(1), mpmath.mpf(0)
        xs = [mpmath.mpf(v) for v in p]
        total = sum(xs)
        xs = [v / total for v in xs]

        def phi(x):
            if A == 1:
                return x * mpmath.log(x) if x > 0 else zero
            return x**A / (A * (A - 1))

        def dphi(x):
            if A == 1:
                return mpmath.log(x) + 1
            return x ** (A - 1) / (A - 1)

        def breg(x, y):
            if x == y:
                return zero
            if y == 0:  # d(x, 0) = phi(x) - phi(0) + phi'(0) x, phi'(0) = 0 for alpha > 1
                return phi(x) if A > 1 else mpmath.inf
            return phi(x) - phi(y) - dphi(y) * (x - y)

        def primal_entry(v, t, top):
            """q_i of eq. (4) for an entry v when the largest entry ``top`` maps to t (f = phi'
            inverted explicitly: q^b = v^b + (t^b - top^b), b = alpha - 1; the largest entries
            take t itself, which the difference would cancel)."""
            if v == top:
                return t
            b = A - 1
            return (v**b + (t**b - top**b)) ** (1 / b)

        def dual_entry(v, nu):
            """q_i of eq. (5): the root of h(y) = (a-2) y + log(e^y - v) - log nu, y = log q,
            on [log v, 0] (h increasing: dual validity), by Newton steps kept inside a shrinking
            bisection bracket (in log space h is close to linear even for alpha = 1e8)."""
            log_nu = mpmath.log(nu)
            low, high = mpmath.log(v), zero
            y = (low + high) / 2
            for _ in range(4 * steps):
                q = mpmath.exp(y)
                value = (A - 2) * y + mpmath.log(q - v) - log_nu
                if value > 0:
                    high = y
                else:
                    low = y
                newton = y - value / ((A - 2) + q / (q - v))
                if abs(newton - y) <= epsilon * (1 + abs(y)) or high - low <= epsilon:
                    break
                y = newton if low < newton < high else (low + high) / 2
            return mpmath.exp(y)

        def project(x):
            deficit = 1 - sum(x)
            if deficit <= mpmath.mpf(10) ** (8 - mpmath.mp.dps) or A == 1:
                return [v / sum(x) for v in x]
            top = max(x)
            if mode == "primal" and A > 1:  # q^b = v^b + c^b: bisection on log c
                # Next to alpha = 1 the level is tiny (about e^-7000 at alpha = 1.001): a
                # bisection on c in [0, 1] never reaches it. log c is bracketed by the levels at
                # which each entry alone would take the mean share of the deficit (every other
                # entry then takes less, resp. more).
                b = A - 1
                share = deficit / len(x)
                ends = [mpmath.log((v + share) ** b - v**b) / b for v in x]
                low, high = min(ends), max(ends)
                for _ in range(2 * steps):
                    middle = (low + high) / 2
                    if sum((v**b + mpmath.exp(b * middle)) ** (1 / b) for v in x) > 1:
                        high = middle
                    else:
                        low = middle
                c_b = mpmath.exp(b * (low + high) / 2)
                q = [(v**b + c_b) ** (1 / b) for v in x]
            elif mode == "primal":  # b < 0: bisection on the image t of the largest entry
                low, high = top, one
                for _ in range(steps):
                    middle = (low + high) / 2
                    if sum(primal_entry(v, middle, top) for v in x) > 1:
                        high = middle
                    else:
                        low = middle
                q = [primal_entry(v, (low + high) / 2, top) for v in x]
            else:  # bisection on log nu: nu in [min(R/k, (R/k)^(a-1)), 1 - max x] (Thm A.1)
                share = mpmath.log(deficit / len(x))
                low, high = min(share, (A - 1) * share) - 1, mpmath.log(1 - top)
                for _ in range(3 * steps):
                    middle = (low + high) / 2
                    if sum(dual_entry(v, mpmath.exp(middle)) for v in x) > 1:
                        high = middle
                    else:
                        low = middle
                q = [dual_entry(v, mpmath.exp((low + high) / 2)) for v in x]
            return [v / sum(q) for v in q]

        order = sorted(range(len(xs)), key=lambda i: -xs[i])
        positive = [i for i in order if xs[i] > 0]
        limit = min(len(positive), k_max) if k_max else len(positive)
        # lambda = 0: every gap is positive (at least p_(k+1)^alpha / (alpha c)), so cost(k)
        # decreases to the limit; comparing costs of 10^-(10^8) would only compare rounding.
        sizes = [min(top_k, limit)] if top_k else [limit] if lam == 0 else range(1, limit + 1)
        best = None
        for k in sizes:
            support = positive[:k]
            x = [xs[i] for i in support]
            q = project(x)
            if mode == "primal":
                div = sum(breg(qi, xi) for qi, xi in zip(q, x, strict=True)) + sum(
                    breg(zero, xs[i]) if A > 0 else mpmath.inf
                    for i in positive[k:])
            else:
                div = sum(breg(xi, qi) for qi, xi in zip(q, x, strict=True)) + sum(
                    breg(xs[i], zero) for i in positive[k:])
            value = div + mpmath.mpf(lam) * k
            if best is None or value < best[0]:
                best = (value, k, support, q)
        _, k, support, q = best
        out = [0.0] * len(p)
        for i, v in zip(support, q, strict=True):
            out[i] = float(v)
        return k, out
