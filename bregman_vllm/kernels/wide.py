"""Rows past the search's candidates, on the device: the search of `kernels.search` (the torch
path's `core.search`, its reference) over a whole row sorted in global memory, a block of
`WIDE_BLOCK` entries at a time (the search kernel holds its candidates in registers, at most
`kernels.step.SEARCH_WIDTH`).

Paper: arXiv 2505.19371. cost(k) (eq. (6)) is discretely convex (Theorem 3.3): k* = min {k :
G(k) <= lambda}, ties to the smaller support (Algorithm 2); the maps are eq. (4) (primal,
Definition 4.1) and eq. (5) (dual, Theorem A.1, Algorithm 1), one scalar per size (the water
level, delta = log q_1 - log p_1, or log nu: `kernels.search`'s kinds 1, 2 and 0), the closed
forms Proposition 4.1 and eq. (1).

A row is the sorted scores of one request (`torch.sort`, descending, ties by index: the order
of `formulas.order_key`) read through its log-normalizer: x, log x and the deficit R_(j+1) =
sum_(i>j) x_i (from a suffix sum per block, `prepare`) are computed where a block is loaded
(`entries`), never stored. Each sum over a support is a loop over its blocks; each value at
one position loads its block (`deficit_at`, `point`).

Per row (`wide_kernel`): a fixed size's map (`closed_scalars` and `closed_values_of` for the
closed forms, else `solve`); the closed-form gaps of KL, alpha = 3/2 and 2 in one pass
(`closed_search`); else (`search`) the floor of the gaps, probes on the scalar in rounds of the
row's first entries as the torch search's rounds of candidates (`probes`: the counts n and c
that bracket k* by weak duality, a straddling Newton step on D(s) = log w_(m+1)(s) - log
lambda, Illinois regula falsi otherwise; a row whose k* passes a round goes on to the next
from the last Newton aim), exact gaps (`settle`: the maps of consecutive sizes by safeguarded
Newton, their weak-duality bounds first, the log-space gap formulas for the rest), and the map
of k*. The last round being the whole row, every k* is decided here.

Differences from `kernels.search`, none of which changes what is certified: the dual's inner
roots start from the last ones solved at each entry (kept in a scratch row, `map_values`), and
every probe solves them (no steering probes); the water-filling start of the primal's level is
not taken (a start, not a bound).

Float64 throughout (`formulas`' exp64 / log64).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..core import step as _core_step
from .formulas import (
    ARGMAX,
    DUAL_THREE,
    DUAL_THREE_HALVES,
    INTERPRET,
    KL,
    SQUARE,
    THREE_HALVES,
    WATER,
    argmax_values,
    at,
    closed_gap_family,
    device,
    exp64,
    expm1_64,
    kl_gap,
    log1p64,
    log64,
    logaddexp64,
    logsumexp64,
    request_at,
    shifted,
    sqrt64,
    square_gaps,
    square_map,
    three_halves_gap,
    three_halves_shift,
    three_halves_values,
    water_values,
)
from .search import (
    MAX_ITERATIONS,
    NEWTON_TOLERANCE,
    PROBES,
    SETTLE,
    STRADDLE,
    SUM_ROUNDING,
    TERM_ROUNDING,
    added_mass,
    alpha_kernel,
    closed_values,
    inner_solve,
    inner_upper,
    isfinite64,
    level_ends,
    level_range,
    level_values,
    log_entry_term,
    logsubexp64,
    newton_update,
    outer_ends,
    shaped_inner,
    support_mass,
    term_slope,
    top_ends,
    top_range,
    top_values,
    values_at,
)

# (Triton types every name, ``_`` too: below, each value a function leaves unused gets a name of
# its own, so that no name changes type inside a loop)


def called(fn):
    """A device function compiled once and called from each call site (Triton inlines every
    other: this kernel would compile each map several times over); under the interpreter the
    Python function itself, as `formulas.device`."""
    return fn if INTERPRET else triton.jit(noinline=True)(fn)


#: The search pass's widest candidates (`kernels.step`): under the interpreter the select
#: kernel's top-k of 2 C keys (`formulas.rank_top`'s [2C, 2C] comparison) must stay within
#: Triton's largest tensor, 2^20 elements.
SEARCH_WIDTH = 512 if INTERPRET else 1024
#: The wide pass's rounds (the torch search's, `core.step.decode_exact`): the first holds
#: GROWTH times the search pass's candidates, each next one GROWTH times more.
GROWTH = tl.constexpr(_core_step.GROWTH)
FIRST = tl.constexpr(_core_step.GROWTH * SEARCH_WIDTH)
#: Entries per block of a wide row (under the interpreter small, so that the tests' rows of a
#: few thousand entries take several blocks).
WIDE_BLOCK = 256 if INTERPRET else 1024


# ----------------------------------------------------------------------------- a row's entries


@device
def log_x_of(v, scale, total, LOGITS: tl.constexpr):
    """log x of float64 scores (`_select_kernel`'s: normalized by the row's log-normalizer, or
    its total mass)."""
    if LOGITS:  # noqa: SIM108 (a compile-time branch)
        out = v * scale - total
    else:
        out = log64(tl.where(v > 0, v, 0.0) / total)
    return out


@device
def x_of(v, log_x, total, LOGITS: tl.constexpr, SMALLEST: tl.constexpr):
    """x of the same scores (0 below the score dtype's smallest value)."""
    if LOGITS:
        x = exp64(log_x)
        x = tl.where(x > SMALLEST, x, 0.0)
    else:
        x = tl.where(v > 0, v, 0.0) / total
    return x


@device
def block_x(src, start, vocab, scale, total, LOGITS: tl.constexpr, SMALLEST: tl.constexpr,
            B: tl.constexpr):
    """x and log x of the block at ``start`` and the positions; past the row x = 0, log x =
    -inf."""
    pos = start + tl.arange(0, B)
    v = tl.load(src + pos, mask=pos < vocab, other=float("-inf")).to(tl.float32).to(tl.float64)
    log_x = log_x_of(v, scale, total, LOGITS)
    return x_of(v, log_x, total, LOGITS, SMALLEST), log_x, pos


@device
def entries(src, tails, start, vocab, scale, total, LOGITS: tl.constexpr,
            SMALLEST: tl.constexpr, B: tl.constexpr):
    """`block_x` and the deficit R_(j+1) = sum_(i>j) x_i (positive terms: the blocks after
    this one from ``tails``, this block's from its own suffix sum)."""
    x, log_x, pos = block_x(src, start, vocab, scale, total, LOGITS, SMALLEST, B)
    local = tl.arange(0, B)
    after = tl.load(tails + start // B + 1)
    deficit = after + tl.cumsum(shifted(x, local, B), 0, reverse=True)
    return x, log_x, deficit, pos


@device
def block_log_x(src, start, vocab, scale, total, LOGITS: tl.constexpr, B: tl.constexpr):
    """log x of the block at ``start`` and the positions."""
    pos = start + tl.arange(0, B)
    v = tl.load(src + pos, mask=pos < vocab, other=float("-inf")).to(tl.float32).to(tl.float64)
    return log_x_of(v, scale, total, LOGITS), pos


@device
def block_lp(src, start, vocab, scale, total, LOGITS: tl.constexpr, B: tl.constexpr):
    """`block_log_x`, whether each log x is finite, and lp: log x there, else 0 (the maps'
    form: their zero entries are separate terms). Returns (log x, finite, lp, positions)."""
    log_x, pos = block_log_x(src, start, vocab, scale, total, LOGITS, B)
    finite = isfinite64(log_x)
    return log_x, finite, tl.where(finite, log_x, 0.0), pos


@device
def log_x_at(src, j, scale, total, LOGITS: tl.constexpr):
    """log x_j."""
    return log_x_of(tl.load(src + j).to(tl.float32).to(tl.float64), scale, total, LOGITS)


@device
def x_at(src, j, vocab, scale, total, LOGITS: tl.constexpr, SMALLEST: tl.constexpr):
    """x_j (0 past the row)."""
    v = tl.load(src + j, mask=j < vocab, other=float("-inf")).to(tl.float32).to(tl.float64)
    return x_of(v, log_x_of(v, scale, total, LOGITS), total, LOGITS, SMALLEST)


@device
def deficit_at(src, tails, j, vocab, scale, total, LOGITS: tl.constexpr,
               SMALLEST: tl.constexpr, B: tl.constexpr):
    """R_(j+1) at one position (its block's suffix sum)."""
    start = (j // B) * B
    x, _log_x, pos = block_x(src, start, vocab, scale, total, LOGITS, SMALLEST, B)
    beyond = tl.load(tails + start // B + 1)
    return beyond + tl.sum(tl.where(pos > j, x, 0.0), axis=0)


@device
def prepare(src, tails, inner, vocab, scale, total, tail, LOGITS: tl.constexpr,
            SMALLEST: tl.constexpr, B: tl.constexpr):
    """The suffix sum of x after each block into ``tails`` (tails[b] = sum over blocks >= b,
    and ``tail``, the mass past the candidates), NaN into ``inner`` (no inner root solved yet),
    and the number of positive candidates (a prefix: they are sorted)."""
    blocks = tl.cdiv(vocab, B)
    tl.store(tails + blocks, tail)
    acc = tail
    positive = tl.full((), 0, tl.int64)
    for i in range(0, blocks):
        b = blocks - 1 - i
        x, _log_x, pos = block_x(src, b * B, vocab, scale, total, LOGITS, SMALLEST, B)
        tl.store(inner + pos, tl.full([B], float("nan"), tl.float64), mask=pos < vocab)
        acc += tl.sum(x, axis=0)
        positive += tl.sum((x > 0).to(tl.int64), axis=0)
        tl.store(tails + b, acc)
    tl.debug_barrier()  # (the sums before any block's deficit reads them)
    return positive


@device
def outside_mass(scores, row_len, src, vocab, scale, total, LOGITS: tl.constexpr,
                 SMALLEST: tl.constexpr, B: tl.constexpr):
    """The mass of the row's entries that are not among its ``vocab`` candidates (the row's top
    entries, from a top-k: ``scores`` is the row as given, ``row_len`` long), from positive
    terms: the entries below the last candidate's value, and as many entries equal to it as
    the candidates leave out."""
    last = tl.load(src + vocab - 1).to(tl.float32)
    below = tl.full((), 0.0, tl.float64)
    equal = tl.full((), 0, tl.int64)
    for first in range(0, row_len, B):
        pos = first + tl.arange(0, B)
        v = tl.load(scores + pos, mask=pos < row_len, other=float("-inf")).to(tl.float32)
        x = x_of(v.to(tl.float64), log_x_of(v.to(tl.float64), scale, total, LOGITS), total,
                 LOGITS, SMALLEST)
        below += tl.sum(tl.where(v < last, x, 0.0), axis=0)
        equal += tl.sum(((pos < row_len) & (v == last)).to(tl.int64), axis=0)
    for first in range(0, vocab, B):
        pos = first + tl.arange(0, B)
        v = tl.load(src + pos, mask=pos < vocab, other=float("-inf")).to(tl.float32)
        equal -= tl.sum(((pos < vocab) & (v == last)).to(tl.int64), axis=0)
    return below + equal.to(tl.float64) * x_at(src, vocab - 1, vocab, scale, total, LOGITS,
                                               SMALLEST)


# ----------------------------------------------------------------------------- values at a scalar


@device
def map_values(kind, closed, lp, finite, beta, s, top, zp, active):
    """Every entry's value at the map's scalar s (`maps.solved`'s: the level, delta itself
    (kind 2), or log nu with the inner roots solved; s = -inf: no deficit, q = p): (log q, d log
    q / ds, log(q / p)). The dual's inner roots start from the last ones solved at these entries
    (``zp``: the row's scratch at them, NaN before the first; ``active``: inside the row) and
    are kept there: a nearby scalar's roots are a close start (the solve is safeguarded, so any
    start converges)."""
    if s == float("-inf"):
        log_q = tl.where(finite, lp, float("-inf"))
        rate = tl.zeros_like(lp)
        lift = tl.where(finite, 0.0, float("-inf")).to(tl.float64)
    elif kind == 1:
        log_q, rate, lift = level_values(lp, finite, beta, s)
    elif kind == 2:
        log_q, rate, lift = top_values(lp, finite, beta, s, top)
    elif closed != 0:
        log_q, rate, lift = closed_values(closed, lp, finite, beta, s)
        log_q = tl.where(finite, log_q, s / beta)  # (`dual_map`'s zero entries)
    else:  # (the inner roots from the last ones solved at these entries, else their shape)
        target = s - beta * lp
        upper = inner_upper(beta, target)
        last = tl.load(zp, mask=active, other=float("nan"))
        start = tl.where(last == last, tl.minimum(last, upper),
                         tl.minimum(shaped_inner(beta, target), upper))
        z = inner_solve(beta, target, start)
        tl.store(zp, z, mask=active)
        log_q, rate, lift = values_at(lp, finite, beta, s, z)
    return log_q, rate, lift


@device
def probe_values(kind, closed, lp, finite, beta, s, top, zp, active):
    """`map_values` at a probe's scalar (kind 2: log delta, the rate per unit of it)."""
    if kind == 2:
        delta = exp64(s)
        log_q, rate, lift = map_values(kind, closed, lp, finite, beta, delta, top, zp, active)
        rate = rate * delta
    else:
        log_q, rate, lift = map_values(kind, closed, lp, finite, beta, s, top, zp, active)
    return log_q, rate, lift


# ----------------------------------------------------------------------------- maps


@called
def bracket(kind, src, tails, vocab, scale, total, beta, k, top, LOGITS: tl.constexpr,
            SMALLEST: tl.constexpr, B: tl.constexpr):
    """The bracket [low, high] of the scalar of size k and a first value inside it
    (`level_map`'s, `top_map`'s, `outer_bracket`'s), their sums over the support's blocks;
    and R_k."""
    deficit = deficit_at(src, tails, k - 1, vocab, scale, total, LOGITS, SMALLEST, B)
    log_r = log64(deficit)
    log_ratio = log_r - log64(k.to(tl.float64))
    log_s = tl.full((), float("-inf"), tl.float64)
    power = log_s
    shifted_power = log_s
    has_zero = k < 0  # (False)
    for first in range(0, k, B):
        _log_x, finite, lp, pos = block_lp(src, first, vocab, scale, total, LOGITS, B)
        mask = pos < k
        if kind == 0:
            power = logaddexp64(power, logsumexp64((1.0 - beta) * lp, finite & mask))
            shifted_power = logaddexp64(shifted_power, logsumexp64(
                (1.0 - beta) * logaddexp64(lp, log_ratio), mask))
            has_zero = has_zero | (tl.max((mask & ~finite).to(tl.int32), axis=0) > 0)
        elif deficit >= 0.5:
            log_s = logaddexp64(log_s, logsumexp64(lp, finite & mask))
    log_s = support_mass(deficit, log_s)
    if kind == 1:
        low, high, first_s = level_ends(top, beta, log_r, k, log_s, float("inf"))
    elif kind == 2:
        low, high, first_s = top_ends(top, log_s, k)
    else:
        low, high, first_s = outer_ends(beta, log_r, k, top, power, has_zero, shifted_power)
    return low, high, first_s, deficit


@called
def solve(kind, closed, src, inner, tails, vocab, scale, total, beta, k, start, top,
          LOGITS: tl.constexpr, SMALLEST: tl.constexpr, B: tl.constexpr):
    """`search.solve_map`'s scalar of the support of size k (`level_map`, `top_map`,
    `dual_map`) by safeguarded Newton on the mass the map adds to the support minus R_k,
    each sum over the support's blocks, from ``start`` where it lies inside the bracket;
    -inf where R_k = 0 (the identity)."""
    low, high, first_s, deficit = bracket(kind, src, tails, vocab, scale, total, beta, k, top,
                                          LOGITS, SMALLEST, B)
    s = tl.full((), float("-inf"), tl.float64)
    if deficit > 0:
        s = tl.where((start > low) & (start < high), start, first_s)
        closed_bracket = high <= low
        previous = tl.full((), float("inf"), tl.float64)
        done = closed_bracket & (k < 0)
        taken = tl.full((), 0, tl.int32)
        while (taken < MAX_ITERATIONS) & ~done:
            value = -deficit
            slope = tl.full((), 0.0, tl.float64)
            for first in range(0, k, B):
                _log_x, finite, lp, pos = block_lp(src, first, vocab, scale, total, LOGITS, B)
                mask = pos < k
                log_q, rate, lift = map_values(kind, closed, lp, finite, beta, s, top, inner + pos,
                                               pos < vocab)
                added, rise = added_mass(lp, finite, mask, log_q, rate, lift)
                value += added
                slope += rise
            s, done, low, high = newton_update(s, value, slope, NEWTON_TOLERANCE * deficit,
                                               previous, low, high, closed_bracket)
            previous = value
            taken += 1
    return s


@called
def normalizer(kind, closed, src, inner, vocab, scale, total, beta, k, s, top,
               LOGITS: tl.constexpr, SMALLEST: tl.constexpr, B: tl.constexpr):
    """log sum_(j<k) q_j at the scalar s (`primal.normalized`'s), and whether a value is NaN."""
    norm = tl.full((), float("-inf"), tl.float64)
    bad = k < 0
    for first in range(0, k, B):
        _log_x, finite, lp, pos = block_lp(src, first, vocab, scale, total, LOGITS, B)
        log_q, _rate, _lift = map_values(kind, closed, lp, finite, beta, s, top, inner + pos,
                                         pos < vocab)
        mask = pos < k
        norm = logaddexp64(norm, logsumexp64(log_q, mask))
        bad = bad | (tl.max((mask & (log_q != log_q)).to(tl.int32), axis=0) > 0)
    return norm, bad | (norm != norm)


@called
def point(kind, closed, dual, src, inner, vocab, scale, total, beta, alpha, s, top, j,
          LOGITS: tl.constexpr, B: tl.constexpr):
    """At position j and the map's scalar s: (log q_j, log(q_j / p_j), its rate, whether x_j
    is finite, log w_j)."""
    log_x, finite, lp, pos = block_lp(src, (j // B) * B, vocab, scale, total, LOGITS, B)
    log_q, rate, lift = map_values(kind, closed, lp, finite, beta, s, top, inner + pos, pos < vocab)
    log_w = log_entry_term(dual, log_x, log_q, alpha)
    return (at(log_q, pos, j), at(lift, pos, j), at(rate, pos, j),
            at(finite.to(tl.int32), pos, j) != 0, at(log_w, pos, j))


@called
def term_at(kind, closed, dual, src, inner, vocab, scale, total, beta, alpha, s, top, j,
            LOGITS: tl.constexpr, B: tl.constexpr):
    """log w_j at the map's scalar s (`point`'s)."""
    _log_q, _lift, _rate, _finite, log_w = point(kind, closed, dual, src, inner, vocab, scale,
                                                 total, beta, alpha, s, top, j, LOGITS, B)
    return log_w


# ----------------------------------------------------------------------------- probes


@called
def probe(dual, kind, closed, src, inner, tails, vocab, scale, total, alpha, log_lam, s, columns,
          top, LOGITS: tl.constexpr, SMALLEST: tl.constexpr, B: tl.constexpr):
    """`search.probe` over the first ``columns`` entries, block by block (the mass added at s
    summed with a carry): (low, high, m, D at m, step)."""
    beta = alpha - 1.0
    carry = tl.full((), 0.0, tl.float64)
    above_s = tl.full((), 0, tl.int64)
    maybe = above_s
    exceeds = above_s
    may_exceed = above_s
    below = above_s
    tolerance = TERM_ROUNDING * (1.0 + tl.abs(log_lam))
    rounding = SUM_ROUNDING * columns.to(tl.float64) + 1e-15
    for first in range(0, columns, B):
        x, log_x, deficit, pos = entries(src, tails, first, vocab, scale, total, LOGITS,
                                         SMALLEST, B)
        active = pos < columns
        finite = isfinite64(log_x)
        lp = tl.where(finite, log_x, 0.0)
        log_q, _rate, lift = probe_values(kind, closed, lp, finite, beta, s, top, inner + pos,
                                          pos < vocab)
        q = exp64(log_q)
        terms = tl.where(active, tl.where(finite, x * expm1_64(lift), q), 0.0)
        added = carry + tl.cumsum(terms, 0)
        carry += tl.sum(terms, axis=0)
        margin = deficit * rounding
        above_s += tl.sum((active & (added < deficit - margin)).to(tl.int64), axis=0)
        maybe += tl.sum((active & (added < deficit + margin)).to(tl.int64), axis=0)
        below += tl.sum((active & (added < deficit)).to(tl.int64), axis=0)
        log_w = log_entry_term(dual, log_x, log_q, alpha)
        exceeds += tl.sum((active & (log_w > log_lam + tolerance)).to(tl.int64), axis=0)
        may_exceed += tl.sum((active & (log_w > log_lam - tolerance)).to(tl.int64), axis=0)
    low = tl.minimum(above_s, exceeds)
    known = (maybe < columns) & (may_exceed < columns)
    high = tl.where(known, tl.maximum(maybe + 1, may_exceed), 9223372036854775807)
    size = below + 1
    m = tl.minimum(tl.maximum(size, 1), columns - 1)
    # D at m and its Newton step (the moves of the entries before m; log w_j's slope in j
    # over a stencil of about m / 64 entries)
    reach = tl.maximum(m // 64, 1)
    ahead = tl.minimum(m + reach, columns - 1)
    behind = tl.maximum(m - reach, 0)
    moves = tl.full((), 0.0, tl.float64)
    for first in range(0, m, B):
        log_x, finite, lp, pos = block_lp(src, first, vocab, scale, total, LOGITS, B)
        log_q, rate, _lift = probe_values(kind, closed, lp, finite, beta, s, top, inner + pos,
                                          pos < vocab)
        moves += tl.sum(tl.where(pos < m, exp64(log_q) * rate, 0.0), axis=0)
    s_map = tl.where(kind == 2, exp64(s), s)
    log_q_m, lift_m, rate_m, finite_m, log_w_m = point(
        kind, closed, dual, src, inner, vocab, scale, total, beta, alpha, s_map, top, m, LOGITS, B)
    rate_m = tl.where(kind == 2, rate_m * s_map, rate_m)
    w_ahead = term_at(kind, closed, dual, src, inner, vocab, scale, total, beta, alpha, s_map, top,
                      ahead, LOGITS, B)
    w_behind = term_at(kind, closed, dual, src, inner, vocab, scale, total, beta, alpha, s_map, top,
                       behind, LOGITS, B)
    residual = log_w_m - log_lam
    slope_q = term_slope(dual, alpha, lift_m, finite_m) * rate_m
    per_entry = (w_ahead - w_behind) / (ahead - behind).to(tl.float64)
    slope = slope_q - per_entry * moves / exp64(log_q_m)
    target = tl.where(residual > 0, -STRADDLE, STRADDLE)
    step = tl.where(size < columns, (target - residual) / slope, float("nan"))
    return low, high, m, residual, step


@device
def probes(dual, kind, closed, src, inner, tails, vocab, scale, total, alpha, log_lam, low, high,
           aim, cap, top, LOGITS: tl.constexpr, SMALLEST: tl.constexpr, B: tl.constexpr):
    """`kernels.search.probes` on a round of the first ``cap`` entries of the sorted row (the
    torch search's rounds of candidates, `core.step.decode_exact`): probes on the scalar until
    the bracket [low, high] of k* is one size wide, or at most `SETTLE` wide and no longer
    narrowing (or three probes in a row), or known to pass the round, or pointed past it; the
    first probe at ``aim`` (the last round's Newton aim; NaN: near the scalar of ``low``).
    Returns (low, high, the last probe's scalar, whether k* lies past the round, the scalar
    the last Newton step aimed at)."""
    beta = alpha - 1.0
    widest = tl.maximum(tl.minimum(high, cap) - 1, 1)
    s_low, s_high, s = scalar_range(kind, src, tails, vocab, scale, total, beta, widest,
                                    tl.minimum(tl.maximum(low, 1), widest), top, LOGITS,
                                    SMALLEST, B)
    s = tl.where(aim == aim, aim, s)
    s = tl.minimum(tl.maximum(s, s_low), s_high)
    last = s
    ahead = s
    nan = tl.full((), float("nan"), tl.float64)
    d_low = nan
    d_high = nan
    above = low < 0  # (False)
    wider = above
    stale = low * 0
    columns = tl.minimum(high, cap)
    count = tl.full((), 0, tl.int32)
    go = (high - low > 1) & ((high <= cap) | (low < cap - 1))
    while go:
        found_low, found_high, m, residual, step = probe(
            dual, kind, closed, src, inner, tails, vocab, scale, total, alpha, log_lam, s, columns,
            top, LOGITS, SMALLEST, B)
        hi = tl.minimum(high, found_high)
        lo = tl.minimum(tl.maximum(low, found_low), hi)
        narrowed = (lo > low) | (hi < high)
        low = lo
        high = hi
        last = s
        up = residual > 0
        down = residual <= 0
        d_low = tl.where(up & above, 0.5 * d_low, d_low)
        d_high = tl.where(down & ~above, 0.5 * d_high, d_high)
        s_high = tl.where(up, s, s_high)
        d_high = tl.where(up, residual, d_high)
        s_low = tl.where(down, s, s_low)
        d_low = tl.where(down, residual, d_low)
        above = up
        proposal = s + step
        ahead = tl.where(proposal == proposal, proposal, s)
        inside = (proposal > s_low) & (proposal < s_high)
        share = tl.minimum(tl.maximum(d_low / (d_low - d_high), 0.05), 0.95)
        share = tl.where(share != share, 0.5, share)
        stale = tl.where(narrowed, 0, stale + 1)
        s_next = tl.where(inside, proposal, s_low + share * (s_high - s_low))
        count += 1
        # (D is not known past the round: the probes cannot settle a k* there, where D points
        # (at the round's end, or its Newton step below every size's scalar in the round))
        wider = up & (hi > cap) & (((m >= cap - 1) & (columns == cap)) | (
            (proposal < s_low) & (d_low != d_low)))
        go = (hi - lo > 1) & (narrowed | ((hi - lo > SETTLE) & (stale < 3))) & ~wider & \
            (s_high - s_low > 1e-14 * (1.0 + tl.abs(s))) & ((hi <= cap) | (lo < cap - 1)) & \
            (count < PROBES)
        columns = tl.minimum(hi + 2, cap)
        s = s_next
    past = ((high > cap) & (low >= cap - 1)) | wider
    return low, high, last, past, ahead


@called
def scalar_range(kind, src, tails, vocab, scale, total, beta, widest, size, top,
                 LOGITS: tl.constexpr, SMALLEST: tl.constexpr, B: tl.constexpr):
    """`kernels.search.scalar_range` in the probes' scalar: the scalar of ``widest`` (a lower
    bound of every size's up to it), size 1's (an upper bound) and a start near that of
    ``size``."""
    deficit = deficit_at(src, tails, widest - 1, vocab, scale, total, LOGITS, SMALLEST, B)
    at_size = deficit_at(src, tails, size - 1, vocab, scale, total, LOGITS, SMALLEST, B)
    log_r = log64(deficit)
    log_r_size = log64(at_size)
    if kind == 1:
        low, _start_widest, high = level_range(top, beta, log_r, widest)
        _low_size, start, _high_size = level_range(top, beta, log_r_size, size)
    elif kind == 2:
        low, _start_widest, high = top_range(top, log_r)
        _low_size, start, _high_size = top_range(top, log_r_size)
    else:  # `outer_bracket`'s low of the widest, its start of ``size``
        low, _high, _first, _r = bracket(kind, src, tails, vocab, scale, total, beta, widest, top,
                                         LOGITS, SMALLEST, B)
        high = log1p64(-exp64(top))
        _low, _high_size, start, _r_size = bracket(kind, src, tails, vocab, scale, total, beta,
                                                   size, top, LOGITS, SMALLEST, B)
    return low, high, start


# ----------------------------------------------------------------------------- exact gaps


@called
def decide_gap(dual, kind, closed, src, inner, vocab, scale, total, alpha, log_lam, m, s, s_next,
               top, LOGITS: tl.constexpr, SMALLEST: tl.constexpr, B: tl.constexpr):
    """`kernels.search.decide_gap` from the scalars of sizes m and m + 1: log G(m), or a bound
    of it on the same side of log lambda (weak duality first; the log-space formulas of
    `primal_log_gap` / `dual_log_gap` over the support's blocks for the rest)."""
    beta = alpha - 1.0
    p_next = log_x_at(src, m, scale, total, LOGITS)
    upper = term_at(kind, closed, dual, src, inner, vocab, scale, total, beta, alpha, s, top, m,
                    LOGITS, B)
    q_next_m, _lift, _rate, _finite, lower = point(kind, closed, dual, src, inner, vocab, scale,
                                                   total, beta, alpha, s_next, top, m, LOGITS, B)
    if upper <= log_lam:
        value = upper
    elif lower > log_lam:
        value = lower
    else:
        norm_next, _nan = normalizer(kind, closed, src, inner, vocab, scale, total, beta, m + 1,
                                     s_next, top, LOGITS, SMALLEST, B)
        terms = tl.full((), float("-inf"), tl.float64)
        for first in range(0, m, B):
            log_x, finite, lp, pos = block_lp(src, first, vocab, scale, total, LOGITS, B)
            _log_q_here, _rate_here, lift = map_values(kind, closed, lp, finite, beta, s, top,
                                                       inner + pos, pos < vocab)
            log_q_next, _rate_next, lift_next = map_values(kind, closed, lp, finite, beta,
                                                          s_next, top, inner + pos, pos < vocab)
            inside = pos < m
            rho = lift - lift_next
            rho = tl.where(inside & isfinite64(rho), rho, 0.0)
            lqn = log_q_next - norm_next
            if dual:
                lpi = tl.where(inside, log_x, 0.0)
                one = log64(beta) + alpha * lqn + alpha_kernel(alpha, rho)
                two = log64(tl.abs(2.0 - alpha)) + lpi + beta * lqn + alpha_kernel(beta, rho)
                log_terms = tl.where(alpha <= 2.0, logaddexp64(one, two), logsubexp64(one, two))
            else:
                log_terms = alpha * lqn + alpha_kernel(alpha, rho)
            terms = logaddexp64(terms, logsumexp64(log_terms, inside))
        if dual:
            last = log_entry_term(1, p_next, q_next_m - norm_next, alpha)
        else:
            last = alpha * (q_next_m - norm_next) - log64(alpha)
        value = logaddexp64(terms, last)
    return value


@device
def settle(dual, kind, closed, src, inner, tails, vocab, scale, total, alpha, log_lam, low, high, s,
           top, LOGITS: tl.constexpr, SMALLEST: tl.constexpr, B: tl.constexpr):
    """`kernels.search.settle`: the smallest k in [low, high] with G(k) <= lambda (or high) by
    exact gaps, Algorithm 2's halving until at most `SETTLE` sizes are left, then the bracket's
    low end. Returns (k, the scalar of k's map where a gap's maps held it, else NaN, whether a
    gap came out NaN: then k is not known)."""
    beta = alpha - 1.0
    held = low * 0 - 1
    held_s = s
    answer_s = tl.full((), float("nan"), tl.float64)
    broken = low < 0  # (False)
    while low < high:
        span = high - low
        m = tl.where(span <= SETTLE, low, low + span // 2)
        m = tl.minimum(m, high - 1)
        s_next = solve(kind, closed, src, inner, tails, vocab, scale, total, beta, m + 1, held_s,
                       top, LOGITS, SMALLEST, B)
        value = term_at(kind, closed, dual, src, inner, vocab, scale, total, beta, alpha, s_next,
                        top, m, LOGITS, B)
        s_m = held_s
        if value <= log_lam:
            if held != m:
                s_m = solve(kind, closed, src, inner, tails, vocab, scale, total, beta, m, s_next,
                            top, LOGITS, SMALLEST, B)
            value = decide_gap(dual, kind, closed, src, inner, vocab, scale, total, alpha, log_lam,
                               m, s_m, s_next, top, LOGITS, SMALLEST, B)
        broken = broken | (value != value) | (s_next != s_next)
        if value > log_lam:
            low = m + 1
            answer_s = s_next
        else:
            high = m
            answer_s = s_m
        held = m + 1
        held_s = s_next
    return low, tl.where(held >= 0, answer_s, float("nan")), broken


# ----------------------------------------------------------------------------- closed forms


@called
def closed_search(family, src, tails, vocab, scale, total, lam, limit,
                  LOGITS: tl.constexpr, SMALLEST: tl.constexpr, B: tl.constexpr):
    """`formulas.closed_search` over the whole row: the first k with G(k) <= lambda or k =
    limit (KL, alpha = 3/2 and 2, their gaps in closed form: `formulas.closed_gaps`), block by
    block with the prefix sums carried."""
    local = tl.arange(0, B)
    k = tl.full((), 0, tl.int64) + vocab
    prefix = tl.full((), 0.0, tl.float64)
    roots = prefix
    first = tl.full((), 0, tl.int64)
    while (k == vocab) & (first < vocab):
        x, _log_x, deficit, pos = entries(src, tails, first, vocab, scale, total, LOGITS,
                                          SMALLEST,
                                     B)
        after = tl.minimum(first + B, vocab - 1)
        x_after = x_at(src, first + B, vocab, scale, total, LOGITS, SMALLEST)
        deficit_after = deficit_at(src, tails, after, vocab, scale, total, LOGITS, SMALLEST, B)
        last = local == B - 1
        x_next = tl.where(last, x_after, shifted(x, local, B))
        sizes = (pos + 1).to(tl.float64)
        if family == KL:
            gaps = kl_gap(prefix + tl.cumsum(x, 0), x_next)
        elif family == SQUARE:
            gaps = square_gaps(x_next, deficit, sizes)
        else:
            r = roots + tl.cumsum(sqrt64(x), 0)
            c = three_halves_shift(r, deficit, sizes)
            r_after = tl.sum(tl.where(last, r, 0.0), axis=0) + sqrt64(x_after)
            c_after = three_halves_shift(r_after, deficit_after,
                                         (first + B + 1).to(tl.float64))
            c_next = tl.where(last, c_after, shifted(c, local, B))
            gaps = three_halves_gap(r, c, c_next, x_next, sizes)
        prefix += tl.sum(x, axis=0)
        roots += tl.sum(sqrt64(x), axis=0)
        stop = ((gaps <= lam) | (pos + 1 >= limit)) & (pos < vocab - 1)
        k = tl.min(tl.where(stop, pos + 1, vocab), axis=0).to(tl.int64)
        first += B
    return k


@called
def closed_scalars(family, src, tails, vocab, scale, total, k,
                   LOGITS: tl.constexpr, SMALLEST: tl.constexpr, B: tl.constexpr):
    """What a closed-form map of size k needs besides each entry (`formulas.closed_map`): log
    R_k and one scalar: KL's log S_k, alpha = 3/2's log sum sqrt(p_i), the water level (the
    first c_j = R_j / (k - j) at or above p_(j+1), R_j the mass from j on), the number of
    entries tied with the largest."""
    deficit = deficit_at(src, tails, k - 1, vocab, scale, total, LOGITS, SMALLEST, B)
    top = log_x_at(src, 0, scale, total, LOGITS)
    scalar = tl.full((), float("-inf"), tl.float64)
    level = tl.full((), float("nan"), tl.float64)
    for first in range(0, k, B):
        x, log_x, deficit_j, pos = entries(src, tails, first, vocab, scale, total, LOGITS,
                                           SMALLEST, B)
        inside = pos < k
        if family == KL:
            scalar = logaddexp64(scalar, logsumexp64(log_x, inside))
        elif family == THREE_HALVES:
            scalar = logaddexp64(scalar, logsumexp64(0.5 * log_x, inside))
        elif family == WATER:
            p = tl.where(inside, exp64(log_x), 0.0)
            c = (x + deficit_j) / tl.maximum((k - pos).to(tl.float64), 1.0)
            hit = inside & (c >= p)
            if (level != level) & (tl.max(hit.to(tl.int32), axis=0) > 0):
                level = at(c, pos, tl.min(tl.where(hit, pos, vocab), axis=0))
        elif family == ARGMAX:
            tied = tl.sum((inside & (log_x == top)).to(tl.float64), axis=0)
            scalar = tl.where(scalar == float("-inf"), 0.0, scalar) + tied
    if family == WATER:
        scalar = level
    return log64(deficit), scalar, top


@device
def closed_values_of(family, log_x, inside, log_deficit, k, scalar, top):
    """A closed-form map's log q on a block (`formulas.closed_map`, its sums in ``scalar``)."""
    if family == KL:
        log_q = tl.where(inside, log_x - scalar, float("-inf"))
    elif family == THREE_HALVES:
        log_q = three_halves_values(log_x, inside, log_deficit, k, scalar)
    elif family == SQUARE:
        log_q = square_map(log_x, inside, log_deficit, k)
    elif family == WATER:
        log_q = water_values(log_x, inside, scalar)
    else:
        log_q = argmax_values(log_x, inside, log_deficit, top, scalar)
    return log_q


@device
def is_closed_map(family):
    """The families whose fixed-size map is closed-form (`formulas.closed_map`)."""
    return (family == KL) | (family == THREE_HALVES) | (family == SQUARE) | \
        (family == WATER) | (family == ARGMAX)


# ----------------------------------------------------------------------------- one row


@device
def search(dual, kind, closed, src, inner, tails, vocab, scale, total, alpha, lam, low, limit, top,
           LOGITS: tl.constexpr, SMALLEST: tl.constexpr, B: tl.constexpr):
    """`kernels.search.search_row` on the whole row (``low``: the search pass's certified lower
    bound on k*): the floor of the gaps, the probes, the exact gaps. Returns `settle`'s."""
    log_lam = log64(lam)
    lo = tl.minimum(tl.maximum(low, 1), limit)
    hi = limit
    # the floor: an entry whose term exceeds lambda at q = p has G(j - 1) > lambda
    tolerance = TERM_ROUNDING * (1.0 + tl.abs(log_lam))
    count = tl.full((), 0, tl.int64)
    for first in range(0, vocab, B):
        log_x, _pos = block_log_x(src, first, vocab, scale, total, LOGITS, B)
        floor = log_entry_term(dual, log_x, log_x, alpha)
        count += tl.sum((floor > log_lam + tolerance).to(tl.int64), axis=0)
    lo = tl.maximum(lo, tl.minimum(count, hi))
    # rounds of candidates as the torch search's (`core.step.decode_exact`): the first
    # ``FIRST`` entries, then GROWTH times as many, the whole row at once where the round after
    # would be the widest
    s = tl.full((), float("nan"), tl.float64)
    aim = s
    cap = tl.minimum(vocab, FIRST).to(tl.int64)
    more = hi - lo > 1
    while more:
        lo, hi, s, past, aim = probes(dual, kind, closed, src, inner, tails, vocab, scale,
                                      total, alpha, log_lam, lo, hi, aim, cap, top, LOGITS,
                                      SMALLEST, B)
        more = past & (cap < vocab)
        grown = cap * GROWTH
        cap = tl.where(more, tl.where(grown * 2 >= vocab, vocab, grown), cap)
    if kind == 2:
        s = exp64(s)  # (the map's solver takes delta itself)
    return settle(dual, kind, closed, src, inner, tails, vocab, scale, total, alpha, log_lam, lo,
                  hi, s, top, LOGITS, SMALLEST, B)


@device
def values_block(family, closed_form, kind, closed, src, inner, vocab, scale, total, beta, k, s,
                 norm, log_deficit, scalar, top, first, LOGITS: tl.constexpr,
                 SMALLEST: tl.constexpr, B: tl.constexpr):
    """log T_k on the block at ``first`` (normalized): a closed form's, or the map at s less
    its normalizer."""
    log_x, pos = block_log_x(src, first, vocab, scale, total, LOGITS, B)
    inside = pos < k
    if closed_form:
        log_q = closed_values_of(family, log_x, inside, log_deficit, k.to(tl.float64), scalar,
                                 top)
    else:
        finite = isfinite64(log_x)
        lp = tl.where(finite, log_x, 0.0)
        log_q, _rate, _lift = map_values(kind, closed, lp, finite, beta, s, top, inner + pos,
                                         pos < vocab)
        log_q = tl.where(inside, log_q - norm, float("-inf"))
    return log_q, pos, inside


@triton.jit(do_not_specialize=["stride", "vocab", "scores_stride", "row_len", "tails_stride"])
def wide_kernel(sorted_ptr, stride, vocab, scores_ptr, scores_stride, row_len, map_ptr,
                family_ptr, fixed_ptr, size_ptr, alpha_ptr, lam_ptr, row_mode_ptr,
                temperature_ptr, scale_ptr, total_ptr, needs_ptr, flagged_ptr, low_ptr,
                tails_ptr, tails_stride, inner_ptr, k_ptr, mode_ptr,
                LOGITS: tl.constexpr, SMALLEST: tl.constexpr, B: tl.constexpr):
    """One row the search pass left ``needs`` (the others leave at once), on its ``vocab``
    sorted candidates (``sorted_ptr``: the whole row sorted, or its top entries, the mass of
    the others read from the row as given, ``scores_ptr``; overwritten with the values to
    write on the support: ``mode`` 4): a fixed size's map, the closed-form gaps, or the search
    (`search`), then log T_k*. A map with a NaN is not written (the row stays flagged: the
    window's answer, or left as it came)."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(needs_ptr + row) == 0:
        return
    slot, family, fixed, size, alpha, lam, dual, temperature = request_at(
        map_ptr, family_ptr, fixed_ptr, size_ptr, alpha_ptr, lam_ptr, row_mode_ptr,
        temperature_ptr, row)
    scale = tl.load(scale_ptr + slot).to(tl.float64)
    total = tl.load(total_ptr + row)
    src = sorted_ptr + row * stride
    tails = tails_ptr + row * tails_stride
    inner = inner_ptr + row * vocab  # (the dual's inner roots, `map_values`)
    tail = tl.full((), 0.0, tl.float64)
    if vocab < row_len:
        tail = outside_mass(scores_ptr + row * scores_stride, row_len, src, vocab, scale, total,
                            LOGITS, SMALLEST, B)
    known = prepare(src, tails, inner, vocab, scale, total, tail, LOGITS, SMALLEST, B)
    top = log_x_at(src, 0, scale, total, LOGITS)
    beta = alpha - 1.0
    kind = tl.where(dual, 0, tl.where(alpha > 1.0, 1, 2))
    closed = tl.where((family == DUAL_THREE_HALVES) | (family == DUAL_THREE), family, 0)
    closed_form = (fixed & is_closed_map(family)) | (~fixed & closed_gap_family(family))
    s = tl.full((), float("nan"), tl.float64)
    broken = fixed & ~fixed  # (False)
    if fixed:
        k = tl.maximum(tl.minimum(known, size), 1)
    elif closed_gap_family(family):
        k = closed_search(family, src, tails, vocab, scale, total, lam,
                          tl.minimum(known, size), LOGITS, SMALLEST, B)
    else:
        k, s, broken = search(dual, kind, closed, src, inner, tails, vocab, scale, total, alpha,
                              lam, tl.load(low_ptr + row), tl.maximum(tl.minimum(known, size), 1),
                              top, LOGITS, SMALLEST, B)
    log_deficit = tl.full((), 0.0, tl.float64)
    scalar = log_deficit
    norm = log_deficit
    if closed_form:
        log_deficit, scalar, top = closed_scalars(family, src, tails, vocab, scale, total, k,
                                                  LOGITS, SMALLEST, B)
    else:
        if s != s:
            s = solve(kind, closed, src, inner, tails, vocab, scale, total, beta, k, s, top, LOGITS,
                      SMALLEST, B)
        norm, nan = normalizer(kind, closed, src, inner, vocab, scale, total, beta, k, s, top,
                               LOGITS, SMALLEST, B)
        norm = tl.where(nan, float("nan"), norm)
    # (a NaN scalar is not always seen in the values: min / max drop NaN operands)
    bad = (norm != norm) | broken | (~closed_form & (s != s))
    if closed_form:  # (the general maps' normalizer saw every value)
        for first in range(0, k, B):
            log_q, _pos, inside = values_block(family, closed_form, kind, closed, src, inner, vocab,
                                            scale, total, beta, k, s, norm, log_deficit,
                                            scalar, top, first, LOGITS, SMALLEST, B)
            bad = bad | (tl.max((inside & (log_q != log_q)).to(tl.int32), axis=0) > 0)
    if bad == 0:
        for first in range(0, k, B):
            log_q, pos, inside = values_block(family, closed_form, kind, closed, src, inner, vocab,
                                              scale, total, beta, k, s, norm, log_deficit,
                                              scalar, top, first, LOGITS, SMALLEST, B)
            tl.debug_barrier()  # (the block read before it is overwritten)
            if LOGITS:
                tl.store(src + pos, log_q * temperature, mask=inside)
            else:
                tl.store(src + pos, exp64(log_q), mask=inside)
        tl.store(k_ptr + row, k)
        tl.store(mode_ptr + row, 4)
        tl.store(needs_ptr + row, 0)
        tl.store(flagged_ptr + row, -1)
