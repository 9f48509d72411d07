"""The search of `bregman_vllm.core.search` as Triton functions: one program decodes one row on
its C sorted candidates, in float64, by the same algorithm, so that the torch path is the
reference each function is tested against (``tests/test_kernel_search.py``; each docstring
names the torch function it restates).

Paper: arXiv 2505.19371. cost(k) (eq. (6)) is discretely convex (Theorem 3.3), so with the gaps
G(k) = cost(k) - cost(k + 1) + lambda, k* = min {k : G(k) <= lambda} (ties to the smaller
support, Algorithm 2). The maps are eq. (4) (primal, Definition 4.1 for phi_alpha) and eq. (5)
(dual, Theorem A.1, Algorithm 1), each with one scalar s per support size:

    kind 1  primal alpha > 1: the water level tau (`primal.level_values`);
    kind 2  primal alpha < 1: log delta, delta = log q_1 - log p_1 (`primal.top_values`);
    kind 0  dual: log nu, every entry's inner root z = log log(q / p) by Newton steps
            (`dual.dual_values`), or the quadratic formulas for dual alpha = 3/2 and 3
            (``closed``: `dual._closed_lift`).

Per row (`search_row`): the floor of the gaps (a lower bound on k*); probes on s
(`probes`: at each s every candidate's value, the counts n and c that bracket k* in
[min(n, c), max(n + 1, c)] by weak duality, a straddling Newton step on D(s) = log w_(m+1)(s) -
log lambda, Illinois regula falsi otherwise), then exact gaps (`settle`: the maps of
consecutive sizes by safeguarded Newton on their scalars, `solve_map`; their own weak-duality
bounds decide most gaps, the log-space formulas `primal_log_gap` / `dual_log_gap` the others,
with `alpha_kernel` for K_alpha), and the map of k*.

Differences from the torch path, none of which changes what is certified: one row at a time
(its own candidate columns are trimmed, where the torch path trims to the widest row left); a
map's dual inner roots are solved by the nested Newton of Algorithm 1 (the torch path's
`dual._nested`, its fallback; its first choice is a joint Newton over (s, z)); the exact gaps
of the last `SETTLE` sizes are taken in increasing size, one at a time, stopping at the first
that is at most lambda (the gaps are nonincreasing); the dual's last sizes take the maps' gaps
here, where the torch path first tries the gaps' series about the last probe
(`search._series`: it holds for k* in the thousands, past any candidate set here).

Float64 throughout (`formulas`' exp64 / log64: libdevice on a GPU, numpy under the
interpreter).
"""

from __future__ import annotations

import math

import triton.language as tl

from ..core import dual as _dual
from ..core import roots as _roots
from ..core import search as _search
from .formulas import (
    DUAL_THREE_HALVES,
    UNBOUNDED,
    at,
    device,
    exp64,
    expm1_64,
    kl_map,
    log1p64,
    log64,
    logaddexp64,
    logsumexp64,
    quadratic_root,
    sqrt64,
    water_level,
)

#: The torch search's constants (`search`, `dual`, `roots`).
PROBES = tl.constexpr(_search.PROBES)
PROBE_STEPS = tl.constexpr(_search.PROBE_STEPS)
STEER_STEPS = tl.constexpr(_search.STEER_STEPS)
STRADDLE = tl.constexpr(_search.STRADDLE)
#: |D| below which the dual's probes solve their inner roots (above it the primal-shaped
#: approximation only steers), and the steering probes at most.
STEER = tl.constexpr(_search.STEER)
STEERING = tl.constexpr(_search.STEERING)
SETTLE = tl.constexpr(_search.SETTLE)
INNER_STEPS = tl.constexpr(_dual.INNER_STEPS)
EXACT_STEP = tl.constexpr(_dual.EXACT_STEP)
NEWTON_TOLERANCE = tl.constexpr(_roots.NEWTON_TOLERANCE)
MAX_ITERATIONS = tl.constexpr(_roots.MAX_ITERATIONS)
SUM_ROUNDING = tl.constexpr(_search.SUM_ROUNDING)
TERM_ROUNDING = tl.constexpr(_search.TERM_ROUNDING)
#: log(1 - 1/e) (`dual._inner_upper`, `dual._inner_bracket`).
LOG1MEXP_AT_ONE = tl.constexpr(math.log(1.0 - math.exp(-1.0)))
LOG_2 = tl.constexpr(math.log(2.0))
LARGEST = tl.constexpr(1.7976931348623157e308)

# ----------------------------------------------------------------------------- scalar numerics


@device
def softplus64(x):
    """`torch.nn.functional.softplus(x, threshold=40)`: log(1 + e^x), x itself past 40."""
    return tl.where(x > 40.0, x, log1p64(exp64(tl.minimum(x, 40.0))))


@device
def softplus20(x):
    """`torch.nn.functional.softplus` at its default threshold, 20."""
    return tl.where(x > 20.0, x, log1p64(exp64(tl.minimum(x, 20.0))))


@device
def sigmoid64(x):
    """`torch.sigmoid`, without overflow."""
    e = exp64(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@device
def log1mexp64(x):
    """`numerics.log1mexp`: log(1 - e^-x) for x >= 0 (Maechler's split at log 2)."""
    small = log64(-expm1_64(-tl.maximum(x, 0.0)))
    large = log1p64(-exp64(-tl.maximum(x, LOG_2)))
    return tl.where(x < LOG_2, small, large)


@device
def log_expm1_64(x):
    """`numerics.log_expm1`: log(e^x - 1) for x >= 0."""
    return x + log1mexp64(x)


@device
def logsubexp64(a, b):
    """`numerics.logsubexp`: log(e^a - e^b) for a >= b."""
    out = a + log1mexp64(tl.maximum(a - b, 0.0))
    return tl.where(b == float("-inf"), a, out)


@device
def isfinite64(x):
    return tl.abs(x) < float("inf")


@device
def nan_to_num64(x):
    """`torch.nan_to_num` of a nonnegative value: NaN to 0, +inf to the largest float64."""
    return tl.where(x != x, 0.0, tl.minimum(x, LARGEST))


@device
def sign64(x):
    return tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))


@device
def converged(value, previous, step, x, tolerance):
    """`roots.converged`: the residual at the rounding floor, a step below float64 resolution,
    or a residual that stopped halving within a few ulps of the tolerance."""
    size = tl.abs(value)
    return (size <= tolerance) | (tl.abs(step) <= 2e-16 * (1.0 + tl.abs(x))) | \
        ((size <= 4.0 * tolerance) & (size >= 0.5 * tl.abs(previous)))


@device
def newton_update(x, value, slope, tolerance, previous, low, high, closed):
    """One iteration of `roots.safeguarded_newton` for an increasing F (scalars or elementwise):
    whether x is converged (then it stays), the bracket kept by the sign of F, the Newton step
    where it stays inside, else the bracket's middle. Returns (x, done, low, high)."""
    step = value / slope
    done = converged(value, previous, step, x, tolerance) | closed
    low = tl.where(value < 0, x, low)
    high = tl.where(value > 0, x, high)
    proposal = x - step
    inside = (proposal > low) & (proposal < high)  # (False for NaN and +-inf too)
    return tl.where(done, x, tl.where(inside, proposal, 0.5 * (low + high))), done, low, high


#: `primal.normalized`: -inf off the support, the constraint's last rounding removed (the KL
#: map's formula).
normalized = kl_map


# ----------------------------------------------------------------------------- K_alpha


@device
def alpha_series(a, r, x):
    """`numerics._series`: K_alpha(r) = r^2 sum_n u_n / n!, u_2 = 1, u_(n+1) = r^(n-1) +
    (a r) u_n, for |r|, |a r| <= x <= 1/4: as many terms as the largest needs (term n is at
    most (n - 1) x^(n-2) / n! of the first; stop below 1e-17, 16 terms at most)."""
    terms = tl.full((), 1, tl.int32)
    bound = tl.full((), 1.0, tl.float64)
    while (terms < 16) & (bound > 1e-17):
        terms += 1
        bound = bound * x * terms / ((terms + 1) * (terms - 1)).to(tl.float64)
    ar = a * r
    u = tl.zeros_like(r) + 1.0
    power = r
    total = tl.zeros_like(r)
    factorial = tl.full((), 2.0, tl.float64)
    for n in range(2, 2 + tl.maximum(terms, 2)):
        total += u / factorial
        u = power + ar * u
        power = power * r
        factorial = factorial * (n + 1)
    return r * r * total


@device
def any_of(mask):
    """Whether any lane of ``mask`` holds (the program then takes a region's branch)."""
    return tl.max(mask.to(tl.int32), axis=0) > 0


@device
def alpha_kernel(a, rho):
    """`numerics.bregman_alpha_kernel`: log K_alpha(rho), with d_alpha(x, y) = y^alpha
    K_alpha(log x - log y) for phi_alpha (Section 4), K_alpha(rho) = [expm1(alpha rho) - alpha
    expm1(rho)] / (alpha (alpha - 1)), by its regions, each computed where some lane is in it:
    the series (|rho|, |alpha rho| <= 1/4), the forms next to alpha = 1 (|alpha - 1| <= 1/4),
    the expm1 form (|rho|, |alpha rho| <= 40) and a max-shifted logarithm beyond; K(-inf) =
    1/alpha (alpha > 0), K(+inf) = +inf."""
    r = tl.where(isfinite64(rho), rho, 0.0)
    b = a - 1.0
    size = tl.maximum(tl.abs(r), tl.abs(a * r))
    spread = tl.abs(b) + tl.zeros_like(size)  # (as a vector: the interpreter's & does not
    #                                             broadcast a scalar bool)
    near_one = (spread <= 0.25) & (size > 0.25)
    other = (spread > 0.25) & (size > 0.25)
    small = size <= 0.25
    out = tl.zeros_like(size)
    if any_of(small):
        x = tl.max(tl.where(small, size, 0.0), axis=0)
        series = alpha_series(a, tl.where(small, r, 0.0), x)
        out = tl.where(small, log64(tl.maximum(series, 0.0)), out)
    safe_b = tl.where(b == 0, 1.0, b)
    if any_of(near_one):
        # [e^r expm1(b r) / b - expm1(r)] / alpha, and its log past r = 40
        rn = tl.where(r <= 40.0, r, 0.0)
        e1 = tl.where(b == 0, rn, expm1_64(b * rn) / safe_b)
        near = log64(tl.maximum((exp64(rn) * e1 - expm1_64(rn)) / a, 0.0))
        rl = tl.where(r > 40.0, r, 41.0)
        e1 = tl.where(b == 0, rl, expm1_64(b * rl) / safe_b)
        near_large = rl + log64(e1 - 1.0 + exp64(-rl)) - log64(a)
        out = tl.where(near_one, tl.where(r <= 40.0, near, near_large), out)
    if any_of(other & (size <= 40.0)):  # the expm1 form
        rm = tl.where(size <= 40.0, r, 0.0)
        den = tl.where(b == 0, 1.0, a * b)
        moderate = log64(tl.maximum((expm1_64(a * rm) - a * expm1_64(rm)) / den, 0.0))
        out = tl.where(other & (size <= 40.0), moderate, out)
    if any_of(other & (size > 40.0)):
        # max-shifted log |e^(alpha r) - alpha e^r + (alpha - 1)| - log |alpha (alpha - 1)|
        t1 = a * r
        t2 = log64(tl.abs(a)) + r
        t3 = log64(tl.abs(b))
        top = tl.maximum(tl.maximum(t1, t2), t3)
        top = tl.where(isfinite64(top), top, 0.0)
        mixed = exp64(t1 - top) - sign64(a) * exp64(t2 - top) + sign64(b) * exp64(t3 - top)
        far = top + log64(tl.abs(mixed)) - log64(tl.where(b == 0, 1.0, tl.abs(a * b)))
        out = tl.where(other & (size > 40.0), far, out)
    out = tl.where(rho == float("-inf"), tl.where(a > 0, -log64(tl.abs(a)), float("inf")), out)
    return tl.where(rho == float("inf"), float("inf"), out)


# ----------------------------------------------------------------------------- entry terms


@device
def log_entry_term(dual, log_p, log_q, alpha):
    """`gaps.log_entry_term`: log w(p, q), the term of entry p_(k+1) in G(k) when the map
    gives it q: primal q^alpha / alpha; dual q^beta [beta^2 (q - p) + p] / (alpha beta) (a sum
    of nonnegative terms; p = 0: beta q^alpha / alpha). Weak duality at the multipliers of T_k
    and T_(k+1): w(p_(k+1), s_(k+1)) <= G(k) <= w(p_(k+1), s_k)."""
    if dual:
        b = alpha - 1.0
        positive = log_p > float("-inf")
        lp = tl.where(positive, log_p, 0.0)
        # beta^2 (q - p) + p = beta^2 p (expm1(log(q / p)) + 1 / beta^2): positive terms.
        rise = expm1_64(tl.maximum(log_q - lp, 0.0))
        inner = tl.where(positive, lp + log64(rise + 1.0 / (b * b)), log_q)
        out = b * log_q + inner + log64(b / alpha)
    else:
        out = alpha * log_q - log64(alpha)
    return out


@device
def term_slope(dual, alpha, lift, finite):
    """`search._term_slope`: d log w / d log q at fixed p: alpha (primal); beta + beta^2 /
    (beta^2 + (1 - beta^2) p / q) (dual; zero entries alpha)."""
    if dual:
        b = alpha - 1.0
        ratio = exp64(-tl.maximum(lift, 0.0))
        out = tl.where(finite, b + b * b / (b * b + (1.0 - b * b) * ratio), alpha)
    else:
        out = alpha
    return out


# ----------------------------------------------------------------------------- primal values


@device
def level_values(lp, finite, beta, tau):
    """`primal.level_values`: beta > 0, every column's value at the water level tau (eq. (4):
    q^beta = p^beta + e^(beta tau); zero entries q = e^tau): (log q, d log q / d tau =
    sigmoid(beta (tau - log p)), log(q / p))."""
    rise = beta * (tau - lp)
    lift = softplus64(rise) / beta
    log_q = tl.where(finite, lp + lift, tau)
    rate = tl.where(finite, sigmoid64(rise), 1.0)
    return log_q, rate, tl.where(finite, lift, log_q)


@device
def top_lift(lp, top, beta, delta):
    """`primal._top_lift`: beta < 0, log(q_i / p_i) at delta = log q_1 - log p_1 (with g_i =
    log p_1 - log p_i, (q_i / p_i)^beta = -expm1(beta g_i) + e^(beta (g_i + delta)))."""
    gap = top - lp
    w = exp64(beta * gap) * expm1_64(beta * delta)
    near = log1p64(tl.maximum(w, -0.5))
    far = logaddexp64(log64(-expm1_64(beta * gap)), beta * (gap + delta))
    return tl.where(w > -0.5, near, far) / beta


@device
def top_values(lp, finite, beta, delta, top):
    """`primal.top_values`: beta < 0, every column's value at delta (zero entries stay 0):
    (log q, d log q / d delta = (q_1 / q)^beta, log(q / p))."""
    lift = top_lift(lp, top, beta, delta)
    log_q = tl.where(finite, lp + lift, float("-inf"))
    rate = tl.where(finite, nan_to_num64(exp64(beta * (top + delta - log_q))), 0.0)
    return log_q, rate, tl.where(finite, lift, log_q)


@device
def primal_values(lp, finite, beta, s, up, top):
    """`primal.primal_values`: the values at the scalar s: the water level (``up``, beta > 0) or
    s = log delta (beta < 0; the rate per unit of log delta)."""
    if up:
        log_q, rate, lift = level_values(lp, finite, beta, s)
    else:
        delta = exp64(s)
        log_q, rate, lift = top_values(lp, finite, beta, delta, top)
        rate = rate * delta
    return log_q, rate, lift


# ----------------------------------------------------------------------------- dual values


@device
def inner_terms(beta, z):
    """`dual._inner_terms`: H(e^z) = beta y + log(1 - e^-y) and dH/dz = beta y + y / expm1(y),
    y = e^z; their expansions below z = -700. Returns (H, dH/dz, y)."""
    y = exp64(z)
    em1 = expm1_64(y)
    linear = beta * y
    tiny = z < -700.0
    big = tl.where(tiny, 1.0, y)
    value = tl.where(tiny, z - 0.5 * y, log64(-expm1_64(-big))) + linear
    slope = tl.where(tiny, 1.0 - 0.5 * y, big / tl.where(tiny, 1.0, em1)) + linear
    return value, slope, y


@device
def inner_bracket(beta, target):
    """`dual._inner_bracket`: [low, high] of the inner root z."""
    low = tl.minimum(target - beta, 0.0)
    high = log64(tl.maximum((target - LOG1MEXP_AT_ONE) / beta, 1.0))
    return low, high


@device
def shaped_inner(beta, target):
    """`dual._shaped_inner`: z of u = softplus(t + log beta) / beta (the primal map of the same
    alpha at c = beta nu), exact at both ends of t."""
    shifted = target + log64(beta)
    rise = softplus64(shifted) / beta
    return tl.where(shifted < -30.0, target, log64(rise))


@device
def inner_upper(beta, target):
    """`dual._inner_upper`: log of an upper end of the inner root (Lambert's W <= log1p)."""
    shifted = target - LOG1MEXP_AT_ONE
    bound = tl.maximum(softplus20(log64(beta) + shifted), shifted)
    return log64(tl.maximum(bound, 1e-300)) - log64(beta)


@device
def inner_rate(beta, u, finite):
    """`dual._inner_rate`: d log q / ds = expm1(u) / (beta expm1(u) + 1), u = log(q / p);
    zero entries 1 / beta."""
    em1 = expm1_64(u)
    return tl.where(finite, em1 / (beta * em1 + 1.0), 1.0 / beta)


@device
def inner_step(beta, z, u, step, target, clamp):
    """`dual._inner_step`: z after a Newton step (in z): taken in u = e^z where H is close to
    linear in u (beta u >= 1 or u >= 1), in z elsewhere; with ``clamp``, into the bracket."""
    linear = (beta * u >= 1.0) | (u >= 1.0)
    z_new = z + tl.where(linear, log1p64(tl.maximum(step, -0.99)), step)
    z_new = tl.where(isfinite64(z_new), z_new, z)
    low, high = inner_bracket(beta, target)
    return tl.where(clamp, tl.minimum(tl.maximum(z_new, low), high), z_new)


@device
def inner_steps(beta, lp, s, z, steps, tolerance, active):
    """`dual._inner_steps`: at most ``steps`` Newton steps of the inner equations at s, until
    none moves a log q (over the ``active`` columns) by more than ``tolerance``. Returns (z,
    whether the last step was within it)."""
    target = s - beta * lp
    done = steps < 0  # (False)
    taken = steps * 0
    while (taken < steps) & ~done:
        value, slope, u = inner_terms(beta, z)
        step = (target - value) / slope
        moves = tl.max(tl.where(active, tl.abs(step * u), 0.0), axis=0)
        z = inner_step(beta, z, u, step, target, moves > 0.1)
        done = moves <= tolerance
        taken += 1
    return z, done


@device
def values_at(lp, finite, beta, s, z):
    """`dual.values_at`: the values at s from the inner unknowns z (zero entries q =
    nu^(1/beta)): (log q, rate, log(q / p))."""
    u = exp64(z)
    log_q = tl.where(finite, lp + u, s / beta)
    return log_q, inner_rate(beta, u, finite), tl.where(finite, u, log_q)


@device
def closed_lift(closed, lp, finite, s):
    """`dual._closed_lift`: log(q / p) of the quadratic inner roots (`dual.quadratic_root`)
    from the added mass: alpha = 3/2, sqrt(q) - sqrt(p) = (nu + nu^2 / (R + 2 sqrt(p))) / 2;
    alpha = 3, q - p = 2 nu / (R + p). Zero entries: log q."""
    nu = exp64(s)
    p = tl.where(finite, exp64(lp), 0.0)
    if closed == DUAL_THREE_HALVES:
        half = sqrt64(p)
        root = quadratic_root(nu, 2.0 * half)
        scale = root + 2.0 * half
        rise = 0.5 * (nu + nu * nu / tl.where(scale > 0, scale, 1.0))
        added = rise * (rise + 2.0 * half)
    else:
        root = quadratic_root(p, 2.0 * sqrt64(nu))
        scale = root + p
        added = 2.0 * nu / tl.where(scale > 0, scale, 1.0)
    return tl.where(finite, log1p64(added / tl.where(finite, p, 1.0)), log64(added))


@device
def closed_values(closed, lp, finite, beta, s):
    """The quadratic duals' values at s (`dual.dual_values` with ``closed``)."""
    lift = closed_lift(closed, lp, finite, s)
    u = tl.where(finite, lift, 0.0)
    return tl.where(finite, lp + u, lift), inner_rate(beta, u, finite), lift


@device
def dual_values(closed, lp, finite, beta, s, z, steps, active):
    """`dual.dual_values`: every column's value at s = log nu, the inner roots by at most
    ``steps`` Newton steps from z (NaN: the shaped start), or the quadratic formulas
    (``closed`` a family code, else 0); and whether they are exact (`dual.EXACT_STEP`).
    Returns (log q, rate, lift, z, exact)."""
    if closed != 0:
        log_q, rate, lift = closed_values(closed, lp, finite, beta, s)
        exact = steps >= 0
    else:
        target = s - beta * lp
        shaped = tl.minimum(shaped_inner(beta, target), inner_upper(beta, target))
        z = tl.where(z != z, shaped, z)
        z, exact = inner_steps(beta, lp, s, z, steps, EXACT_STEP, active)
        log_q, rate, lift = values_at(lp, finite, beta, s, z)
    return log_q, rate, lift, z, exact


# ----------------------------------------------------------------------------- scalar ranges


@device
def level_range(top, beta, log_r, k):
    """`primal.level_range`: the water level of size k: a lower bound, a start (q_1 at its KL
    value p_1 / S) and the level of size 1 (an upper bound of every size's)."""
    log_ratio = log_r - log64(k.to(tl.float64))
    low = tl.where(beta >= 1, log_ratio, (log64(beta) + log_ratio) / beta)
    high = top + log_expm1_64(-beta * top) / beta
    kl = top + log_expm1_64(-beta * log1p64(-exp64(log_r))) / beta
    return low, tl.maximum(tl.minimum(kl, high), low), high


@device
def top_range(top, log_r):
    """`primal.top_range`: log delta of size k: delta >= -log(1 - R) (a lower bound and the
    start), delta <= -log p_1 (size 1's)."""
    low = log64(-log1p64(-exp64(log_r)))
    return low, low, log64(-top)


@device
def outer_bracket(lp, finite, mask, beta, log_r, k, top):
    """`dual._outer_bracket`: a bracket [low, high] of s = log nu of the support ``mask`` and a
    start inside it (`outer_ends`, from the support's sums)."""
    log_ratio = log_r - log64(k.to(tl.float64))
    log_power_sum = logsumexp64((1.0 - beta) * lp, finite & mask)
    has_zero = tl.max((mask & ~finite).to(tl.int32), axis=0) > 0
    shifted = logsumexp64((1.0 - beta) * logaddexp64(lp, log_ratio), mask)
    return outer_ends(beta, log_r, k, top, log_power_sum, has_zero, shifted)


@device
def outer_ends(beta, log_r, k, top, log_power_sum, has_zero, shifted):
    """`outer_bracket` from the support's sums: log sum q^(1 - alpha) at q = p (``log_power_sum``,
    finite entries), whether a zero entry is in it, and log sum (p + R/k)^(1 - alpha)
    (``shifted``; nu = R / sum_i q_i^(2 - alpha) at the alpha = 2 solution q = p + R/k is the
    start)."""
    log_ratio = log_r - log64(k.to(tl.float64))
    below_two = beta < 1.0
    low = tl.where(below_two, log_ratio, beta * log_ratio)
    low = tl.where(below_two | has_zero, low, tl.maximum(low, log_r - log_power_sum))
    high = tl.where(below_two, log_r - log_power_sum, log_ratio)
    low, high = tl.minimum(low, high), tl.maximum(low, high)
    high = tl.minimum(high, log1p64(-exp64(top)))
    low = tl.where(k == 1, high, tl.minimum(low, high))  # (size 1: q_1 = 1, given)
    start = log_r - shifted
    return low, high, tl.where((start > low) & (start < high), start, high)


@device
def scalar_range(kind, lp, finite, beta, deficit, size, positions):
    """`search._ends`: the scalar of ``size``: a lower bound, a start near it; and an upper
    bound of every size's scalar (size 1's)."""
    log_r = log64(at(deficit, positions, size - 1))
    top = at(lp, positions, 0)
    if kind == 1:
        low, start, high = level_range(top, beta, log_r, size)
    elif kind == 2:
        low, start, high = top_range(top, log_r)
    else:
        low, _, start = outer_bracket(lp, finite, positions < size, beta, log_r, size, top)
        high = log1p64(-exp64(top))
    return low, start, high


# ----------------------------------------------------------------------------- probes


@device
def probe(dual, kind, closed, log_p, lp, finite, p, deficit, alpha, log_lam, s, z, steps,
          columns, positions):
    """`search._probe`: one probe at s over the first ``columns`` candidates: every
    candidate's value; n, the sizes whose scalars surely lie above s (the mass added at s short
    of R_k by more than its rounding), and c, the entries whose terms surely exceed lambda,
    bracket k* in [min(n, c), max(n + 1, c)] (none where the values are not exact); D(s) =
    log w_(m+1)(s) - log lambda at the size m whose scalar s is, and a Newton step on it
    aimed just across its root. Returns (low, high, m, D, step, exact, z, rate)."""
    beta = alpha - 1.0
    active = positions < columns
    if kind == 0:
        log_q, rate, lift, z, exact = dual_values(closed, lp, finite, beta, s, z, steps, active)
    else:
        log_q, rate, lift = primal_values(lp, finite, beta, s, kind == 1,
                                          at(lp, positions, 0))
        exact = steps >= -1000000  # (True)
    q = exp64(log_q)
    added = tl.cumsum(tl.where(active, tl.where(finite, p * expm1_64(lift), q), 0.0), 0)
    margin = deficit * (SUM_ROUNDING * columns.to(tl.float64) + 1e-15)
    above_s = tl.sum((active & (added < deficit - margin)).to(tl.int64), axis=0)
    maybe = tl.sum((active & (added < deficit + margin)).to(tl.int64), axis=0)
    log_w = log_entry_term(dual, log_p, log_q, alpha)
    tolerance = TERM_ROUNDING * (1.0 + tl.abs(log_lam))
    exceeds = tl.sum((active & (log_w > log_lam + tolerance)).to(tl.int64), axis=0)
    may_exceed = tl.sum((active & (log_w > log_lam - tolerance)).to(tl.int64), axis=0)
    low = tl.where(exact, tl.minimum(above_s, exceeds), 0)
    known = (maybe < columns) & (may_exceed < columns) & exact
    high = tl.where(known, tl.maximum(maybe + 1, may_exceed), UNBOUNDED)
    size = tl.sum((active & (added < deficit)).to(tl.int64), axis=0) + 1
    m = tl.minimum(tl.maximum(size, 1), columns - 1)
    residual = at(log_w, positions, m) - log_lam
    finite_m = at(finite.to(tl.int32), positions, m) != 0
    slope_q = term_slope(dual, alpha, at(lift, positions, m), finite_m) * at(rate, positions, m)
    moves = -tl.sum(tl.where(positions < m, q * rate, 0.0), axis=0) / at(q, positions, m)
    # (d log w_j / d j over a stencil of about m / 64 entries)
    reach = tl.maximum(m // 64, 1)
    ahead = tl.minimum(m + reach, columns - 1)
    behind = tl.maximum(m - reach, 0)
    per_entry = (at(log_w, positions, ahead) - at(log_w, positions, behind)) / \
        (ahead - behind).to(tl.float64)
    slope = slope_q + per_entry * moves
    target = tl.where(residual > 0, -STRADDLE, STRADDLE)
    step = tl.where(size < columns, (target - residual) / slope, float("nan"))
    return low, high, m, residual, step, exact, z, rate


@device
def warm(z, rate, old, new):
    """`search._warm`: the dual's inner unknowns at a new s, to first order; NaN where the step
    is too long for it."""
    u = exp64(z)
    moved = u + rate * (new - old)
    return tl.where(moved > 0.5 * u, log64(tl.maximum(moved, 1e-300)), float("nan"))


@device
def probes(dual, kind, closed, log_p, lp, finite, p, deficit, alpha, log_lam, low, high,
           positions, C: tl.constexpr):
    """`search._search`: probes on the multiplier for one row until its bracket [low, high] of
    k* is one size wide, or at most `SETTLE` wide and no longer narrowing (or three probes in
    a row), or known to pass the candidates, or pointed past them; each next s a Newton step
    on D inside the bracket of s its signs keep, else Illinois regula falsi. Returns (low,
    high, the last probe's scalar, the dual's inner unknowns there, whether an exact probe's
    scalar lay below every candidate size's with k* possibly past them)."""
    beta = alpha - 1.0
    top_size = tl.maximum(tl.minimum(high, C) - 1, 1)
    s_low, _, s_high = scalar_range(kind, lp, finite, beta, deficit, top_size, positions)
    _, s, _ = scalar_range(kind, lp, finite, beta, deficit,
                           tl.minimum(tl.maximum(low, 1), top_size), positions)
    s = tl.minimum(tl.maximum(s, s_low), s_high)
    last = s
    nan = tl.full((), float("nan"), tl.float64)
    z = tl.full([C], float("nan"), tl.float64)
    state = z
    d_low = nan
    d_high = nan
    above = low < 0  # (False)
    stale = low * 0
    steps = tl.full((), STEER_STEPS, tl.int32)  # (the dual's first probes only steer)
    steering = steps >= 0  # (True)
    columns = low * 0 + C
    count = tl.full((), 0, tl.int32)
    go = count == 0
    wider = count != 0  # (False)
    while go:
        found_low, found_high, m, residual, step, exact, z_now, rate = probe(
            dual, kind, closed, log_p, lp, finite, p, deficit, alpha, log_lam, s, z, steps,
            columns, positions)
        # (the counts bound k* without the cap; a capped row's k* is min(k*, cap), Theorem 3.3)
        hi = tl.minimum(high, found_high)
        lo = tl.minimum(tl.maximum(low, found_low), hi)
        narrowed = (lo > low) | (hi < high)
        low = lo
        high = hi
        last = s
        state = z_now
        # D increases with s; only exact values move the bracket of s (steering ones may put
        # D's root elsewhere). (Illinois: an end kept twice in a row counts half.)
        up = (residual > 0) & exact
        down = (residual <= 0) & exact
        d_low = tl.where(up & above, 0.5 * d_low, d_low)
        d_high = tl.where(down & ~above, 0.5 * d_high, d_high)
        s_high = tl.where(up, s, s_high)
        d_high = tl.where(up, residual, d_high)
        s_low = tl.where(down, s, s_low)
        d_low = tl.where(down, residual, d_low)
        above = tl.where(exact, up, above)
        proposal = s + step
        inside = (proposal > s_low) & (proposal < s_high)
        share = tl.minimum(tl.maximum(d_low / (d_low - d_high), 0.05), 0.95)
        share = tl.where(share != share, 0.5, share)
        stale = tl.where(narrowed | ~exact, 0, stale + 1)
        # (a steering probe with no step in the bracket probes again where it is, exactly)
        fallback = tl.where(exact, s_low + share * (s_high - s_low), s)
        s_next = tl.where(inside, proposal, fallback)
        count += 1
        # (D is not known past the candidates: the probes cannot settle a k* there, where an
        # exact probe's D points (at their end, or its Newton step below every candidate
        # size's scalar))
        wider = exact & (residual > 0) & (hi > C) & (((m >= C - 1) & (columns == C)) | (
            ~steering & (proposal < s_low) & (d_low != d_low)))
        go = (hi - lo > 1) & (narrowed | ((hi - lo > SETTLE) & (stale < 3))) & ~wider & \
            (s_high - s_low > 1e-14 * (1.0 + tl.abs(s))) & ((hi <= C) | (lo < C - 1)) & \
            (count < PROBES)
        if (kind == 0) & (closed == 0):
            z = warm(z_now, rate, s, s_next)
        # (columns past the bracket's end play no part in the next probes)
        columns = tl.minimum(hi + 2, C)
        # (the first probe that solves the inner roots goes on until they are exact; steering
        # ends near the root, or soon)
        solve = (tl.abs(residual) < STEER) | (count >= STEERING)
        steps = tl.where(steering, tl.where(solve, INNER_STEPS, STEER_STEPS), PROBE_STEPS)
        steering = steering & ~solve
        s = s_next
    return low, high, last, state, wider


# ----------------------------------------------------------------------------- maps


@device
def support_mass(deficit, log_mass):
    """log S_k, the support's mass: log(1 - R_k) where R_k < 1/2, else from the support's own
    log-sum-exp (``log_mass``), whichever is the more accurate."""
    return tl.where(deficit < 0.5, log1p64(-tl.minimum(deficit, 0.5)), log_mass)


@device
def level_ends(top, beta, log_r, k, log_s, cap):
    """`level_map`'s bracket of the water level of size k and its first value: the KL start
    (q_1 at p_1 / S_k; ``log_s`` = log S_k) held below ``cap`` (the water-filling level, or
    +inf). Returns (low, high, first)."""
    log_ratio = log_r - log64(k.to(tl.float64))
    low = tl.where(beta >= 1, log_ratio, (log64(beta) + log_ratio) / beta)
    high = top + log_expm1_64(-beta * top) / beta
    first = top + log_expm1_64(-beta * log_s) / beta
    first = tl.where(beta < 1, tl.minimum(first, log_ratio), first)
    first = tl.minimum(tl.minimum(first, high), cap)
    low = tl.where(k == 1, high, tl.minimum(low, first))  # (size 1: q_1 = 1, given)
    return low, high, first


@device
def top_ends(top, log_s, k):
    """`top_map`'s bracket of delta for size k, [0, -log p_1], and its first value, the KL
    value -log S_k. Returns (low, high, first)."""
    high = tl.maximum(-top, 0.0)
    low = tl.where(k == 1, high, 0.0)  # (size 1: q_1 = 1, given)
    return low, high, tl.minimum(tl.maximum(-log_s, 0.0), high)


@device
def level_map(lp, finite, beta, log_r, k, start, positions, C: tl.constexpr):
    """`primal.primal_multiplier`, beta > 0: the water level of the support of size k by
    safeguarded Newton on sum_i (q_i - p_i) = R (positive terms), from the KL start (or the
    water-filling level, or ``start`` where it lies inside the bracket)."""
    mask = positions < k
    fin = finite & mask
    deficit = exp64(log_r)
    top = at(lp, positions, 0)
    log_s = support_mass(deficit, logsumexp64(lp, fin))
    water = water_level(tl.where(fin, exp64(lp), 0.0), log_r, k.to(tl.float64), positions, C)
    low, high, first = level_ends(top, beta, log_r, k, log_s, log64(water))
    tau = tl.where((start > low) & (start < high), start, first)
    closed = high <= low
    previous = tl.full((), float("inf"), tl.float64)
    done = closed & (k < 0)  # (False)
    taken = tl.full((), 0, tl.int32)
    while (taken < MAX_ITERATIONS) & ~done:
        z = beta * (tau - lp)
        rise = softplus64(z) / beta
        q = tl.where(mask, exp64(tl.where(fin, lp + rise, tau)), 0.0)
        value = tl.sum(tl.where(fin, exp64(lp) * expm1_64(rise), q), axis=0) - deficit
        slope = tl.sum(q * tl.where(fin, sigmoid64(z), 1.0), axis=0)
        tau, done, low, high = newton_update(tau, value, slope, NEWTON_TOLERANCE * deficit,
                                             previous, low, high, closed)
        previous = value
        taken += 1
    return tau


@device
def top_map(log_p, lp, finite, beta, log_r, k, start, positions):
    """`primal.primal_multiplier`, beta < 0: delta = log q_1 - log p_1 of the support of size k
    on [0, -log p_1] by safeguarded Newton, from the KL value -log S (or ``start``)."""
    mask = positions < k
    fin = finite & mask
    deficit = exp64(log_r)
    top = at(lp, positions, 0)
    low, high, first = top_ends(top, support_mass(deficit, logsumexp64(lp, fin)), k)
    delta = tl.where((start > low) & (start < high), start, first)
    closed = high <= low
    previous = tl.full((), float("inf"), tl.float64)
    done = closed & (k < 0)
    taken = tl.full((), 0, tl.int32)
    while (taken < MAX_ITERATIONS) & ~done:
        rise = top_lift(log_p, top, beta, delta)
        log_q = tl.where(fin, log_p + rise, float("-inf"))
        q = exp64(log_q)
        value = tl.sum(tl.where(fin, exp64(lp) * expm1_64(rise), q), axis=0) - deficit
        weights = nan_to_num64(exp64(beta * (top + delta - log_q)))
        slope = tl.sum(tl.where(mask, q * weights, 0.0), axis=0)
        delta, done, low, high = newton_update(delta, value, slope, NEWTON_TOLERANCE * deficit,
                                               previous, low, high, closed)
        previous = value
        taken += 1
    return delta


@device
def inner_solve(beta, target, z):
    """`dual._inner_solve`: H(e^z) = target for z, elementwise, by safeguarded Newton from z
    (clamped into `inner_bracket`), until every column is converged."""
    low, high = inner_bracket(beta, target)
    z = tl.where((z > low) & (z < high), z, 0.5 * (low + high))
    closed = high <= low
    previous = tl.zeros_like(z) + float("inf")
    finished = tl.max(closed.to(tl.int32), axis=0) < 0  # (False)
    taken = tl.full((), 0, tl.int32)
    while (taken < MAX_ITERATIONS) & ~finished:
        value, slope, y = inner_terms(beta, z)
        residual = value - target
        tolerance = 4e-16 * (1.0 + tl.abs(target) + beta * y)
        z, done, low, high = newton_update(z, residual, slope, tolerance, previous, low, high,
                                           closed)
        previous = residual
        finished = tl.min(done.to(tl.int32), axis=0) > 0
        taken += 1
    return z


@device
def added_mass(lp, finite, mask, log_q, rate, lift):
    """The mass a map adds to the support ``mask`` (from positive terms: p (e^lift - 1) for
    each entry, q for zero entries) and its derivative in the map's scalar (sum q d log q /
    ds): the function and slope of every map's Newton solve."""
    q = tl.where(mask, exp64(log_q), 0.0)
    added = tl.where(finite, exp64(lp) * expm1_64(lift), q)
    return (tl.sum(tl.where(mask, added, 0.0), axis=0),
            tl.sum(tl.where(mask, q * rate, 0.0), axis=0))


@device
def dual_map(closed, lp, finite, beta, log_r, k, start, z, positions):
    """`dual._nested` (Algorithm 1; `dual.dual_multiplier` for the quadratic families): s =
    log nu of the support of size k by safeguarded Newton on the mass added to the support
    minus R (convex, increasing in s), every inner root solved at each s, warm-started to first
    order from the last (or the quadratic formulas, ``closed``), from ``start`` where it lies in
    `outer_bracket`. Returns (s, z at s)."""
    mask = positions < k
    deficit = exp64(log_r)
    top = at(lp, positions, 0)
    low, high, first = outer_bracket(lp, finite, mask, beta, log_r, k, top)
    s = tl.where((start > low) & (start < high), start, first)
    target = s - beta * lp
    shaped = tl.minimum(shaped_inner(beta, target), inner_upper(beta, target))
    z = tl.where(z != z, shaped, z)
    closed_bracket = high <= low
    previous = tl.full((), float("inf"), tl.float64)
    done = closed_bracket & (k < 0)
    taken = tl.full((), 0, tl.int32)
    while (taken < MAX_ITERATIONS) & ~done:
        if closed != 0:
            y = closed_lift(closed, lp, finite, s)
        else:
            target = s - beta * lp
            z = inner_solve(beta, target, tl.minimum(z, inner_upper(beta, target)))
            y = exp64(z)
        rate = inner_rate(beta, y, finite)
        added, slope = added_mass(lp, finite, mask, tl.where(finite, lp + y, s / beta), rate, y)
        value = added - deficit
        s_new, done, low, high = newton_update(s, value, slope, NEWTON_TOLERANCE * deficit,
                                               previous, low, high, closed_bracket)
        previous = value
        # (the inner roots at the new s, to first order: dy/ds = rate)
        predicted = y + rate * (s_new - s)
        z = tl.where(predicted > 0.5 * y, log64(tl.maximum(predicted, 1e-300)), z)
        s = s_new
        taken += 1
    if closed == 0:
        target = s - beta * lp
        z = inner_solve(beta, target, z)
    return s, z


@device
def solve_map(kind, closed, log_p, lp, finite, alpha, deficit, k, start, z, positions,
              C: tl.constexpr):
    """`maps.solved`: the map of support size k by its scalar, with every column's value at
    that scalar (past the support: what eq. (4) or (5) gives the entry); ``start`` / ``z``: a
    nearby scalar and (dual) inner unknowns (NaN: none). No mass outside the support (R = 0):
    the identity. Returns (s, log q unnormalized, log(q / p), z)."""
    beta = alpha - 1.0
    log_r = log64(at(deficit, positions, k - 1))
    if log_r == float("-inf"):
        s = tl.full((), float("-inf"), tl.float64)
        log_q = log_p
        lift = tl.where(finite, 0.0, float("-inf")).to(tl.float64)
    elif kind == 1:
        s = level_map(lp, finite, beta, log_r, k, start, positions, C)
        log_q, _, lift = level_values(lp, finite, beta, s)
    elif kind == 2:
        s = top_map(log_p, lp, finite, beta, log_r, k, start, positions)
        log_q, _, lift = top_values(lp, finite, beta, s, at(lp, positions, 0))
    else:
        s, z = dual_map(closed, lp, finite, beta, log_r, k, start, z, positions)
        if closed != 0:
            log_q, _, lift = closed_values(closed, lp, finite, beta, s)
        else:
            log_q, _, lift = values_at(lp, finite, beta, s, z)
    return s, log_q, lift, z


# ----------------------------------------------------------------------------- exact gaps


@device
def primal_log_gap(log_q, log_q_next, m, alpha, rho, positions):
    """`gaps.primal_log_gap`: log G(m) = log [sum_(i<=m) d(q_i, q'_i) + q'_(m+1)^alpha / alpha]
    (the Bregman Pythagorean identity, eqs. (15)-(16)) from log T_m and log T_(m+1), with
    rho_i = log(q_i / q'_i) exact from the maps' multipliers."""
    inside = positions < m
    rho = tl.where(inside & isfinite64(rho), rho, 0.0)
    terms = alpha * log_q_next + alpha_kernel(alpha, rho)
    added = at(log_q_next, positions, m)
    last = alpha * added - log64(alpha)
    return logaddexp64(logsumexp64(terms, inside), last)


@device
def dual_log_gap(log_p, log_q, log_q_next, m, alpha, rho, positions):
    """`gaps.dual_log_gap`: log G*(m), a sum of nonnegative brackets R_i = beta q'^alpha
    K_alpha(rho) + (2 - alpha) p q'^beta K_beta(rho) over the support and the last entry's
    term (`log_entry_term`)."""
    inside = positions < m
    b = alpha - 1.0
    rho = tl.where(inside & isfinite64(rho), rho, 0.0)
    lp = tl.where(inside, log_p, 0.0)
    first = log64(b) + alpha * log_q_next + alpha_kernel(alpha, rho)
    second = log64(tl.abs(2.0 - alpha)) + lp + b * log_q_next + alpha_kernel(b, rho)
    log_terms = tl.where(alpha <= 2.0, logaddexp64(first, second), logsubexp64(first, second))
    last = log_entry_term(1, at(log_p, positions, m), at(log_q_next, positions, m), alpha)
    return logaddexp64(logsumexp64(log_terms, inside), last)


@device
def decide_gap(dual, log_p, alpha, log_lam, m, log_q, lift, log_q_next, lift_next,
               positions):
    """One gap of `gaps.consecutive_gaps`: log G(m), or a bound of it on the same side of log
    lambda, from the unnormalized maps T_m and T_(m+1): G(m) <= w_(m+1)(s_m) and G(m) >=
    w_(m+1)(s_(m+1)) decide most; the exact formulas the others."""
    p_next = at(log_p, positions, m)
    upper = log_entry_term(dual, p_next, at(log_q, positions, m), alpha)
    lower = log_entry_term(dual, p_next, at(log_q_next, positions, m), alpha)
    if upper <= log_lam:
        value = upper
    elif lower > log_lam:
        value = lower
    else:
        rho = lift - lift_next
        lq = normalized(log_q, positions < m)
        lqn = normalized(log_q_next, positions < m + 1)
        if dual:
            value = dual_log_gap(log_p, lq, lqn, m, alpha, rho, positions)
        else:
            value = primal_log_gap(lq, lqn, m, alpha, rho, positions)
    return value


@device
def settle(dual, kind, closed, log_p, lp, finite, deficit, alpha, log_lam, low, high, s, z,
           positions, C: tl.constexpr):
    """`search._settle`: the smallest k in [low, high] with G(k) <= lambda (or high) by exact
    gaps: where at most `SETTLE` sizes are left, the gap at the bracket's low end (the next
    size's map is the one kept); else Algorithm 2's binary search. Each gap G(m) from the map
    of m + 1 first (its own bound), then that of m. Returns (k, the map T_k normalized where a
    gap's maps held it, whether they did)."""
    held = low * 0 - 1  # the size of the map in hand (``held_*``)
    held_s = s
    held_z = z
    held_q = tl.full([C], float("-inf"), tl.float64)
    held_lift = held_q
    answer = held  # the size of ``answer_q``
    answer_q = held_q
    while low < high:
        span = high - low
        m = tl.where(span <= SETTLE, low, low + span // 2)
        m = tl.minimum(tl.minimum(m, high - 1), C - 1)  # (T_(m + 1) exists)
        # The map of m + 1 first: its own bound G(m) >= w_(m+1)(s_(m+1)) > lambda decides
        # most such gaps without the map of m.
        s_next, q_next, lift_next, z_next = solve_map(
            kind, closed, log_p, lp, finite, alpha, deficit, m + 1, held_s, held_z, positions, C)
        value = log_entry_term(dual, at(log_p, positions, m), at(q_next, positions, m), alpha)
        if value <= log_lam:
            if held != m:
                held_s, held_q, held_lift, held_z = solve_map(
                    kind, closed, log_p, lp, finite, alpha, deficit, m, s_next, z_next,
                    positions, C)
            value = decide_gap(dual, log_p, alpha, log_lam, m, held_q, held_lift, q_next,
                               lift_next, positions)
        if value > log_lam:
            low = m + 1
            if low == high:
                answer = low
                answer_q = normalized(q_next, positions < low)
        else:
            high = m
            if low == high:
                answer = m
                answer_q = normalized(held_q, positions < m)
        held = m + 1
        held_s = s_next
        held_q = q_next
        held_lift = lift_next
        held_z = z_next
    return low, answer_q, answer == low


# ----------------------------------------------------------------------------- one row


@device
def search_row(dual, closed, alpha, lam, x, log_x, deficit, low, limit, positions,
               C: tl.constexpr):
    """`search.support_sizes` and `search._search_rows` for one adaptive row without a closed-form
    gap, on its C candidates (``low``: a certified lower bound on k*; ``limit``: min(k_max,
    the positive entries)): the floor of the gaps, the probes, the exact gaps, the map of k*.
    Returns (k, log T_k normalized, whether k* is decided here; if not, k is a certified lower
    bound: k* passes the candidates)."""
    finite = isfinite64(log_x)
    lp = tl.where(finite, log_x, 0.0)
    log_lam = log64(lam)
    kind = tl.where(dual, 0, tl.where(alpha > 1.0, 1, 2))
    lo = tl.minimum(tl.maximum(low, 1), limit)
    hi = limit
    # The floor: every scalar is at least that of no deficit (q = p), so an entry whose term
    # exceeds lambda there has G(j - 1) > lambda.
    floor = log_entry_term(dual, log_x, log_x, alpha)
    tolerance = TERM_ROUNDING * (1.0 + tl.abs(log_lam))
    count = tl.sum((floor > log_lam + tolerance).to(tl.int64), axis=0)
    lo = tl.maximum(lo, tl.minimum(count, hi))
    s = tl.full((), float("nan"), tl.float64)
    z = tl.full([C], float("nan"), tl.float64)
    wider = lo < 0  # (False)
    if (hi - lo > 1) & ((hi <= C) | (lo < C - 1)):
        lo, hi, s, z, wider = probes(dual, kind, closed, log_x, lp, finite, x, deficit, alpha,
                                     log_lam, lo, hi, positions, C)
        if kind == 2:
            s = exp64(s)  # (the map's solver takes delta itself)
    past = ((hi > C) & (lo >= C - 1)) | wider
    hi = tl.minimum(hi, C)
    k = lo
    log_q = tl.full([C], float("-inf"), tl.float64)
    have = k < 0  # (False)
    if past == 0:
        k, log_q, have = settle(dual, kind, closed, log_x, lp, finite, deficit, alpha, log_lam,
                                lo, hi, s, z, positions, C)
    done = ~past & ((k < C) | (limit <= C))
    if done & ~have:
        _, raw, _, _ = solve_map(kind, closed, log_x, lp, finite, alpha, deficit, k, s, z,
                                 positions, C)
        log_q = normalized(raw, positions < k)
    return k, log_q, done


@device
def fixed_map(dual, closed, alpha, log_x, deficit, k, positions, C: tl.constexpr):
    """`maps.log_renorm` for a fixed size k of a family without a closed-form map (the general
    primal and dual maps, the quadratic duals): log T_k normalized."""
    finite = isfinite64(log_x)
    lp = tl.where(finite, log_x, 0.0)
    kind = tl.where(dual, 0, tl.where(alpha > 1.0, 1, 2))
    nan = tl.full((), float("nan"), tl.float64)
    _, raw, _, _ = solve_map(kind, closed, log_x, lp, finite, alpha, deficit, k, nan,
                             tl.full([C], float("nan"), tl.float64), positions, C)
    return normalized(raw, positions < k)
