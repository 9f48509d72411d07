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
