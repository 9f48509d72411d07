"""Candidates: the W largest entries of each row, sorted, and the mass of everything else.

By the greedy property (Theorems 3.1 and 3.2 of arXiv 2505.19371) the decoded support is a set of
top entries, so decoding only ever looks at the largest entries of a row. They are found from
the scores themselves (logits, or probabilities), in two reads of the batch and no [n, V]
intermediate:

1. the maxima of blocks of `BLOCK` entries (one read): the W blocks with the largest maxima hold
   the W largest entries, and a top-k over those W * BLOCK entries finds them;
2. the mass of each block (one read): its log-sum-exp for logits (the row's log-normalizer is
   their log-sum-exp, so no probability tensor is made), its sum for probabilities.

The mass outside the candidates is a sum of positive terms (the other blocks' masses and the
unchosen entries of the chosen blocks), so the deficit 1 - S_k never cancels. A per-row
``scale`` (the inverse temperature of vLLM's Model Runner V2) multiplies the logits inside the
normalizer only: the order of a row's entries does not depend on it.

Every function here runs a fixed sequence of ops on fixed shapes (the shapes depend only on the
input's shape and the requested width): no host syncs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

Tensor = torch.Tensor

#: Block length of the two-stage top-k.
BLOCK = 64
#: Device types whose two-stage top-k gives way to one plain top-k of the row once it would
#: gather more than 1/N of the row again (``width * BLOCK * N >= vocab``; elsewhere N = 1): on a
#: CPU at [8, 49152] a width of 512 takes 1.25 ms against 4.6 (the exact path's wider rounds;
#: the step's windows, 64 wide, keep the two reads of the logits that a GPU wants).
PLAIN_TOP_K_FRACTION: dict[str, int] = {"cpu": 4}
#: Widths up to which the deficits are one matrix product (the matrix is width^2 float64).
_MATMUL_WIDTH = 256
#: A support-size bound meaning "not known from the candidates" (all candidates are positive and
#: some mass lies outside them).
UNBOUNDED = 2**62


class Candidates(NamedTuple):
    """The candidates of each row (all float64 [n, W] tensors are sorted decreasingly)."""

    x: Tensor  # [n, W] probabilities normalized by the row total; 0 past the row's support
    index: Tensor  # [n, W] their vocabulary positions
    deficit: Tensor  # [n, W] deficit[:, j] = R_(j+1) = 1 - S_(j+1), from positive terms
    valid: Tensor  # [n] bool: the row is a distribution (finite, positive mass)
    known: Tensor  # [n] number of positive entries if the candidates hold all of them, else
    #                UNBOUNDED
    log_x: Tensor  # [n, W] log x, computed in log space for logits (-inf where x is 0)


def under_smallest(dtype: torch.dtype) -> float:
    """The largest float64 below the smallest positive value of ``dtype`` (`threshold` keeps
    what is above it)."""
    info = torch.finfo(dtype)
    return math.nextafter(info.tiny * info.eps, 0.0)


def log_smallest(dtype: torch.dtype) -> float:
    """log of the smallest positive value of a score dtype (its smallest subnormal): a logit
    whose probability is below it is a zero of softmax in that dtype, and is no candidate."""
    info = torch.finfo(dtype)
    return math.log(info.tiny * info.eps)


#: Device types whose eager step normalizes logits with one softmax (a probability tensor: two
#: more passes) instead of block log-sum-exps. On a CPU, aten::logsumexp's eager kernel (the
#: maximum, then exp(x - max) into a temporary, then its sum) takes 2 to 4 times a softmax
#: (the CUDA step is the Triton kernels', `bregman_vllm.kernels`, one fused read).
SOFTMAX_NORMALIZER: dict[str, bool] = {"cpu": True}


def _mass(blocks: Tensor, logits: bool, scale: Tensor | None) -> Tensor:
    """Each block's mass over the last dimension, in the score dtype: log-sum-exp of (scaled)
    logits, or the sum of probabilities (a float32 sum of 64 entries: relative error ~1e-7)."""
    if not logits:
        return blocks.sum(-1)
    if scale is not None:
        blocks = blocks * scale.view(-1, *([1] * (blocks.dim() - 1)))
    return torch.logsumexp(blocks, -1)


def _top(scores: Tensor, width: int, logits: bool, scale: Tensor | None
         ) -> tuple[Tensor, Tensor, Tensor]:
    """(values, index) of the ``width`` largest entries, sorted, and the mass of every other
    entry (its log for logits), from positive terms."""
    n, vocab = scores.shape
    empty = -math.inf if logits else 0.0
    if width >= vocab:  # the whole row: nothing left outside
        values, index = torch.sort(scores, dim=-1, descending=True)
        return values, index, torch.full((n,), empty, dtype=torch.float64, device=scores.device)
    if width * BLOCK * PLAIN_TOP_K_FRACTION.get(scores.device.type, 1) >= vocab:  # plain top-k
        values, index = torch.topk(scores, width, dim=-1)
        rest = _mass(scores.scatter(1, index, empty), logits, scale)
        return values, index, rest if logits else rest.to(torch.float64)
    full = vocab // BLOCK
    blocks = scores[:, : full * BLOCK].view(n, full, BLOCK)
    block_max = blocks.amax(-1)  # read 1
    block_mass = _mass(blocks, logits, scale)  # read 2
    if vocab % BLOCK:  # the ragged last block, padded below every score
        tail = scores[:, full * BLOCK:]
        pad = torch.nn.functional.pad(tail, (0, BLOCK - vocab % BLOCK), value=-math.inf)
        block_max = torch.cat([block_max, pad.amax(-1, keepdim=True)], 1)
        block_mass = torch.cat([block_mass, _mass(tail, logits, scale).unsqueeze(-1)], 1)
    # The top-`width` entries lie in the `width` blocks with the largest maxima.
    chosen = torch.topk(block_max, width, dim=-1, sorted=False).indices
    offsets = (chosen.unsqueeze(-1) * BLOCK + cached_arange(BLOCK, scores.device)).flatten(1)
    if vocab % BLOCK:
        gathered = torch.gather(scores, 1, offsets.clamp_max(vocab - 1))
        gathered = torch.where(offsets < vocab, gathered, -math.inf)
    else:
        gathered = torch.gather(scores, 1, offsets)
    values, where_in = torch.topk(gathered, width, dim=-1)
    index = torch.gather(offsets, 1, where_in)
    if logits:
        others = torch.logaddexp(
            torch.logsumexp(block_mass.scatter(1, chosen, -math.inf), -1),
            _mass(gathered.scatter(1, where_in, -math.inf), True, scale))
    else:
        others = block_mass.scatter(1, chosen, 0.0).sum(-1) + \
            gathered.clamp_min(0.0).scatter(1, where_in, 0.0).sum(-1, dtype=torch.float64)
    return values, index, others


def candidates(scores: Tensor, width: int, *, logits: bool = False,
               scale: Tensor | None = None) -> Candidates:
    """The ``width`` candidates of every row of ``scores`` ([n, V]): logits (``logits=True``;
    probabilities softmax(scale * scores)) or probabilities (entries <= 0 count as zero; rows
    are normalized by their sum). Rows that are not distributions (NaN, +inf, no mass) come out
    with ``valid`` False. Logits on a device of `SOFTMAX_NORMALIZER`: the probabilities of one
    softmax, then as probabilities."""
    if logits and SOFTMAX_NORMALIZER.get(scores.device.type):
        scaled = scores if scale is None else scores * scale.unsqueeze(-1)
        return candidates(torch.softmax(scaled, -1), width)
    values, index, others = _top(scores, width, logits, scale)
    if logits:
        scaled = values.to(torch.float64)
        if scale is not None:
            scaled = scaled * scale.to(torch.float64).unsqueeze(-1)
        # The log-normalizer in float64 from the candidates and the mass of the others (summed
        # in the score dtype), so that sum x + tail = 1 to float64 rounding.
        total = torch.logaddexp(torch.logsumexp(scaled, -1), others)
        log_x = scaled - total.unsqueeze(-1)
        # A probability below the dtype's smallest positive value is a zero of softmax there
        # (its log_x stays finite: every use of log_x past the positive entries is masked).
        x = torch.nn.functional.threshold(torch.exp(log_x), under_smallest(scores.dtype), 0.0)
        tail = torch.exp(others - total)
        valid = total.abs() < math.inf  # (NaN: not valid)
    else:
        x = values.to(torch.float64).clamp_min(0.0)
        total = x.sum(-1) + others
        x = x / total.unsqueeze(-1)
        tail = others / total
        log_x = torch.log(x)
        valid = (total > 0) & (total < math.inf)
    # R_k = tail + sum_{i > k} x_i: a sum of positive terms (no cancellation near S_k = 1); for
    # the usual widths one product with a strictly lower-triangular matrix of ones.
    if x.shape[-1] <= _MATMUL_WIDTH:
        deficit = torch.addmm(tail.unsqueeze(-1), x, _strictly_lower(x.shape[-1], x.device))
    else:
        suffix = x.flip(-1).cumsum(-1).flip(-1)
        deficit = torch.nn.functional.pad(suffix[:, 1:], (0, 1)) + tail.unsqueeze(-1)
    return Candidates(x, index, deficit, valid, _known(x, deficit), log_x)


def _known(x: Tensor, deficit: Tensor) -> Tensor:
    """How many positive entries the rows have, as far as the candidates ``x`` tell: all are
    among them unless every candidate is positive and mass (R_W, ``deficit[:, -1]``) lies
    beyond them (then `UNBOUNDED`)."""
    incomplete = (x[:, -1] > 0) & (deficit[:, -1] > 0)
    return (x > 0).sum(-1).masked_fill_(incomplete, UNBOUNDED)


def select(cand: Candidates, where: Tensor, width: int) -> Candidates:
    """The candidates of the rows ``where``, cut to the first ``width`` (what `candidates`
    gives for that width: the deficits do not depend on it, the count of known positive
    entries does), for a family's formulas on its rows of a joint pass. ``index`` and ``valid``
    stay the whole pass's: those formulas do not read them (the pass writes its rows once)."""
    x = cand.x[:, :width].index_select(0, where)
    deficit = cand.deficit[:, :width].index_select(0, where)
    log_x = cand.log_x[:, :width].index_select(0, where)
    known = cand.known.index_select(0, where) if width == cand.x.shape[-1] else _known(x, deficit)
    return Candidates(x, cand.index, deficit, cand.valid, known, log_x)


def take(cand: Candidates, rows: Tensor) -> Candidates:
    """The candidates of ``rows`` (a host-synced index of the exact path); no copy when that is
    every row."""
    if rows.numel() == cand.x.shape[0]:
        return cand
    return Candidates(*(t[rows] for t in cand))


_ARANGE: dict[tuple[int, torch.device, torch.dtype], Tensor] = {}
_LOWER: dict[tuple[int, torch.device], Tensor] = {}


def _strictly_lower(size: int, device: torch.device) -> Tensor:
    """[size, size] float64 matrix with ones where row > column (made once per size)."""
    key = (size, torch.device(device))
    if key not in _LOWER:
        _LOWER[key] = torch.ones(size, size, dtype=torch.float64, device=device).tril(-1)
    return _LOWER[key]


def cached_arange(size: int, device: torch.device, dtype: torch.dtype = torch.long) -> Tensor:
    """``torch.arange(size)`` on ``device``, made once (constants are not rebuilt per step)."""
    key = (size, torch.device(device), dtype)
    cached = _ARANGE.get(key)
    if cached is None:
        cached = _ARANGE[key] = torch.arange(size, device=device, dtype=dtype)
    return cached
