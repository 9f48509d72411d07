"""Bregman decoding of a batch of next-token distributions: the public entry points.

Pipeline, per batch (every step is vectorized over rows; loops run over rounds, iterations and
parameter groups, never over rows):

1. Validate and broadcast ``alpha``, ``lam``, ``top_k``, ``k_max`` to one value per row
   (`bregman_vllm.params`); rows whose answer is the input itself (lambda = 0 without a cap) and
   rows that are not distributions pass through.
2. Candidates: the W largest entries of each row, found without sorting the vocabulary (block
   maxima -> top blocks -> top entries, exact), with the mass of everything else summed as
   positive terms (no cancellation in the deficit 1 - S_k).
3. Support size. Fixed k: min(top_k, k_max, number of nonzero entries). Adaptive: the smallest k
   with G(k) <= lambda (`gaps`), in closed form over all k for (primal, 1), (primal, 3/2) and
   alpha = 2, otherwise by galloping then binary search on the sign of G(m) - lambda, each probe
   solving T_m and T_(m+1) exactly. The greedy property (Theorems greedy_optimal, greedy-dual)
   makes the top-k sets optimal; k-convexity (Theorem convex_cost) makes the first k with
   G(k) <= lambda the global minimizer. A row whose k* is not certified inside its W candidates
   goes to the next round with 8 W candidates (up to the whole row).
4. Renormalize the top k* entries with T_alpha (primal) or T*_alpha (dual) in log space, and
   scatter the result into zeros (probabilities) or -inf (logits).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..params import (
    BregmanParamError,
    alpha_range,
    parse_mode,
)
from .dual import dual_log_renorm
from .gaps import closed_form_gaps, dual_log_gap, has_closed_form, primal_log_gap
from .generators import (
    BregmanGenerator,
    generic_dual_renorm,
    generic_gap,
    generic_primal_renorm,
)
from .primal import primal_log_renorm, support_mask

Tensor = torch.Tensor

#: Width of the first candidate set; rows whose k* is not certified inside it get 8x more.
INITIAL_CANDIDATES = 64
#: Block length of the two-stage top-k used to find candidates without sorting the vocabulary.
BLOCK = 64
_GROWTH = 8
_FULL_SORT_FRACTION = 4


class BregmanOutput(NamedTuple):
    """Decoded distribution (same shape and dtype as the input) and support size per row."""

    probs: Tensor
    k: Tensor


# ----------------------------------------------------------------------------- parameters


def _row_values(value, name: str, batch_shape: torch.Size, device, dtype) -> Tensor:
    """Broadcast a Python number or tensor to one float64 value per row (flattened)."""
    if isinstance(value, bool):
        raise BregmanParamError(name, f"must be a number, got {value!r}")
    if isinstance(value, Tensor):
        tensor = value.to(device=device, dtype=torch.float64)
    elif isinstance(value, (int, float)):
        tensor = torch.tensor(float(value), dtype=torch.float64, device=device)
    elif isinstance(value, str):
        from ..params import parse_alpha
        tensor = torch.tensor(parse_alpha(value, name), dtype=torch.float64, device=device)
    else:
        raise BregmanParamError(name, f"must be a number or a tensor, got {type(value).__name__}")
    try:
        tensor = torch.broadcast_to(tensor, batch_shape)
    except RuntimeError:
        raise BregmanParamError(
            name, f"shape {tuple(tensor.shape)} does not broadcast to the batch shape "
            f"{tuple(batch_shape)}") from None
    return tensor.reshape(-1)


def _row_sizes(value, name: str, batch_shape: torch.Size, device) -> Tensor:
    """Broadcast top_k / k_max to one int64 per row; 0 means "not set"."""
    if value is None:
        return torch.zeros(batch_shape, dtype=torch.long, device=device).reshape(-1)
    if isinstance(value, bool):
        raise BregmanParamError(name, f"must be an integer >= 1, got {value!r}")
    if isinstance(value, Tensor):
        if value.is_floating_point() and not bool((value == value.round()).all()):
            raise BregmanParamError(name, "must hold integers >= 1 (or 0 for 'not set')")
        tensor = value.to(device=device, dtype=torch.long)
        if bool((tensor < 0).any()):
            raise BregmanParamError(name, "must hold integers >= 1 (or 0 for 'not set')")
    else:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or value < 1:
            raise BregmanParamError(name, f"must be an integer >= 1, got {value!r}")
        tensor = torch.tensor(value, dtype=torch.long, device=device)
    try:
        tensor = torch.broadcast_to(tensor, batch_shape)
    except RuntimeError:
        raise BregmanParamError(name, f"shape {tuple(tensor.shape)} does not broadcast to the "
                                f"batch shape {tuple(batch_shape)}") from None
    return tensor.reshape(-1)


def _check_alpha_rows(alpha: Tensor, mode: str, fixed: Tensor, name: str) -> None:
    """Apply the parameter model's alpha ranges to every row (vectorized)."""
    for is_fixed in (False, True):
        rows = fixed == is_fixed
        if not bool(rows.any()):
            continue
        allowed = alpha_range(mode, is_fixed)
        a = alpha[rows]
        ok = ~torch.isnan(a)
        ok &= (a >= allowed.low) if allowed.low_closed else (a > allowed.low)
        ok &= (a <= allowed.high) if allowed.high_closed else (a < allowed.high)
        if allowed.exclude_zero:
            ok &= a != 0
        if not bool(ok.all()):
            bad = float(a[~ok][0])
            selection = "fixed-k" if is_fixed else "adaptive"
            raise BregmanParamError(
                name, f"must be in {allowed.text()} for {selection} {mode} decoding, got {bad:g}; "
                f"{allowed.why}")


class _Plan(NamedTuple):
    mode: str
    alpha: Tensor  # [N] float64
    lam: Tensor  # [N] float64
    fixed_k: Tensor  # [N] int64, 0 = adaptive
    k_max: Tensor  # [N] int64, 0 = no cap
    generator: BregmanGenerator | None = None
    # Derived once per plan (in vLLM: once per batch change), not at every decoding step.
    keep_rows: Tensor | None = None  # lambda = 0 and no fixed k: every nonzero entry is kept
    decode_rows: Tensor | None = None  # the other rows
    alpha_values: tuple[float, ...] = ()  # distinct alphas of decode_rows (none: generator)
    decoded: _Plan | None = None  # the plan of decode_rows alone, when they are not all rows


def _plan(batch_shape, device, alpha, lam, mode, k_max, top_k, generator=None) -> _Plan:
    mode = parse_mode(mode, "mode", allow_off=False)
    if generator is not None:
        if alpha is not None:
            raise BregmanParamError("alpha", "give either alpha or generator, not both")
        if not isinstance(generator, BregmanGenerator):
            raise BregmanParamError(
                "generator", "must implement phi, dphi, d2phi and inv_dphi (BregmanGenerator)")
        alpha = 0.0  # unused placeholder; the generator defines the divergence
    elif alpha is None:
        raise BregmanParamError("alpha", "is required")
    alpha_rows = _row_values(alpha, "alpha", batch_shape, device, torch.float64)
    lam_rows = _row_values(lam, "lam", batch_shape, device, torch.float64)
    if not bool((torch.isfinite(lam_rows) & (lam_rows >= 0)).all()):
        bad = float(lam_rows[~(torch.isfinite(lam_rows) & (lam_rows >= 0))][0])
        raise BregmanParamError("lam", f"must be a finite number in [0, inf), got {bad:g}")
    top = _row_sizes(top_k, "top_k", batch_shape, device)
    cap = _row_sizes(k_max, "k_max", batch_shape, device)
    if generator is None:
        _check_alpha_rows(alpha_rows, mode, top > 0, "alpha")
    return _assemble(mode, alpha_rows, lam_rows, top, cap, generator)


def _assemble(mode: str, alpha: Tensor, lam: Tensor, top: Tensor, cap: Tensor,
              generator: BregmanGenerator | None = None) -> _Plan:
    """Per-row plan from validated values (top/cap: 0 = not set)."""
    fixed = torch.where(cap > 0, torch.minimum(top, cap), top)
    fixed = torch.where(top > 0, fixed, 0)
    # lambda = 0 keeps every nonzero entry: the adaptive problem becomes fixed k = k_max.
    zero_lam = (top == 0) & (lam == 0)
    fixed = torch.where(zero_lam, cap, fixed)
    return _derive(_Plan(mode, alpha, lam, fixed, cap, generator))


def _derive(plan: _Plan) -> _Plan:
    """``plan`` with its derived fields filled in."""
    keep_all = (plan.fixed_k == 0) & (plan.lam == 0)
    keep_rows = keep_all.nonzero().squeeze(-1)
    decode_rows = (~keep_all).nonzero().squeeze(-1)
    values = () if plan.generator is not None else \
        tuple(torch.unique(plan.alpha[decode_rows]).tolist())
    plan = plan._replace(keep_rows=keep_rows, decode_rows=decode_rows, alpha_values=values)
    if 0 < decode_rows.numel() < keep_all.shape[0]:
        plan = plan._replace(decoded=_derive(_Plan(
            plan.mode, *(t[decode_rows] for t in (plan.alpha, plan.lam, plan.fixed_k,
                                                  plan.k_max)), plan.generator)))
    return plan


# ----------------------------------------------------------------------------- candidates


class _Candidates(NamedTuple):
    log_p: Tensor  # [n, W] float64, sorted decreasingly, normalized by the row total; -inf = 0
    x: Tensor  # [n, W] float64 probabilities (normalized)
    index: Tensor  # [n, W] vocabulary positions
    deficit: Tensor  # [n, W + 1] float64: R_j = 1 - S_j for j = 0..W
    positive: Tensor  # [n] number of positive entries among the candidates
    complete: Tensor  # [n] bool: no positive entry outside the candidates


def _take(cand: _Candidates, rows: Tensor) -> _Candidates:
    """The candidates of ``rows`` (sorted row numbers); no copy when that is every row, which is
    the common case and saves copying [n, W] float64 tensors at every probe of the search."""
    if rows.numel() == cand.x.shape[0]:
        return cand
    return _Candidates(*(t[rows] for t in cand))


def _top_candidates(p: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """Values and positions of the ``width`` largest entries per row, sorted, and the float64 sum
    of all other entries (formed from positive terms only)."""
    n, vocab = p.shape
    if width >= vocab:
        values, index = torch.sort(p, dim=-1, descending=True)
        return values, index, torch.zeros(n, dtype=torch.float64, device=p.device)
    if width * BLOCK * 4 > vocab:
        values, index = torch.topk(p, width, dim=-1)
        rest = p.scatter(1, index, 0.0).sum(-1, dtype=torch.float64)
        return values, index, rest
    full = vocab // BLOCK
    blocks = p[:, : full * BLOCK].unflatten(1, (full, BLOCK))
    block_max = blocks.amax(-1)
    block_sum = blocks.sum(-1)
    if vocab % BLOCK:
        tail = p[:, full * BLOCK:]
        block_max = torch.cat([block_max, tail.amax(-1, keepdim=True)], 1)
        block_sum = torch.cat([block_sum, tail.sum(-1, keepdim=True)], 1)
    # The top-`width` entries lie in the `width` blocks with the largest maxima.
    chosen = torch.topk(block_max, width, dim=-1).indices
    offsets = (chosen.unsqueeze(-1) * BLOCK + torch.arange(BLOCK, device=p.device)).flatten(1)
    valid = offsets < vocab
    gathered = torch.gather(p, 1, offsets.clamp_max(vocab - 1))
    gathered = torch.where(valid, gathered, -1.0)  # padding sorts below every probability
    values, where_in = torch.topk(gathered, width, dim=-1)
    index = torch.gather(offsets, 1, where_in)
    other_blocks = block_sum.to(torch.float64).scatter(1, chosen, 0.0).sum(-1)
    other_gathered = gathered.clamp_min(0).to(torch.float64).scatter(1, where_in, 0.0).sum(-1)
    return values, index, other_blocks + other_gathered


def _candidates(p: Tensor, width: int) -> tuple[_Candidates, Tensor]:
    """The candidates of each row and the row total (float64) they were normalized by."""
    values, index, rest = _top_candidates(p, width)
    x = values.to(torch.float64).clamp_min(0.0)
    total = torch.where(torch.isnan(values).any(-1), math.nan, x.sum(-1) + rest)
    x = x / total.unsqueeze(-1)
    tail = rest / total
    suffix = torch.flip(torch.cumsum(torch.flip(x, [-1]), -1), [-1])
    deficit = torch.cat([suffix, torch.zeros_like(tail).unsqueeze(-1)], -1) + tail.unsqueeze(-1)
    positive = (x > 0).sum(-1)
    complete = (positive < x.shape[-1]) | (tail <= 0)
    return _Candidates(torch.log(x), x, index, deficit, positive, complete), total


# ----------------------------------------------------------------------------- renormalization


def _log_renorm(mode: str, log_p: Tensor, k: Tensor, alpha: Tensor, log_deficit: Tensor,
                generator: BregmanGenerator | None = None) -> Tensor:
    if generator is not None:
        mask = support_mask(k, log_p.shape[-1])
        renorm = generic_primal_renorm if mode == "primal" else generic_dual_renorm
        return torch.log(renorm(torch.exp(log_p), mask, generator))
    if mode == "primal":
        return primal_log_renorm(log_p, k, alpha, log_deficit)
    return dual_log_renorm(log_p, k, alpha, log_deficit)


def _renorm_at(mode: str, cand: _Candidates, k: Tensor, alpha: Tensor,
               generator: BregmanGenerator | None = None) -> Tensor:
    """log T_k (per row, k >= 1) on the first max(k) candidate columns."""
    width = int(k.max())
    log_deficit = torch.log(torch.gather(cand.deficit, 1, k.unsqueeze(-1)).squeeze(-1))
    return _log_renorm(mode, cand.log_p[:, :width], k, alpha, log_deficit, generator)


#: Support sizes the first probe of an adaptive search covers at once (most k* are small).
WINDOW = 16


def _window_exceeds(mode: str, cand: _Candidates, start: Tensor, count: int, alpha: Tensor,
                    lam: Tensor, generator: BregmanGenerator | None = None
                    ) -> tuple[Tensor, Tensor]:
    """G(m) > lambda for m = start .. start + count - 1 per row ([n, count]), from the exact maps
    on the count + 1 consecutive supports (1 <= start, start + count <= candidates); also returns
    those maps (log T_m for m = start .. start + count, [n, count + 1, W])."""
    sizes = start.unsqueeze(-1) + torch.arange(count + 1, device=start.device)  # [n, count + 1]
    width = int(sizes.max())
    log_p = cand.log_p[:, :width]
    deficit = torch.gather(cand.deficit, 1, sizes)
    maps = _log_renorm(mode, log_p.unsqueeze(1).expand(-1, count + 1, -1), sizes,
                       alpha.unsqueeze(-1).expand(-1, count + 1), torch.log(deficit), generator)
    log_q, log_q_next = maps[:, :-1], maps[:, 1:]
    m = sizes[:, :-1]
    a = alpha.unsqueeze(-1).expand(-1, count)
    rows = log_p.unsqueeze(1).expand(-1, count, -1)
    if generator is not None:
        gap = generic_gap(mode, generator, torch.exp(rows), torch.exp(log_q),
                          torch.exp(log_q_next), m)
        return gap > lam.unsqueeze(-1), maps
    if mode == "primal":
        log_gap = primal_log_gap(log_q, log_q_next, m, a)
    else:
        log_gap = dual_log_gap(rows, log_q, log_q_next, m, a)
    return log_gap > torch.log(lam).unsqueeze(-1), maps


def _search(mode: str, cand: _Candidates, alpha: Tensor, lam: Tensor, low: Tensor,
            high: Tensor, generator: BregmanGenerator | None = None
            ) -> tuple[Tensor, Tensor, Tensor]:
    """Smallest k in [low, high] with G(k) <= lambda, where G(high) <= lambda is taken as given.

    Rows starting at low = 1: one window probe decides G(1 .. WINDOW) at once (k* is usually
    small), then galloping (m = low, low + 1, low + 3, ...) and bisection: O(log k*) probes. Rows
    of a later candidate round (low > 1, high = 8 low) bisect [low, high]. All rows advance
    together; each probe runs only on the rows still searching.

    Returns (k*, log T_k* for the rows the window resolved ([n, W]), which rows those are).
    """
    low, high = low.clone(), high.clone()
    cache = torch.empty(low.shape[0], 0, dtype=cand.log_p.dtype, device=low.device)
    cached = torch.zeros_like(low, dtype=torch.bool)
    first_round = low == 1  # later rounds know k* >= low: they bisect [low, high] directly
    active = ((low < high) & first_round).nonzero().squeeze(-1)
    if active.numel():
        lo, hi = low[active], high[active]
        count = int(min(WINDOW, int((hi - lo).max())))
        sub = _take(cand, active)
        start = torch.minimum(lo, hi - count).clamp_min(1)  # keep the window inside [1, hi]
        exceeds, maps = _window_exceeds(mode, sub, start, count, alpha[active], lam[active],
                                        generator)
        m = start.unsqueeze(-1) + torch.arange(count, device=lo.device)
        # Sizes below low are known to exceed; at or beyond high the search stops by definition.
        stop = (~exceeds | (m >= hi.unsqueeze(-1))) & (m >= lo.unsqueeze(-1))
        first = torch.where(stop, m, hi.unsqueeze(-1)).amin(-1)
        covered = start + count  # every size below this was decided
        resolved = first < covered
        high[active] = torch.where(resolved, first, hi)
        low[active] = torch.where(resolved, first, torch.maximum(lo, covered))
        # The window already holds T_k* for the rows it resolved: keep it for the output.
        pick = (first - start).clamp(0, count).view(-1, 1, 1).expand(-1, 1, maps.shape[-1])
        cache = torch.full((low.shape[0], maps.shape[-1]), -math.inf, dtype=maps.dtype,
                           device=maps.device)
        cache[active] = torch.gather(maps, 1, pick).squeeze(1)
        cached[active] = resolved
    step = torch.ones_like(low)
    galloping = first_round.clone()
    while True:
        active = (low < high).nonzero().squeeze(-1)
        if active.numel() == 0:
            return low, cache, cached
        lo, hi = low[active], high[active]
        gal = galloping[active]
        m = torch.where(gal, torch.minimum(lo + step[active] - 1, hi - 1), (lo + hi) // 2)
        sub = _take(cand, active)
        exceeds = _window_exceeds(mode, sub, m, 1, alpha[active], lam[active], generator)[0][:, 0]
        low[active] = torch.where(exceeds, m + 1, lo)
        high[active] = torch.where(exceeds, hi, m)
        step[active] = torch.where(exceeds & gal, step[active] * 2, step[active])
        galloping[active] = gal & exceeds


def _support_sizes(mode: str, cand: _Candidates, alpha: Tensor, lam: Tensor, fixed: Tensor,
                   cap: Tensor, low: Tensor, generator: BregmanGenerator | None = None,
                   alpha_values: tuple[float, ...] = ()) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Support size per row, whether it is certified with these candidates, and log T_k for the
    rows whose map the search already computed (with a mask of those rows).

    ``low`` is a known lower bound on k* (from earlier rounds); ``alpha_values`` the distinct
    alphas of the plan, a superset of those of these rows.
    """
    width = cand.x.shape[-1]
    n_known = torch.where(cand.complete, cand.positive, torch.full_like(cand.positive, 10**18))
    limit = torch.where(cap > 0, torch.minimum(cap, n_known), n_known).clamp_min(1)
    k = torch.zeros_like(fixed)
    done = torch.zeros_like(fixed, dtype=torch.bool)
    is_fixed = fixed > 0
    fixed_k = torch.minimum(fixed, limit)
    done |= is_fixed & (fixed_k <= width)
    k = torch.where(is_fixed, fixed_k, k)
    cache = torch.empty(k.shape[0], 0, dtype=cand.log_p.dtype, device=k.device)
    cached = torch.zeros_like(done)
    adaptive = (~is_fixed).nonzero().squeeze(-1)
    if adaptive.numel():
        hi = limit[adaptive]
        bounded = hi <= width  # the last size is a real boundary
        upper = torch.minimum(hi, torch.full_like(hi, width))
        lo = torch.minimum(low[adaptive], upper)
        sub = _take(cand, adaptive)
        a, lm = alpha[adaptive], lam[adaptive]
        found = torch.empty_like(lo)
        if generator is not None or len(alpha_values) == 1:  # one divergence for every row
            every = torch.arange(a.shape[0], device=a.device)
            groups = [(alpha_values[0] if generator is None else math.nan, every)]
        else:
            groups = [(value, (a == value).nonzero().squeeze(-1))
                      for value in torch.unique(a).tolist()]
        for value, rows in groups:
            if generator is None and has_closed_form(mode, value):
                grp = _take(sub, rows)
                gaps = closed_form_gaps(mode, value, grp.x, grp.deficit)
                # Column j is k = j + 1; the last column (k = width) always stops.
                gaps = torch.nn.functional.pad(gaps, (0, 1), value=-math.inf)
                sizes = torch.arange(1, width + 1, device=gaps.device)
                stop = (gaps <= lm[rows].unsqueeze(-1)) | (sizes >= upper[rows].unsqueeze(-1))
                stop &= sizes >= lo[rows].unsqueeze(-1)
                first = torch.where(stop, sizes, width).amin(-1)
                found[rows] = torch.minimum(first, upper[rows])
            else:
                grp = _take(sub, rows)
                found[rows], maps, have = _search(mode, grp, a[rows], lm[rows], lo[rows],
                                                  upper[rows], generator)
                if maps.shape[-1] > cache.shape[-1]:
                    cache = torch.nn.functional.pad(cache, (0, maps.shape[-1] - cache.shape[-1]),
                                                    value=-math.inf)
                target = adaptive[rows]
                cache[target] = torch.nn.functional.pad(
                    maps, (0, cache.shape[-1] - maps.shape[-1]), value=-math.inf)
                cached[target] = have
        k[adaptive] = found
        # Certified unless the search ran into the end of the candidate set without a boundary.
        done[adaptive] = (found < width) | bounded
    return k, done, cache, cached


# ----------------------------------------------------------------------------- driver


def _final_maps(plan: _Plan, cand: _Candidates, k: Tensor, alpha: Tensor, cache: Tensor,
                cached: Tensor) -> Tensor:
    """log T_k for every row: from the search's cache where it has it, else renormalized now."""
    todo = (~cached).nonzero().squeeze(-1)
    if todo.numel() == 0:
        return cache[:, : int(k.max())]
    fresh = _renorm_at(plan.mode, _take(cand, todo), k[todo], alpha[todo],
                       plan.generator)
    if todo.numel() == k.shape[0]:
        return fresh
    width = max(fresh.shape[-1], int(k.max()))
    out = torch.nn.functional.pad(cache[:, :width], (0, max(0, width - cache.shape[-1])),
                                  value=-math.inf)
    out[todo] = torch.nn.functional.pad(fresh, (0, width - fresh.shape[-1]), value=-math.inf)
    return out


def _decode_rows(p: Tensor, plan: _Plan) -> tuple[list[tuple[Tensor, Tensor, Tensor, Tensor]],
                                                  Tensor]:
    """Decode every row of ``p`` ([N, V]).

    Returns one chunk per candidate round, (rows, index [n, W], log_q [n, W], k [n]), in which the
    W positions of a row are distinct (log q = -inf past its support), and the rows that are not
    distributions (no positive mass, NaN or inf), which are left alone.
    """
    n, vocab = p.shape
    device = p.device
    pending = torch.arange(n, device=device)
    low = torch.ones(n, dtype=torch.long, device=device)
    width = min(max(INITIAL_CANDIDATES, 2), vocab)
    chunks: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []
    invalid: list[Tensor] = []
    while pending.numel():
        if width < vocab:
            # Fixed-k rows larger than this round's width wait for a wider round.
            need = plan.fixed_k[pending]
            ready = need <= width
            now, later = pending[ready], pending[~ready]
        else:
            now, later = pending, pending[:0]
        if now.numel():
            rows_now = p if now.numel() == n else p[now]  # no copy in the common case
            cand, total = _candidates(rows_now, width)
            bad = ~torch.isfinite(total) | (total <= 0)
            if bool(bad.any()):
                invalid.append(now[bad])
                good = (~bad).nonzero().squeeze(-1)
                now, cand = now[good], _take(cand, good)
            k, done, cache, cached = _support_sizes(
                plan.mode, cand, plan.alpha[now], plan.lam[now], plan.fixed_k[now],
                plan.k_max[now], low[now], plan.generator, plan.alpha_values)
            if width >= vocab:
                done = torch.ones_like(done)
            fin = done.nonzero().squeeze(-1)
            if fin.numel() == now.numel():  # every row certified: no copies of the candidates
                log_q = _final_maps(plan, cand, k, plan.alpha[now], cache, cached)
                chunks.append((now, cand.index[:, : log_q.shape[-1]], log_q, k))
            elif fin.numel():
                rows = now[fin]
                sub = _take(cand, fin)
                log_q = _final_maps(plan, sub, k[fin], plan.alpha[rows], cache[fin], cached[fin])
                chunks.append((rows, sub.index[:, : log_q.shape[-1]], log_q, k[fin]))
            again = (~done).nonzero().squeeze(-1)
            low[now[again]] = width  # G(k) > lambda for every k < width
            later = torch.cat([later, now[again]])
        pending = later
        width *= _GROWTH
        if width * _FULL_SORT_FRACTION >= vocab:  # a top-k that large costs about a full sort
            width = vocab
    empty = torch.empty(0, dtype=torch.long, device=device)
    return chunks, torch.cat(invalid) if invalid else empty


def _flatten(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _decode(p2: Tensor, plan: _Plan) -> tuple[Tensor, Tensor, list]:
    """Decode [N, V]. Returns (rows kept whole: lambda = 0 without cap, so k* = every nonzero
    entry; rows left alone: not distributions; chunks of decoded rows)."""
    decode_rows = plan.decode_rows
    assert decode_rows is not None and plan.keep_rows is not None
    chunks: list = []
    invalid = decode_rows[:0]
    if plan.decoded is None:
        if decode_rows.numel():
            chunks, invalid = _decode_rows(p2, plan)
    else:
        sub_chunks, sub_invalid = _decode_rows(p2[decode_rows], plan.decoded)
        chunks = [(decode_rows[r], i, q, k) for r, i, q, k in sub_chunks]
        invalid = decode_rows[sub_invalid]
    return plan.keep_rows, invalid, chunks


def _write(out: Tensor, k_out: Tensor, chunks, to_values) -> None:
    """Write each chunk's support values into ``out`` ([N, V]) without touching other entries."""
    vocab = out.shape[-1]
    flat = out.view(-1)
    for rows, index, log_q, k in chunks:
        positions = (rows.unsqueeze(-1) * vocab + index).reshape(-1)
        flat.index_put_((positions,), to_values(log_q).reshape(-1))
        k_out[rows] = k


def _keep_all(p2: Tensor) -> tuple[Tensor, Tensor]:
    """lambda = 0 without a cap: k* is the whole support, renormalized (cost(k) decreases in k).

    One pass in the input dtype (the float32 sum is a cascade: relative error ~1e-7, and never
    below the largest entry, so every quotient is in [0, 1]); rows that are not distributions
    are returned unchanged with k = 0. k counts the nonzero entries of the output.
    """
    # Few full-size temporaries: each one costs a pass and, at [64, 128256], fresh pages.
    normalized = p2.clamp_min(0)
    total = normalized.sum(-1, keepdim=True)
    usable = torch.isfinite(total) & (total > 0)
    normalized.div_(torch.where(usable, total, 1.0))
    # sign() sums exactly in float (counts < 2^24); bool reductions are 10x slower on CPU.
    support = torch.where(usable.squeeze(-1), normalized.sign().sum(-1), 0.0).long()
    if not bool(usable.all()):
        normalized = torch.where(usable, normalized, p2)
    return normalized, support


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
    """Bregman decoding (problem sp-br) of a batch of next-token distributions.

    Args:
        probs: ``[..., V]`` probabilities (float32 or float64; rows are normalized by their sum,
            entries <= 0 count as zero).
        alpha: exponent of phi_alpha(x) = x^alpha / (alpha (alpha - 1)); a float or a tensor
            broadcastable to the batch shape ``probs.shape[:-1]``. Ranges: see
            `bregman_vllm.params` (adaptive primal (0, inf), adaptive dual (1, inf), fixed-k
            primal any nonzero value with +-inf, fixed-k dual [1, inf]).
        lam: lambda >= 0, the l0 price per kept token (float or per-row tensor).
        mode: "primal" (min D(q, p), eq. ren) or "dual" (min D(p, q), eq. ren-dual).
        k_max: optional cap on the support size (int or per-row tensor, 0 = no cap).
        top_k: optional fixed support size: generalized top-k (Definition gentopk) instead of
            the adaptive k* (int or per-row tensor, 0 = adaptive for that row).
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
    if probs.dim() == 0:
        raise BregmanParamError("probs", "must have at least one dimension (the vocabulary)")
    batch_shape = probs.shape[:-1]
    plan = _plan(batch_shape, probs.device, alpha, lam, mode, k_max, top_k, generator)
    p2 = _flatten(probs)
    keep_all, invalid, chunks = _decode(p2, plan)
    every_row = keep_all.numel() == p2.shape[0]
    if every_row:  # all rows lambda = 0: nothing to scatter into
        out, k_out = _keep_all(p2)
    else:
        out = torch.zeros_like(p2)
        k_out = torch.zeros(p2.shape[0], dtype=torch.long, device=probs.device)
        if keep_all.numel():
            out[keep_all], k_out[keep_all] = _keep_all(p2[keep_all])
    if invalid.numel():
        out[invalid] = p2[invalid]
    _write(out, k_out, chunks, lambda log_q: torch.exp(log_q).to(p2.dtype))
    return BregmanOutput(out.reshape(probs.shape), k_out.reshape(batch_shape))


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
    """
    if logits.dim() == 0:
        raise BregmanParamError("logits", "must have at least one dimension (the vocabulary)")
    batch_shape = logits.shape[:-1]
    plan = _plan(batch_shape, logits.device, alpha, lam, mode, k_max, top_k)
    out, k_out = decode_logits_rows(_flatten(logits), plan)
    out = out.reshape(logits.shape)
    if return_k:
        return out, k_out.reshape(batch_shape)
    return out


def plan_rows(mode: str, alpha: Tensor, lam: Tensor, top_k: Tensor, k_max: Tensor,
              validate: bool = True) -> _Plan:
    """Per-row parameters for `decode_logits_rows` (e.g. built once per vLLM batch change).

    ``alpha``/``lam`` are float64 tensors, ``top_k``/``k_max`` int64 tensors with 0 for "not set",
    all of shape [N]. ``validate=False`` skips the range checks for values already validated
    (by `bregman_vllm.params` at request admission).
    """
    if validate:
        return _plan(alpha.shape, alpha.device, alpha, lam, mode, k_max.clamp_min(0), top_k)
    return _assemble(mode, alpha, lam, top_k, k_max)


def decode_logits_rows(l2: Tensor, plan: _Plan) -> tuple[Tensor, Tensor]:
    """`bregman_decode_logits` on [N, V] logits with an already validated plan.

    Returns (log q with -inf off the support, k per row).
    """
    p2 = torch.softmax(l2, -1)
    keep_all, invalid, chunks = _decode(p2, plan)
    out = torch.full_like(l2, -math.inf)
    k_out = torch.zeros(l2.shape[0], dtype=torch.long, device=l2.device)
    if keep_all.numel():
        kept = l2[keep_all]
        log_p = torch.log_softmax(kept, -1)
        usable = ~torch.isnan(log_p).any(-1, keepdim=True)
        out[keep_all] = torch.where(usable, log_p, kept)
        support = p2[keep_all].sign().sum(-1)  # exact in float; faster than a bool count
        k_out[keep_all] = torch.where(usable.squeeze(-1), support, 0.0).long()
    if invalid.numel():
        out[invalid] = l2[invalid]
    _write(out, k_out, chunks, lambda log_q: log_q.to(l2.dtype))
    return out, k_out


def renormalize(x: Tensor, *, alpha, mode: str = "primal") -> Tensor:
    """Renormalize sub-probability vectors on a fixed support: T_alpha (eq. ren) or T*_alpha
    (eq. ren-dual) applied to the whole last dimension of ``x``.

    ``x`` holds entries >= 0 with row sums <= 1 (sums above 1 by rounding count as 1). Zero
    entries are part of the support: primal alpha > 1 and dual maps give them mass, primal
    alpha <= 1 keeps them at zero. A row of zeros maps to the uniform distribution.

    Example:
        >>> renormalize(torch.tensor([0.4, 0.2]), alpha=2.0)
        tensor([0.6000, 0.4000])
    """
    mode = parse_mode(mode, "mode", allow_off=False)
    batch_shape = x.shape[:-1]
    alpha_rows = _row_values(alpha, "alpha", batch_shape, x.device, torch.float64)
    _check_alpha_rows(alpha_rows, mode, torch.ones_like(alpha_rows, dtype=torch.bool), "alpha")
    x2 = _flatten(x).to(torch.float64).clamp_min(0.0)
    if bool((x2.sum(-1) > 1.0 + 1e-6).any()):
        raise BregmanParamError("x", "rows must sum to at most 1 (a sub-probability vector)")
    order = torch.argsort(x2, dim=-1, descending=True)
    xs = torch.gather(x2, 1, order)
    width = xs.shape[-1]
    k = torch.full((xs.shape[0],), width, dtype=torch.long, device=x.device)
    deficit = (1.0 - xs.sum(-1)).clamp_min(0.0)
    empty = xs[:, 0] <= 0
    with torch.no_grad():
        log_q = _log_renorm(mode, torch.log(xs), k, alpha_rows, torch.log(deficit))
    q = torch.exp(log_q)
    q = torch.where(empty.unsqueeze(-1), torch.full_like(q, 1.0 / width), q)
    out = torch.empty_like(q).scatter_(1, order, q)
    return out.to(x.dtype).reshape(x.shape)
