"""Dual alpha-renormalization T*_alpha on a fixed support (arXiv 2505.19371: eq. (5), Theorem A.1).

The dual map solves min_{q in simplex} sum_i d_phi(p_i, q_i). For phi_alpha, eq. (5) reads

    q_i^(alpha-2) (q_i - p_i) = nu   for every i in the support,   sum_i q_i = 1,   nu > 0,

so each q_i is the unique root above p_i of an increasing function (dual validity, alpha > 1).
Closed forms: alpha = 1 and alpha = 2 coincide with the primal maps (q = p/S and q = p + R/k), and
alpha = +inf is water-filling (Appendix G.3). Every other alpha > 1 is solved in log space with
the unknowns of Algorithm 1:

  * outer: s = log nu, bracketed by nu in [R/k, R / sum_i p_i^(2-alpha)] (1 < alpha < 2) or
    nu in [max((R/k)^(alpha-1), R / sum_i p_i^(2-alpha)), R/k] (alpha > 2), from bounds on
    q_i^(2-alpha), and by nu <= 1 - max_i p_i (proof of Theorem A.1); the constraint written
    as the mass the map adds to the support, sum_i (q_i - p_i) = R (positive terms: exact to a
    few ulps of R however small R is);
  * inner: y_i = log(q_i / p_i) > 0 solves
    H(y) = (alpha-1) y + log(1 - e^-y) = s - (alpha-1) log p_i, with H increasing from -inf to
    +inf, in z = log y.

`dual_multiplier` runs Newton on all of them at once (`_joint_newton`: the Jacobian is an
arrow, one pass over the support per step) from a neighbouring solve or a shaped start, and
falls back to the nested root finding of Algorithm 1 (`_nested`: outer Newton on s, an inner
safeguarded Newton per entry at every outer step) for a row that does not converge. It also
gives the value the same nu gives each entry past the support (`roots.Multiplier`), and the
same values at any trial nu (`dual_values`), which the search probes with (`search`).

Zero entries in the support get q_i = nu^(1/(alpha-1)). ``log_p`` is ``[..., K]`` sorted
decreasingly; ``k`` gives the support size of each row; the result is log q, -inf off the support.
"""

from __future__ import annotations

import math

import torch

from .families import Family
from .numerics import logsumexp_masked
from .primal import normalized, support_mask
from .roots import NEWTON_TOLERANCE, Multiplier, converged, safeguarded_newton

Tensor = torch.Tensor

_LOG1MEXP_AT_ONE = math.log(1.0 - math.exp(-1.0))
_LOG_100 = math.log(100.0)


def _inner_terms(beta: Tensor, z: Tensor, expm1: bool = False, above: float | None = None
                 ) -> tuple[Tensor, Tensor, Tensor] | tuple[Tensor, Tensor, Tensor, Tensor]:
    """H(e^z) = beta y + log(1 - e^-y) and dH/dz = beta y + y / expm1(y), with y = e^z (and
    expm1(y), with ``expm1``). ``above``: a lower bound on z the caller knows (no host read
    for the expansion branch when it is above -700).

    log(-expm1(-y)) is exact to absolute rounding, all H needs (its tolerance is absolute), and
    both are exact to relative rounding down to the smallest normal y. Below it (z < -700:
    z reaches -1000 for alpha = 1000) the expansions log(1 - e^-y) = z - y/2 + O(y^2) and
    y / expm1(y) = 1 - y/2 + O(y^2) replace them.
    """
    y = torch.exp(z)
    em1 = torch.expm1(y)
    linear = beta * y
    tiny = z < -700.0
    if (above is not None and above >= -700.0) or not bool(tiny.any()):
        # the common case: skip the expansion branch
        value, slope = torch.log(-torch.expm1(-y)) + linear, y / em1 + linear
    else:
        big = torch.where(tiny, 1.0, y)
        value = torch.where(tiny, z - 0.5 * y, torch.log(-torch.expm1(-big))) + linear
        slope = torch.where(tiny, 1.0 - 0.5 * y, big / torch.where(tiny, 1.0, em1)) + linear
    return (value, slope, y, em1) if expm1 else (value, slope, y)


def _inner_solve(beta: Tensor, target: Tensor, z: Tensor, low: Tensor, high: Tensor) -> Tensor:
    """Solve H(e^z) = target for z, elementwise, by safeguarded Newton from the warm start z.

    H(y) = beta y + log(1 - e^-y); dH/dz = beta y + y / expm1(y). Bracket:
    y_lo = min(1, e^(target - beta)) (H(y) <= beta y + log y) and
    y_hi = max(1, (target - log(1 - 1/e)) / beta) (H(y) >= beta y + log(1 - 1/e) for y >= 1).
    """
    z = torch.where((z > low) & (z < high), z, 0.5 * (low + high))

    def equation(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        value, slope, y = _inner_terms(beta, z)
        # Rounding in the value scales with the size of its terms.
        return value - target, slope, 4e-16 * (1.0 + target.abs() + beta * y)

    return safeguarded_newton(equation, z, low, high)


def _inner_upper(beta: Tensor, target: Tensor) -> Tensor:
    """log of an upper end of the inner root, next to it for large beta (where the other
    starts are far above it). With c = log(1 - 1/e): log(1 - e^-y) >= log y + c for y <= 1, so
    there beta y + log y <= t - c and y <= W(beta e^(t - c)) / beta <= log1p(beta e^(t - c)) /
    beta (Lambert's W(x) <= log(1 + x)); above 1, log(1 - e^-y) >= c and y <= (t - c) / beta."""
    shifted = target - _LOG1MEXP_AT_ONE
    bound = torch.maximum(torch.nn.functional.softplus(torch.log(beta) + shifted), shifted)
    return torch.log(bound.clamp_min(1e-300)) - torch.log(beta)



def quadratic_root(family: Family, p: Tensor, nu: Tensor,
                   two_sqrt_p: Tensor | None = None) -> Tensor:
    """The inner equation of eq. (5), q^(alpha-2) (q - p) = nu, where it is a quadratic; the
    one place these closed forms are written (the window's fixed Newton steps and the exact
    path's nested root finding both use it). Returns the root term R of

        alpha = 3/2 (``DUAL_THREE_HALVES``):  2 sqrt(q) = nu + R,  R = sqrt(nu^2 + 4 p);
        alpha = 3   (``DUAL_THREE``):         2 q = p + R,         R = sqrt(p^2 + 4 nu),

    as a `torch.hypot` (no overflow or underflow of the squares); both are sums of positive
    terms (no cancellation). Zero entries follow the same formulas (q = nu^2, resp. sqrt(nu)).
    ``two_sqrt_p``: 2 sqrt(p), when the caller has it."""
    if family == Family.DUAL_THREE_HALVES:
        return torch.hypot(nu, 2.0 * torch.sqrt(p) if two_sqrt_p is None else two_sqrt_p)
    return torch.hypot(p, 2.0 * torch.sqrt(nu))


def _closed_lift(family: Family, lp: Tensor, finite: Tensor, s: Tensor) -> Tensor:
    """log(q_i / p_i) of the quadratic inner solutions (`quadratic_root`) without cancellation,
    from the added mass q - p: alpha = 3/2, sqrt(q) - sqrt(p) = (nu + nu^2 / (R + 2 sqrt(p))) / 2;
    alpha = 3, q - p = 2 nu / (R + p). Zero entries: log q."""
    nu = torch.exp(s).unsqueeze(-1)
    p = torch.where(finite, torch.exp(lp), 0.0)
    root = quadratic_root(family, p, nu)
    if family == Family.DUAL_THREE_HALVES:
        half = torch.sqrt(p)
        scale = root + 2.0 * half  # (0 only where nu = p = 0, and then q = 0)
        rise = 0.5 * (nu + nu * nu / torch.where(scale > 0, scale, 1.0))  # sqrt(q) - sqrt(p)
        added = rise * (rise + 2.0 * half)
    else:
        scale = root + p
        added = 2.0 * nu / torch.where(scale > 0, scale, 1.0)
    return torch.where(finite, torch.log1p(added / torch.where(finite, p, 1.0)), torch.log(added))


def _outer_bracket(lp: Tensor, finite: Tensor, mask: Tensor, beta: Tensor, log_deficit: Tensor,
                   k: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A bracket [low, high] of s = log nu and a start inside it (per row), from bounds on
    q_i^(2-alpha): nu in [R/k, R / sum_i p_i^(2-alpha)] (1 < alpha < 2), nu in
    [max((R/k)^(alpha-1), R / sum_i p_i^(2-alpha)), R/k] (alpha > 2), and nu <= 1 - p_1 (proof
    of Theorem A.1: there q_1 = 1 and every q_i <= 1). The start is nu = R / sum_i q_i^(2-alpha)
    at q = p + R/k (the alpha = 2 solution, exact there)."""
    b = beta.squeeze(-1)
    log_ratio = log_deficit - torch.log(k.to(lp.dtype))
    log_power_sum = logsumexp_masked((1.0 - beta) * lp, finite & mask)
    has_zero = (mask & ~finite).any(-1)
    below_two = b < 1.0
    low = torch.where(below_two, log_ratio, b * log_ratio)
    low = torch.where(below_two | has_zero, low, torch.maximum(low, log_deficit - log_power_sum))
    high = torch.where(below_two, log_deficit - log_power_sum, log_ratio)
    low, high = torch.minimum(low, high), torch.maximum(low, high)
    high = torch.minimum(high, torch.log1p(-torch.exp(lp[..., 0])))
    low = torch.where(k == 1, high, torch.minimum(low, high))  # (size 1: q_1 = 1, given)
    shifted = torch.logaddexp(lp, log_ratio.unsqueeze(-1))
    start = log_deficit - logsumexp_masked((1.0 - beta) * shifted, mask)
    return low, high, torch.where((start > low) & (start < high), start, high)


def _inner_bracket(beta: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """[low, high] of the inner root z (`_inner_solve`)."""
    return (torch.clamp_max(target - beta, 0.0),
            torch.log(torch.clamp_min((target - _LOG1MEXP_AT_ONE) / beta, 1.0)))


def _inner_rate(beta: Tensor, u: Tensor, finite: Tensor) -> Tensor:
    """d log q_i / ds along eq. (5): 1 / H'(u) = expm1(u) / (beta expm1(u) + 1) with u =
    log(q_i / p_i); zero entries (q_i = nu^(1/beta)): 1 / beta."""
    em1 = torch.expm1(u)
    return torch.where(finite, em1 / (beta * em1 + 1.0), 1.0 / beta)


def _inner_start(beta: Tensor, lp: Tensor, s: Tensor) -> Tensor:
    """z at s before any solve: the root at beta = 0, y = -log(1 - e^t) (the KL limit, an upper
    end of the root since beta y > 0), close to it when beta y is small (alpha next to 1, where
    the search probes the widest supports); the solvers clamp it into their brackets."""
    first = (s.unsqueeze(-1) - beta * lp).clamp_max(-1e-300)
    return torch.log(-torch.log1p(-torch.exp(first)))


#: Relative inner residual at which the joint Newton stops: four roundings of H's terms.
INNER_FLOOR = 1.6e-15
#: Residuals (relative to their floors' scales) from which one more Newton step of the joint
#: Newton lands below the floor: the step is taken and not checked (`_joint_newton`).
LAST_STEP = 1e-10
#: Iterations of the joint Newton (`_joint_newton`) before a row falls back to the nested one.
JOINT_ITERATIONS = 30
#: Newton steps for the columns past the support and the next column (`dual_multiplier`), at
#: most, and the change of log q below which they stop.
FAR_STEPS = 6
FAR_TOLERANCE = 1e-6
#: Newton steps of the inner equations at one multiplier (`dual_values`), at most, and the
#: largest last step (in log q) after which they count as exact.
INNER_STEPS = 30
EXACT_STEP = 1e-8


def _added_mass(lp: Tensor, finite: Tensor, mask: Tensor, u: Tensor, q: Tensor) -> Tensor:
    """sum over the support of q_i - p_i = p_i expm1(u_i) (zero entries: q_i), a sum of
    positive terms: the map's constraint sum_i q_i = 1 is this = R."""
    added = torch.where(finite, torch.exp(lp) * torch.expm1(u), q)
    return added.masked_fill(~mask, 0.0).sum(-1)


def _inner_step(beta: Tensor, lp: Tensor, z: Tensor, u: Tensor, step: Tensor,
                target: Tensor, clamp: bool) -> Tensor:
    """z after a Newton step ``step`` (in z) of the inner equation: taken in u = e^z where H is
    close to linear in u (beta u >= 1 or u >= 1: z + log1p(step), the Newton step in u, monotone
    there since H is concave in u; a step past u = 0 stops at u / 100) and in z elsewhere (H
    close to log u); with ``clamp``, into the inner bracket at ``target``."""
    linear = (beta * u >= 1.0) | (u >= 1.0)
    z_new = z + torch.where(linear, torch.log1p(step.clamp_min(-0.99)), step)
    z_new = torch.where(torch.isfinite(z_new), z_new, z)
    if not clamp:
        return z_new
    z_low, z_high = _inner_bracket(beta, target)
    return torch.minimum(torch.maximum(z_new, z_low), z_high)


def _joint_newton(lp: Tensor, finite: Tensor, mask: Tensor, beta: Tensor, log_deficit: Tensor,
                  s: Tensor, z: Tensor, low: Tensor, high: Tensor
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """Newton on the whole system of eq. (5) at once: the C + 1 unknowns (s, z_1 .. z_C) of

        H(e^z_i) = s - beta log p_i  (every column),   sum_(i in support) (q_i - p_i) = R,

    whose Jacobian is an arrow, so one step is one pass over the columns: with r_i the inner
    residuals, H_z,i = dH/dz, g_i = dq_i/ds = q_i u_i / H_z,i (zero entries: q_i / beta) and
    A = sum_i (q_i - p_i) + sum_i g_i r_i (Newton on log A - log R: the added mass grows about
    exponentially in s; written as added mass, its rounding is a few ulps of R, not of 1),

        ds = (log R - log A) A / sum_i g_i,    dz_i = (r_i + ds) / H_z,i.

    Safeguards: s moves only once the inner steps change no log q_i by more than 1/10, and by
    at most one unit of any support entry's log q; each entry steps in u or in z
    (`_inner_step`); s stays in [low, high]. A row is converged once its outer residual is at
    the rounding floor (`roots.converged`) and every inner one within `INNER_FLOOR` (1 +
    |target| + beta u), or once both are below `LAST_STEP` of those and the step from there is
    taken (Newton squares the error). Returns (s, z, converged per row); rows stop as they
    converge.
    """
    n = s.shape[0]
    out_s, out_z = s.clone(), z.clone()
    done = torch.zeros_like(s, dtype=torch.bool)
    rows = torch.arange(n, device=s.device)
    previous_outer = torch.full_like(s, math.inf)
    zeros = mask & ~finite
    inside = mask & finite
    p = torch.where(finite, torch.exp(lp), 0.0)
    held = torch.where(mask, p, 0.0)  # p on the support
    scaled = beta * lp
    deficit = torch.exp(log_deficit)
    # Every column positive (the common case): no zero entries to give their own values, and
    # three selections fewer per pass (each costs about three arithmetic ops on a CPU).
    positive = bool(finite.all())
    guarded = True  # the first iterations' safeguards, until every inner step is small
    above = None  # a lower bound on z, from the last step's host read
    for _ in range(JOINT_ITERATIONS):
        target = s.unsqueeze(-1) - scaled
        value, slope, u, em1 = _inner_terms(beta, z, expm1=True, above=above)
        if positive:
            residual = target - value
            added = torch.where(mask, p * em1, 0.0)  # q - p (em1 may overflow past it)
            rate = u / slope  # d log q_i / ds
        else:
            residual = torch.where(finite, target - value, 0.0)
            q_zero = torch.exp(s / beta.squeeze(-1)).unsqueeze(-1)  # q of a zero entry
            added = torch.where(inside, p * em1, torch.where(zeros, q_zero, 0.0))
            rate = torch.where(zeros, 1.0 / beta, u / slope)
        gain = (held + added) * rate  # dq_i / ds on the support (0 past it: both are)
        outer = added.sum(-1) - deficit
        moved = outer + deficit + (gain * residual).sum(-1)  # A
        ds = torch.where(moved > 0, (log_deficit - torch.log(moved)) * moved,
                         deficit - moved) / gain.sum(-1)
        if guarded:
            moves = (residual * rate).abs().amax(-1)
            reach = torch.where(mask, rate, 0.0).amax(-1)
            ds = torch.where(moves < 0.1, ds.clamp(-1.0 / reach, 1.0 / reach), 0.0)
        ready = converged(outer, previous_outer, ds, s, NEWTON_TOLERANCE * deficit)
        close = (outer.abs() <= LAST_STEP * deficit) & (not guarded)
        previous_outer = outer
        if bool((ready | close).any()):  # (the inner residuals, once the sum is close)
            inner = (residual.abs() / (1.0 + target.abs() + beta * u)).amax(-1)
            ready &= inner <= INNER_FLOOR
            close &= ~ready & (inner <= LAST_STEP)
        proposal = s + ds
        within = (proposal > low) & (proposal < high)  # (False for NaN and +-inf too)
        # (a step out of the bracket goes halfway to the end it would have crossed)
        s_new = torch.where(within, proposal, 0.5 * (s + torch.where(ds > 0, high, low)))
        step = (residual + (s_new - s).unsqueeze(-1)) / slope
        stop = ready | close
        # (the largest step, whether any row stops and the smallest z, in one host read: an
        # unclamped step moves z down by at most the largest step, or log(100) in u,
        # `_inner_step`; a clamped one may go anywhere in the inner bracket)
        biggest, stopping, lowest = torch.stack(
            [step.abs().max(), stop.any().to(step.dtype), z.min()]).tolist()
        above = lowest - max(biggest, _LOG_100) if biggest <= 0.5 else None
        guarded = biggest > 1e-2
        if biggest > 0.1:  # (from there on a plain step in z is as good as one in u)
            z_new = _inner_step(beta, lp, z, u, step, s_new.unsqueeze(-1) - scaled, biggest > 0.5)
        else:
            z_new = z + step
        if stopping:
            finished = stop.nonzero().squeeze(-1)
            out_s[rows[finished]] = torch.where(close, s_new, s)[finished]
            out_z[rows[finished]] = torch.where(close.unsqueeze(-1), z_new, z)[finished]
            done.index_fill_(0, rows[finished], True)
            if finished.numel() == stop.numel():
                return out_s, out_z, done
            keep = (~stop).nonzero().squeeze(-1)  # the rows that go on, alone
            rows = rows[keep]
            lp, finite, mask, beta, log_deficit, low, high, previous_outer = (
                t[keep] for t in (lp, finite, mask, beta, log_deficit, low, high, previous_outer))
            zeros, inside, p, held, scaled, deficit = (
                t[keep] for t in (zeros, inside, p, held, scaled, deficit))
            s_new, z_new = s_new[keep], z_new[keep]
        s, z = s_new, z_new
    out_s[rows], out_z[rows] = s, z
    return out_s, out_z, done


def _inner_steps(beta: Tensor, lp: Tensor, s: Tensor, z: Tensor, steps: int,
                 tolerance: float = FAR_TOLERANCE) -> tuple[Tensor, Tensor]:
    """Newton steps of the inner equation at a fixed s, at most ``steps``, until none moves a
    log q by more than ``tolerance`` (`FAR_TOLERANCE`: values for a prediction). Returns z
    and, per row, whether its last step was within the tolerance."""
    target = s.unsqueeze(-1) - beta * lp
    done = torch.zeros_like(s, dtype=torch.bool)
    for _ in range(steps):
        value, slope, u = _inner_terms(beta, z)
        step = (target - value) / slope
        moves = (step * u).abs().amax(-1)  # (d log q = u dz)
        biggest = float(moves.max())
        z = _inner_step(beta, lp, z, u, step, target, biggest > 0.1)
        done = moves <= tolerance
        if biggest <= tolerance:
            break
    return z, done


def _nested(lp: Tensor, finite: Tensor, mask: Tensor, beta: Tensor, log_deficit: Tensor,
            start: Tensor, z: Tensor, low: Tensor, high: Tensor, closed: Family | None
            ) -> tuple[Tensor, Tensor]:
    """The nested root finding of Algorithm 1: outer Newton on s for the mass added to the
    support minus R (`_added_mass`), which is convex and increasing (y_i is convex in s and
    q_i = p_i e^(y_i)), from the upper end of the bracket so that the iterates decrease
    monotonically; inner Newton for each y_i, warm-started from the previous outer step (or the
    quadratic formula, ``closed``). Returns (s, z)."""
    keep = mask.to(lp.dtype)
    state = {"z": z}
    deficit = torch.exp(log_deficit)

    def outputs(s_value: Tensor, z_start: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if closed is not None:
            y = _closed_lift(closed, lp, finite, s_value)
            z_new = z_start
        else:
            target = s_value.unsqueeze(-1) - beta * lp
            z_start = torch.minimum(z_start, _inner_upper(beta, target))
            z_new = _inner_solve(beta, target, z_start, *_inner_bracket(beta, target))
            y = torch.exp(z_new)
        log_q = torch.where(finite, lp + y, s_value.unsqueeze(-1) / beta)
        q = torch.exp(log_q) * keep
        return q, _inner_rate(beta, y, finite), z_new, _added_mass(lp, finite, mask, y, q)

    def outer(s_value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, state["rate"], state["z"], added = outputs(s_value, state["z"])
        return added - deficit, (q * state["rate"]).sum(-1), NEWTON_TOLERANCE * deficit

    def warm_start(old: Tensor, new: Tensor) -> None:
        # Predict each y_i at the new s to first order (dy/ds = rate), so the inner Newton
        # starts next to its root.
        y = torch.exp(state["z"])
        predicted = y + state["rate"] * (new - old).unsqueeze(-1)
        state["z"] = torch.where(predicted > 0.5 * y, torch.log(predicted), state["z"])

    s = safeguarded_newton(outer, start, low, high, moved=warm_start)
    if closed is None:
        target = s.unsqueeze(-1) - beta * lp
        z = _inner_solve(beta, target, state["z"], *_inner_bracket(beta, target))
    return s, z


def _shaped_inner(beta: Tensor, target: Tensor) -> Tensor:
    """z = log u of the inner equation's approximation u = softplus(t + log beta) / beta (the
    primal map of the same alpha at c = beta nu: q^beta = p^beta + beta nu), which is exact at
    both ends, u -> e^t (t -> -inf) and beta u - t -> log(beta) (t -> +inf, within log(beta)
    / beta of the root there)."""
    shifted = target + torch.log(beta)
    rise = torch.nn.functional.softplus(shifted, threshold=40.0) / beta
    # (softplus underflows where e^shifted does: there u = e^t)
    return torch.where(shifted < -30.0, target, torch.log(rise))


def _shaped_start(lp: Tensor, finite: Tensor, mask: Tensor, beta: Tensor, log_deficit: Tensor,
                  s: Tensor, low: Tensor, high: Tensor) -> tuple[Tensor, Tensor]:
    """A start for the joint Newton without a neighbouring solve: s solving the outer equation
    with every inner root replaced by `_shaped_inner` (safeguarded Newton on log(added mass)
    - log R, a few passes of closed forms), and those z."""
    p = torch.where(finite & mask, torch.exp(lp), 0.0)
    zeros = (mask & ~finite).to(lp.dtype).sum(-1)
    b = beta.squeeze(-1)

    def equation(value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        shifted = value.unsqueeze(-1) - beta * lp + torch.log(beta)
        rise = torch.nn.functional.softplus(shifted, threshold=40.0) / beta  # u
        grown = torch.exp(rise)
        added = (p * (grown - 1.0)).sum(-1) + zeros * torch.exp(value / b)
        slope = (p * grown * torch.sigmoid(shifted) / beta).sum(-1) + zeros * torch.exp(
            value / b) / b
        return torch.log(added) - log_deficit, slope / added, torch.full_like(value, 1e-6)

    # [low, high] brackets the exact equation's root, not always this one's (the shaped inner
    # roots are approximations): where this root lies past an end (a large deficit: k_max far
    # below k*), that end is the start, at once (Newton would bisect towards it for 100 steps).
    past_low, past_high = equation(low)[0] >= 0, equation(high)[0] <= 0
    s = torch.where(past_low, low, torch.where(past_high, high, s))
    low, high = torch.where(past_high, high, low), torch.where(past_low, low, high)
    s = safeguarded_newton(equation, s, low, high)
    return s, _shaped_inner(beta, s.unsqueeze(-1) - beta * lp)


def dual_multiplier(log_p: Tensor, mask: Tensor, alpha: Tensor, log_deficit: Tensor, k: Tensor,
                    closed: Family | None = None, start: Tensor | None = None,
                    state: Tensor | None = None) -> Multiplier:
    """T*_alpha for any finite alpha > 1 on the support ``mask`` (the first k columns), by its
    multiplier s = log nu, with the values the same nu gives every column (`roots.Multiplier`).

    General alpha: the joint Newton of the whole system (`_joint_newton`) over the support and
    the next column; a row it has not converged in `JOINT_ITERATIONS` steps is solved by the
    nested root finding of Algorithm 1 (`_nested`). The columns past those get inner Newton
    steps at the solution's s from their start (`_inner_steps`): values for a prediction, to
    `FAR_TOLERANCE`. ``closed`` = ``DUAL_THREE_HALVES`` or ``DUAL_THREE`` (every row has
    that alpha): the inner solve is a formula (`quadratic_root`) and Newton runs on s alone.
    ``start`` / ``state``: s and the inner unknowns z of a nearby solve (a neighbouring support
    size), used where they lie inside this solve's brackets.
    """
    dtype = log_p.dtype
    beta = (alpha.to(dtype) - 1.0).unsqueeze(-1)
    finite = torch.isfinite(log_p)
    lp = torch.where(finite, log_p, 0.0)
    low, high, first = _outer_bracket(lp, finite, mask, beta, log_deficit, k)
    s = first if start is None else torch.where((start > low) & (start < high), start, first)
    if closed is not None:
        s, _ = _nested(lp, finite, mask, beta, log_deficit, s, lp, low, high, closed)
        return dual_values(lp, finite, beta, s, None, closed)[0]
    cold = None if state is None else torch.isnan(state)
    if cold is None or bool(cold.any()):  # (NaN: no warm start for that entry)
        # A start without a neighbouring solve: for alpha >= 2 the primal-shaped one
        # (`_shaped_start`), next to alpha = 1 the KL limit of the inner roots.
        target = s.unsqueeze(-1) - beta * lp
        z = torch.minimum(_inner_start(beta, lp, s), _inner_upper(beta, target))
        steep = (beta.squeeze(-1) >= 1.0) & (torch.ones_like(s, dtype=torch.bool) if start is None
                                             else torch.isnan(start))
        rows = steep.nonzero().squeeze(-1)
        if rows.numel():
            s[rows], z[rows] = _shaped_start(lp[rows], finite[rows], mask[rows], beta[rows],
                                             log_deficit[rows], s[rows], low[rows], high[rows])
        z = z if cold is None else torch.where(cold, z, state)
    else:
        z = state
    target = s.unsqueeze(-1) - beta * lp
    z_low, z_high = _inner_bracket(beta, target)
    z = torch.minimum(torch.maximum(z, z_low), z_high)
    # The support and the next column (the search's bounds read it) are solved together to
    # the rounding floor; the columns past them follow the same s with a few inner steps.
    near = min(lp.shape[-1], int(k.max()) + 1)
    s, z_near, done = _joint_newton(lp[:, :near], finite[:, :near], mask[:, :near], beta,
                                    log_deficit, s, z[:, :near], low, high)
    if not bool(done.all()):
        rows = (~done).nonzero().squeeze(-1)
        again = _inner_start(beta[rows], lp[rows, :near], first[rows])
        s[rows], z_near[rows] = _nested(lp[rows, :near], finite[rows, :near], mask[rows, :near],
                                        beta[rows], log_deficit[rows], first[rows], again,
                                        low[rows], high[rows], None)
    if near < lp.shape[-1]:
        z = torch.cat([z_near, _inner_steps(beta, lp[:, near:], s, z[:, near:], FAR_STEPS)[0]], -1)
    else:
        z = z_near
    return values_at(lp, finite, beta, s, z)


def dual_range(lp: Tensor, finite: Tensor, beta: Tensor, log_deficit: Tensor, k: Tensor
               ) -> tuple[Tensor, Tensor, Tensor]:
    """s = log nu of the support of size k: a lower bound, a start inside its bracket
    (`_outer_bracket`), and an upper bound of every size's (size 1's, q_1 = 1)."""
    low, _, start = _outer_bracket(lp, finite, support_mask(k, lp.shape[-1]), beta, log_deficit, k)
    return low, start, torch.log1p(-torch.exp(lp[:, 0]))


def dual_values(lp: Tensor, finite: Tensor, beta: Tensor, s: Tensor, z: Tensor | None,
                closed: Family | None = None, steps: int = INNER_STEPS
                ) -> tuple[Multiplier, Tensor]:
    """Every column's value at the multiplier s of eq. (5) (`roots.Multiplier`): the inner
    roots by at most ``steps`` Newton steps from ``z`` (a start; None or NaN: the shaped
    start, `_shaped_inner`), or the quadratic formulas (``closed``); and per row whether
    they are exact: the last step moved no log q by more than `EXACT_STEP` (Newton's error
    after it is about its square)."""
    if closed is not None:
        lift = _closed_lift(closed, lp, finite, s)
        u = torch.where(finite, lift, 0.0)
        rate = _inner_rate(beta, u, finite)
        return (Multiplier(s, torch.where(finite, lp + u, lift), rate, lift),
                torch.ones_like(s, dtype=torch.bool))
    target = s.unsqueeze(-1) - beta * lp
    cold = None if z is None else torch.isnan(z)  # (NaN: no start)
    if cold is None or bool(cold.any()):  # (one host read: two passes of softplus saved)
        shaped = torch.minimum(_shaped_inner(beta, target), _inner_upper(beta, target))
        z = shaped if cold is None else torch.where(cold, shaped, z)
    z, exact = _inner_steps(beta, lp, s, z, steps, EXACT_STEP)
    return values_at(lp, finite, beta, s, z), exact


def values_at(lp: Tensor, finite: Tensor, beta: Tensor, s: Tensor, z: Tensor) -> Multiplier:
    """Every column's value at the multiplier s from its inner unknown z (``lp``: log p, 0
    where p = 0, whose q is nu^(1/beta); ``beta``: [n, 1])."""
    u = torch.exp(z)
    log_q = torch.where(finite, lp + u, s.unsqueeze(-1) / beta)
    rate = _inner_rate(beta, u, finite)
    return Multiplier(s, log_q, rate, torch.where(finite, u, log_q), z)


def dual_log_renorm(log_p: Tensor, mask: Tensor, alpha: Tensor, log_deficit: Tensor, k: Tensor,
                    closed: Family | None = None) -> Tensor:
    """log T*_alpha on the support (`dual_multiplier`), normalized, -inf off it."""
    return normalized(dual_multiplier(log_p, mask, alpha, log_deficit, k, closed).log_q, mask)
