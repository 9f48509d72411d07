"""Formula families: which formulas decode a row, decided once per plan from (mode, alpha, k).

This module is the one place where special values of alpha are recognized: `family_of`, on the
host, once per distinct parameter set (by the plan, `plan`). Every other module receives the
family (the fixed-shape step, the exact path's maps and gaps), so a closed form is never picked
by a float comparison written somewhere else.

Paper: Noarov, Mallick, Wang et al., "Foundations of Top-k Decoding for Language Models",
arXiv 2505.19371. The primal map is eq. (4) (Definition 4.1 for phi_alpha), the dual map eq. (5);
the closed forms are Proposition 4.1 (primal alpha = -inf, 3/2, 2, +inf); the primal and dual
maps coincide at alpha in {1, 2, +inf} (Appendix G.3).

=================  ====================================================================
family             rows
=================  ====================================================================
``KEEP_ALL``       no fixed k, no cap, and lambda = 0 or too small to drop 1e-9 of mass
                   (`keeps_all`): k* is the whole support
``KL``             primal alpha = 1 (standard top-k renormalization, eq. (1)); dual alpha = 1
``THREE_HALVES``   primal alpha = 3/2 (Proposition 4.1)
``SQUARE``         alpha = 2, primal or dual (Proposition 4.1; the two maps coincide)
``WATER``          alpha = +inf, fixed k (water-filling, Proposition 4.1), primal or dual
``ARGMAX``         primal alpha = -inf, fixed k (the deficit goes to the argmax)
``POWER``          primal alpha in [1.1, 7], other values: q_i = (p_i^b + w)^(1/b), b = alpha - 1,
                   one scalar w per (row, k) by Newton in linear space
``DUAL_THREE_HALVES``  dual alpha = 3/2: the inner equation of eq. (5) is a quadratic in sqrt(q)
``DUAL_THREE``     dual alpha = 3: the inner equation is a quadratic in q
``EXACT``          everything else (alpha near 1 or large, alpha < 1, other dual alphas, a user
                   generator): the search (`search`)
=================  ====================================================================

What decodes a row (`route`), and how wide its window is (`window_width`), is decided here
and read everywhere else (the plan, the slot table, the torch step, the kernels):

* ``KEEP``: every positive entry renormalized (``KEEP_ALL``), no candidates;
* ``WINDOW``: the fixed window of `WINDOW` (or `WIDE_WINDOW`) candidates, with the family's
  closed forms or fixed Newton iterations (`window`, and the kernels' `kernels.formulas`); a
  row it cannot certify (`may_flag`) goes on to the search;
* ``SEARCH``: the search alone (`search`): the ``EXACT`` family (no window formula), fixed
  sizes past the widest window, user generators.
"""

from __future__ import annotations

import enum
import math

import torch

from .candidates import UNBOUNDED

Tensor = torch.Tensor

#: Primal alphas (besides the closed forms) solved by the linear-space Newton of `window`:
#: b = alpha - 1 in [0.1, 6] keeps p^b in float64 range for every float32 probability and the
#: power 1/b from amplifying rounding beyond 1e-14.
POWER_RANGE: tuple[float, float] = (1.1, 7.0)


class Family(str, enum.Enum):
    KEEP_ALL = "keep_all"
    KL = "kl"
    THREE_HALVES = "three_halves"
    SQUARE = "square"
    WATER = "water"
    ARGMAX = "argmax"
    POWER = "power"
    DUAL_THREE_HALVES = "dual_three_halves"
    DUAL_THREE = "dual_three"
    EXACT = "exact"


#: Total variation within which an adaptive row is decoded by its lambda -> 0 limit, every
#: positive token kept (`keeps_all`).
KEEP_ALL_TOLERANCE = 1e-9


def log_gap_floor_scale(mode: str, alpha: float) -> float:
    """log(alpha c) of the floor G(k) >= p_(k+1)^alpha / (alpha c) of every cost gap, with c = 1
    (primal) or alpha - 1 (dual), for alpha > 0 (resp. > 1).

    Primal: G(k) = D(T_k, T_(k+1)) >= d(0, q'_(k+1)) = q'^alpha / alpha (the Bregman
    Pythagorean identity, eqs. (15)-(16); `gaps`), and q' >= p_(k+1) since T adds mass (eq. (4)).
    Dual: the last term of G*(k) (`gaps`) is q'^(alpha-1) [(alpha-1)^2 (q' - p) + p] /
    (alpha (alpha-1)) >= p^alpha / (alpha (alpha-1)), the other terms are >= 0 and q' >= p
    (Theorem A.1)."""
    scale = math.log(alpha)
    if mode == "dual":
        scale += math.log(alpha - 1.0)
    return scale


def keeps_all(mode: str, alpha: float, lam: float, vocab: int) -> bool:
    """Whether adaptive decoding keeps every positive token of any row of ``vocab`` entries, to
    within a total variation of `KEEP_ALL_TOLERANCE` (lambda = 0: exactly; Theorem 3.3).

    With the floor of `log_gap_floor_scale`, a token past k* has p <= (lambda alpha c)^(1/alpha)
    (G(k*) <= lambda), so the exact answer drops a mass R <= V (lambda alpha c)^(1/alpha) and
    differs from p itself (every token kept, nothing renormalized) by R in total variation.
    This is the limit of both ends where k* -> V: lambda -> 0, primal alpha -> 0 (the bound is
    (lambda alpha)^(1/alpha)) and dual alpha -> 1 (the bound is V lambda alpha (alpha - 1))."""
    if lam == 0.0:
        return True
    exponent = (math.log(lam) + log_gap_floor_scale(mode, alpha)) / alpha
    return math.log(vocab) + exponent <= math.log(KEEP_ALL_TOLERANCE)


#: Candidates of the first window: k* up to WINDOW - 1 is certified there.
WINDOW = 64
#: The widest window: closed-form families at small lambda, fixed sizes above `WINDOW`.
WIDE_WINDOW = 256
#: Below these lambdas a closed-form family's k* often passes 64 on peaked rows (standard top-k
#: keeps every token with p_(k+1) > ~lambda S_k): it gets the wide window.
WIDE_BELOW = {Family.KL: 5e-3, Family.THREE_HALVES: 5e-4, Family.SQUARE: 1e-4}


class Route(str, enum.Enum):
    """What decodes a row (module docstring)."""

    KEEP = "keep"
    WINDOW = "window"
    SEARCH = "search"


def route(family: Family, fixed: bool, size: int) -> Route:
    """The route of a row (``size``: its fixed size, or its cap; `candidates.UNBOUNDED` for
    none)."""
    if family == Family.KEEP_ALL:
        return Route.KEEP
    if family == Family.EXACT or (fixed and size > WIDE_WINDOW):
        return Route.SEARCH
    return Route.WINDOW


def window_width(family: Family, lam: float, fixed: bool, size: int) -> int:
    """The candidates the window reads for a row: its fixed size, or the sizes searched at once
    (iterative families solve a [K, K] system per row, so theirs stays at `WINDOW`; closed-form
    families widen it at small lambda), no more than the cap."""
    if fixed:
        return max(1, size)
    window = WIDE_WINDOW if lam < WIDE_BELOW.get(family, 0.0) else WINDOW
    return max(1, min(window, size))


def width_class(width: int) -> int:
    """The compiled window a width needs: `WINDOW` or `WIDE_WINDOW`."""
    return WINDOW if width <= WINDOW else WIDE_WINDOW


def support_bound(mode: str, alpha: float, lam: float) -> int:
    """An upper bound on k* from the parameters alone (adaptive rows; `UNBOUNDED` where none is
    known): G(k - 1) <= w(p_k, s_(k-1)) by weak duality (`gaps.log_entry_term`), and at the
    scalar of T_(k-1) the entry p_k gets at most what each of the k - 1 entries of the support
    gets (q is increasing in p at a fixed scalar, eqs. (4) and (5)), so q_k <= 1 / (k - 1) and
    G(k - 1) <= M (k - 1)^(-alpha) / alpha, with M = 1 (primal: w = q^alpha / alpha) or
    max(beta, 1 / beta) (dual: w = q^beta [beta^2 (q - p) + p] / (alpha beta), beta = alpha -
    1, 0 <= p <= q). k* - 1 has G(k* - 1) > lambda, hence k* - 1 < (M / (lambda alpha))^(1 /
    alpha). Tested against the independent reference (tests/test_kernel_search.py)."""
    if not (lam > 0.0 and math.isfinite(alpha) and alpha > 0.0):
        return UNBOUNDED
    scale = 0.0
    if mode == "dual":
        if alpha <= 1.0:
            return UNBOUNDED
        scale = abs(math.log(alpha - 1.0))
    log_bound = (scale - math.log(lam) - math.log(alpha)) / alpha
    if log_bound > 60.0 * math.log(2.0):
        return UNBOUNDED
    return math.floor(math.exp(log_bound) * (1.0 + 1e-9)) + 1


def may_flag(family: Family, fixed: bool, size: int, width: int) -> bool:
    """Whether a window row may be handed to the search (the step then syncs once): adaptive
    rows whose largest support (``size``: the cap, and `support_bound`, the smaller) passes the
    window, and iterative fixed sizes above `WINDOW` (whose certificates the window computes
    there)."""
    if fixed:
        return family in ITERATIVE_FAMILIES and size > WINDOW
    return size > width


#: Families whose k* search is a closed-form gap over the whole window (no iteration).
CLOSED_GAP_FAMILIES = frozenset({Family.KL, Family.THREE_HALVES, Family.SQUARE})
#: Families whose map on a fixed support is a closed form (`primal.closed_log_renorm`).
CLOSED_FORM_FAMILIES = frozenset({Family.KL, Family.THREE_HALVES, Family.SQUARE, Family.WATER,
                                  Family.ARGMAX})
#: Families solved by a fixed number of Newton iterations per support size.
ITERATIVE_FAMILIES = frozenset({Family.POWER, Family.DUAL_THREE_HALVES, Family.DUAL_THREE})
#: The dual maps whose inner equation is a quadratic (`dual.quadratic_root`).
QUADRATIC_DUAL_FAMILIES = frozenset({Family.DUAL_THREE_HALVES, Family.DUAL_THREE})


def family_of(mode: str, alpha: float, fixed: bool, keep_all: bool = False) -> Family:
    """The family of one row, from validated parameters (host values, no tensors);
    ``keep_all``: an adaptive row without a cap whose k* is every positive token (`keeps_all`)."""
    if keep_all and not fixed:
        return Family.KEEP_ALL
    if alpha == 2.0:
        return Family.SQUARE
    if alpha == 1.0:
        return Family.KL
    if alpha == math.inf:
        return Family.WATER if fixed else Family.EXACT  # adaptive +inf is refused upstream
    if mode == "primal":
        if alpha == 1.5:
            return Family.THREE_HALVES
        if alpha == -math.inf:
            return Family.ARGMAX
        if POWER_RANGE[0] <= alpha <= POWER_RANGE[1]:
            return Family.POWER
        return Family.EXACT
    if alpha == 1.5:
        return Family.DUAL_THREE_HALVES
    if alpha == 3.0:
        return Family.DUAL_THREE
    return Family.EXACT


def newton_iterations(family: Family, alphas: list[float]) -> int:
    """Fixed Newton iterations for a group of rows (the worst alpha of the group decides).

    Counted from the starts in `window`: POWER converges monotonically (concave in w for
    b >= 1, convex for b < 1, each start on the side that makes the iterates monotone) and
    needs more steps as |b| grows; the dual quadratic families converge in 2 to 6. A row that is not
    converged after these steps is not certified and is decoded again by the exact path, so
    the counts trade speed for how often that happens, never exactness.
    """
    if family == Family.DUAL_THREE_HALVES:
        return 5
    if family == Family.DUAL_THREE:
        return 7
    if family != Family.POWER:
        return 0
    spread = max(max(a - 1.0, 1.0 / max(a - 1.0, 1e-12)) for a in alphas)
    if spread <= 2.0:
        return 6
    if spread <= 3.0:
        return 7
    if spread <= 5.0:
        return 8
    return 10
