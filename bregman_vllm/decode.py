"""Bregman decoding of a batch of next-token distributions: the public entry points.

Pipeline of one call (`step` has the details):

1. `core.plan.make_plan`: validate ``alpha``, ``lam``, ``top_k``, ``k_max``
   (`bregman_vllm.params`) and group the rows by formula family (`core.families`), on the host;
2. `backend.decode`: candidates, the support size (fixed, or the adaptive k* over a fixed
   window of sizes), the alpha map on the support, written into zeros (probabilities) or -inf
   (logits); rows the window cannot certify go through the search (`core.search`). On CUDA
   tensors this is four Triton kernels (`bregman_vllm.kernels`; ``BREGMAN_BACKEND``,
   `backend.chosen_backend`), elsewhere the torch step (`core.step`).

The primal problem is min_q D_phi(q, p) + lambda ||q||_0 and the dual one
min_q D_phi(p, q) + lambda ||q||_0 (eqs. (2) and (3) of arXiv 2505.19371) with
phi_alpha(x) = x^alpha / (alpha (alpha - 1)) (Section 4); the greedy property (Theorems 3.1, 3.2)
makes the support a set of top entries, k-convexity (Theorem 3.3) makes k* the first size whose
cost gap is at most lambda.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .backend import decode
from .core.generators import BregmanGenerator
from .core.maps import log_renorm
from .core.plan import Plan, make_plan
from .params import BregmanParamError, parse_mode

Tensor = torch.Tensor


class BregmanOutput(NamedTuple):
    """Decoded distribution (same shape and dtype as the input) and support size per row."""

    probs: Tensor
    k: Tensor


def _flatten(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _public_plan(scores: Tensor, alpha, lam, mode, k_max, top_k, generator=None) -> Plan:
    if scores.dim() == 0:
        raise BregmanParamError("probs", "must have at least one dimension (the vocabulary)")
    return make_plan(mode, alpha, lam, top_k, k_max, batch_shape=scores.shape[:-1],
                     vocab=scores.shape[-1], device=scores.device, generator=generator)


def bregman_decode(
    probs: Tensor,
    *,
    alpha=None,
    lam,
    mode: str = "primal",
    k_max=None,
    top_k=None,
    generator: BregmanGenerator | None = None,
) -> BregmanOutput:
    """Bregman decoding (problem (2) / (3)) of a batch of next-token distributions.

    Args:
        probs: ``[..., V]`` probabilities (float32 or float64; rows are normalized by their sum,
            entries <= 0 count as zero).
        alpha: exponent of phi_alpha(x) = x^alpha / (alpha (alpha - 1)); a float or a tensor
            broadcastable to the batch shape ``probs.shape[:-1]``. Ranges: see
            `bregman_vllm.params` (adaptive primal (0, inf), adaptive dual (1, inf), fixed-k
            primal any nonzero value with +-inf, fixed-k dual [1, inf]).
        lam: lambda >= 0, the l0 price per kept token (float or per-row tensor).
        mode: "primal" (min D(q, p), eq. (3); map eq. (4)) or "dual" (min D(p, q), eq. (3);
            map eq. (5)).
        k_max: optional cap on the support size (int or per-row tensor, 0 = no cap).
        top_k: optional fixed support size: generalized top-k (Definition 2.2) instead of the
            adaptive k* (int or per-row tensor, 0 = adaptive for that row).
        generator: instead of ``alpha``, any `BregmanGenerator` (phi, phi', phi'', (phi')^-1);
            primal mode needs a primal-valid phi, dual mode a dual-valid one (see `generators`).

    Returns:
        `BregmanOutput(probs, k)`: the decoded distribution (same shape and dtype; zeros off the
        support) and the support size per row (LongTensor of the batch shape; 0 for a row with no
        positive mass, which is returned unchanged).

    Example:
        >>> p = torch.tensor([0.5, 0.3, 0.15, 0.05])
        >>> out = bregman_decode(p, alpha=2.0, lam=0.01)
        >>> out.k.item(), [round(v, 4) for v in out.probs.tolist()]
        (3, [0.5167, 0.3167, 0.1667, 0.0])
    """
    plan = _public_plan(probs, alpha, lam, mode, k_max, top_k, generator)
    out, k, _ = decode(_flatten(probs), plan, logits=False)
    return BregmanOutput(out.reshape(probs.shape), k.reshape(probs.shape[:-1]))


def bregman_decode_logits(
    logits: Tensor,
    *,
    alpha=None,
    lam,
    mode: str = "primal",
    k_max=None,
    top_k=None,
    return_k: bool = False,
):
    """Bregman decoding of ``softmax(logits)``, returning the decoded distribution's logits.

    The result is log q (normalized), -inf off the support, same shape and dtype as ``logits``;
    ``softmax`` of it is `bregman_decode(softmax(logits), ...).probs`. Rows that are all -inf or
    hold NaN are returned unchanged. With ``return_k=True`` returns ``(logits, k)``.

    With Python numbers for every parameter this is one fixed sequence of ops (on CUDA
    tensors four Triton kernels) with at most one host sync: none when every support fits the
    window (a fixed ``top_k`` or a ``k_max`` of at most 64, for every alpha with a
    fixed-shape formula), one otherwise (the rows the window cannot certify, and alphas
    without such a formula, go through the exact path).
    """
    if logits.dim() == 0:
        raise BregmanParamError("logits", "must have at least one dimension (the vocabulary)")
    plan = _public_plan(logits, alpha, lam, mode, k_max, top_k)
    out, k, _ = decode(_flatten(logits), plan, logits=True)
    out = out.reshape(logits.shape)
    if return_k:
        return out, k.reshape(logits.shape[:-1])
    return out


# ----------------------------------------------------------------------------- renormalize


def renormalize(x: Tensor, *, alpha, mode: str = "primal") -> Tensor:
    """Renormalize sub-probability vectors on a fixed support: T_alpha (eq. (4)) or T*_alpha
    (eq. (5)) applied to the whole last dimension of ``x``.

    ``x`` holds entries >= 0 with row sums <= 1 (sums above 1 by rounding count as 1). Zero
    entries are part of the support: primal alpha > 1 and dual maps give them mass, primal
    alpha <= 1 keeps them at zero. A row of zeros maps to the uniform distribution.

    Example:
        >>> renormalize(torch.tensor([0.4, 0.2]), alpha=2.0)
        tensor([0.6000, 0.4000])
    """
    mode = parse_mode(mode, "mode", allow_off=False)
    # Validated and grouped by family by the plan, as a fixed top-k of the whole row.
    plan = make_plan(mode, alpha, 0.0, top_k=x.shape[-1], batch_shape=x.shape[:-1],
                     vocab=x.shape[-1], device=x.device)
    x2 = _flatten(x).to(torch.float64).clamp_min(0.0)
    if bool((x2.sum(-1) > 1.0 + 1e-6).any()):
        raise BregmanParamError("x", "rows must sum to at most 1 (a sub-probability vector)")
    order = torch.argsort(x2, dim=-1, descending=True)
    xs = torch.gather(x2, 1, order)
    width = xs.shape[-1]
    k = torch.full((xs.shape[0],), width, dtype=torch.long, device=x.device)
    deficit = (1.0 - xs.sum(-1)).clamp_min(0.0)
    empty = xs[:, 0] <= 0
    log_q = torch.full_like(xs, -math.inf)
    with torch.no_grad():
        for group in plan.groups:
            index = group.rows_or_all(x.device)
            alpha_rows = torch.as_tensor(group.host["alpha"], dtype=torch.float64,
                                         device=x.device).expand(index.numel())
            log_q[index] = log_renorm(group.family, mode, torch.log(xs[index]), k[index],
                                      alpha_rows, torch.log(deficit[index]))
    q = torch.exp(log_q)
    q = torch.where(empty.unsqueeze(-1), torch.full_like(q, 1.0 / width), q)
    out = torch.empty_like(q).scatter_(1, order, q)
    return out.to(x.dtype).reshape(x.shape)

