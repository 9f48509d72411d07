"""Primal alpha-renormalization T_alpha on a fixed support (arXiv 2505.19371: eq. (4) with
phi_alpha, i.e. Definition 4.1).

For phi_alpha(x) = x^alpha / (alpha (alpha - 1)), f = phi' and eq. (4) give

    q_i^(alpha-1) = p_i^(alpha-1) + t,   t chosen so that sum_i q_i = 1,

with the closed forms of Proposition 4.1 (special primal alpha-renormalization maps):

    alpha = 1     q = p / S                                  (standard top-k)
    alpha = 3/2   q_i = (sqrt(p_i) + c)^2, c = R / (sqrt(r^2 + k R) + r)
    alpha = 2     q_i = p_i + R / k
    alpha = +inf  q_i = max(p_i, c)                          (water-filling)
    alpha = -inf  q_i = p_i + R 1[i = argmax]                 (ties share R equally)

where S = sum_i p_i, R = 1 - S, r = sum_i sqrt(p_i). Every other alpha is solved by safeguarded
Newton iteration on one scalar per row, with every q_i explicit in it:

    q_i^beta = p_i^beta + c^beta     (beta = alpha - 1 > 0; c is the "water level")
    q_i^beta = p_i^beta + q_1^beta - p_1^beta     (beta < 0; the scalar is log q_1)

evaluated in log space so that alpha = 1000 (the water-filling limit) and alpha -> 1 (the top-k
limit) neither overflow nor lose precision.

All functions take a batch of sorted supports: ``log_p`` is ``[..., K]`` sorted in decreasing order,
``k`` (``[...]``) is the support size of each row (entries at positions >= k are ignored), and the
result is ``log q`` with -inf outside the support.
"""

from __future__ import annotations

import math

import torch

from .families import Family
from .numerics import log_expm1, logsumexp_masked
from .roots import safeguarded_newton

Tensor = torch.Tensor

def support_mask(k: Tensor, width: int) -> Tensor:
    """[..., width] boolean mask of positions < k."""
    positions = torch.arange(width, device=k.device)
    return positions < k.unsqueeze(-1)


def kl_log_renorm(log_p: Tensor, mask: Tensor) -> Tensor:
    """alpha = 1 (KL): q = p / S, i.e. standard top-k renormalization (eq. (1))."""
    inside = log_p.masked_fill(~mask, -math.inf)
    return inside - torch.logsumexp(inside, -1, keepdim=True)


def square_log_renorm(log_p: Tensor, mask: Tensor, log_deficit: Tensor, k: Tensor) -> Tensor:
    """alpha = 2: q_i = p_i + R / k (Proposition 4.1)."""
    shift = (log_deficit - torch.log(k.to(log_p.dtype))).unsqueeze(-1)
    return torch.logaddexp(log_p, shift).masked_fill_(~mask, -math.inf)


def three_halves_log_renorm(log_p: Tensor, mask: Tensor, log_deficit: Tensor,
                            k: Tensor) -> Tensor:
    """alpha = 3/2: q_i = (sqrt(p_i) + c)^2 with c = R / (sqrt(r^2 + k R) + r) (Proposition 4.1).

    This is the paper's c = [sqrt(r^2 + k(1 - s)) - r] / k, rationalized so that it does not
    cancel when k R is small against r^2.
    """
    half = (0.5 * log_p).masked_fill_(~mask, -math.inf)
    log_r = torch.logsumexp(half, -1)
    # sqrt(r^2 + k R) in log space: 0.5 * logaddexp(2 log r, log k + log R).
    log_root = 0.5 * torch.logaddexp(2.0 * log_r, torch.log(k.to(log_p.dtype)) + log_deficit)
    log_c = log_deficit - torch.logaddexp(log_root, log_r)
    return (2.0 * torch.logaddexp(half, log_c.unsqueeze(-1))).masked_fill_(~mask, -math.inf)


def water_filling_log_renorm(log_p: Tensor, mask: Tensor, log_deficit: Tensor) -> Tensor:
    """alpha = +inf: q_i = max(p_i, c) with sum_i q_i = 1 (Proposition 4.1).

    With j entries above the water, c_j = (1 - S_j) / (k - j); the level is c_j for the smallest
    j with c_j >= p_(j+1). 1 - S_j is formed as R plus the masked suffix sum (no cancellation).
    """
    p = torch.where(mask, torch.exp(log_p), 0.0)
    c = _water_level(p, mask, log_deficit)
    return torch.where(mask, torch.log(torch.maximum(p, c)), -math.inf)


def _water_level(p: Tensor, mask: Tensor, log_deficit: Tensor) -> Tensor:
    """The level c of water-filling ([..., 1]): sum_i max(p_i, c) = 1 over the support."""
    width = p.shape[-1]
    suffix = torch.flip(torch.cumsum(torch.flip(p, [-1]), -1), [-1])  # sum_{i >= j} p_i
    deficit = torch.exp(log_deficit).unsqueeze(-1)
    above = deficit + suffix  # 1 - S_j for j = 0..width-1 (entries before j are above water)
    k = mask.sum(-1, keepdim=True)
    j = torch.arange(width, device=p.device)
    level = above / (k - j).clamp_min(1).to(p.dtype)
    valid = (level >= p) & (j < k)
    first = torch.where(valid, j, width).amin(-1, keepdim=True).clamp_max(width - 1)
    return torch.gather(level, -1, first)


def argmax_fill_log_renorm(log_p: Tensor, mask: Tensor, log_deficit: Tensor) -> Tensor:
    """alpha = -inf: the whole deficit goes to the largest entry, shared equally among ties."""
    top = log_p[..., :1]
    tied = mask & (log_p == top)
    count = tied.sum(-1).to(log_p.dtype)
    shift = (log_deficit - torch.log(count)).unsqueeze(-1)
    out = torch.where(tied, torch.logaddexp(log_p, shift), log_p)
    return torch.where(mask, out, -math.inf)


def closed_log_renorm(family: Family, log_p: Tensor, mask: Tensor, log_deficit: Tensor,
                      k: Tensor) -> Tensor:
    """The map of a closed-form ``family`` (`families.CLOSED_FORM_FAMILIES`): the one dispatch
    from a family to its closed form, used by the fixed-shape window and the exact path."""
    return _CLOSED[family](log_p, mask, log_deficit, k)


def _softplus(x: Tensor) -> Tensor:
    """log(1 + e^x) in one fused op; the cut-off at 40 is below float64 resolution."""
    return torch.nn.functional.softplus(x, beta=1.0, threshold=40.0)


def _level_log_q(log_p: Tensor, finite: Tensor, beta: Tensor, tau: Tensor) -> Tensor:
    """beta > 0: log q_i for the water level tau = log c (q_i^beta = p_i^beta + c^beta).

    log q_i = log p_i + softplus(beta (tau - log p_i)) / beta is convex and increasing in tau; zero
    entries get q_i = c. alpha -> inf gives max(p_i, c) (water-filling), alpha -> 1 the KL shift.
    """
    b = beta.unsqueeze(-1)
    level = tau.unsqueeze(-1)
    log_q = log_p + _softplus(b * (level - log_p)) / b
    return torch.where(finite, log_q, level)


def _top_log_q(log_p: Tensor, finite: Tensor, beta: Tensor, delta: Tensor) -> Tensor:
    """beta < 0: log q_i for delta = log q_1 - log p_1 >= 0 (q_i^beta = p_i^beta + q_1^beta -
    p_1^beta).

    With g_i = log p_1 - log p_i >= 0, (q_i / p_i)^beta = 1 + w_i = -expm1(beta g_i) +
    e^(beta (g_i + delta)), a sum of two nonnegative terms; zero entries stay zero (f(0) = -inf).
    """
    b = beta.unsqueeze(-1)
    d = delta.unsqueeze(-1)
    gap = log_p[..., :1] - log_p
    w = torch.exp(b * gap) * torch.expm1(b * d)
    near = torch.log1p(w.clamp_min(-0.5))
    far = torch.logaddexp(torch.log(-torch.expm1(b * gap)), b * (gap + d))
    log_q = log_p + torch.where(w > -0.5, near, far) / b
    return torch.where(finite, log_q, -math.inf)


def _normalized(log_q: Tensor, mask: Tensor) -> Tensor:
    """Mask and remove the last rounding of the constraint (|sum q - 1| <= 1e-14)."""
    log_q = log_q.masked_fill(~mask, -math.inf)
    return log_q - torch.logsumexp(log_q, -1, keepdim=True)


def newton_log_renorm(log_p: Tensor, mask: Tensor, alpha: Tensor, log_deficit: Tensor,
                      k: Tensor) -> Tensor:
    """Any finite alpha != 0: solve sum_i q_i = 1 with q_i from eq. (4) by safeguarded Newton.

    beta = alpha - 1 > 0, in the water level tau = log c: sum_i q_i(tau) is convex and increasing.
    The start tau_KL (q_1 equal to its KL value p_1 / S) has sum q >= 1, so Newton decreases
    monotonically to the root. Lower end of the bracket: tau = log(R/k) for beta >= 1 (since
    (a^b + c^b)^(1/b) <= a + c) and log(beta R/k)/beta for beta < 1 (mean value theorem); for
    beta < 1, log(R/k) is a second right end, and the start is the smaller of the two.
    beta < 0, in delta = log q_1 - log p_1 on [0, -log p_1], from the KL value -log S.
    """
    dtype = log_p.dtype
    beta = alpha.to(dtype) - 1.0
    finite = torch.isfinite(log_p) & mask
    keep = mask.to(dtype)
    lp = torch.where(finite, log_p, 0.0)  # finite placeholder; masked out of every sum
    top = lp[..., 0]
    log_s = logsumexp_masked(log_p, finite)
    out = torch.empty_like(log_p)

    up = beta > 0
    if bool(up.any()):
        i = up.nonzero().squeeze(-1)
        lpi, fin, kp, b = lp[i], finite[i], keep[i], beta[i]
        log_ratio = log_deficit[i] - torch.log(k[i].to(dtype))
        low = torch.where(b >= 1, log_ratio, (torch.log(b) + log_ratio) / b)
        high = top[i] + log_expm1(-b * top[i]) / b  # q_1 = 1
        start = top[i] + log_expm1(-b * log_s[i]) / b  # q_1 = p_1 / S
        start = torch.where(b < 1, torch.minimum(start, log_ratio), start).minimum(high)
        # q_i >= max(p_i, c): c is at most the water-filling level, a closer upper end than
        # the KL start where the support has a long tail (k* in the thousands).
        water = _water_level(torch.where(fin, torch.exp(lpi), 0.0), mask[i], log_deficit[i])
        start = torch.minimum(start, torch.log(water[..., 0]))
        low = torch.minimum(low, start)
        bcol = b.unsqueeze(-1)

        def level_equation(tau: Tensor) -> tuple[Tensor, Tensor]:
            z = bcol * (tau.unsqueeze(-1) - lpi)
            q = torch.exp(torch.where(fin, lpi + _softplus(z) / bcol, tau.unsqueeze(-1))) * kp
            return q.sum(-1) - 1.0, (q * torch.where(fin, torch.sigmoid(z), 1.0)).sum(-1)

        tau = safeguarded_newton(level_equation, start, low, high)
        out[i] = _normalized(_level_log_q(lpi, fin, b, tau), mask[i])

    down = ~up
    if bool(down.any()):
        i = down.nonzero().squeeze(-1)
        lpi, fin, kp, b = log_p[i], finite[i], keep[i], beta[i]
        high = (-top[i]).clamp_min(0.0)
        low = torch.zeros_like(high)
        u_col = (top[i]).unsqueeze(-1)
        bcol = b.unsqueeze(-1)

        def top_equation(delta: Tensor) -> tuple[Tensor, Tensor]:
            log_q = torch.where(mask[i], _top_log_q(lpi, fin, b, delta), -math.inf)
            q = torch.exp(log_q)
            # d log q_i / d delta = (q_1 / q_i)^beta.
            weight = torch.exp(bcol * (u_col + delta.unsqueeze(-1) - log_q)) * kp
            return q.sum(-1) - 1.0, (q * torch.nan_to_num(weight)).sum(-1)

        start = (-log_s[i]).clamp_min(0.0).minimum(high)
        delta = safeguarded_newton(top_equation, start, low, high)
        out[i] = _normalized(_top_log_q(lpi, fin, b, delta), mask[i])
    return out


#: Arguments: log p, support mask, log R, k.
_CLOSED = {
    Family.KL: lambda lp, mk, ld, kk: kl_log_renorm(lp, mk),
    Family.THREE_HALVES: three_halves_log_renorm,
    Family.SQUARE: square_log_renorm,
    Family.WATER: lambda lp, mk, ld, kk: water_filling_log_renorm(lp, mk, ld),
    Family.ARGMAX: lambda lp, mk, ld, kk: argmax_fill_log_renorm(lp, mk, ld),
}
