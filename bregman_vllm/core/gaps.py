"""The cost gap G(k) = cost(k) - cost(k + 1) + lambda that decides k* (Theorem 3.3 of arXiv
2505.19371).

cost(k) (eq. (6)) is discretely convex, so with L(k) = cost(k) - lambda k the gaps
G(k) = L(k) - L(k+1) are nonincreasing and

    k* = min { k : G(k) <= lambda }        (ties go to the smaller support, as in
                                              Algorithm 2).

We never form L(k) itself (it is a sum over the whole vocabulary); G(k) is written as a sum of
nonnegative terms over the top k+1 entries, so it has no cancellation:

Primal. T_k is the Bregman projection onto the face {supp q in [k], sum q = 1}, which contains the
face of size k, so the Bregman Pythagorean identity (equivalently eqs. (15) and (16) of Appendix D)
gives

    G(k) = D_phi(T_k(p), T_(k+1)(p)) = sum_{i<=k} d_phi(q_i, q'_i) + d_phi(0, q'_(k+1)),

with q = T_k(p), q' = T_(k+1)(p). For phi_alpha, d(0, q') = q'^alpha / alpha.

Dual. With nu' the multiplier of T*_(k+1) and theta_x(y) = phi''(y)(y - x), eq. (5) gives
sum_{i<=k} (q_i - q'_i) = q'_(k+1), hence

    G*(k) = sum_{i<=k} [d(p_i, q_i) - d(p_i, q'_i) - theta_{p_i}(q'_i)(q_i - q'_i)]
            + q'^(alpha-1) [(alpha-1)^2 (q' - p) + p] / (alpha (alpha-1))     (at index k+1),

where every bracket is >= 0 by convexity of d(p_i, .) on [p_i, 1] (dual validity), as
q_i >= q'_i >= p_i.

`consecutive_gaps` evaluates G at a few consecutive sizes for the search (`search`), from their
maps, deciding most by the bounds above before any formula.

Closed forms over all k at once (prefix sums; S_k = sum_{i<=k} p_i, R_k = 1 - S_k):
    primal alpha = 1:    G(k) = log(1 + p_(k+1) / S_k)              (cost(k) = -log S_k + lambda k)
    alpha = 2 (both):    G(k) = (k p_(k+1) + R_k)^2 / (2 k (k+1))
    primal alpha = 3/2:  G(k) = 2/3 [(c_k - c_(k+1))^2 (3 r_k + 2k c_k + k c_(k+1))
                                      + (sqrt(p_(k+1)) + c_(k+1))^3],
                         r_k = sum_{i<=k} sqrt(p_i), c_k = R_k / (sqrt(r_k^2 + k R_k) + r_k).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .candidates import Candidates
from .families import Family
from .generators import BregmanGenerator, generic_gap
from .maps import log_deficit, log_renorm, solved
from .numerics import bregman_alpha_kernel, logsubexp, logsumexp_masked
from .primal import normalized, support_mask
from .roots import Multiplier

Tensor = torch.Tensor


def _log_ratios(log_q: Tensor, log_q_next: Tensor, inside: Tensor, rho: Tensor | None
                ) -> Tensor:
    """rho_i = log(q_i / q'_i) on the support (0 elsewhere); from two normalized maps it is all
    rounding where they barely differ (rho ~ 1e-20), so callers with multipliers pass it exact
    (``rho``, the difference of the maps' log(q / p))."""
    rho = log_q - log_q_next if rho is None else rho
    return torch.where(inside & torch.isfinite(rho), rho, 0.0)


def primal_log_gap(log_q: Tensor, log_q_next: Tensor, m: Tensor, alpha: Tensor,
                   rho: Tensor | None = None) -> Tensor:
    """log G(m) for the primal alpha family from log T_m and log T_(m+1) (``[..., W]``;
    ``rho``: `_log_ratios`)."""
    width = log_q.shape[-1]
    positions = torch.arange(width, device=log_q.device)
    inside = positions < m.unsqueeze(-1)
    a = alpha.to(log_q.dtype).unsqueeze(-1)
    rho = _log_ratios(log_q, log_q_next, inside, rho)
    terms = a * log_q_next + bregman_alpha_kernel(a, rho)
    added = torch.gather(log_q_next, -1, m.unsqueeze(-1)).squeeze(-1)  # q'_(m+1)
    last = log_entry_term("primal", added, added, alpha.to(log_q.dtype))
    return torch.logaddexp(logsumexp_masked(terms, inside), last)


def dual_log_gap(log_p: Tensor, log_q: Tensor, log_q_next: Tensor, m: Tensor,
                 alpha: Tensor, rho: Tensor | None = None) -> Tensor:
    """log G*(m) for the dual alpha family (alpha > 1) from log T*_m and log T*_(m+1)
    (``rho``: `_log_ratios`)."""
    width = log_q.shape[-1]
    positions = torch.arange(width, device=log_q.device)
    inside = positions < m.unsqueeze(-1)
    a = alpha.to(log_q.dtype)
    b = a - 1.0
    acol, bcol = a.unsqueeze(-1), b.unsqueeze(-1)
    rho = _log_ratios(log_q, log_q_next, inside, rho)
    lp = torch.where(inside, log_p, 0.0)
    # R_i = beta q'^alpha K_alpha(rho) + (2 - alpha) p q'^beta K_beta(rho).
    first = torch.log(bcol) + acol * log_q_next + bregman_alpha_kernel(acol, rho)
    second = (torch.log((2.0 - acol).abs()) + lp + bcol * log_q_next
              + bregman_alpha_kernel(bcol, rho))
    log_r = torch.where(acol <= 2.0, torch.logaddexp(first, second), logsubexp(first, second))
    index = m.unsqueeze(-1)
    lq1 = torch.gather(log_q_next, -1, index).squeeze(-1)
    lp1 = torch.gather(log_p, -1, index).squeeze(-1)
    last = log_entry_term("dual", lp1, lq1, a)
    return torch.logaddexp(logsumexp_masked(log_r, inside), last)


def log_entry_term(mode: str, log_p: Tensor, log_q: Tensor, alpha: Tensor) -> Tensor:
    """log w(p, q): the term of the entry p_(k+1) in G(k) when the map gives it q (elementwise;
    ``alpha`` broadcasts):

        primal  w = d(0, q) = q^alpha / alpha,
        dual    w = q^beta [beta^2 (q - p) + p] / (alpha beta),   beta = alpha - 1,

    the dual one a sum of nonnegative terms (q - p = p expm1(log q - log p) >= 0; p = 0 gives
    beta q^alpha / alpha). It is also the value at the map's multiplier nu of the entry's
    Lagrangian term, w(p, nu) = d(p, 0) + max_y [nu y - d(p, y)] (dual), resp. d(0, p) +
    max_y [nu y - d(y, p)] (primal), with q the maximizer y; by weak duality at the multipliers
    of T_k and T_(k+1) (the search's probes, `search`)

        w(p_(k+1), nu_(k+1)) <= G(k) <= w(p_(k+1), nu_k).
    """
    if mode == "primal":
        return alpha * log_q - torch.log(alpha)
    b = alpha - 1.0
    positive = torch.isfinite(log_p)
    lp = torch.where(positive, log_p, 0.0)
    # beta^2 (q - p) + p = beta^2 p (expm1(log(q / p)) + 1 / beta^2): positive terms.
    rise = torch.expm1((log_q - lp).clamp_min(0.0))
    inner = torch.where(positive, lp + torch.log(rise + 1.0 / (b * b)), log_q)
    return b * log_q + inner + torch.log(b / alpha)


def kl_gaps(prefix: Tensor, x: Tensor) -> Tensor:
    """alpha = 1, both modes' convention: G(k) = log1p(p_(k+1) / S_k), k = 1..W-1 (``[N, W-1]``)."""
    return torch.log1p(x[..., 1:] / prefix[..., :-1])


def square_gaps(x: Tensor, deficit: Tensor) -> Tensor:
    """alpha = 2: G(k) = (k p_(k+1) + R_k)^2 / (2 k (k+1)), k = 1..W-1.

    ``deficit[..., j]`` is R_j = 1 - S_j for j = 0..W.
    """
    width = x.shape[-1]
    k = torch.arange(1, width, device=x.device, dtype=x.dtype)
    return (k * x[..., 1:] + deficit[..., 1:width]) ** 2 / (2.0 * k * (k + 1.0))


def three_halves_gaps(x: Tensor, deficit: Tensor) -> Tensor:
    """Primal alpha = 3/2 gaps for k = 1..W-1 (see the module docstring)."""
    width = x.shape[-1]
    k = torch.arange(1, width + 1, device=x.device, dtype=x.dtype)  # k = 1..W
    root = torch.sqrt(x)
    r = torch.cumsum(root, -1)  # r_k for k = 1..W
    big_r = deficit[..., 1:width + 1]  # R_k for k = 1..W
    c = big_r / (torch.sqrt(r * r + k * big_r) + r)
    ck, cn = c[..., :-1], c[..., 1:]
    kk = k[:-1]
    moved = (ck - cn) ** 2 * (3.0 * r[..., :-1] + 2.0 * kk * ck + kk * cn)
    return (2.0 / 3.0) * (moved + (root[..., 1:] + cn) ** 3)


def closed_form_gaps(family: Family, x: Tensor, deficit: Tensor) -> Tensor:
    """All gaps G(1..W-1) of a family with closed-form gaps (`families.CLOSED_GAP_FAMILIES`)."""
    if family == Family.KL:
        return kl_gaps(torch.cumsum(x, -1), x)
    if family == Family.SQUARE:
        return square_gaps(x, deficit)
    return three_halves_gaps(x, deficit)


def consecutive_gaps(family: Family | None, mode: str, cand: Candidates, start: Tensor,
                     count: int, alpha: Tensor, lam: Tensor,
                     generator: BregmanGenerator | None, s: Tensor | None,
                     state: Tensor | None) -> tuple[Tensor, Tensor]:
    """log G(m) for m = start .. start + count - 1 ([n, count]), or a bound of it on the same
    side of log lambda, and the maps log T_m, m = start .. start + count ([n, count + 1, C],
    normalized; start + count <= candidates), solved by their multipliers (`maps.solved`;
    ``s`` / ``state``: warm starts). Their weak-duality bounds (`log_entry_term`) decide most
    gaps, the formulas above the others. A user generator's maps are its generic ones, and
    its gaps `generators.generic_gap`."""
    sizes = start.unsqueeze(-1) + torch.arange(count + 1, device=start.device)
    width = cand.log_x.shape[-1]
    columns = min(width, int(sizes.max()) + 1)
    log_p = cand.log_x[:, :columns]
    n = log_p.shape[0]
    m = sizes[:, :-1]
    stacked = log_p.unsqueeze(1).expand(-1, count + 1, -1)
    deficits = log_deficit(cand, sizes)
    if generator is not None:
        maps = log_renorm(family, mode, stacked, sizes, alpha.unsqueeze(-1).expand_as(sizes),
                          deficits, generator)
        gap = generic_gap(mode, generator, torch.exp(log_p.unsqueeze(1).expand(-1, count, -1)),
                          torch.exp(maps[:, :-1]), torch.exp(maps[:, 1:]), m)
        return torch.log(gap), maps
    total = n * (count + 1)
    found = solved(family, mode, stacked.reshape(total, columns), sizes.reshape(-1),
                   alpha.repeat_interleave(count + 1, output_size=total), deficits.reshape(-1),
                   None if s is None else s.repeat_interleave(count + 1, output_size=total),
                   None if state is None else
                   state[:, :columns].repeat_interleave(count + 1, 0, output_size=total))
    shape = (n, count + 1, columns)
    log_q, lift = found.log_q.reshape(shape), found.lift.reshape(shape)
    maps = normalized(log_q, support_mask(sizes, columns))
    a = alpha.to(log_p.dtype).unsqueeze(-1)
    ends = (sizes - 1, sizes.clamp_max(columns - 1))  # entries m and m + 1 of each map
    own, after = (log_entry_term(mode, log_p.gather(1, j), log_q.gather(2, j.unsqueeze(-1))
                                 .squeeze(-1), a) for j in ends)
    after = torch.where(sizes < width, after, math.inf)  # (no entry past the candidates)
    log_lam = torch.log(lam).unsqueeze(-1)
    upper, lower = after[:, :-1], own[:, 1:]
    value = torch.where(upper <= log_lam, upper, torch.where(lower > log_lam, lower, math.nan))
    rows, j = torch.isnan(value).nonzero(as_tuple=True)
    if rows.numel():
        rho = lift[rows, j] - lift[rows, j + 1]
        pair = (maps[rows, j], maps[rows, j + 1], m[rows, j], a[rows, 0])
        value[rows, j] = primal_log_gap(*pair, rho) if mode == "primal" else \
            dual_log_gap(log_p[rows], *pair, rho)
    return value, maps


#: Largest |s_j - s| over which `series_gap` expands a map; primal: |beta| |s_j - s| above |beta| =
#: 1, |beta|^(3/4) |s_j - s| below (each derivative of log q past the first carries a beta: the
#: cubic's remainder is about (beta v)^3 v / 96).
SERIES_REACH = 1e-2


def _cubic(c: Tensor, x: Tensor) -> Tensor:  # c[0] x + c[1] x^2 / 2 + c[2] x^3 / 6
    return x * (c[0] + x * (c[1] / 2.0 + x * c[2] / 6.0))


def series_gap(mode: str, log_p: Tensor, found: Multiplier, beta: Tensor, sizes: Tensor,
               log_r: Tensor) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor]]:
    """log G(j), j = m .. m + c - 1, from the values at one scalar s (dual: log nu; primal,
    beta > 0: the level tau, nu = e^(beta tau) / beta; beta < 0: delta, nu = p_1^beta
    (e^(beta delta) - 1) / beta) near those of the maps T_j, j = m .. m + c (``sizes``
    [n, c + 1]; ``log_r``: their log R_j; ``beta``: [n, 1]), no map solved. With
    M_j = sum_(i<=j) q_i and D_j the dual function of size j (D_j' = 1 - M_j in nu, D_j -
    D_(j+1) = w(p_(j+1), .)), Theorem 3.3's gap is
        G(j) = w(p_(j+1), nu_(j+1)) + integral from nu_(j+1) to nu_j of (1 - M_j) dnu.

    Each log q_i is a cubic in s about s (dual: L1 = e g, L2 = L1 (e + 1) g^2, L3 = L1 (e + 1)
    g (g^3 + (2 - 2 beta) L1 g^2 - beta L1^2 g), e = expm1(log(q / p)), g = 1 / (beta e + 1),
    zero entries 1 / beta, 0, 0; primal: the rate r, beta r (1 - r), beta (1 - 2 r) L2), so are
    the added mass (its cubics give each s_j) and the integral (dnu = e^(b s) ds, b = 1 or
    beta, times p_1^beta below beta = 0). Returns (log G [n, c], where it holds [n, c], the
    map of size j (j: [n], 0 .. c))."""
    finite = torch.isfinite(log_p)
    e = torch.expm1(torch.where(finite, found.lift, 0.0))
    if mode == "dual":
        g = torch.reciprocal(beta * e + 1.0)
        one, lifted = e * g, e * g * (e + 1.0) * g
        two, three = lifted * g, lifted * (g ** 3 + (2.0 - 2.0 * beta) * one * g * g
                                           - beta * one * one * g)
        one = torch.where(finite, one, torch.reciprocal(beta).expand_as(one))  # (two, three: 0)
        rate, unit = torch.ones_like(beta), torch.ones_like(beta)
    else:
        one = found.rate
        two = beta * one * (1.0 - one)
        three, rate, unit = beta * (1.0 - 2.0 * one) * two, beta, torch.maximum(
            beta.abs(), beta.abs() ** 0.75)
    # What each entry adds to the mass and its derivatives, summed up to each size.
    q = torch.exp(found.log_q)
    terms = torch.stack([torch.where(finite, torch.exp(log_p) * e, q), q * one,
                         q * (two + one * one), q * (three + 3.0 * one * two + one ** 3)])
    sums = terms.cumsum(-1).gather(2, (sizes - 1).unsqueeze(0).expand(4, -1, -1))  # [4, n, c+1]
    deficit = torch.exp(log_r)  # (s_j - s: Newton on the cubic of the added mass = R_j)
    shift = (deficit - sums[0]) / sums[1]
    for _ in range(4):
        shift = shift - (_cubic(sums[1:], shift) + sums[0] - deficit) \
            / (sums[1] + shift * (sums[2] + shift * sums[3] / 2.0))
    derivatives = torch.stack([one, two, three])
    at = sizes[:, :-1].clamp_max(log_p.shape[-1] - 1)  # (entry j + 1 of the map of size j + 1)
    entry = derivatives.gather(2, at.unsqueeze(0).expand(3, -1, -1))
    last = log_entry_term(mode, log_p.gather(1, at),
                          found.log_q.gather(1, at) + _cubic(entry, shift[:, 1:]), beta + 1.0)
    # 1 - M_j(s_j - v) = A1 v - A2 v^2 / 2 + A3 v^3 / 6 (the mass's derivatives at s_j) against
    # dnu = e^(b (s_j - v)) dv for v from 0 to s_j - s_(j+1): moments int v^n e^(-b v) dv by
    # their series (b v <= 2 `SERIES_REACH`).
    low, width = shift[:, :-1], (shift[:, :-1] - shift[:, 1:]).clamp_min(0.0)
    a1, a2, a3 = sums[1:, :, :-1]
    moments = [width ** (n + 1) * sum((-rate * width) ** t / (math.factorial(t) * (n + t + 1))
                                     for t in range(8)) for n in (1, 2, 3)]
    integral = ((a1 + low * (a2 + low * a3 / 2.0)) * moments[0]
                - (a2 + low * a3) * moments[1] / 2.0 + a3 * moments[2] / 6.0)
    origin = beta.clamp_max(0.0) * log_p[:, :1]  # (nu's factor p_1^beta below alpha = 1)
    log_gap = torch.logaddexp(last, rate * (found.s.unsqueeze(-1) + low) + origin
                              + torch.log(integral))
    near = (unit * shift).abs() <= SERIES_REACH
    return log_gap, near[:, :-1] & near[:, 1:] & (integral > 0), \
        lambda j: found.log_q + _cubic(derivatives, shift.gather(1, j.unsqueeze(-1)))
