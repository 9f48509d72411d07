"""The fixed-shape k* search: every support size of a window at once, then one selection.

For the candidates x_1 >= ... >= x_W of a row (normalized, `candidates`), the search evaluates
the cost gap G(k) = cost(k) - cost(k + 1) + lambda for every k = 1 .. K - 1 of the window and
takes

    k* = min { k : G(k) <= lambda  or  k = limit }       (limit = min(k_max, #positive entries)),

which is the global minimizer of cost(k) because cost is discretely convex (Theorem 3.3 of arXiv
2505.19371; ties go to the smaller support). There is no value-dependent control flow: the
window is a fixed shape, and the iterative families run a fixed number of Newton steps. Each
function returns, with k* and log T_k*, whether the row is *certified*:

* the window held k* (k* < K, or the row's limit is inside the window);
* iterative families: every size up to the limit converged (|sum q - 1| <= `TOLERANCE`), and the
  two decisive comparisons, G(k* - 1) > lambda and G(k*) <= lambda, hold with a margin larger
  than the rounding bound of the formula that computed G.

An uncertified row is decoded again by the exact path (`search`), so certification trades speed,
never exactness. The step asks the iterative families for the numerical certificate
(``certify``) only where a row's support may pass the window. Where every support fits it,
leaving the certificate out removes the step's only host sync; that rests on evidence rather
than a proof: on every extreme input the tests know, the certificate never fails there
(`tests/test_gpu_readiness.py` computes it anyway and requires that). The Newton updates
keep w and nu at or above 0 (where their roots lie), so a rounding overshoot can never turn a
power or square root into NaN.

Gap formulas. Closed forms (`gaps`) for alpha = 1 (primal), 3/2 (primal) and 2. For the
iterative families, G(k) = [H(k) - H(k + 1)] / (alpha (alpha - 1)) with one scalar H per size,

    primal (q_i^b = p_i^b + w_k, b = alpha - 1):   H(k) = alpha w_k - (alpha - 1) sum_i q_i^alpha
    dual   (q_i^b - p_i q_i^(b-1) = nu_k):         H(k) = alpha nu_k - sum_i q_i^alpha

over the support of T_k. Both follow from substituting the maps of eqs. (4) and (5) into
cost(k) = D(T_k(p), p) + lambda k (resp. D(p, T*_k(p)) + lambda k, eq. (6)); the primal one is
stationary in w at the solution, so a Newton residual enters it only to second order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch

from .candidates import Candidates, cached_arange
from .dual import quadratic_root
from .families import Family
from .gaps import closed_form_gaps
from .numerics import first_true
from .primal import closed_log_renorm

Tensor = torch.Tensor
Scalar = float | Tensor  # a Python number, or one value per row ([n])

#: |sum_i q_i - 1| below which a Newton solution is accepted (a few hundred ulps).
TOLERANCE = 1e-13
#: Relative rounding bound of H(k) - H(k + 1); a closer call is left to the exact path.
MARGIN = 1e-12


class Decoded(NamedTuple):
    """The result of a support search (this window's, or a candidate round of the exact path,
    `search`): k* per row, log T_k* on the first W' candidates (-inf past k*), which rows are
    not certified (None: every row is certified by construction), for those a lower bound on
    k* that the window did certify (``past``: the row needs sizes past the window only, every
    G(k) of the window being clearly above lambda; None: no such row), and which rows have
    their log T_k* computed (``computed``; None: every row)."""

    k: Tensor
    log_q: Tensor
    uncertain: Tensor | None
    past: Tensor | None = None
    computed: Tensor | None = None


def column(value: Scalar, dims: int = 1) -> Scalar:
    """A per-row value shaped to broadcast against [n, *dims]; numbers pass through."""
    if isinstance(value, Tensor):
        return value.view(-1, *([1] * dims))
    return value


# ----------------------------------------------------------------------------- selection


def first_stop(stop: Tensor, window: int) -> Tensor:
    """The first k in 1 .. window - 1 whose ``stop`` ([n, window - 1]) holds, else window."""
    if window == 1:
        return torch.ones(stop.shape[0], dtype=torch.long, device=stop.device)
    sizes = cached_arange(window + 1, stop.device, torch.float32)[1:window]
    return first_true(stop, sizes, window)


def support_log(q: Tensor) -> Tensor:
    """log of ``q`` ([n, W'], zero past the support) renormalized to sum 1: removes the last
    rounding of a solved map; -inf past the support."""
    return torch.log(q / q.sum(-1, keepdim=True))


def support_range(cand: Candidates, values: Mapping, capped: bool = True
                  ) -> tuple[Tensor | None, Tensor]:
    """The support sizes an adaptive row's k* may take, [low, limit], from the row's values
    (`plan.Group.values`, `plan.ExactPlan.values`): limit = min(cap, number of positive
    entries) (``values["size"]``: the cap, `candidates.UNBOUNDED` for none; ``capped`` False:
    no row has one); low None: 1. The one place both searches (this window's and the exact
    path's) read the bounds of their sizes from the parameters."""
    size = values["size"]
    if not capped:
        limit = cand.known
    elif isinstance(size, Tensor):
        limit = torch.minimum(cand.known, size)
    else:
        limit = cand.known.clamp_max(size)
    return None, limit


def _beyond_window(k: Tensor, limit: Tensor, window: int) -> Tensor:
    """k* ran into the end of the window and the row could grow past it."""
    return (k >= window) & (limit > window)


# ----------------------------------------------------------------------------- closed forms


def closed_gaps(family: Family, x: Tensor, deficit: Tensor) -> Tensor:
    """G(1 .. W - 1) in closed form (`gaps`) for the candidates of a window of W sizes
    (``deficit[:, j]`` = R_(j+1))."""
    if family != Family.KL:  # the gap formulas index R_j from j = 0 (R_0 = 1)
        deficit = torch.nn.functional.pad(deficit, (1, 0), value=1.0)
    return closed_form_gaps(family, x, deficit)


def closed_map(family: Family, cand: Candidates, k: Tensor, width: int) -> Tensor:
    """log T_k on the first ``width`` candidates for the closed-form families: the maps of
    `primal` (eq. (1) and Proposition 4.1), applied to the candidates."""
    inside = cached_arange(width, cand.x.device) < k.unsqueeze(-1)
    log_deficit = torch.log(torch.gather(cand.deficit, 1, (k - 1).unsqueeze(-1)).squeeze(-1))
    return closed_log_renorm(family, cand.log_x[:, :width], inside, log_deficit, k)


def closed_sizes(family: Family, cand: Candidates, lam: Scalar, limit: Tensor, window: int,
                 low: Tensor | None = None) -> Tensor:
    """The first size in low .. window - 1 whose closed-form gap is at most lambda or that
    reaches ``limit``, else ``window``: k* of a closed-form family over these candidates (the
    window's search and the exact path's rounds both use it)."""
    x, deficit = cand.x[:, :window], cand.deficit[:, :window]
    gaps = closed_gaps(family, x, deficit)
    sizes = cached_arange(window + 1, x.device)[1:window]
    stop = (gaps <= column(lam)) | (sizes >= limit.unsqueeze(-1))
    if low is not None:
        stop &= sizes >= low.unsqueeze(-1)
    return first_stop(stop, window)


def closed_search(family: Family, cand: Candidates, lam: Scalar, limit: Tensor, window: int,
                  bounded: bool, *, low: Tensor | None = None) -> Decoded:
    """Adaptive k* for a closed-form family over sizes low .. window (`support_range`)."""
    k = closed_sizes(family, cand, lam, limit, window, low)
    uncertain = None if bounded else _beyond_window(k, limit, window)
    # Closed forms are exact up to rounding: a row past the window saw G(k) > lambda for every
    # k < window.
    return Decoded(k, closed_map(family, cand, k, window), uncertain, uncertain)


# ----------------------------------------------------------------------------- iterative


class Solved(NamedTuple):
    """T_k for several sizes per row: ``q`` [n, m, W'] (T_k times a positive factor per row,
    zero past each support), ``h`` [n, m] = H(k) in the same units, the Newton residual
    sum q - 1 [n, m], and ``factor``: G(k) <= lambda  <=>  h(k) - h(k+1) <= lambda * factor."""

    q: Tensor
    h: Tensor
    residual: Tensor
    factor: Tensor | float
    multiplier: Tensor | None = None  # [n, m] POWER: v = w / x_1^b of each size


def _nonzero(x: Tensor) -> Tensor:
    """``x`` with zero entries replaced by 1. Zeros only sit inside supports past the row's
    limit (never used); 1 keeps the Newton arrays finite there."""
    return x.masked_fill(x <= 0, 1.0)


def _masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    """sum_i mask[k, i] values[n, k, i] -> [n, k] (the support of each size)."""
    return (values * mask).sum(-1)


def power_solve(x: Tensor, deficit: Tensor, sizes: Tensor, mask: Tensor, alpha: Scalar,
                iterations: int, any_below_two: bool, any_above_two: bool) -> Solved:
    """Primal T_k for alpha in `families.POWER_RANGE`: q_i = (p_i^b + w)^(1/b), b = alpha - 1
    (eq. (4) with phi_alpha, Definition 4.1), sum_i q_i = 1.

    In units of the largest entry (r_i = x_i / x_1, v = w / x_1^b, s_i = q_i / x_1) the
    constraint is F(v) = sum_i (r_i^b + v)^(1/b) - 1 / x_1 = 0. F is concave in v for b >= 1 and
    convex for b < 1; the start v_0 = (R / (k x_1))^b lies on the side from which Newton is
    monotone (the level c >= R/k for b >= 1, c <= R/k for b < 1), and for b < 1 the KL start
    (q_1 = p_1 / S, also right of the root) is used when smaller. No safeguard is needed.

    ``deficit`` [n, m] is R_k, ``sizes`` [.., m] the sizes k (float), ``mask`` [.., m, W'] the
    supports. H(k) / x_1^alpha = alpha v / x_1 - (alpha - 1) sum_i s_i^alpha, s_i^alpha = s_i a_i.
    """
    b = alpha - 1.0
    inv_x1 = torch.reciprocal(x[:, :1])
    powers = (_nonzero(x) * inv_x1).pow(column(b)).unsqueeze(1)  # [n, 1, W']
    v = (deficit * inv_x1 / sizes).pow(column(b))
    if any_below_two:  # the KL start, v = (1 / S_k)^b - 1
        kl = torch.expm1(torch.log1p(-deficit) * column(-b))
        v = torch.minimum(v, kl) if not any_above_two else \
            torch.where(column(b) < 1.0, torch.minimum(v, kl), v)
    exponent = column(1.0 / b, 2)
    negative_b = column(-b) if isinstance(b, Tensor) else -b
    for _ in range(iterations):
        a = powers + v.unsqueeze(-1)
        s = a.pow(exponent) * mask
        residual = s.sum(-1) - inv_x1
        slope = (s / a).sum(-1)  # b dF/dv
        if isinstance(b, Tensor):
            v = torch.addcdiv(v, residual * negative_b, slope)
        else:
            v = torch.addcdiv(v, residual, slope, value=negative_b)
        # w >= 0 (mass is only added); a rounding overshoot past a root at 0 (no deficit)
        # would make r^b + v negative for tiny entries and their power NaN.
        v = v.clamp_min(0.0)
    a = powers + v.unsqueeze(-1)
    s = a.pow(exponent) * mask
    residual = (s.sum(-1) - inv_x1) * x[:, :1]
    power_sums = (s * a).sum(-1) * negative_b
    if isinstance(alpha, Tensor):
        h = torch.addcmul(power_sums, v, inv_x1 * column(alpha))
    else:
        h = torch.addcmul(power_sums, v, inv_x1, value=alpha)
    # G = x_1^alpha (h(k) - h(k+1)) / (alpha (alpha - 1)).
    factor = inv_x1.squeeze(-1).pow(alpha) * (alpha * b)
    return Solved(s, h, residual, factor, v)


def dual_quadratic_solve(family: Family, x: Tensor, deficit: Tensor, sizes: Tensor,
                         mask: Tensor, iterations: int) -> Solved:
    """Dual T*_k for alpha in {3/2, 3} (``family``), where the inner equation of eq. (5),
    q^(alpha-2) (q - p) = nu, is a quadratic (`dual.quadratic_root`; Algorithm 1 needs no
    inner loop):

        alpha = 3/2:  sqrt(q) = (nu + R) / 2   (F convex in nu)
        alpha = 3:    q = (p + R) / 2          (F concave in nu)

    Newton on F(nu) = sum_i (q_i(nu) - p_i) - R_k, the mass the map adds against the deficit:
    sums of positive terms, with q - p from the roots without cancellation (alpha = 3/2:
    sqrt(q) - sqrt(p) = (nu + nu^2 / (R + 2 sqrt(p))) / 2; alpha = 3: q - p = 2 nu / (R + p)),
    so nu comes out to full relative precision however small R_k is (a support holding all
    but 1e-40 of the mass: the map only adds mass, q_i >= p_i, down to its smallest entry).
    Starts on the side that makes Newton monotone: alpha = 3/2 from nu = R / sum_i (p_i +
    R/k)^(1/2) (the alpha = 2 solution; F convex, so every start converges monotonically after
    the first step), alpha = 3 from the lower bound nu >= max((R/k)^2, R / sum_i 1/p_i) (q_i <= 1
    and q_i >= p_i in eq. (5)). H(k) = alpha nu - sum_i q_i^alpha.
    """
    xs = _nonzero(x).unsqueeze(1)  # [n, 1, W']
    if family == Family.DUAL_THREE_HALVES:
        # q - p = nu sqrt(q) and 2 sqrt(q) = nu + root = h: the added mass is nu sum h / 2,
        # its derivative sum h^2 / (2 root)
        two_sqrt_p = 2.0 * torch.sqrt(xs)
        twice = 2.0 * deficit
        nu = deficit / _masked_sum(torch.sqrt(xs + (deficit / sizes).unsqueeze(-1)), mask)
        for _ in range(iterations):
            root = quadratic_root(family, xs, nu.unsqueeze(-1), two_sqrt_p)
            h = (nu.unsqueeze(-1) + root) * mask
            nu = torch.addcdiv(nu, nu * h.sum(-1) - twice, (h * h / root).sum(-1), value=-1.0)
        root = quadratic_root(family, xs, nu.unsqueeze(-1), two_sqrt_p)
        h = (nu.unsqueeze(-1) + root) * mask
        q4 = h * h
        # q^(3/2) = (h / 2)^3 = q4 h / 8
        return Solved(q4, torch.add(nu, (q4 * h).sum(-1), alpha=-1.0 / 12.0),
                      0.5 * nu * h.sum(-1) - deficit, 0.5)
    # q - p = nu / q = 2 nu / (p + root): the added mass; its derivative sum 1 / root
    inverse_sums = torch.cumsum(torch.reciprocal(x), -1)
    if sizes.dim() == 1:  # every size of the window
        inverse_sums = inverse_sums[:, : sizes.shape[0]]
    else:
        inverse_sums = torch.gather(inverse_sums, 1, sizes.long() - 1)
    nu = torch.maximum((deficit / sizes) ** 2, deficit / inverse_sums)
    for _ in range(iterations):
        root = quadratic_root(family, xs, nu.unsqueeze(-1))
        added = (2.0 * nu.unsqueeze(-1) / (root + xs) * mask).sum(-1)
        nu = torch.addcdiv(nu, added - deficit, _masked_sum(torch.reciprocal(root), mask),
                           value=-1.0)
        # nu = q (q - p) >= 0; a rounding overshoot below 0 (no deficit) would make the
        # square root of nu NaN.
        nu = nu.clamp_min(0.0)
    root = quadratic_root(family, xs, nu.unsqueeze(-1))
    gained = 2.0 * nu.unsqueeze(-1) / (root + xs) * mask
    q2 = 2.0 * xs * mask + 2.0 * gained
    return Solved(q2, torch.add(nu, (q2**3).sum(-1), alpha=-1.0 / 24.0),
                  gained.sum(-1) - deficit, 2.0)


def _solve(family: Family, cand: Candidates, deficit: Tensor, sizes: Tensor, mask: Tensor,
           alpha: Scalar, iterations: int, width: int, below_two: bool, above_two: bool
           ) -> Solved:
    x = cand.x[:, :width]
    if family == Family.POWER:
        return power_solve(x, deficit, sizes, mask, alpha, iterations, below_two, above_two)
    return dual_quadratic_solve(family, x, deficit, sizes, mask, iterations)


#: Newton steps of POWER's chosen map in the level form (`_power_map`).
LEVEL_STEPS = 6
#: POWER's linear-space solve (`power_solve`) meets sum q = 1 to rounding, so each q_i is
#: exact to about 1e-16 absolutely: to 1e-8 relatively down to entries of this size. A fixed
#: size is solved again in log space (`_power_map`: exact in the tail); an adaptive row whose
#: support holds a smaller entry is not certified (the exact path decodes it; in a group whose
#: every support fits the window the step does not ask, `step._may_flag`).
POWER_RESOLUTION = 1e-8


def _power_map(cand: Candidates, k: Tensor, alpha: Scalar, width: int, v: Tensor) -> Tensor:
    """log T_k of POWER's chosen size per row, solved again in log space for the level
    tau = log c of eq. (4) (q^b = p^b + c^b): Newton on log A(tau) = log R_k, A the mass the
    map adds to the support (sum_i p_i expm1(softplus(b (tau - log p_i)) / b), positive terms),
    from the window's v (or the lower end of the level's bracket, log(R/k) for b >= 1, where
    it lies below). The linear-space solve of `power_solve` finds v to the rounding of
    sum q = 1, which is all of v where the deficit R_k is below it (a support holding all but
    1e-40 of the mass: its tail entries would get ~1e-17); this finds c to full relative
    precision, so every entry is exact, q_i >= p_i."""
    lp, x = cand.log_x[:, :width], cand.x[:, :width]
    inside = cached_arange(width, k.device) < k.unsqueeze(-1)
    b = column(alpha - 1.0)
    log_r = torch.log(torch.gather(cand.deficit, 1, (k - 1).unsqueeze(-1)))  # [n, 1]
    share = log_r - torch.log(k.unsqueeze(-1).to(lp.dtype))
    low = torch.where(b >= 1.0, share, (torch.log(b) + share) / b) if isinstance(b, Tensor) \
        else (share if b >= 1.0 else (math.log(b) + share) / b)
    tau = torch.maximum(low, torch.log(v) / b + lp[:, :1])
    tau = torch.where(torch.isfinite(tau), tau, low)
    lp_in = torch.where(inside, lp, 0.0)
    p = torch.where(inside, x, 0.0)
    for _ in range(LEVEL_STEPS):
        z = b * (tau - lp_in)
        lift = torch.nn.functional.softplus(z, threshold=40.0) / b
        added = p * torch.expm1(lift)
        total = added.sum(-1, keepdim=True)
        slope = ((p + added) * torch.sigmoid(z)).sum(-1, keepdim=True)
        tau = tau + torch.nan_to_num((log_r - torch.log(total)) * total / slope, nan=0.0,
                                     posinf=0.0, neginf=0.0)
    lift = torch.nn.functional.softplus(b * (tau - lp_in), threshold=40.0) / b
    lift = torch.where(torch.isneginf(log_r), 0.0, lift)  # (no deficit: q = p)
    log_q = torch.where(inside & (x > 0), lp + lift, -math.inf)
    return log_q - torch.logsumexp(log_q, -1, keepdim=True)


def iterative_search(family: Family, cand: Candidates, alpha: Scalar, lam: Scalar,
                     limit: Tensor, window: int, iterations: int, bounded: bool,
                     below_two: bool = False, above_two: bool = True, *,
                     certify: bool = True, low: Tensor | None = None) -> Decoded:
    """Adaptive k* for POWER and the dual quadratic families: T_k for k = 1 .. window at
    once, the gaps from H, and (with ``certify``) the certificate: convergence up to the
    limit, decisions clear of the rounding bound of H differences, k* inside the window
    unless ``bounded``. Without ``certify`` nothing is flagged (``uncertain`` is None).
    ``low``: the smallest size allowed (`support_range`; None: 1)."""
    device = cand.x.device
    sizes = cached_arange(window + 1, device, torch.float64)[1:]
    mask = _triangle(window, device)
    solved = _solve(family, cand, cand.deficit[:, :window], sizes, mask, alpha, iterations,
                    window, below_two, above_two)
    h = solved.h
    drop = h[:, :-1] - h[:, 1:]
    threshold = column(lam) * column(solved.factor)
    count = cached_arange(window + 1, device)[1:]
    below = count[:-1] < limit.unsqueeze(-1)  # sizes whose gap may decide k*
    stop = (drop <= threshold) | ~below
    if low is not None:
        stop &= count[:-1] >= low.unsqueeze(-1)
    k = first_stop(stop, window)
    at = (k - 1).unsqueeze(-1)
    log_q = support_log(torch.gather(solved.q, 1, at.unsqueeze(-1).expand(-1, 1, window))
                        .squeeze(1))
    if not certify:
        return Decoded(k, log_q, None)
    # Not certified: a size up to the limit did not converge, or a comparison of a size below
    # the limit is within the rounding bound of h(k) - h(k+1).
    magnitude = h.abs()
    rounding = (magnitude[:, :-1] + magnitude[:, 1:]) * MARGIN
    close = ((drop - threshold).abs() <= rounding) & below
    # (written so that a NaN residual counts as not converged)
    unconverged = ~(solved.residual.abs() <= TOLERANCE) & (count <= limit.unsqueeze(-1))
    flags = [close, unconverged]
    if family == Family.POWER:  # an entry of the support below the solve's resolution
        flags.append(torch.gather(cand.x, 1, at) < POWER_RESOLUTION)
    unsure = torch.cat(flags, -1).any(-1)
    past = None
    if not bounded:
        beyond = _beyond_window(k, limit, window)
        past = beyond & ~unsure  # every decision of the window stands: k* >= window
        unsure = unsure | beyond
    return Decoded(k, log_q, unsure, past)


def iterative_fixed(family: Family, cand: Candidates, alpha: Scalar, k: Tensor, width: int,
                    iterations: int, below_two: bool = False, above_two: bool = True, *,
                    certify: bool = True) -> Decoded:
    """T_k for a fixed size per row (generalized top-k, Definition 2.2); with ``certify``,
    rows whose Newton residual is above `TOLERANCE` are flagged."""
    at = (k - 1).unsqueeze(-1)
    deficit = torch.gather(cand.deficit, 1, at)  # [n, 1]
    sizes = k.unsqueeze(-1).to(torch.float64)
    mask = (cached_arange(width, k.device) < k.view(-1, 1, 1)).to(torch.float64)
    solved = _solve(family, cand, deficit, sizes, mask, alpha, iterations, width, below_two,
                    above_two)
    uncertain = ~(solved.residual.squeeze(-1).abs() <= TOLERANCE) if certify else None
    if family == Family.POWER:
        return Decoded(k, _power_map(cand, k, alpha, width, solved.multiplier), uncertain)
    return Decoded(k, support_log(solved.q.squeeze(1)), uncertain)


_TRIANGLES: dict[tuple[int, torch.device], Tensor] = {}


def _triangle(window: int, device: torch.device) -> Tensor:
    """[window, window] float64 mask: row k - 1 keeps the first k entries (made once)."""
    key = (window, torch.device(device))
    if key not in _TRIANGLES:
        _TRIANGLES[key] = torch.ones(window, window, dtype=torch.float64, device=device).tril()
    return _TRIANGLES[key]
