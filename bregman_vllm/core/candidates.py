"""Candidates: the W largest entries of each row, sorted, and the mass of everything else.

By the greedy property (Theorems 3.1 and 3.2 of arXiv 2505.19371) the decoded support is a set of
top entries, so decoding only ever looks at the largest entries of a row. They are found without
sorting the vocabulary: the row is cut into blocks of `BLOCK` entries, the W blocks with the
largest maxima hold the W largest entries, and a top-k over those W * BLOCK entries finds them.
The mass outside the candidates is summed from positive terms (the other blocks' sums and the
unchosen entries of the chosen blocks), so the deficit 1 - S_k never cancels.

Every function here runs a fixed sequence of ops on fixed shapes (the shapes depend only on the
input's shape and the requested width): no host syncs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

Tensor = torch.Tensor

#: Block length of the two-stage top-k.
BLOCK = 64
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
    total: Tensor  # [n] the row total (float64); not a distribution unless finite and > 0
    known: Tensor  # [n] number of positive entries if the candidates hold all of them, else
    #                UNBOUNDED


def top_entries(p: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """Values and positions of the ``width`` largest entries of each row of ``p`` ([n, V],
    entries >= 0), sorted decreasingly, and the float64 sum of all other entries."""
    n, vocab = p.shape
    if width >= vocab:
        values, index = torch.sort(p, dim=-1, descending=True)
        return values, index, p.new_zeros(n, dtype=torch.float64)
    if width * BLOCK * 4 > vocab:  # few blocks: a plain top-k is as cheap
        values, index = torch.topk(p, width, dim=-1)
        return values, index, p.scatter(1, index, 0.0).sum(-1, dtype=torch.float64)
    full = vocab // BLOCK
    blocks = p[:, : full * BLOCK].view(n, full, BLOCK)
    block_max = blocks.amax(-1)
    block_sum = blocks.sum(-1)
    if vocab % BLOCK:  # the ragged last block, padded below every probability
        tail = torch.nn.functional.pad(p[:, full * BLOCK:], (0, BLOCK - vocab % BLOCK),
                                       value=-1.0)
        block_max = torch.cat([block_max, tail.amax(-1, keepdim=True)], 1)
        block_sum = torch.cat([block_sum, tail.clamp_min(0.0).sum(-1, keepdim=True)], 1)
    # The top-`width` entries lie in the `width` blocks with the largest maxima.
    chosen = torch.topk(block_max, width, dim=-1, sorted=False).indices
    offsets = (chosen.unsqueeze(-1) * BLOCK + _arange(BLOCK, p.device)).flatten(1)
    if vocab % BLOCK:
        gathered = torch.gather(p, 1, offsets.clamp_max(vocab - 1))
        gathered = torch.where(offsets < vocab, gathered, -1.0)
    else:
        gathered = torch.gather(p, 1, offsets)
    values, where_in = torch.topk(gathered, width, dim=-1)
    index = torch.gather(offsets, 1, where_in)
    other_blocks = block_sum.scatter(1, chosen, 0.0).sum(-1, dtype=torch.float64)
    if vocab % BLOCK:
        gathered = gathered.clamp_min(0.0)  # drop the padding
    other_gathered = gathered.scatter(1, where_in, 0.0).sum(-1, dtype=torch.float64)
    return values, index, other_blocks + other_gathered


def candidates(p: Tensor, width: int) -> Candidates:
    """The ``width`` candidates of every row of ``p`` ([n, V], entries >= 0 or NaN)."""
    values, index, rest = top_entries(p, width)
    x = values.to(torch.float64).clamp_min(0.0)
    total = x.sum(-1) + rest
    x = x / total.unsqueeze(-1)
    tail = rest / total
    # R_k = tail + sum_{i > k} x_i: a sum of positive terms (no cancellation near S_k = 1); for
    # the usual widths one product with a strictly lower-triangular matrix of ones.
    if x.shape[-1] <= _MATMUL_WIDTH:
        deficit = torch.addmm(tail.unsqueeze(-1), x, _strictly_lower(x.shape[-1], x.device))
    else:
        suffix = x.flip(-1).cumsum(-1).flip(-1)
        deficit = torch.nn.functional.pad(suffix[:, 1:], (0, 1)) + tail.unsqueeze(-1)
    # The candidates hold every positive entry unless all are positive and mass lies outside.
    incomplete = (x[:, -1] > 0) & (tail > 0)
    known = (x > 0).sum(-1).masked_fill_(incomplete, UNBOUNDED)
    return Candidates(x, index, deficit, total, known)



_ARANGE: dict[tuple[int, torch.device, torch.dtype], Tensor] = {}
_LOWER: dict[tuple[int, torch.device], Tensor] = {}


def _strictly_lower(size: int, device: torch.device) -> Tensor:
    """[size, size] float64 matrix with ones where row > column (made once per size)."""
    if torch.compiler.is_compiling():  # a graph makes its own constants
        return torch.ones(size, size, dtype=torch.float64, device=device).tril(-1)
    key = (size, torch.device(device))
    if key not in _LOWER:
        _LOWER[key] = torch.ones(size, size, dtype=torch.float64, device=device).tril(-1)
    return _LOWER[key]


def _arange(size: int, device: torch.device, dtype: torch.dtype = torch.long) -> Tensor:
    """``torch.arange(size)`` on ``device``, made once (constants are not rebuilt per step)."""
    if torch.compiler.is_compiling():  # a graph makes its own constants
        return torch.arange(size, device=device, dtype=dtype)
    key = (size, torch.device(device), dtype)
    cached = _ARANGE.get(key)
    if cached is None:
        cached = _ARANGE[key] = torch.arange(size, device=device, dtype=dtype)
    return cached
