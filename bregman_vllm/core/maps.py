"""The map of each family on a fixed support: log T_k (eq. (4)) or log T*_k (eq. (5)).

One dispatch from a family (`families`) to its map: the closed forms of Proposition 4.1 and
Appendix G.3 (`primal.closed_log_renorm`), the quadratic dual maps, and the general maps by
their multipliers (`primal.primal_multiplier`: Newton on one scalar; `dual.dual_multiplier`:
the joint Newton of eq. (5), Algorithm 1 as its fallback), or a user generator's generic
maps (`generators`). The search (`search`) and the public `renormalize` use it; the fixed
window (`window`) runs its own fixed-iteration forms of the same maps.
"""

from __future__ import annotations

import math

import torch

from .candidates import Candidates
from .dual import dual_log_renorm, dual_multiplier
from .families import CLOSED_FORM_FAMILIES, QUADRATIC_DUAL_FAMILIES, Family
from .generators import BregmanGenerator, generic_dual_renorm, generic_primal_renorm
from .primal import (
    closed_log_renorm,
    kl_log_renorm,
    newton_log_renorm,
    primal_multiplier,
    support_mask,
)
from .roots import Multiplier

Tensor = torch.Tensor


def log_deficit(cand: Candidates, k: Tensor) -> Tensor:
    """log R_k for sizes k >= 1 (``[n, ...]`` like ``k``; `Candidates.deficit` holds R_1..R_W)."""
    flat = k.reshape(k.shape[0], -1)
    return torch.log(torch.gather(cand.deficit, 1, flat - 1)).reshape(k.shape)


def _family_map(family: Family | None, mode: str):
    """The map of a family on a fixed support (arguments: log p, support mask, alpha, log R,
    k): a closed form, a quadratic dual map, or the general primal / dual map."""
    if family in CLOSED_FORM_FAMILIES:
        return lambda lp, mk, a, ld, kk: closed_log_renorm(family, lp, mk, ld, kk)
    if mode == "primal":
        return newton_log_renorm
    closed = family if family in QUADRATIC_DUAL_FAMILIES else None
    return lambda lp, mk, a, ld, kk: dual_log_renorm(lp, mk, a, ld, kk, closed=closed)


def log_renorm(family: Family | None, mode: str, log_p: Tensor, k: Tensor, alpha: Tensor,
               log_deficit: Tensor, generator: BregmanGenerator | None = None) -> Tensor:
    """T_alpha (eq. (4), primal) or T*_alpha (eq. (5), dual) on the top-k entries of each row,
    in log space, with the rows' family's map.

    Args:
        log_p: ``[..., K]`` log-probabilities sorted in decreasing order.
        k: ``[...]`` support sizes, 1 <= k <= K.
        alpha: ``[...]`` exponents.
        log_deficit: ``[...]`` log(1 - S_k), the mass left outside the support (-inf if none:
            every map is then the identity, the KL map q = p / S with S = 1).

    Returns:
        ``[..., K]`` log q, normalized, -inf at positions >= k.
    """
    if generator is not None:
        mask = support_mask(k, log_p.shape[-1])
        renorm = generic_primal_renorm if mode == "primal" else generic_dual_renorm
        return torch.log(renorm(torch.exp(log_p), mask, generator))
    shape = log_p.shape
    lp = log_p.reshape(-1, shape[-1])
    mk = support_mask(k, shape[-1]).reshape(-1, shape[-1])
    ld = log_deficit.reshape(-1)
    kk = k.reshape(-1)
    a = alpha.to(log_p.dtype).reshape(-1)
    out = torch.full_like(lp, -math.inf)
    none = torch.isneginf(ld)
    identity = none.nonzero().squeeze(-1)
    if identity.numel():
        out[identity] = kl_log_renorm(lp[identity], mk[identity])
    rest = (~none).nonzero().squeeze(-1)
    if rest.numel():
        out[rest] = _family_map(family, mode)(lp[rest], mk[rest], a[rest], ld[rest], kk[rest])
    return out.reshape(shape)


def solved(family: Family | None, mode: str, log_p: Tensor, k: Tensor, alpha: Tensor,
           log_deficit: Tensor, start: Tensor | None = None, state: Tensor | None = None
           ) -> Multiplier:
    """The map of support size k by its multiplier (`roots.Multiplier`: every column valued,
    the support to the rounding floor), for the families without a closed form; ``start`` /
    ``state``: a nearby scalar and (dual) inner unknowns, used where they fit the solve's
    brackets. Rows with no mass outside the support (log R = -inf) are the identity, q = p."""
    identity = torch.isneginf(log_deficit)
    if bool(identity.any()):
        rest = (~identity).nonzero().squeeze(-1)
        lift = torch.where(torch.isfinite(log_p), 0.0, -math.inf).to(log_p.dtype)
        zero = torch.zeros_like(log_p)
        out = Multiplier(torch.full_like(log_deficit, -math.inf), log_p.clone(), zero,
                         lift, None if mode == "primal" else torch.full_like(log_p, math.nan))
        if rest.numel():
            part = solved(family, mode, log_p[rest], k[rest], alpha[rest], log_deficit[rest],
                          None if start is None else start[rest],
                          None if state is None else state[rest])
            for whole, piece in zip(out, part, strict=True):
                if whole is not None and piece is not None:
                    whole[rest] = piece
        return out
    mask = support_mask(k, log_p.shape[-1])
    a = alpha.to(log_p.dtype)
    if mode == "primal":
        return primal_multiplier(log_p, mask, a, log_deficit, k, start)
    closed = family if family in QUADRATIC_DUAL_FAMILIES else None
    return dual_multiplier(log_p, mask, a, log_deficit, k, closed, start, state)
