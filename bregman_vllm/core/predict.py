"""Where the exact path probes: k* predicted from the values of the maps at one multiplier.

The exact path's probes (`exact._probe`) each solve one map T_m by its multiplier; what that
multiplier gives every column also predicts the next size to probe (`predicted_sizes`: Halley
steps of each size's equation from it, then each size's entry term at its predicted
multiplier). Nothing here is certified: it decides where a probe goes and what it starts from;
the probes' weak-duality bounds and exact gaps decide k*.

Where k* is in the thousands (tiny lambda) the first probe used to go to the floor of the gaps
(`exact._floor_sizes`), 5 to 40 % below k*, and two more maps to get next to it. For the dual's
general alphas and the primal's on both sides of 1 (`first_probe`) it is predicted from one
multiplier found without a map, per row:

1. s~, where the support the multiplier fills, k(s) (the last size whose added mass
   A_k(s) = sum_(i<=k) (q_i(s) - p_i) is at most R_k, eq. (5)), has its next entry's term at
   lambda: w(p_(k+1), q_(k+1)(s)) = lambda (`gaps.log_entry_term`). w grows with s and k(s)
   falls, so the term is monotone in s: `SEARCH_STEPS` bisection steps on about
   `SAMPLED_COLUMNS` evenly spaced columns, with the inner roots replaced by their
   primal-shaped approximation (`dual._shaped_inner`, a closed form; k(s~) within 0.5 to 2 %
   of k* on the extreme cases of benchmarks/bench_core.py);
2. the values at s~ on every column: the dual's exact inner roots (Newton from the shaped ones,
   `dual._inner_steps`), the primal's closed forms in its level (alpha > 1) or in delta =
   log(q_1 / p_1) (alpha < 1, `primal.top_values`);
3. `predicted_sizes` from those values, as from a probe's multiplier, column by column only
   next to the support filled at s~ (`predicted_near`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .dual import _inner_steps, _shaped_inner, values_at
from .gaps import log_entry_term
from .primal import _top_lift, level_lift, level_values, top_values
from .roots import Multiplier

Tensor = torch.Tensor

#: Columns the bisection reads per row, about (evenly spaced).
SAMPLED_COLUMNS = 2048
#: Bisection steps (s~ to 2^-16 of its bracket, a few sizes: the Halley steps from the exact
#: values at s~ take the prediction the rest of the way).
SEARCH_STEPS = 16
#: Columns valued past twice the support filled at s~.
SPARE_COLUMNS = 64
#: Newton steps of the inner roots at s~ from the shaped ones, at most (`dual._inner_steps`;
#: two measured fastest: the first probe's joint Newton takes them further).
INNER_STEPS = 2


def state_drift(solved: Multiplier) -> Tensor | None:
    """What moves the dual's inner unknowns with s (`moved_state`): the map's rate and
    curvature, dy/ds and d^2y/ds^2 of y = log(q / p) ([2, r, C]); None for the primal."""
    if solved.state is None:
        return None
    return torch.stack([solved.rate, solved.curvature])


def moved_state(state: Tensor, drift: Tensor, shift: Tensor) -> Tensor:
    """The inner unknowns z = log y moved by ``shift`` in s to second order, z' = y'/y and
    z'' = y''/y - z'^2 (``drift``: y' and y'', `state_drift`): from the last size's z, the next
    solve's inner Newton starts about where it ends (where s moves by about 1, as it does at
    dual alpha 20 over a hundred sizes: 6 joint Newton passes, against 9 from y moved to first
    order)."""
    inverse = torch.exp(-state)
    first = drift[0] * inverse
    ahead = state + shift * (first + 0.5 * shift * (drift[1] * inverse - first * first))
    return torch.where(torch.isfinite(ahead), ahead, state)


def predicted_sizes(mode: str, log_p: Tensor, deficit: Tensor, values: Multiplier,
                    alpha: Tensor, lam: Tensor, m: Tensor, skip: int) -> tuple[Tensor, Tensor]:
    """The sizes k* is predicted at from the values ``values`` of a multiplier s at every
    column (a probe's solve, or `start_values`), and each size's predicted multiplier shift.

    For support size j (column j - 1), the mass the map adds to the first j entries,
    A_j(s) = sum_(i<=j) (q_i - p_i), must reach R_j: Halley's step on log A_j(s) - log R_j from
    s (its first two derivatives from those of every log q_i; with log A_j linear in s, exact
    for alpha = 2 where A_j = j nu, the Newton step), then log w_j at that s_j to second order.
    Returns (guess, shift): the last size predicted to keep its next entry (G > lambda; ``m``
    where s is -inf) and s_j - s per column (NaN in the first ``skip`` columns, whose sums are
    carried in one piece: sizes below a known lower bound need no prediction).
    ``deficit``: R_1 .. R_C ([n, C], `candidates.Candidates.deficit`).
    """
    width = log_p.shape[-1]
    terms = _terms(log_p, values)
    carried = terms[..., :skip].sum(-1, keepdim=True)
    sums = torch.cumsum(terms[..., skip:], -1) + carried
    stops, shift = _predicted_at(
        mode, log_p[:, skip:], values.log_q[:, skip:], values.rate[:, skip:],
        values.curvature[:, skip:], deficit[:, skip:width], sums, values.s, alpha, lam, m,
        torch.arange(skip, width, device=m.device), width)
    return _guess(values.s, m, stops), torch.nn.functional.pad(shift, (skip, 0), value=math.nan)


def _guess(s: Tensor, m: Tensor, stops: Tensor) -> Tensor:
    """The size predicted from the first column predicted to stop (its size - 1; ``m`` where
    s is -inf: the identity map, nothing predicted)."""
    return torch.where(torch.isneginf(s), m, stops.clamp_min(1))


def _terms(log_p: Tensor, values: Multiplier) -> Tensor:
    """Per column, the mass q_i - p_i the map adds and its first two derivatives in s
    ([3, n, C]; 0 where not finite: none may spoil the sums)."""
    q = torch.exp(values.log_q)
    positive = torch.isfinite(log_p)
    added = torch.where(positive, torch.exp(torch.where(positive, log_p, 0.0))
                        * torch.expm1(values.lift), q)
    terms = torch.stack([added, q * values.rate, q * (values.rate ** 2 + values.curvature)])
    return torch.nan_to_num(terms, nan=0.0, posinf=0.0, neginf=0.0)


def _predicted_at(mode: str, log_p: Tensor, log_q: Tensor, rate: Tensor, curvature: Tensor,
                  deficit: Tensor, sums: Tensor, s: Tensor, alpha: Tensor, lam: Tensor,
                  m: Tensor, column: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """`predicted_sizes` at the given columns (``column``: [J] or [n, J]; the other arrays
    [n, J], ``sums`` the cumulative `_terms` through each column): the first column predicted
    to stop (``width`` where none is) and each column's predicted shift."""
    acol = alpha.to(log_p.dtype).unsqueeze(-1)
    total, first, second = sums.unbind(0)
    first = first / total  # (log A)'
    second = second / total - first ** 2
    newton = (torch.log(deficit) - torch.log(total)) / first
    shift = newton / (1.0 + 0.5 * newton * second / first).clamp(0.5, 2.0)
    log_w = log_entry_term(mode, log_p, log_q, acol)
    # d log w_j / ds: alpha rate_j (primal); dual, with dw / dnu = q: g = nu q_j / w_j and
    # d^2 log w / ds^2 = g (1 + rate_j) - g^2.
    if mode == "primal":
        gain, bend = acol * rate, acol * curvature
    else:
        gain = torch.exp(s.unsqueeze(-1) + log_q - log_w)
        bend = gain * (1.0 + rate) - gain ** 2
    predicted = log_w + shift * (gain + 0.5 * bend * shift)
    # (no added mass yet, in the first columns: no prediction there, and k* >= m anyway)
    keeps = (predicted > torch.log(lam).unsqueeze(-1)) | (torch.isnan(predicted)
                                                          & (column < m.unsqueeze(-1)))
    return torch.where(~keeps, column, width).amin(-1), shift


#: Sizes on each side of where k* is expected that `predicted_near` predicts column by column.
NEAR_REACH = 256


def predicted_near(mode: str, log_p: Tensor, deficit: Tensor, values: Multiplier,
                   alpha: Tensor, lam: Tensor, m: Tensor, skip: int, expected: Tensor,
                   reach: int = NEAR_REACH) -> tuple[Tensor, Tensor]:
    """`predicted_sizes` where k* is expected next to ``expected`` (sizes per row: a probe
    placed by a prediction, or the support a multiplier filled, `_bisected`): the Halley steps
    and entry terms only ``reach`` sizes on each side of it, per row (those of a whole row
    cost more than its sums). A row whose first stop is at an end of its columns (k* may lie
    past it) is predicted over all of them: the same guesses, and NaN shifts outside the
    columns predicted at (a probe there starts from s itself, `exact._warm_start`)."""
    width = log_p.shape[-1]
    span = min(width - skip, 2 * reach + 1)
    if span == width - skip:
        return predicted_sizes(mode, log_p, deficit, values, alpha, lam, m, skip)
    n = log_p.shape[0]
    first = (expected - reach).clamp(skip, width - span)
    column = first.unsqueeze(-1) + torch.arange(span, device=m.device)  # [n, span]
    end = int(first.max()) + span
    terms = _terms(log_p[:, :end], values.take(slice(None), end))
    sums = torch.cumsum(terms[..., skip:], -1) + terms[..., :skip].sum(-1, keepdim=True)
    sums = sums.gather(-1, (column - skip).expand(3, n, span))

    def at(t: Tensor) -> Tensor:
        return t.gather(1, column)

    stops, near = _predicted_at(mode, at(log_p), at(values.log_q), at(values.rate),
                                at(values.curvature), at(deficit), sums, values.s, alpha, lam,
                                m, column, width)
    guess = _guess(values.s, m, stops)
    shift = torch.full_like(log_p, math.nan).scatter_(1, column, near)
    missed = (((stops <= first) & (first > skip)) | ((stops >= first + span)
                                                     & (first + span < width))) \
        & torch.isfinite(values.s)
    rows = missed.nonzero().squeeze(-1)
    if rows.numel():
        guess[rows], shift[rows] = predicted_sizes(
            mode, log_p[rows], deficit[rows], values.take(rows, width), alpha[rows],
            lam[rows], m[rows], skip)
    return guess, shift


def _bisected(mode: str, log_p: Tensor, deficit: Tensor, alpha: Tensor, beta: Tensor,
              log_lam: Tensor, low: Tensor, lift, zero, high: Tensor | None = None
              ) -> tuple[Tensor, Tensor]:
    """Step 1 of the module docstring: the multiplier s~ per row in [low, high] (default 0), by
    bisection on about `SAMPLED_COLUMNS` evenly spaced columns; at s, ``lift(s, lp, beta)``
    gives log(q / p) of the positive entries (``lp``: log p, 0 where p = 0) and
    ``zero(s, beta)`` log q of the zero ones ([n, 1]). Also the support filled at s~ per row
    (to the sampling's stride, `_stride`).

    Two bisection steps at a time: the midpoint and both quarter points are tested together
    (the rows stacked three times), the same points and brackets as one step at a time in half
    the launched ops."""
    stride = _stride(log_p.shape[-1])
    lp = log_p[:, ::stride]
    finite = torch.isfinite(lp)
    p = torch.exp(lp)
    lp = torch.where(finite, lp, 0.0)
    samples = lp.shape[-1]
    n = lp.shape[0]
    lp, finite, p, r, beta, alpha = (t.repeat(3, 1) for t in (
        lp, finite, p, deficit[:, ::stride], beta, alpha))
    log_lam = log_lam.repeat(3)
    if high is None:
        high = torch.zeros_like(low)  # nu < 1 (Theorem A.1), c < 1 (eq. (4))
    for _ in range(SEARCH_STEPS // 2):  # (SEARCH_STEPS is even)
        mid = 0.5 * (low + high)
        points = torch.stack([0.5 * (low + mid), mid, 0.5 * (mid + high)])  # [3, n]
        s = points.reshape(-1)
        rise, level = lift(s, lp, beta), zero(s, beta)
        log_q = torch.where(finite, lp + rise, level)
        added = torch.where(finite, p * torch.expm1(rise), torch.exp(level))  # q - p
        filled = (torch.cumsum(added, -1) * stride <= r).sum(-1)
        at = filled.clamp_max(samples - 1).unsqueeze(-1)  # the sampled column after it
        w = log_entry_term(mode, torch.where(finite, lp, -math.inf).gather(1, at),
                           log_q.gather(1, at), alpha).squeeze(-1)
        # (a support past the sampled columns: s is too small)
        big = ((w > log_lam) & (filled < samples)).view(3, n)
        filled = filled.view(3, n)
        # the step at the midpoint, then the one at the quarter point inside its half
        high = torch.where(big[1], mid, high)
        low = torch.where(big[1], low, mid)
        side = torch.where(big[1], 0, 2)
        point = points.gather(0, side.unsqueeze(0)).squeeze(0)
        second = big.gather(0, side.unsqueeze(0)).squeeze(0)
        high = torch.where(second, point, high)
        low = torch.where(second, low, point)
        last = filled.gather(0, side.unsqueeze(0)).squeeze(0)
    return 0.5 * (low + high), last * stride


def _stride(width: int) -> int:
    return max(1, width // SAMPLED_COLUMNS)


def _columns_after(sizes: Tensor, width: int) -> int:
    """The columns steps 2 and 3 value: twice the largest support filled at s~, and
    `SPARE_COLUMNS` more (the predictions reach that far)."""
    return min(width, 2 * (int(sizes.max()) + _stride(width)) + SPARE_COLUMNS)


def _guessed(mode: str, log_p: Tensor, deficit: Tensor, alpha: Tensor, lam: Tensor
             ) -> tuple[Tensor, Tensor]:
    """Step 1 for rows of one kind (dual; primal alpha > 1, in the level tau; primal alpha < 1,
    in delta = log(q_1 / p_1)): s~ and the support filled at it."""
    a = alpha.to(log_p.dtype).unsqueeze(-1)
    beta = a - 1.0
    lp = torch.where(torch.isfinite(log_p), log_p, 0.0)
    log_lam = torch.log(lam).to(log_p.dtype)
    if mode == "dual":
        # (at the lower end every entry's t = s - beta log p is below -60: no mass added; a
        # zero entry's q is nu^(1/beta))
        return _bisected(mode, log_p, deficit, a, beta, log_lam,
                         (beta * lp).amin(-1) - 60.0,
                         lambda s, lp, b: torch.exp(_shaped_inner(b, s.unsqueeze(-1) - b * lp)),
                         lambda s, b: s.unsqueeze(-1) / b)
    if bool((beta < 0).all()):
        # delta from 0 (q = p: no mass added) to -log p_1 (q_1 = 1); zero entries stay zero
        high = (-lp[:, 0]).clamp_min(0.0)
        return _bisected(mode, log_p, deficit, a, beta, log_lam, torch.zeros_like(high),
                         lambda s, lp, b: _top_lift(lp, b.squeeze(-1), s),
                         lambda s, b: torch.full_like(s, -math.inf).unsqueeze(-1), high)
    # (at the lower end every entry's beta (tau - log p) is below -60: no mass added; a zero
    # entry's q is the level c = e^tau)
    return _bisected(mode, log_p, deficit, a, beta, log_lam,
                     lp.amin(-1) - 60.0 / beta.squeeze(-1),
                     lambda s, lp, b: level_lift(lp, b, s), lambda s, b: s.unsqueeze(-1))


def _values(mode: str, log_p: Tensor, alpha: Tensor, s: Tensor) -> Multiplier:
    """Step 2: every column's values at s~ (the dual's exact inner roots by Newton from the
    shaped ones; the primal's closed forms)."""
    beta = (alpha.to(log_p.dtype) - 1.0).unsqueeze(-1)
    finite = torch.isfinite(log_p)
    lp = torch.where(finite, log_p, 0.0)
    if mode == "dual":
        z = _shaped_inner(beta, s.unsqueeze(-1) - beta * lp)
        return values_at(lp, finite, beta, s, _inner_steps(beta, lp, s, z, INNER_STEPS))
    if bool((beta < 0).all()):
        return top_values(lp, finite, beta, s)
    return level_values(lp, finite, beta, s)


def start_values(mode: str, log_p: Tensor, deficit: Tensor, alpha: Tensor, lam: Tensor
                 ) -> tuple[Multiplier, Tensor]:
    """Steps 1 and 2 for rows of one kind (`_guessed`): the values of s~ at the first columns
    (`_columns_after`), what `predicted_sizes` predicts the first probe from and its warm start
    (the dual's ``state``: the inner unknowns z); and the support filled at s~ per row."""
    s, sizes = _guessed(mode, log_p, deficit, alpha, lam)
    columns = _columns_after(sizes, log_p.shape[-1])
    return _values(mode, log_p[:, :columns], alpha, s), sizes


class FirstProbe(NamedTuple):
    """Where the first probe goes (``guess``, [r]), the values of a multiplier next to it
    (``values``, the first C columns) and each size's predicted multiplier shift from it
    (``shift``, [r, C]): the probe's warm start (`exact._warm_start`)."""

    guess: Tensor
    values: Multiplier
    shift: Tensor


def first_probe(mode: str, log_p: Tensor, deficit: Tensor, alpha: Tensor, lam: Tensor,
                low: Tensor) -> FirstProbe:
    """The first probe of rows with k* >= ``low`` (the floor of the gaps), all of one kind
    (`_guessed`): the module docstring's steps. (Probing at the floor instead where it is at
    or past the support filled at s~ measured slower: the prediction puts the probe closer, and
    a probe there starts cold. Moving the dual's inner unknowns on to the multiplier predicted
    at the guessed size and solving them there, a closer start for the probe's joint Newton,
    measured no faster: the joint Newton saves about the passes the move costs.)"""
    values, sizes = start_values(mode, log_p, deficit, alpha, lam)
    columns = values.log_q.shape[-1]
    skip = max(0, min(int(low.min()) - 1, columns - 1))
    # (k* is expected within a few per cent of the support filled at s~)
    guess, shift = predicted_near(mode, log_p[:, :columns], deficit, values, alpha, lam, low,
                                  skip, sizes, NEAR_REACH + int(sizes.max()) // 16)
    return FirstProbe(guess, values, shift)
