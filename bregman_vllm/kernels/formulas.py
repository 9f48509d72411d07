"""The step's formulas as Triton functions: each restates one torch function of `bregman_vllm.core`
(named in its docstring, the reference it is tested against in ``tests/test_kernels.py``) on
the candidates of one row, in float64.

Paper: arXiv 2505.19371. The primal map is eq. (4) (Definition 4.1 for phi_alpha), the dual map
eq. (5) (Theorem A.1, Algorithm 1), the cost eq. (6) with k* the first size whose gap is at most
lambda (Theorem 3.3); the closed forms are Proposition 4.1 and eq. (1).

Vectors are over the candidates of a row (``[K]``, sorted decreasingly; position j holds the
(j+1)-th largest entry) or, for the iterative families' search, over (size, candidate) pairs
(``[M, K]``: row m - 1 is the support of size m). ``deficit[j]`` is R_(j+1) = 1 - S_(j+1),
summed from positive terms (`candidates.candidates`).

Numerics. The float64 transcendental functions are libdevice's on a GPU (Triton's own ``exp``
and ``log`` are float32 approximations) and numpy's under Triton's interpreter (where
libdevice does not run); log1p and expm1 are written from them (Goldberg's and Kahan's forms,
accurate to a few ulps), so that one text serves both.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..core import candidates as _candidates
from ..core import window as _window
from ..core.families import Family, Route
from ..rows import FAMILY_CODES, ROUTE_CODES

#: Triton's interpreter runs these functions (CPU tensors; ``TRITON_INTERPRET=1`` before Triton
#: was imported). (Triton before 3.4 has no ``knobs``: the variable itself.)
INTERPRET = tl.constexpr(bool(triton.knobs.runtime.interpret) if hasattr(triton, "knobs") else
                         os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"))



def device(fn):
    """A Triton device function: `triton.jit`, and under the interpreter the Python function
    itself (the interpreter patches `triton.language` again at every call of a nested jit
    function, about 0.1 ms: most of an interpreted search's time). The same text runs either
    way."""
    return fn if INTERPRET else triton.jit(fn)


KEEP_ALL = tl.constexpr(FAMILY_CODES[Family.KEEP_ALL])
KL = tl.constexpr(FAMILY_CODES[Family.KL])
THREE_HALVES = tl.constexpr(FAMILY_CODES[Family.THREE_HALVES])
SQUARE = tl.constexpr(FAMILY_CODES[Family.SQUARE])
WATER = tl.constexpr(FAMILY_CODES[Family.WATER])
ARGMAX = tl.constexpr(FAMILY_CODES[Family.ARGMAX])
POWER = tl.constexpr(FAMILY_CODES[Family.POWER])
DUAL_THREE_HALVES = tl.constexpr(FAMILY_CODES[Family.DUAL_THREE_HALVES])
DUAL_THREE = tl.constexpr(FAMILY_CODES[Family.DUAL_THREE])
EXACT = tl.constexpr(FAMILY_CODES[Family.EXACT])
#: What decodes a row (`families.route`): the route column's codes.
ROUTE_KEEP = tl.constexpr(ROUTE_CODES[Route.KEEP])
ROUTE_WINDOW = tl.constexpr(ROUTE_CODES[Route.WINDOW])
ROUTE_SEARCH = tl.constexpr(ROUTE_CODES[Route.SEARCH])

# ----------------------------------------------------------------------------- float64 numerics


@device
def exp64(x):
    if INTERPRET:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@device
def log64(x):
    if INTERPRET:
        return tl.log(x)
    else:
        return libdevice.log(x)


@device
def sqrt64(x):
    if INTERPRET:
        return tl.sqrt(x)
    else:
        return libdevice.sqrt(x)


@device
def pow64(x, y):
    """x^y for x >= 0 (0^y = 0 for y > 0), as e^(y log x)."""
    return exp64(y * log64(x))


@device
def log1p64(x):
    """log(1 + x) (Goldberg: log(u) x / (u - 1) with u = 1 + x, exact where u rounds)."""
    u = 1.0 + x
    ratio = x / tl.where(u == 1.0, 1.0, u - 1.0)
    return tl.where(u == 1.0, x, log64(u) * ratio)


@device
def expm1_64(x):
    """e^x - 1 (Kahan: (u - 1) x / log(u) with u = e^x, exact where u rounds to 1)."""
    u = exp64(x)
    lu = log64(u)
    ratio = x / tl.where(lu == 0.0, 1.0, lu)
    out = tl.where(u - 1.0 == -1.0, -1.0, (u - 1.0) * ratio)
    return tl.where(u == 1.0, x, tl.where(u == float("inf"), u, out))


@device
def logaddexp64(a, b):
    """log(e^a + e^b) (-inf when both are)."""
    top = tl.maximum(a, b)
    gap = tl.where(tl.minimum(a, b) == float("-inf"), float("-inf"), tl.minimum(a, b) - top)
    return tl.where(top == float("-inf"), top, top + log1p64(exp64(gap)))


@device
def logsumexp64(v, inside):
    """log sum e^v over ``inside`` ([K] -> scalar; -inf for an empty selection)."""
    top = tl.max(tl.where(inside, v, float("-inf")), axis=0)
    safe = tl.where(top == float("-inf"), 0.0, top)
    return safe + log64(tl.sum(tl.where(inside, exp64(v - safe), 0.0), axis=0))


@device
def request_at(map_ptr, family_ptr, fixed_ptr, size_ptr, alpha_ptr, lam_ptr, row_mode_ptr,
               temperature_ptr, row):
    """A row's request through the step's row -> slot mapping (`rows.RowTable`'s columns):
    (slot, family, fixed, size, alpha, lambda, dual, temperature)."""
    slot = tl.load(map_ptr + row).to(tl.int64)
    return (slot, tl.load(family_ptr + slot), tl.load(fixed_ptr + slot) != 0,
            tl.load(size_ptr + slot), tl.load(alpha_ptr + slot), tl.load(lam_ptr + slot),
            tl.load(row_mode_ptr + slot) == 2,  # (`rows.MODES`: 1 primal, 2 dual)
            tl.load(temperature_ptr + slot).to(tl.float64))


@device
def at(v, positions, j):
    """v[j] for a scalar position j (``positions``: tl.arange over v)."""
    return tl.sum(tl.where(positions == j, v, 0), axis=0)


@device
def shifted(v, positions, K: tl.constexpr):
    """v[j + 1] at position j (0 at the last)."""
    return tl.where(positions + 1 < K, tl.gather(v, tl.minimum(positions + 1, K - 1), 0), 0.0)


# ----------------------------------------------------------------------------- candidates' keys


@device
def order_key(value, index):
    """int64 keys that order entries as their float32 values (ties: the smaller index first):
    the value's bits made order-preserving as a signed integer (negative floats have their
    magnitude bits flipped), shifted left 32, OR the index's complement. Distinct for distinct
    indices, so a top-k of keys is a top-k of entries that carries their positions."""
    bits = value.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (4294967295 - index.to(tl.int64))


@device
def key_value(key):
    """The float32 value of `order_key`."""
    high = (key >> 32).to(tl.int32)
    return tl.where(high < 0, high ^ 0x7FFFFFFF, high).to(tl.float32, bitcast=True)


@device
def key_index(key):
    """The index of `order_key`."""
    return 4294967295 - (key & 4294967295)


@device
def rank_top(keys, K: tl.constexpr):
    """The K largest of distinct ``keys``, sorted decreasingly, by rank: key i goes to position
    #{keys > key i}. (Triton's interpreter runs `tl.topk`'s bitonic network element by element,
    seconds per call; these are a few vectorized ops.)"""
    rank = tl.sum((keys[None, :] > keys[:, None]).to(tl.int32), axis=1)
    hit = rank[:, None] == tl.arange(0, K)[None, :]
    return tl.sum(tl.where(hit, keys[:, None], 0), axis=0)


@device
def top_keys(keys, K: tl.constexpr):
    """The K largest ``keys``, sorted decreasingly: `tl.topk` on a GPU, `rank_top` under the
    interpreter (the two agree: tests/test_kernels.py)."""
    if INTERPRET:
        return rank_top(keys, K)
    else:
        return tl.topk(keys, K)


# ----------------------------------------------------------------------------- closed-form gaps


@device
def kl_gaps(x, x_next):
    """`gaps.kl_gaps`: G(k) = log1p(p_(k+1) / S_k) at k = j + 1 (alpha = 1, eq. (1): cost(k) =
    -log S_k + lambda k)."""
    return kl_gap(tl.cumsum(x, 0), x_next)


@device
def kl_gap(prefix, x_next):
    """`kl_gaps` from S_k (``prefix``) and p_(k+1)."""
    return log1p64(x_next / tl.where(prefix > 0, prefix, 1.0))


@device
def square_gaps(x_next, deficit, sizes):
    """`gaps.square_gaps`: G(k) = (k p_(k+1) + R_k)^2 / (2 k (k + 1)) at k = j + 1 (alpha = 2,
    Proposition 4.1's q = p + R/k in eq. (6))."""
    t = sizes * x_next + deficit
    return t * t / (2.0 * sizes * (sizes + 1.0))


@device
def three_halves_gaps(x, x_next, deficit, sizes, positions, K: tl.constexpr):
    """`gaps.three_halves_gaps`: primal alpha = 3/2 at k = j + 1, G(k) = 2/3 [(c_k -
    c_(k+1))^2 (3 r_k + 2k c_k + k c_(k+1)) + (sqrt(p_(k+1)) + c_(k+1))^3] with r_k =
    sum_(i<=k) sqrt(p_i), c_k = R_k / (sqrt(r_k^2 + k R_k) + r_k) (Proposition 4.1)."""
    r = tl.cumsum(sqrt64(x), 0)
    c = three_halves_shift(r, deficit, sizes)
    return three_halves_gap(r, c, shifted(c, positions, K), x_next, sizes)


@device
def three_halves_shift(r, deficit, sizes):
    """c_k = R_k / (sqrt(r_k^2 + k R_k) + r_k), the shift of sqrt(p) in alpha = 3/2's map."""
    return deficit / (sqrt64(r * r + sizes * deficit) + r)


@device
def three_halves_gap(r, c, c_next, x_next, sizes):
    """`three_halves_gaps` from r_k, c_k, c_(k+1) and p_(k+1)."""
    moved = (c - c_next) * (c - c_next) * (3.0 * r + 2.0 * sizes * c + sizes * c_next)
    added = sqrt64(x_next) + c_next
    return (2.0 / 3.0) * (moved + added * added * added)


@device
def closed_gaps(family, x, deficit, positions, K: tl.constexpr):
    """`window.closed_gaps`: G(1 .. K - 1) at positions 0 .. K - 2 (the last is unused)."""
    sizes = (positions + 1).to(tl.float64)
    x_next = shifted(x, positions, K)
    if family == KL:
        gaps = kl_gaps(x, x_next)
    elif family == SQUARE:
        gaps = square_gaps(x_next, deficit, sizes)
    else:
        gaps = three_halves_gaps(x, x_next, deficit, sizes, positions, K)
    return gaps


# ----------------------------------------------------------------------------- closed-form maps


@device
def kl_map(log_x, inside):
    """`primal.kl_log_renorm`: q = p / S on the support (alpha = 1, eq. (1))."""
    v = tl.where(inside, log_x, float("-inf"))
    return v - logsumexp64(v, inside)


@device
def square_map(log_x, inside, log_deficit, k):
    """`primal.square_log_renorm`: q_i = p_i + R / k (alpha = 2, Proposition 4.1)."""
    return tl.where(inside, logaddexp64(log_x, log_deficit - log64(k)), float("-inf"))


@device
def three_halves_map(log_x, inside, log_deficit, k):
    """`primal.three_halves_log_renorm`: q_i = (sqrt(p_i) + c)^2, c = R / (sqrt(r^2 + k R) + r)
    (alpha = 3/2, Proposition 4.1, rationalized)."""
    half = tl.where(inside, 0.5 * log_x, float("-inf"))
    return three_halves_values(log_x, inside, log_deficit, k, logsumexp64(half, inside))


@device
def three_halves_values(log_x, inside, log_deficit, k, log_r):
    """`three_halves_map` from log r, r = sum_(i<=k) sqrt(p_i)."""
    log_root = 0.5 * logaddexp64(2.0 * log_r, log64(k) + log_deficit)
    log_c = log_deficit - logaddexp64(log_root, log_r)
    return tl.where(inside, 2.0 * logaddexp64(0.5 * log_x, log_c), float("-inf"))


@device
def water_level(p, log_deficit, k, positions, K: tl.constexpr):
    """`primal._water_level`: the level c of water-filling on the support of size k (p: 0 off
    it), the first level c_j = (1 - S_j) / (k - j) at or above p_(j+1)."""
    above = exp64(log_deficit) + tl.cumsum(p, 0, reverse=True)
    j = positions.to(tl.float64)
    level = above / tl.maximum(k - j, 1.0)
    first = tl.min(tl.where((level >= p) & (j < k), positions, K - 1), axis=0)
    return at(level, positions, first)


@device
def water_map(log_x, inside, log_deficit, k, positions, K: tl.constexpr):
    """`primal.water_filling_log_renorm`: q_i = max(p_i, c), c the level (`water_level`;
    alpha = +inf, Proposition 4.1)."""
    c = water_level(tl.where(inside, exp64(log_x), 0.0), log_deficit, k, positions, K)
    return water_values(log_x, inside, c)


@device
def water_values(log_x, inside, c):
    """`water_map` from its level c: log max(p_i, c)."""
    return tl.where(inside, log64(tl.maximum(exp64(log_x), c)), float("-inf"))


@device
def argmax_map(log_x, inside, log_deficit):
    """`primal.argmax_fill_log_renorm`: the deficit goes to the largest entry, shared equally
    among ties (alpha = -inf, Proposition 4.1)."""
    top = tl.max(tl.where(inside, log_x, float("-inf")), axis=0)
    tied = tl.sum((inside & (log_x == top)).to(tl.float64), axis=0)
    return argmax_values(log_x, inside, log_deficit, top, tied)


@device
def argmax_values(log_x, inside, log_deficit, top, tied):
    """`argmax_map` from the largest entry's log and the number of entries tied with it."""
    shift = log_deficit - log64(tied)
    return tl.where(inside, tl.where(log_x == top, logaddexp64(log_x, shift), log_x),
                    float("-inf"))


@device
def closed_map(family, log_x, inside, log_deficit, k, positions, K: tl.constexpr):
    """`primal.closed_log_renorm`: log T_k of a closed-form family on the candidates."""
    if family == KL:
        log_q = kl_map(log_x, inside)
    elif family == THREE_HALVES:
        log_q = three_halves_map(log_x, inside, log_deficit, k)
    elif family == SQUARE:
        log_q = square_map(log_x, inside, log_deficit, k)
    elif family == WATER:
        log_q = water_map(log_x, inside, log_deficit, k, positions, K)
    else:
        log_q = argmax_map(log_x, inside, log_deficit)
    return log_q


@device
def closed_map_at(family, log_x, deficit, k, positions, K: tl.constexpr):
    """`closed_map` of the support of size k (int), its deficit read from the candidates'."""
    log_deficit = log64(at(deficit, positions, k - 1))
    return closed_map(family, log_x, positions < k, log_deficit, k.to(tl.float64), positions, K)


@device
def closed_gap_family(family):
    """`families.CLOSED_GAP_FAMILIES`: the families whose every gap has a closed form."""
    return (family == KL) | (family == THREE_HALVES) | (family == SQUARE)


@device
def iterative_family(family):
    """`families.ITERATIVE_FAMILIES`: the families whose window map takes Newton steps."""
    return (family == POWER) | (family == DUAL_THREE_HALVES) | (family == DUAL_THREE)


# ----------------------------------------------------------------------------- iterative maps


@device
def power_solve(x, x1, deficit, sizes, mask, alpha, iterations):
    """`window.power_solve`: primal T_k for alpha in `families.POWER_RANGE`, q_i = (p_i^b +
    w)^(1/b), b = alpha - 1 (eq. (4), Definition 4.1), by Newton on v = w / x_1^b from the start
    that makes it monotone (the KL start too for b < 1). ``x`` [1, K], ``deficit`` and ``sizes``
    [M], ``mask`` [M, K]. Returns (q [M, K] in units of x_1, H(k) [M] in the same units, the
    residual sum q - 1 [M], the factor of G(k) <= lambda  <=>  H(k) - H(k+1) <= lambda factor)."""
    b = alpha - 1.0
    inv_b = 1.0 / b
    inv_x1 = 1.0 / x1
    powers = pow64(tl.where(x > 0, x, 1.0) * inv_x1, b)
    v = pow64(deficit * inv_x1 / sizes, b)
    if b < 1.0:  # the KL start, v = (1 / S_k)^b - 1
        v = tl.minimum(v, expm1_64(log1p64(-deficit) * (-b)))
    for _ in range(iterations):
        a = powers + v[:, None]
        s = pow64(a, inv_b) * mask
        residual = tl.sum(s, axis=1) - inv_x1
        v = tl.maximum(v - b * (residual / tl.sum(s / a, axis=1)), 0.0)
    a = powers + v[:, None]
    s = pow64(a, inv_b) * mask
    residual = (tl.sum(s, axis=1) - inv_x1) * x1
    h = tl.sum(s * a, axis=1) * (-b) + alpha * (v * inv_x1)
    return s, h, residual, pow64(inv_x1, alpha) * (alpha * b)


@device
def quadratic_root(a, b):
    """`dual.quadratic_root`: the root term sqrt(a^2 + b^2) of eq. (5)'s inner equation where it
    is a quadratic (alpha = 3/2: a = nu, b = 2 sqrt(p); alpha = 3: a = p, b = 2 sqrt(nu)). The
    terms are at most 2 and at least ~1e-46 (a float32 probability, a multiplier of R / k):
    their squares neither overflow nor underflow in float64."""
    return sqrt64(a * a + b * b)


@device
def dual_three_halves_solve(x, deficit, sizes, mask, iterations):
    """`window.dual_quadratic_solve` for dual alpha = 3/2: 2 sqrt(q) = nu + sqrt(nu^2 + 4p)
    (eq. (5)), Newton on nu from the alpha = 2 solution's multiplier. Returns (4 q, H(k), the
    residual, the factor 1/2) as `power_solve`."""
    xs = tl.where(x > 0, x, 1.0)
    two_sqrt_p = 2.0 * sqrt64(xs)
    nu = deficit / tl.sum(sqrt64(xs + (deficit / sizes)[:, None]) * mask, axis=1)
    for _ in range(iterations):
        root = quadratic_root(nu[:, None], two_sqrt_p)
        h = (nu[:, None] + root) * mask
        q4 = h * h
        nu = nu - 0.5 * ((tl.sum(q4, axis=1) - 4.0) / tl.sum(q4 / root, axis=1))
    root = quadratic_root(nu[:, None], two_sqrt_p)
    h = (nu[:, None] + root) * mask
    q4 = h * h
    residual = tl.sum(q4, axis=1) * 0.25 - 1.0
    return q4, nu - tl.sum(q4 * h, axis=1) / 12.0, residual, tl.full((), 0.5, tl.float64)


@device
def dual_three_solve(x, deficit, sizes, mask, iterations):
    """`window.dual_quadratic_solve` for dual alpha = 3: 2 q = p + sqrt(p^2 + 4 nu) (eq. (5)),
    Newton on nu from its lower bound max((R/k)^2, R / sum_i 1/p_i). Returns (2 q, H(k), the
    residual, the factor 2) as `power_solve`."""
    xs = tl.where(x > 0, x, 1.0)
    inverse = tl.where(x > 0, 1.0 / xs, float("inf"))
    inverse_sums = tl.sum(tl.where(mask > 0, inverse, 0.0), axis=1)
    ratio = deficit / sizes
    nu = tl.maximum(ratio * ratio, deficit / inverse_sums)
    for _ in range(iterations):
        root = quadratic_root(xs, 2.0 * sqrt64(nu)[:, None])
        q2 = (xs + root) * mask
        step = (tl.sum(q2, axis=1) - 2.0) / tl.sum(mask / root, axis=1)
        nu = tl.maximum(nu - 0.5 * step, 0.0)
    root = quadratic_root(xs, 2.0 * sqrt64(nu)[:, None])
    q2 = (xs + root) * mask
    residual = tl.sum(q2, axis=1) * 0.5 - 1.0
    return q2, nu - tl.sum(q2 * q2 * q2, axis=1) / 24.0, residual, tl.full((), 2.0, tl.float64)


@device
def iterative_solve(family, x, x1, deficit, sizes, mask, alpha, iterations):
    """`window._solve`: the iterative family's T_k for the sizes of ``mask``'s rows."""
    if family == POWER:
        q, h, residual, factor = power_solve(x, x1, deficit, sizes, mask, alpha, iterations)
    elif family == DUAL_THREE_HALVES:
        q, h, residual, factor = dual_three_halves_solve(x, deficit, sizes, mask, iterations)
    else:
        q, h, residual, factor = dual_three_solve(x, deficit, sizes, mask, iterations)
    return q, h, residual, factor


# ----------------------------------------------------------------------------- support sizes

TOLERANCE = tl.constexpr(_window.TOLERANCE)
MARGIN = tl.constexpr(_window.MARGIN)
UNBOUNDED = tl.constexpr(_candidates.UNBOUNDED)


@device
def known_count(x, deficit, positions, K: tl.constexpr):
    """`candidates._known`: the number of positive entries as far as the K candidates tell
    (`candidates.UNBOUNDED` when all are positive and mass lies beyond them)."""
    last = (at(x, positions, K - 1) > 0) & (at(deficit, positions, K - 1) > 0)
    return tl.where(last, UNBOUNDED, tl.sum((x > 0).to(tl.int64), axis=0))


@device
def closed_search(family, x, log_x, deficit, lam, limit, positions, K: tl.constexpr):
    """`window.closed_search`: k* = the first k in 1 .. K - 1 with G(k) <= lambda or k = limit
    (limit = min(k_max, #positive entries)), else K (Theorem 3.3); whether k* ran into the end
    of the window while the row could grow past it (then the exact path decides: the closed
    forms being exact, k* >= K is certified); log T_k* on the candidates."""
    gaps = closed_gaps(family, x, deficit, positions, K)
    sizes = positions + 1
    stop = ((gaps <= lam) | (sizes >= limit)) & (positions < K - 1)
    k = tl.min(tl.where(stop, sizes, K), axis=0).to(tl.int64)
    beyond = (k >= K) & (limit > K)
    return k, closed_map_at(family, log_x, deficit, k, positions, K), beyond


@device
def iterative_search(family, x, deficit, alpha, lam, limit, iterations, certify,
                     W: tl.constexpr):
    """`window.iterative_search`: T_k for every k = 1 .. W at once (``[W, W]``: row k - 1 is
    the support of size k), the gaps from H(k) - H(k+1), k* the first k whose gap is at most
    lambda or that reaches the limit; with ``certify``, whether the row is uncertified (a size
    up to the limit not converged, a decision within the rounding bound of H, or k* at the end
    of the window while the row could grow past it) and, among those, whether every decision
    of the window stands (k* >= W certified). Returns (k*, log T_k* [W], uncertified, past)."""
    positions = tl.arange(0, W)
    sizes = (positions + 1).to(tl.float64)
    mask = (positions[None, :] <= positions[:, None]).to(tl.float64)
    x1 = tl.max(x, axis=0)
    q, h, residual, factor = iterative_solve(family, x[None, :], x1, deficit, sizes, mask,
                                             alpha, iterations)
    h_next = shifted(h, positions, W)
    drop = h - h_next
    threshold = lam * factor
    count = positions + 1
    below = count < limit
    decide = positions < W - 1
    stop = ((drop <= threshold) | ~below) & decide
    k = tl.min(tl.where(stop, count, W), axis=0).to(tl.int64)
    q_k = tl.sum(tl.where((positions == k - 1)[:, None], q, 0.0), axis=0)
    log_q = log64(q_k / tl.sum(q_k, axis=0))
    unsure = k < 0  # (False)
    past = k < 0
    if certify:
        rounding = (tl.abs(h) + tl.abs(h_next)) * MARGIN
        close = (tl.abs(drop - threshold) <= rounding) & below & decide
        unconverged = ~(tl.abs(residual) <= TOLERANCE) & (count <= limit)
        unsure = tl.max((close | unconverged).to(tl.int32), axis=0) > 0
        beyond = (k >= W) & (limit > W)
        past = beyond & ~unsure
        unsure = unsure | beyond
    return k, log_q, unsure, past


@device
def iterative_fixed(family, x, deficit, alpha, k, iterations, certify, positions,
                    K: tl.constexpr):
    """`window.iterative_fixed`: T_k for a fixed size k (generalized top-k, Definition 2.2) and,
    with ``certify``, whether its Newton residual is above `window.TOLERANCE`."""
    mask = (positions < k).to(tl.float64)[None, :]
    x1 = tl.max(x, axis=0)
    one = tl.zeros([1], tl.float64)
    q, _h, residual, _factor = iterative_solve(
        family, x[None, :], x1, one + at(deficit, positions, k - 1), one + k.to(tl.float64),
        mask, alpha, iterations)
    q_k = tl.sum(q, axis=0)
    unsure = certify & (tl.max((~(tl.abs(residual) <= TOLERANCE)).to(tl.int32), axis=0) > 0)
    return log64(q_k / tl.sum(q_k, axis=0)), unsure
