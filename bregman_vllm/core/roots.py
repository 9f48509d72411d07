"""The one safeguarded Newton iteration of the exact path (maps of eqs. (4) and (5)).

Every map without a closed form reduces to scalar root finding (Section 3.1 of arXiv
2505.19371): one unknown per row for the primal map (the level w of eq. (4)), and for the dual
map one outer unknown per row (nu of eq. (5)) and one inner unknown per entry (Algorithm 1).
All three are solved here, elementwise over a batch, to the rounding floor. (The fixed-shape
step of `window` runs a fixed number of plain Newton steps instead, from starts that make them
monotone, and certifies the result.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

Tensor = torch.Tensor

#: |F| at which Newton stops: a few ulps of a sum of O(1) terms (the rounding floor).
NEWTON_TOLERANCE = 4e-15
MAX_ITERATIONS = 100


def converged(value: Tensor, previous: Tensor, step: Tensor, x: Tensor,
              tolerance: Tensor | float = NEWTON_TOLERANCE) -> Tensor:
    """The residual is at the rounding floor, the step is below float64 resolution, or the
    residual stopped halving once within a few ulps of the tolerance (stagnation at the floor,
    where rounding rather than the iteration decides it)."""
    size = value.abs()
    return ((size <= tolerance) | (step.abs() <= 2e-16 * (1.0 + x.abs()))
            | ((size <= 4.0 * tolerance) & (size >= 0.5 * previous.abs())))


Evaluation = tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]


def safeguarded_newton(evaluate: Callable[[Tensor], Evaluation], x: Tensor, low: Tensor,
                       high: Tensor, moved: Callable[[Tensor, Tensor], None] | None = None
                       ) -> Tensor:
    """Root of an increasing F with F(low) <= 0 <= F(high), elementwise.

    ``evaluate(x)`` returns (F(x), F'(x)) or (F(x), F'(x), tolerance). A Newton step that leaves
    the bracket (or is not finite) bisects instead; an element stops once `converged`, or at
    once where the bracket is closed (low = high = x: a caller's answer given in advance). When
    F is convex and the start has F >= 0, the iterates decrease monotonically.
    ``moved(old, new)`` runs after every update (e.g. to warm-start an inner solve).
    """
    previous = torch.full_like(x, math.inf)
    closed = high <= low
    for _ in range(MAX_ITERATIONS):
        evaluation = evaluate(x)
        value, slope = evaluation[0], evaluation[1]
        tolerance = evaluation[2] if len(evaluation) > 2 else NEWTON_TOLERANCE
        step = value / slope
        done = converged(value, previous, step, x, tolerance) | closed
        previous = value
        if bool(done.all()):
            break
        low = torch.where(value < 0, x, low)
        high = torch.where(value > 0, x, high)
        proposal = x - step
        inside = (proposal > low) & (proposal < high)  # (False for NaN and +-inf too)
        updated = torch.where(done, x, torch.where(inside, proposal, 0.5 * (low + high)))
        if moved is not None:
            moved(x, updated)
        x = updated
    return x


class Multiplier(NamedTuple):
    """A map of eq. (4) or (5) on a fixed support, by its scalar: every entry's value is explicit
    in one unknown per row (primal: the level of eq. (4); dual: s = log nu of eq. (5)), so
    the same scalar also gives each entry past the support the value the map would give it.

    ``log_q``, ``rate`` and ``lift`` cover every column the solve was given
    ([n, C]); the support is the first k columns and sums to 1 there up to `NEWTON_TOLERANCE`
    (not renormalized).
    ``state`` is the dual's inner unknowns z = log log(q / p) ([n, C]), a warm start for a
    nearby solve; None for the primal, whose entries are closed forms in s."""

    s: Tensor  # [n]
    log_q: Tensor  # [n, C] log q_j at s
    rate: Tensor  # [n, C] d log q_j / d s
    lift: Tensor  # [n, C] log(q_j / p_j) >= 0, exact where tiny (p_j = 0: log q_j)
    state: Tensor | None = None
