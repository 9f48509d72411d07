"""Dual alpha-renormalization T*_alpha on a fixed support (arXiv 2505.19371: eq. (5), Theorem A.1).

The dual map solves min_{q in simplex} sum_i d_phi(p_i, q_i). For phi_alpha, eq. (5) reads

    q_i^(alpha-2) (q_i - p_i) = nu   for every i in the support,   sum_i q_i = 1,   nu > 0,

so each q_i is the unique root above p_i of an increasing function (dual validity, alpha > 1).
Closed forms: alpha = 1 and alpha = 2 coincide with the primal maps (q = p/S and q = p + R/k), and
alpha = +inf is water-filling (Appendix G.3). Every other alpha > 1 is solved by the nested
root finding of Algorithm 1, in log space:

  * outer: s = log nu, bracketed by nu in [R/k, R / sum_i p_i^(2-alpha)] (1 < alpha < 2) or
    nu in [max((R/k)^(alpha-1), R / sum_i p_i^(2-alpha)), R/k] (alpha > 2), from bounds on
    q_i^(2-alpha), and by nu <= 1 - max_i p_i (proof of Theorem A.1); Newton on
    sum_i q_i(s) - 1, which is convex and increasing in s;
  * inner: y_i = log(q_i / p_i) > 0 solves
    H(y) = (alpha-1) y + log(1 - e^-y) = s - (alpha-1) log p_i, with H increasing from -inf to
    +inf, by safeguarded Newton in z = log y, warm-started from the previous outer iterate.

Zero entries in the support get q_i = nu^(1/(alpha-1)). ``log_p`` is ``[..., K]`` sorted
decreasingly; ``k`` gives the support size of each row; the result is log q, -inf off the support.
"""

from __future__ import annotations

import math

import torch

from .families import Family
from .numerics import log1mexp, logsumexp_masked
from .primal import _normalized
from .roots import safeguarded_newton

Tensor = torch.Tensor

_LOG1MEXP_AT_ONE = math.log(1.0 - math.exp(-1.0))


def _inner_terms(beta: Tensor, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """H(e^z) = beta y + log(1 - e^-y) and dH/dz = beta y + y / expm1(y), with y = e^z.

    For y < 1e-8 (e^z may underflow: z reaches -1000 for alpha = 1000) the expansions
    log(1 - e^-y) = z - y/2 + O(y^2) and y / expm1(y) = 1 - y/2 + O(y^2) replace the closed forms.
    """
    y = torch.exp(z)
    tiny = z < math.log(1e-8)
    if not bool(tiny.any()):  # the common case: skip the expansion branch
        return log1mexp(y) + beta * y, y / torch.expm1(y) + beta * y, y
    big = torch.where(tiny, torch.ones_like(y), y)
    value = torch.where(tiny, z - 0.5 * y, log1mexp(big)) + beta * y
    slope = torch.where(tiny, 1.0 - 0.5 * y, big / torch.expm1(big)) + beta * y
    return value, slope, y


def _inner_solve(beta: Tensor, target: Tensor, z: Tensor, low: Tensor, high: Tensor) -> Tensor:
    """Solve H(e^z) = target for z, elementwise, by safeguarded Newton from the warm start z.

    H(y) = beta y + log(1 - e^-y); dH/dz = beta y + y / expm1(y). Bracket:
    y_lo = min(1, e^(target - beta)) (H(y) <= beta y + log y) and
    y_hi = max(1, (target - log(1 - 1/e)) / beta) (H(y) >= beta y + log(1 - 1/e) for y >= 1).
    """
    z = torch.where((z > low) & (z < high), z, 0.5 * (low + high))

    def equation(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        value, slope, y = _inner_terms(beta, z)
        # Rounding in the value scales with the size of its terms.
        return value - target, slope, 4e-16 * (1.0 + target.abs() + beta * y)

    return safeguarded_newton(equation, z, low, high)


def _inner_upper(beta: Tensor, target: Tensor) -> Tensor:
    """log of an upper end of the inner root, next to it for large beta (where the other
    starts are far above it). With c = log(1 - 1/e): log(1 - e^-y) >= log y + c for y <= 1, so
    there beta y + log y <= t - c and y <= W(beta e^(t - c)) / beta <= log1p(beta e^(t - c)) /
    beta (Lambert's W(x) <= log(1 + x)); above 1, log(1 - e^-y) >= c and y <= (t - c) / beta."""
    shifted = target - _LOG1MEXP_AT_ONE
    bound = torch.maximum(torch.nn.functional.softplus(torch.log(beta) + shifted), shifted)
    return torch.log(bound.clamp_min(1e-300)) - torch.log(beta)


_LOG_2 = math.log(2.0)


def quadratic_root(family: Family, p: Tensor, nu: Tensor,
                   two_sqrt_p: Tensor | None = None) -> Tensor:
    """The inner equation of eq. (5), q^(alpha-2) (q - p) = nu, where it is a quadratic; the
    one place these closed forms are written (the window's fixed Newton steps and the exact
    path's nested root finding both use it). Returns the root term R of

        alpha = 3/2 (``DUAL_THREE_HALVES``):  2 sqrt(q) = nu + R,  R = sqrt(nu^2 + 4 p);
        alpha = 3   (``DUAL_THREE``):         2 q = p + R,         R = sqrt(p^2 + 4 nu),

    as a `torch.hypot` (no overflow or underflow of the squares); both are sums of positive
    terms (no cancellation). Zero entries follow the same formulas (q = nu^2, resp. sqrt(nu)).
    ``two_sqrt_p``: 2 sqrt(p), when the caller has it."""
    if family == Family.DUAL_THREE_HALVES:
        return torch.hypot(nu, 2.0 * torch.sqrt(p) if two_sqrt_p is None else two_sqrt_p)
    return torch.hypot(p, 2.0 * torch.sqrt(nu))


def _closed_inner_log_q(family: Family, lp: Tensor, finite: Tensor, s: Tensor) -> Tensor:
    """log q_i as a function of s = log nu where the inner equation is quadratic
    (`quadratic_root`)."""
    nu = torch.exp(s).unsqueeze(-1)
    p = torch.where(finite, torch.exp(lp), 0.0)
    root = quadratic_root(family, p, nu)
    if family == Family.DUAL_THREE_HALVES:
        return 2.0 * (torch.log(nu + root) - _LOG_2)
    return torch.log(p + root) - _LOG_2


def nested_log_renorm(log_p: Tensor, mask: Tensor, alpha: Tensor, log_deficit: Tensor,
                      k: Tensor, closed: Family | None = None) -> Tensor:
    """Any finite alpha > 1: the nested root finding of Algorithm 1.

    Outer Newton on s = log nu for sum_i q_i(s) - 1, which is convex and increasing (y_i is convex
    in s and q_i = p_i e^(y_i)), started at the upper end of the bracket so that the iterates
    decrease monotonically; inner Newton for each y_i, warm-started from the previous outer step.
    With ``closed`` = ``DUAL_THREE_HALVES`` or ``DUAL_THREE`` (every row has that alpha) the
    inner solve is a formula (`quadratic_root`).
    """
    dtype = log_p.dtype
    b = alpha.to(dtype) - 1.0
    beta = b.unsqueeze(-1)
    finite = torch.isfinite(log_p) & mask
    keep = mask.to(dtype)
    lp = torch.where(finite, log_p, 0.0)
    log_ratio = log_deficit - torch.log(k.to(dtype))
    # sum_i p_i^(2 - alpha) over the positive support entries.
    log_power_sum = logsumexp_masked((1.0 - beta) * lp, finite)
    has_zero = (mask & ~finite).any(-1)
    below_two = b < 1.0
    low = torch.where(below_two, log_ratio, b * log_ratio)
    low = torch.where(below_two | has_zero, low, torch.maximum(low, log_deficit - log_power_sum))
    high = torch.where(below_two, log_deficit - log_power_sum, log_ratio)
    low, high = torch.minimum(low, high), torch.maximum(low, high)
    # nu <= phi''(1) (1 - max p) = 1 - p_1 (proof of Theorem A.1): there q_1 = 1 and every q_i <= 1.
    high = torch.minimum(high, torch.log1p(-torch.exp(lp[..., 0])))
    low = torch.minimum(low, high)
    # Start: nu = R / sum_i q_i^(2 - alpha) at q = p + R/k (the alpha = 2 solution, exact there).
    shifted = torch.logaddexp(lp, log_ratio.unsqueeze(-1))
    start = log_deficit - logsumexp_masked((1.0 - beta) * shifted, mask)
    start = torch.where((start > low) & (start < high), start, high)

    def inner_bracket(target: Tensor) -> tuple[Tensor, Tensor]:
        return (torch.clamp_max(target - beta, 0.0),
                torch.log(torch.clamp_min((target - _LOG1MEXP_AT_ONE) / beta, 1.0)))

    def outputs(s_value: Tensor, z_start: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if closed is not None:
            log_q = _closed_inner_log_q(closed, lp, finite, s_value)
            y = torch.where(finite, log_q - lp, 0.0).clamp_min(0.0)
            z_new = z_start
        else:
            target = s_value.unsqueeze(-1) - beta * lp
            z_start = torch.minimum(z_start, _inner_upper(beta, target))
            z_new = _inner_solve(beta, target, z_start, *inner_bracket(target))
            y = torch.exp(z_new)
            log_q = torch.where(finite, lp + y, s_value.unsqueeze(-1) / beta)
        q = torch.exp(log_q) * keep
        # dq_i/ds = q_i / H'(y_i), 1 / H'(y) = expm1(y) / (beta expm1(y) + 1); zeros: q_i / beta.
        em1 = torch.expm1(y)
        rate = torch.where(finite, em1 / (beta * em1 + 1.0), 1.0 / beta)
        return q, rate, z_new

    # Inner start: the root at beta = 0, y = -log(1 - e^t) (the KL limit, an upper end of the
    # root since beta y > 0), close to it when beta y is small (alpha next to 1, where the
    # search probes the widest supports); the safeguarded Newton clamps it into its bracket.
    first = (start.unsqueeze(-1) - beta * lp).clamp_max(-1e-300)
    state = {"z": torch.log(-torch.log1p(-torch.exp(first)))}

    def outer(s_value: Tensor) -> tuple[Tensor, Tensor]:
        q, state["rate"], state["z"] = outputs(s_value, state["z"])
        return q.sum(-1) - 1.0, (q * state["rate"]).sum(-1)

    def warm_start(old: Tensor, new: Tensor) -> None:
        # Predict each y_i at the new s to first order (dy/ds = rate), so the inner Newton
        # starts next to its root.
        y = torch.exp(state["z"])
        predicted = y + state["rate"] * (new - old).unsqueeze(-1)
        state["z"] = torch.where(predicted > 0.5 * y, torch.log(predicted), state["z"])

    s = safeguarded_newton(outer, start, low, high, moved=warm_start)
    z = state["z"]
    if closed is not None:
        log_q = _closed_inner_log_q(closed, lp, finite, s)
    else:
        target = s.unsqueeze(-1) - beta * lp
        y = torch.exp(_inner_solve(beta, target, z, *inner_bracket(target)))
        log_q = torch.where(finite, lp + y, s.unsqueeze(-1) / beta)
    return _normalized(log_q, mask)
