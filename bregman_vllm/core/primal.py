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
from .numerics import first_true, log_expm1, logsumexp_masked
from .roots import NEWTON_TOLERANCE, Multiplier, safeguarded_newton

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
    j = torch.arange(width, device=p.device, dtype=p.dtype)  # float: see `first_true`
    level = above / (k - j).clamp_min(1)
    valid = (level >= p) & (j < k)
    first = first_true(valid, j, width - 1).unsqueeze(-1)
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


def level_values(lp: Tensor, finite: Tensor, beta: Tensor, tau: Tensor) -> Multiplier:
    """beta > 0: every column's value at the level tau (``lp``: log p, 0 where p = 0, whose q is
    c; ``beta``: [n, 1]): log q, rate d log q / d tau = sigmoid(beta (tau - log p)) (1 for
    zero entries) and log(q / p)."""
    rise = beta * (tau.unsqueeze(-1) - lp)
    lift = _softplus(rise) / beta
    log_q = torch.where(finite, lp + lift, tau.unsqueeze(-1))
    rate = torch.where(finite, torch.sigmoid(rise), 1.0)
    return Multiplier(tau, log_q, rate, torch.where(finite, lift, log_q))


def _top_log_q(log_p: Tensor, finite: Tensor, beta: Tensor, delta: Tensor) -> Tensor:
    """beta < 0: log q_i for delta = log q_1 - log p_1 >= 0 (q_i^beta = p_i^beta + q_1^beta -
    p_1^beta).

    With g_i = log p_1 - log p_i >= 0, (q_i / p_i)^beta = 1 + w_i = -expm1(beta g_i) +
    e^(beta (g_i + delta)), a sum of two nonnegative terms; zero entries stay zero (f(0) = -inf).
    """
    return torch.where(finite, log_p + _top_lift(log_p, beta, delta), -math.inf)


def _top_lift(log_p: Tensor, beta: Tensor, delta: Tensor) -> Tensor:
    """log(q_i / p_i) of `_top_log_q` (no cancellation where it is tiny)."""
    b = beta.unsqueeze(-1)
    d = delta.unsqueeze(-1)
    gap = log_p[..., :1] - log_p
    w = torch.exp(b * gap) * torch.expm1(b * d)
    near = torch.log1p(w.clamp_min(-0.5))
    far = torch.logaddexp(torch.log(-torch.expm1(b * gap)), b * (gap + d))
    return torch.where(w > -0.5, near, far) / b


def top_values(lp: Tensor, finite: Tensor, beta: Tensor, delta: Tensor) -> Multiplier:
    """beta < 0: every column's value at delta = log q_1 - log p_1 (``lp``: log p, 0 where
    p = 0, whose q stays 0; ``beta``: [n, 1]): log q (`_top_log_q`), rate d log q / d delta =
    (q_1 / q)^beta (0 for zero entries) and log(q / p)."""
    lift = _top_lift(lp, beta.squeeze(-1), delta)
    log_q = torch.where(finite, lp + lift, -math.inf)
    rate = torch.where(finite, torch.nan_to_num(torch.exp(
        beta * (lp[..., :1] + delta.unsqueeze(-1) - log_q))), 0.0)
    return Multiplier(delta, log_q, rate, torch.where(finite, lift, log_q))


def normalized(log_q: Tensor, mask: Tensor) -> Tensor:
    """Mask and remove the last rounding of the constraint (|sum q - 1| <= 1e-14)."""
    log_q = log_q.masked_fill(~mask, -math.inf)
    return log_q - torch.logsumexp(log_q, -1, keepdim=True)


def _added(lp: Tensor, finite: Tensor, rise: Tensor, q: Tensor) -> Tensor:
    """The mass the map adds to the support (``finite``: its positive entries; ``q``: 0 off the
    support), sum_i q_i - p_i = p_i expm1(log(q_i / p_i)) (zero entries: q_i): positive
    terms, so the constraint sum_i q_i = 1, written as this = R, holds to a few ulps of R."""
    return torch.where(finite, torch.exp(lp) * torch.expm1(rise), q).sum(-1)


def primal_multiplier(log_p: Tensor, mask: Tensor, alpha: Tensor, log_deficit: Tensor, k: Tensor,
                      start: Tensor | None = None) -> Multiplier:
    """Any finite alpha != 0, 1: T_alpha on the support ``mask`` (the first k columns) by its
    scalar, solving sum_i q_i = 1 with q_i from eq. (4) by safeguarded Newton, with the values the
    same scalar gives every column (`roots.Multiplier`; past the support, what eq. (4) at that
    multiplier gives the entry).

    beta = alpha - 1 > 0, in the water level tau = log c: sum_i q_i(tau) is convex and increasing.
    The start tau_KL (q_1 equal to its KL value p_1 / S) has sum q >= 1, so Newton decreases
    monotonically to the root. Lower end of the bracket: tau = log(R/k) for beta >= 1 (since
    (a^b + c^b)^(1/b) <= a + c) and log(beta R/k)/beta for beta < 1 (mean value theorem); for
    beta < 1, log(R/k) is a second right end, and the start is the smaller of the two.
    beta < 0, in delta = log q_1 - log p_1 on [0, -log p_1], from the KL value -log S.
    ``start``: the scalar of a nearby solve (a neighbouring support size), used where it lies
    inside the bracket.
    """
    dtype = log_p.dtype
    beta = alpha.to(dtype) - 1.0
    positive = torch.isfinite(log_p)
    lp = torch.where(positive, log_p, 0.0)  # finite placeholder; masked out of every sum
    top = lp[..., 0]
    scalar = torch.empty_like(top)
    log_q = torch.empty_like(log_p)
    rate = torch.empty_like(log_p)
    lift = torch.empty_like(log_p)  # log(q / p), exact where tiny
    # Newton runs on the support's columns; every column's value follows from the scalar.
    near = min(log_p.shape[-1], int(k.max()))
    deficit = torch.exp(log_deficit)
    finite = positive[:, :near] & mask[:, :near]
    keep = mask[:, :near].to(dtype)
    # log S_k = log(1 - R): from the deficit where the support's sum rounds to 1 (a tail below
    # 1e-16 of the mass: the KL start would be -inf there), from the support otherwise.
    log_s = torch.where(deficit < 0.5, torch.log1p(-deficit.clamp_max(0.5)),
                        logsumexp_masked(log_p[:, :near], finite))

    def started(first: Tensor, low: Tensor, high: Tensor, i: Tensor) -> Tensor:
        if start is None:
            return first
        near = start[i]
        return torch.where((near > low) & (near < high), near, first)

    up = beta > 0
    i = up.nonzero().squeeze(-1)
    if i.numel():
        lpi, fin, kp, b = lp[i, :near], finite[i], keep[i], beta[i]
        log_ratio = log_deficit[i] - torch.log(k[i].to(dtype))
        low = torch.where(b >= 1, log_ratio, (torch.log(b) + log_ratio) / b)
        high = top[i] + log_expm1(-b * top[i]) / b  # q_1 = 1
        first = top[i] + log_expm1(-b * log_s[i]) / b  # q_1 = p_1 / S
        first = torch.where(b < 1, torch.minimum(first, log_ratio), first).minimum(high)
        # q_i >= max(p_i, c): c is at most the water-filling level, a closer upper end than
        # the KL start where the support has a long tail (k* in the thousands).
        water = _water_level(torch.where(fin, torch.exp(lpi), 0.0), mask[i, :near], log_deficit[i])
        first = torch.minimum(first, torch.log(water[..., 0]))
        low = torch.where(k[i] == 1, high, torch.minimum(low, first))  # (size 1: q_1 = 1, given)
        bcol = b.unsqueeze(-1)

        def level_equation(tau: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            z = bcol * (tau.unsqueeze(-1) - lpi)
            rise = _softplus(z) / bcol  # log(q / p), from z (needed below)
            q = torch.exp(torch.where(fin, lpi + rise, tau.unsqueeze(-1))) * kp
            return (_added(lpi, fin, rise, q) - deficit[i], (q * torch.where(fin, torch.sigmoid(z),
                    1.0)).sum(-1), NEWTON_TOLERANCE * deficit[i])

        tau = safeguarded_newton(level_equation, started(first, low, high, i), low, high)
        scalar[i] = tau
        level = level_values(lp[i], positive[i], bcol, tau)
        log_q[i], rate[i], lift[i] = level.log_q, level.rate, level.lift

    down = ~up
    i = down.nonzero().squeeze(-1)
    if i.numel():
        lpi, fin, kp, b = log_p[i, :near], finite[i], keep[i], beta[i]
        high = (-top[i]).clamp_min(0.0)
        low = torch.where(k[i] == 1, high, 0.0)
        u_col = (top[i]).unsqueeze(-1)
        bcol = b.unsqueeze(-1)

        def weights(delta: Tensor, log_q: Tensor) -> Tensor:
            # d log q_i / d delta = (q_1 / q_i)^beta.
            return torch.nan_to_num(torch.exp(bcol * (u_col + delta.unsqueeze(-1) - log_q)))

        def top_equation(delta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            rise = _top_lift(lpi, b, delta)
            log_q = torch.where(fin, lpi + rise, -math.inf)
            q = torch.exp(log_q)
            return (_added(lpi, fin, rise, q) - deficit[i],
                    (q * weights(delta, log_q) * kp).sum(-1), NEWTON_TOLERANCE * deficit[i])

        first = (-log_s[i]).clamp_min(0.0).minimum(high)
        delta = safeguarded_newton(top_equation, started(first, low, high, i), low, high)
        scalar[i] = delta
        top_level = top_values(lp[i], positive[i], bcol, delta)
        log_q[i], rate[i], lift[i] = top_level.log_q, top_level.rate, top_level.lift
    # d^2 log q / ds^2 = beta rate (1 - rate) for both scalars (tau: rate = sigmoid(beta (tau -
    # log p)); delta: rate = (q_1 / q)^beta, d log q_1 / d delta = 1).
    lift = torch.where(positive, lift, log_q)
    return Multiplier(scalar, log_q, rate, lift)


def level_range(top: Tensor, beta: Tensor, log_deficit: Tensor, k: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
    """beta > 0: the water level tau = log c of the support of size k: a lower bound, log(R/k)
    for beta >= 1 ((a^b + c^b)^(1/b) <= a + c) and log(beta R/k)/beta for beta < 1 (mean value
    theorem); a start, the level at which q_1 is its KL value p_1 / S, or that lower bound if
    above it; and the level of size 1 (q_1 = 1), an upper bound of every size's (``top``:
    log p_1; [n] tensors)."""
    log_ratio = log_deficit - torch.log(k.to(top.dtype))
    low = torch.where(beta >= 1, log_ratio, (torch.log(beta) + log_ratio) / beta)
    high = top + log_expm1(-beta * top) / beta
    kl = top + log_expm1(-beta * torch.log1p(-torch.exp(log_deficit))) / beta
    return low, torch.maximum(torch.minimum(kl, high), low), high


def top_range(top: Tensor, log_deficit: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """beta < 0: log delta (delta = log q_1 - log p_1) of the support of size k: every entry's
    ratio q_i / p_i is at most q_1 / p_1 (p_i <= p_1 in eq. (4)), so R <= S (e^delta - 1) and
    delta >= -log S = -log(1 - R), a lower bound and a start (equal when every ratio is);
    delta <= -log p_1 (q_1 <= 1), the value of size 1 (``top``: log p_1; [n] tensors)."""
    low = torch.log(-torch.log1p(-torch.exp(log_deficit)))
    return low, low, torch.log(-top)


def primal_values(lp: Tensor, finite: Tensor, beta: Tensor, s: Tensor, up: bool) -> Multiplier:
    """Every column's value at the scalar s of eq. (4) (`roots.Multiplier`), with its rate
    in s: ``up`` (beta > 0), s = tau, the water level (`level_values`); beta < 0,
    s = log delta (`top_values`; delta spans orders of magnitude as the support grows).
    ``beta``: [n, 1]."""
    if up:
        return level_values(lp, finite, beta, s)
    delta = torch.exp(s)
    values = top_values(lp, finite, beta, delta)
    rate = values.rate * delta.unsqueeze(-1)
    return values._replace(s=s, rate=rate)


def newton_log_renorm(log_p: Tensor, mask: Tensor, alpha: Tensor, log_deficit: Tensor,
                      k: Tensor) -> Tensor:
    """log T_alpha on the support (`primal_multiplier`), normalized, -inf off it."""
    return normalized(primal_multiplier(log_p, mask, alpha, log_deficit, k).log_q, mask)


#: Arguments: log p, support mask, log R, k.
_CLOSED = {
    Family.KL: lambda lp, mk, ld, kk: kl_log_renorm(lp, mk),
    Family.THREE_HALVES: three_halves_log_renorm,
    Family.SQUARE: square_log_renorm,
    Family.WATER: lambda lp, mk, ld, kk: water_filling_log_renorm(lp, mk, ld),
    Family.ARGMAX: lambda lp, mk, ld, kk: argmax_fill_log_renorm(lp, mk, ld),
}
