"""The gaps of the sizes next to a solved one, by series in the multiplier (no more maps).

The exact path solves T*_m by its multiplier s_m = log nu_m (`dual.dual_multiplier`; the primal
T_m by its scalar, `primal.primal_multiplier`, below), which also gives every entry past the
support the value the same multiplier would (`roots.Multiplier`).
Where k* is in the thousands, the multipliers of neighbouring sizes differ by little
(|s_j - s_m| ~ q_(m+1) / sum_i dq_i/ds), so a Taylor series of the support's mass in s gives
them, and their gaps, to far below the distance of a gap from lambda: one solve decides every
size within `SERIES_SIZES` of m, where it took two more maps and an exact gap.

With M_j(s) = sum_(i<=j) q_i(s) and D_j(s) the map's dual function on the support of size j
(concave, D_j'(nu) = 1 - M_j, maximal at nu_j), D_j - D_(j+1) = w(p_(j+1), .) (`gaps.
log_entry_term`), hence the gap of Theorem 3.3 of arXiv 2505.19371 as

    G(j) = D_j(nu_j) - D_(j+1)(nu_(j+1))
         = w(p_(j+1), nu_(j+1)) + integral from s_(j+1) to s_j of (1 - M_j(s)) e^s ds,

both terms positive (the weak-duality bounds of `exact._probe` are its two ends). Per entry,
log q_i = log p_i + y_i with H(y_i) = s - (alpha - 1) log p_i (`dual`), whose derivatives in s
are closed forms of y_i: with e = expm1(y), g = 1 / (beta e + 1), beta = alpha - 1,

    L1 = e g,   L2 = L1 (e + 1) g^2,   L3 = L1 (e + 1) g (g^3 + (2 - 2 beta) L1 g^2 - beta L1^2 g)

(zero entries, q = nu^(1/beta): 1/beta, 0, 0). The mass's derivatives are prefix sums of
q (L1), q (L2 + L1^2) and q (L3 + 3 L1 L2 + L1^3); s_j solves the cubic of M_j about s_m,
and the integral is the cubic's about s_j against e^-u, term by term.

Primal (eq. (4)): the multiplier is nu = (q_i^beta - p_i^beta) / beta for every i, the scalar
s the level tau = log c (beta > 0: nu = e^(beta tau) / beta) or delta = log(q_1 / p_1) (beta <
0: d nu / ds = p_1^beta e^(beta delta)); with r = d log q / ds (a sigmoid of beta (tau - log
p), resp. (q_1 / q)^beta), L2 = beta r (1 - r) and L3 = beta (1 - 2 r) L2, and the integral
runs against e^(beta s) (the same identity: D_j'(nu) = 1 - M_j, D_j - D_(j+1) = w).

Used where every |s_j - s_m| (primal: |beta (s_j - s_m)| for |beta| > 1, its derivatives
growing as powers of beta) is below `SERIES_REACH`, where the omitted terms are small (against
the exact gaps of two maps, tests/test_exact_search.py: |log G| within 3e-8 at sizes 300 to
6000 of peaked and flat rows, dual alpha 1.05 to 10, primal 0.3 to 20), and a size is
decided only where its gap is more than `SERIES_TOLERANCE` (relative) from lambda; the others
stay with the probes and the exact gap of two maps.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from .gaps import log_entry_term
from .primal import _added
from .roots import Multiplier

Tensor = torch.Tensor

#: Sizes on each side of the solved one that the series decides.
SERIES_SIZES = 32
#: Columns after a solved support the series reads (its sizes' next entries): a solve that
#: feeds it takes them to the rounding floor, a probe values them.
SERIES_COLUMNS = SERIES_SIZES + 2
#: Largest |s_j - s_m| the series is used for.
SERIES_REACH = 0.03
#: Relative distance from lambda within which a series gap decides nothing.
SERIES_TOLERANCE = 1e-6
#: Terms of the series of the integrals of u^n e^(-b u) (`_moments`), and the largest |b delta|
#: they are used for: the first omitted term is then below 1e-11 of the first.
_MOMENT_TERMS = 10
_MOMENT_REACH = 0.3


class SeriesBounds(NamedTuple):
    """What one dual solve at m decides of the sizes next to it (per row): k* >= ``low`` and
    k* <= ``high`` (0 and a size past the row where it decides nothing), and s_j - s_m for the
    sizes j = m - SERIES_SIZES .. m + SERIES_SIZES + 1 (``shift``, [n, 2 SERIES_SIZES + 2],
    NaN where the series does not reach): a warm start for T_j; and log G(j) for j = m -
    SERIES_SIZES .. m + SERIES_SIZES (``log_gap``, NaN where unknown)."""

    low: Tensor
    high: Tensor
    shift: Tensor
    log_gap: Tensor


def _derivatives(beta: Tensor, lift: Tensor, finite: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """d^n log q / ds^n, n = 1, 2, 3, from y = log(q / p) (see the module docstring)."""
    e = torch.expm1(torch.where(finite, lift, 0.0))
    g = torch.reciprocal(beta * e + 1.0)
    first = e * g
    lifted = (e + 1.0) * g
    second = first * lifted * g
    third = lifted * first * g * (g * g + (2.0 - 2.0 * beta) * first * g - beta * first * first)
    inverse = torch.reciprocal(beta).expand_as(first)
    return (torch.where(finite, first, inverse), torch.where(finite, second, 0.0),
            torch.where(finite, third, 0.0))


def _primal_derivatives(beta: Tensor, rate: Tensor, curvature: Tensor
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """d^n log q / ds^n, n = 1, 2, 3, of the primal map in its scalar (`primal.
    primal_multiplier`: the level tau = log c, or delta = log q_1 - log p_1): with r the rate,
    r' = beta r (1 - r) (its curvature) and r'' = beta (1 - 2 r) r'."""
    return rate, curvature, beta * (1.0 - 2.0 * rate) * curvature


def _mass_terms(log_q: Tensor, first: Tensor, second: Tensor, third: Tensor) -> Tensor:
    """[3, ...] the terms of dM/ds, d^2M/ds^2, d^3M/ds^3 of the entries."""
    q = torch.exp(log_q)
    return torch.stack([q * first, q * (second + first * first),
                        q * (third + 3.0 * first * second + first ** 3)])


def _moments(delta: Tensor, rate: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """integral from 0 to delta of u^n e^(-rate u) du, n = 1, 2, 3, by their series (no
    cancellation for small delta; |rate delta| <= `_MOMENT_REACH`):

        delta^(n+1) sum_(k < `_MOMENT_TERMS`) (-rate delta)^k / (k! (n + k + 1)),

    every term of every n at once (a few ops, not one per term: the exact path's launches)."""
    terms, coefficients, exponents = _moment_constants(delta.dtype, delta.device)
    powers = torch.pow((-rate * delta).unsqueeze(-1), terms)  # [..., K]
    sums = torch.matmul(powers, coefficients)  # [..., 3]
    out = sums * torch.pow(delta.unsqueeze(-1), exponents)
    return out[..., 0], out[..., 1], out[..., 2]


@functools.lru_cache(maxsize=8)
def _moment_constants(dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """The powers k = 0 .. K-1, the coefficients 1 / (k! (n + k + 1)) with their signs folded
    into the powers ([K, 3]) and the exponents n + 1 ([3]) of `_moments`, made once."""
    coefficients = [[1.0 / (math.factorial(k) * (n + k + 1)) for n in (1, 2, 3)]
                    for k in range(_MOMENT_TERMS)]
    return (torch.arange(_MOMENT_TERMS, dtype=dtype, device=device),
            torch.tensor(coefficients, dtype=dtype, device=device),
            torch.tensor([2.0, 3.0, 4.0], dtype=dtype, device=device))


def series_bounds(mode: str, log_p: Tensor, solved: Multiplier, m: Tensor, alpha: Tensor,
                  lam: Tensor, log_deficit: Tensor, exact_columns: Tensor) -> SeriesBounds:
    """Bounds on k* from the gaps G(j), |j - m| <= SERIES_SIZES, of a solve at m.

    Args:
        mode: ``"primal"`` or ``"dual"``.
        log_p: ``[n, C]`` the candidates' log p, sorted.
        solved: T_m or T*_m by its multiplier, every column valued (``[n, C]``).
        m: ``[n]`` the solved sizes; ``alpha``, ``lam``: ``[n]``; ``log_deficit``: log R_m.
        exact_columns: ``[n]`` columns the solve took to the rounding floor (the support and
            those after it): the series reads no other.
    """
    width = log_p.shape[-1]
    dtype = log_p.dtype
    side = SERIES_SIZES
    beta = (alpha.to(dtype) - 1.0).unsqueeze(-1)
    finite = torch.isfinite(log_p)
    # The whole support's sums at s_m (one pass), then the window's columns m - side .. m + side.
    primal = mode == "primal"

    def derivatives(lift: Tensor, finite: Tensor, rate: Tensor, curvature: Tensor
                    ) -> tuple[Tensor, Tensor, Tensor]:
        if primal:
            return _primal_derivatives(beta, rate, curvature)
        return _derivatives(beta, lift, finite)

    prefix = int(m.max())
    lift, log_q = solved.lift[:, :prefix], solved.log_q[:, :prefix]
    inside = torch.arange(prefix, device=m.device) < m.unsqueeze(-1)
    totals = torch.where(inside, _mass_terms(log_q, *derivatives(
        lift, finite[:, :prefix], solved.rate[:, :prefix], solved.curvature[:, :prefix])),
        0.0).sum(-1)  # [3, n]
    support = finite[:, :prefix] & inside
    added = _added(torch.where(support, log_p[:, :prefix], 0.0), support, lift,
                   torch.where(inside, torch.exp(log_q), 0.0))
    residual = torch.exp(log_deficit) - added  # R_m - A_m
    columns = (m - side).unsqueeze(-1) + torch.arange(2 * side + 1, device=m.device)
    usable = (columns >= 0) & (columns < torch.minimum(exact_columns, torch.full_like(
        exact_columns, width)).unsqueeze(-1))
    at = columns.clamp(0, width - 1)
    lp, log_q, lift, here_finite, rate, curvature = (
        torch.gather(t, 1, at) for t in (log_p, solved.log_q, solved.lift, finite, solved.rate,
                                         solved.curvature))
    l1, l2, l3 = derivatives(lift, here_finite, rate, curvature)
    w_terms = torch.where(usable, _mass_terms(log_q, l1, l2, l3), 0.0)
    w_mass = torch.where(usable, torch.exp(log_q), 0.0)
    pad = torch.nn.functional.pad
    # sizes j = m + d, d = -side .. side + 1 (index d + side): sums over entries m < i <= j
    # (minus those over j < i <= m).
    running = pad(torch.cumsum(torch.cat([w_mass.unsqueeze(0), w_terms]), -1), (1, 0))
    change = running - running[..., side:side + 1]
    sizes = m.unsqueeze(-1) + torch.arange(-side, side + 2, device=m.device)
    reach = pad(usable, (1, 0), value=False)
    valid = (sizes >= 1) & (sizes <= width)
    # every entry between m and j read from a usable column
    span = torch.arange(-side, side + 2, device=m.device)
    ok = torch.where(span > 0, torch.cumprod(torch.where(span > 0, reach, True).int(), -1) > 0,
                     torch.flip(torch.cumprod(torch.flip(
                         torch.where(span < 0, pad(usable, (0, 1), value=False), True)
                         .int(), [-1]), -1), [-1]) > 0)
    valid &= ok
    f = residual.unsqueeze(-1) - change[0]  # 1 - M_j(s_m)
    m1, m2, m3 = (totals[i].unsqueeze(-1) + change[i + 1] for i in range(3))
    shift = f / m1
    for _ in range(6):  # Newton on the cubic 1 - M_j(s_m + shift) = 0
        value = f - shift * (m1 + shift * (0.5 * m2 + shift * m3 / 6.0))
        slope = m1 + shift * (m2 + 0.5 * shift * m3)
        shift = shift + value / slope
    # (the primal's derivatives in s grow as powers of beta: its reach is in beta s)
    scale = beta.abs().clamp_min(1.0) if primal else torch.ones_like(beta)
    valid &= torch.isfinite(shift) & ((scale * shift).abs() <= SERIES_REACH) & (m1 > 0)
    shift = torch.where(valid, shift, math.nan)
    # G(j) for j = m - side .. m + side (index a: s_j at a, s_(j+1) at a + 1, entry j + 1 at a)
    here, there = shift[:, :-1], shift[:, 1:]
    delta = here - there
    g1 = m1[:, :-1] + here * (m2[:, :-1] + 0.5 * here * m3[:, :-1])
    g2 = m2[:, :-1] + here * m3[:, :-1]
    # d nu / ds = e^(b s) K: the dual's s = log nu (b = 1); the primal's nu = (q_i^beta -
    # p_i^beta) / beta, so d nu / ds = q_i^beta d log q_i / ds for any i: e^(beta tau) at the
    # level tau, p_1^beta e^(beta delta) at delta = log(q_1 / p_1) (beta < 0).
    b = beta if primal else torch.ones_like(beta)
    log_k = torch.where(beta < 0, beta * log_p[:, :1], 0.0) if primal else torch.zeros_like(beta)
    j1, j2, j3 = _moments(delta, b)
    integral = g1 * j1 - 0.5 * g2 * j2 + m3[:, :-1] * j3 / 6.0
    log_integral = log_k + b * (solved.s.unsqueeze(-1) + here) + torch.log(integral)
    moved = log_q + there * (l1 + there * (0.5 * l2 + there * l3 / 6.0))
    log_w = log_entry_term(mode, lp, moved, alpha.to(dtype).unsqueeze(-1))
    log_gap = torch.logaddexp(log_w, log_integral)
    known = valid[:, :-1] & valid[:, 1:] & (delta > 0) & (integral > 0) \
        & ((b * delta).abs() <= _MOMENT_REACH) & torch.isfinite(log_gap)
    margin = torch.log(lam).unsqueeze(-1)
    exceeds = known & (log_gap > margin + SERIES_TOLERANCE)
    stops = known & (log_gap < margin - SERIES_TOLERANCE)
    j = sizes[:, :-1]
    low = torch.where(exceeds, j + 1, 0).amax(-1)
    high = torch.where(stops, j, torch.iinfo(j.dtype).max).amin(-1)
    return SeriesBounds(low, high, shift, torch.where(known, log_gap, math.nan))
