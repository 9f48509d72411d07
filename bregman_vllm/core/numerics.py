"""Log-space scalar kernels shared by the primal and dual alpha maps.

Every function is elementwise, vectorized, float64-friendly and free of NaN for the documented
domain. They exist because powers x**alpha over- and underflow for large |alpha| (alpha = 1000 and
p = 0.01 gives 1e-2000) and because the textbook formulas cancel catastrophically near alpha = 1
and near equal arguments.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

def log1mexp(x: Tensor) -> Tensor:
    """log(1 - e^{-x}) for x >= 0 (Maechler's split at log 2); -inf at 0."""
    small = x < math.log(2.0)
    return torch.where(
        small,
        torch.log(-torch.expm1(-x.clamp_min(0.0))),
        torch.log1p(-torch.exp(-x.clamp_min(math.log(2.0)))),
    )


def log_expm1(x: Tensor) -> Tensor:
    """log(e^x - 1) for x >= 0; -inf at 0 and x for large x."""
    return x + log1mexp(x)


def logsubexp(a: Tensor, b: Tensor) -> Tensor:
    """log(e^a - e^b) for a >= b (returns -inf where b >= a, e.g. from rounding)."""
    gap = (a - b).clamp_min(0.0)
    out = a + log1mexp(gap)
    return torch.where(torch.isneginf(b), a, out)


_SERIES_TERMS = 16  # enough for |rho|, |alpha rho| <= 1/4 to reach float64 precision (~1e-17)


def bregman_alpha_kernel(alpha: Tensor, rho: Tensor) -> Tensor:
    """log K_alpha(rho), where d_alpha(a, b) = b^alpha * K_alpha(log a - log b).

    For the generator phi_alpha(x) = x^alpha / (alpha (alpha - 1)) of arXiv 2505.19371,
    Section 4, the Bregman divergence is
    d(a, b) = [a^alpha + (alpha-1) b^alpha - alpha a b^(alpha-1)] / (alpha (alpha-1)), so with
    rho = log(a / b):

        K_alpha(rho) = [expm1(alpha rho) - alpha expm1(rho)] / (alpha (alpha - 1))
                     = sum_{n >= 2} (1 + alpha + ... + alpha^(n-2)) rho^n / n!,

    which at alpha = 1 is the KL kernel rho e^rho - e^rho + 1 and at alpha = 0 is e^rho - 1 - rho.
    K >= 0 for every alpha (convexity of phi), K(0) = 0, and K(-inf) = 1/alpha for alpha > 0
    (a = 0), +inf for alpha < 0.

    Evaluation regions, each free of overflow and of catastrophic cancellation, each evaluated
    on its own entries only:
      * series, |rho| <= 1/4 and |alpha rho| <= 1/4 (a close to b), its length set by the largest
        of its entries (in three bands: up to 1e-8, as at the heads of long supports, it takes
        3 terms; up to 1e-3, 6);
      * |alpha - 1| <= 1/4: [e^rho expm1((alpha-1) rho) / (alpha-1) - expm1(rho)] / alpha, and its
        logarithm rho + log(E - 1 + e^-rho) - log(alpha) once rho > 40;
      * otherwise the expm1 form while |rho|, |alpha rho| <= 40, then a max-shifted logarithm of
        e^(alpha rho) - alpha e^rho + (alpha - 1).
    """
    alpha, rho = torch.broadcast_tensors(alpha, rho)
    shape = rho.shape
    rho, a = rho.reshape(-1), alpha.reshape(-1)
    r = torch.where(torch.isfinite(rho), rho, 0.0)
    zero = torch.zeros((), dtype=rho.dtype, device=rho.device)
    b = a - 1.0
    log_k = torch.empty_like(r)
    # Each region is evaluated on its own entries only (the exact path's gaps run over supports
    # of tens of thousands, where most entries sit in the series region).
    size = torch.maximum(r.abs(), (a * r).abs())
    near_one = b.abs() <= 0.25
    def series(a: Tensor, b: Tensor, r: Tensor) -> Tensor:
        return torch.log(_series(a, r).clamp_min(0.0))

    regions = (
        (size <= 1e-8, series),
        ((size > 1e-8) & (size <= 1e-3), series),
        ((size > 1e-3) & (size <= 0.25), series),
        ((size > 0.25) & near_one & (r <= 40.0), lambda a, b, r: _near_one(a, b, r, zero)),
        ((size > 0.25) & near_one & (r > 40.0), _near_one_large),
        ((size > 0.25) & ~near_one & (size <= 40.0),
         lambda a, b, r: _moderate(a, b, r, torch.ones_like(r, dtype=torch.bool), zero)),
        ((size > 0.25) & ~near_one & (size > 40.0), lambda a, b, r: _far(a, b, r, zero)),
    )
    for mask, kernel in regions:
        index = mask.nonzero().squeeze(-1)
        if index.numel():
            log_k[index] = kernel(a[index], b[index], r[index])
    at_neg_inf = torch.where(a > 0, -torch.log(a.abs()), torch.full_like(a, math.inf))
    log_k = torch.where(torch.isneginf(rho), at_neg_inf, log_k)
    log_k = torch.where(torch.isposinf(rho), torch.full_like(a, math.inf), log_k)
    return log_k.reshape(shape)


def _series(a: Tensor, r: Tensor) -> Tensor:
    """K_alpha(r) = r^2 sum_n u_n / n! with u_2 = 1, u_{n+1} = r^(n-1) + (a r) u_n (|r|, |ar|
    <= 1/4; u_n = (1 + a + ... + a^(n-2)) r^(n-2))."""
    ar = a * r
    u = torch.ones_like(r)
    power = r.clone()
    total = torch.zeros_like(r)
    factorial = 2.0
    # Term n is at most (n-1) x^(n-2) / n! of the first, x = max(|r|, |a r|) <= 1/4: stop once
    # that is below 1e-17 (6 terms for x = 1e-3, 16 for x = 1/4).
    x = float(torch.maximum(r.abs().amax(), ar.abs().amax())) if r.numel() else 0.0
    terms, bound = 1, 1.0
    while terms < _SERIES_TERMS and bound > 1e-17:
        terms += 1
        bound *= x * terms / ((terms + 1) * max(terms - 1, 1))
    for n in range(2, 2 + max(terms, 2)):
        total = total + u / factorial
        u = power + ar * u
        power = power * r
        factorial *= n + 1
    return r * r * total


def _near_one(a: Tensor, b: Tensor, r: Tensor, zero: Tensor) -> Tensor:
    """|alpha - 1| <= 1/4, rho <= 40: log of [e^r expm1(b r)/b - expm1(r)] / alpha."""
    rn = torch.where(r <= 40.0, r, zero)
    safe_b = torch.where(b == 0, torch.ones_like(b), b)
    e1 = torch.where(b == 0, rn, torch.expm1(b * rn) / safe_b)
    return torch.log(((torch.exp(rn) * e1 - torch.expm1(rn)) / a).clamp_min(0.0))


def _near_one_large(a: Tensor, b: Tensor, r: Tensor) -> Tensor:
    """|alpha - 1| <= 1/4, rho > 40: rho + log(E - 1 + e^-rho) - log(alpha)."""
    rl = torch.where(r > 40.0, r, torch.full_like(r, 41.0))
    safe_b = torch.where(b == 0, torch.ones_like(b), b)
    e1 = torch.where(b == 0, rl, torch.expm1(b * rl) / safe_b)
    return rl + torch.log(e1 - 1.0 + torch.exp(-rl)) - torch.log(a)


def _moderate(a: Tensor, b: Tensor, r: Tensor, moderate: Tensor, zero: Tensor) -> Tensor:
    """|rho|, |alpha rho| <= 40: log [expm1(alpha rho) - alpha expm1(rho)] / (alpha (alpha-1))."""
    rm = torch.where(moderate, r, zero)
    den = torch.where(b == 0, torch.ones_like(a), a * b)
    return torch.log(((torch.expm1(a * rm) - a * torch.expm1(rm)) / den).clamp_min(0.0))


def _far(a: Tensor, b: Tensor, r: Tensor, zero: Tensor) -> Tensor:
    """Large arguments: max-shifted log|e^(alpha rho) - alpha e^rho + (alpha - 1)| - log|a(a-1)|."""
    t1 = a * r
    t2 = torch.log(a.abs()) + r
    t3 = torch.log(b.abs())
    top = torch.maximum(torch.maximum(t1, t2), t3)
    top = torch.where(torch.isfinite(top), top, zero)
    mixed = (torch.exp(t1 - top) - torch.sign(a) * torch.exp(t2 - top)
             + torch.sign(b) * torch.exp(t3 - top))
    den = torch.where(b == 0, torch.ones_like(a), (a * b).abs())
    return top + torch.log(mixed.abs()) - torch.log(den)


def logsumexp_masked(x: Tensor, mask: Tensor, dim: int = -1) -> Tensor:
    """logsumexp over entries where mask is True; -inf for an empty selection."""
    return torch.logsumexp(x.masked_fill(~mask, -math.inf), dim=dim)


def first_true(flags: Tensor, positions: Tensor, fill: float) -> Tensor:
    """The entry of ``positions`` ([W], float, increasing) at the first True of ``flags``
    ([..., W]) along the last dimension, else ``fill``; int64. The minimum is taken in floating
    point (exact for positions below 2^24): torch 2.11's inductor fails to write the Triton
    code of an integer minimum with masked lanes (``torch.iinfo`` of a float dtype; seen
    compiling the step on an H200, docs/benchmarks.md), which left the GPU step eager."""
    return torch.where(flags, positions, fill).amin(-1).long()
