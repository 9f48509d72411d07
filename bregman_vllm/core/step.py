"""The decoding step: a batch of scores in, the Bregman-decoded batch out, with a plan.

This is the hot path (vLLM calls it once per generated token for the whole batch). The plan
(`plan`) groups rows by formula family; groups of one window size class share one pass (a
`plan.Joint`: a batch mixing alphas, modes and lambdas is one pass, split only for each
family's formulas on its rows' candidates), the others (lambda -> 0, the exact family, wide
fixed top-k) run alone. Each pass makes three passes over its rows of the batch, and no [n, V]
intermediate:

1. `_start`: the candidates (`candidates`: block maxima, read 1; block masses, hence the
   log-normalizer, read 2; for logits no probability tensor is made), then per family the
   support size and the map on the candidates: fixed k, or the adaptive k* (the minimizer of
   cost(k), eq. (6) of arXiv 2505.19371) over a fixed window of sizes (`window`), with a
   certificate for rows whose answer could lie outside what the window decided;
2. one host sync, only for plans that can produce uncertified rows (`families.may_flag`): how
   many rows need the search; those rows are then decoded by the exact path (`decode_exact`,
   value-dependent: rounds of candidates, 64 then 8 times more, each decided by
   `search.support_sizes`) from the scores, which are still as given;
3. `_finish`: the write (`write.write_support`, write 3): -inf (logits) or 0 off the support,
   log q (or q) on it; rows that are not distributions (NaN, +inf, no mass) keep their values.

Rows are gathered from the batch only for a pass that does not cover all of it. Plans whose
every support fits the window (every row's k_max, or a fixed top-k, at most the window) never
sync, whatever the family. Everything before the sync is a fixed sequence of ops on fixed
shapes. A per-row temperature (`plan.Plan.scale`, vLLM's Model Runner V2) enters the
log-normalizer only; the values written are T log q.

Extra memory of one step (besides the output) is bounded for any parameters: a gathered copy of
the rows when a pass is not the whole batch, O(n W) float64 candidate arrays, O(n K^2) float64
Newton arrays for the iterative families (K = window <= 64), and row chunks of at most
`MEMORY_BUDGET` bytes for fixed-k groups wider than the window and for the exact path.
No float64 [n, V] array is ever made. `step_memory_bound` gives the bound in bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .candidates import UNBOUNDED, Candidates, candidates, log_smallest, select, take
from .families import CLOSED_GAP_FAMILIES, ITERATIVE_FAMILIES, WIDE_WINDOW, WINDOW, Family
from .maps import log_deficit, log_renorm
from .plan import ROW_DTYPES, ROW_FIELDS, ExactPlan, Group, Joint, Plan, exact_plan, to_device
from .result import StepResult
from .search import support_sizes
from .window import (
    Decoded,
    closed_map,
    closed_search,
    iterative_fixed,
    iterative_search,
    support_range,
)
from .write import output_values, write_support

Tensor = torch.Tensor


class _Window(NamedTuple):
    """The fixed-shape part of a window pass (`fixed_shape_group`, `joint_groups`)."""

    index: Tensor  # [n, W] candidate positions
    log_q: Tensor  # [n, W] log T_k* on them (-inf past k*)
    k: Tensor  # [n]
    valid: Tensor  # [n] rows that are distributions
    needs: Tensor | None  # [n] rows to decode again with the exact path (None: none can)
    past: Tensor | None  # [n] rows among those whose k* is certified >= the window


@dataclass
class _Pass:
    """One pass of the step over some rows of the batch."""

    owner: Group | Joint
    rows: Tensor | None  # batch rows (None: every row, in order)
    source: Tensor  # the pass's scores: the batch itself, or a gathered copy of its rows
    scale: Tensor | None  # the rows' inverse temperatures
    temperature: Tensor | None  # and temperatures
    k: Tensor  # [n]
    window: _Window | None = None  # window passes
    shift: Tensor | None = None  # keep-all passes (logits): what is subtracted from each row
    done: Tensor | None = None  # rows the exact path finished
    written: bool = False  # the pass wrote its rows itself (chunked wide fixed-k)
    exact_rows: int = 0  # rows a chunked pass handed to the exact path


def decode_step(scores: Tensor, plan: Plan, *, logits: bool, inplace: bool = False
                ) -> StepResult:
    """Decode the rows of ``scores`` ([N, V] logits, or probabilities with ``logits=False``)
    that the plan's groups name; rows outside every group are left as they are (and get
    k = 0). With ``inplace`` the result is written into ``scores``. The kernels
    (`bregman_vllm.kernels`, chosen by `bregman_vllm.backend`) give the same supports and maps
    (tests/test_kernels.py).

    Exceptions propagate. With ``inplace``, one raised by the exact path is raised after the
    other rows were written, and carries ``bregman_uncertified_rows`` (the rows the exact path
    did not finish, which keep the fixed step's uncertified answer, a distribution on the
    window, or their own values for exact-family rows): ``scores`` is then decoded and must not
    be decoded again.
    """
    alone, joints = plan.passes()
    passes = [_start(scores, owner, plan, logits, inplace) for owner in (*alone, *joints)]
    # The step's only host sync, for plans that can produce uncertified rows.
    counts = [p.window.needs.sum() for p in passes
              if p.window is not None and p.window.needs is not None]
    exact_rows = 0 if not counts else int(counts[0] if len(counts) == 1 else
                                          torch.stack(counts).sum())
    exact_rows += sum(p.exact_rows for p in passes)
    whole = len(passes) == 1 and passes[0].rows is None
    exact_family = any(p.owner.family == Family.EXACT for p in passes
                       if isinstance(p.owner, Group))
    if inplace:
        out = scores
    elif whole and not exact_rows and not exact_family:
        out = None  # made by the write (one read of the scores, one write)
    else:
        out = scores.clone()
    failure: Exception | None = None
    for p in passes:
        try:
            _exact(p, out, logits, exact_rows > 0)
        except Exception as error:  # the other passes are still written
            failure = failure or error
    for p in passes:
        out = _finish(p, out, scores, logits)
    if failure is not None:
        if inplace:
            # ``scores`` holds the step's output: tell the caller not to decode it again, and
            # how many rows the exact path left.
            failure.bregman_uncertified_rows = sum(  # type: ignore[attr-defined]
                _unfinished(p) for p in passes)
        raise failure
    if whole:
        return StepResult(out, passes[0].k, exact_rows)
    k = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)
    for p in passes:
        k.index_copy_(0, _all_rows(p, scores), p.k)
    return StepResult(out, k, exact_rows)


def _all_rows(p: _Pass, scores: Tensor) -> Tensor:
    if p.rows is not None:
        return p.rows
    return torch.arange(scores.shape[0], device=scores.device)


# ----------------------------------------------------------------------------- 1. start


def _scale_of(owner: Group | Joint, plan: Plan) -> tuple[Tensor | None, Tensor | None]:
    """The inverse temperatures and temperatures of a pass's rows, gathered once per plan."""
    if plan.scale is None or plan.temperature is None:
        return None, None
    if "scale" not in owner.derived:
        owner.derived["scale"] = tuple(
            values if owner.rows is None else values.index_select(0, owner.rows)
            for values in (plan.scale, plan.temperature))
    return owner.derived["scale"]


def _start(scores: Tensor, owner: Group | Joint, plan: Plan, logits: bool, inplace: bool
           ) -> _Pass:
    """Step 1 for one pass: everything before the sync (no write, except for wide fixed-k
    groups, which run in row chunks start to end)."""
    source = scores if owner.rows is None else scores.index_select(0, owner.rows)
    scale, temperature = _scale_of(owner, plan)
    if isinstance(owner, Joint):
        window = _window_pass(source, owner, logits, scale)
        return _Pass(owner, owner.rows, source, scale, temperature, window.k, window=window)
    if owner.family == Family.KEEP_ALL:
        return _keep_all_start(owner, source, logits, scale, temperature)
    if owner.family == Family.EXACT:
        return _Pass(owner, owner.rows, source, scale, temperature,
                     torch.zeros(source.shape[0], dtype=torch.long, device=source.device))
    static = _Static.of(owner)
    chunk = max(1, MEMORY_BUDGET // (static.width * _WIDE_BYTES_PER_ENTRY))
    if source.shape[0] > chunk:
        return _chunked(owner, static, source, logits, scale, temperature, chunk, inplace)
    window = _Window(*fixed_shape_group(source, static, owner.values, logits, scale))
    return _Pass(owner, owner.rows, source, scale, temperature, window.k, window=window)


def _window_pass(source: Tensor, joint: Joint, logits: bool, scale: Tensor | None) -> _Window:
    """The joint pass (`joint_groups`) over the union of its groups' rows."""
    if "static" not in joint.derived:  # once per plan
        joint.derived["static"] = _JointStatic(
            tuple(_Static.of(group) for group in joint.groups), joint.width)
        joint.derived["values"] = tuple(group.values for group in joint.groups)
    static = joint.derived["static"]
    args = (joint.positions, joint.derived["values"], logits, scale)
    return _Window(*joint_groups(source, static, *args))


def _keep_all_start(group: Group, source: Tensor, logits: bool, scale: Tensor | None,
                    temperature: Tensor | None) -> _Pass:
    """Every positive entry kept, renormalized (lambda -> 0, `families.keeps_all`): for
    logits, the log-normalizer (read 1) and the number of entries whose probability is nonzero
    in the score dtype (read 2); the write subtracts T times the normalizer."""
    if not logits:
        return _Pass(group, group.rows, source, scale, temperature,
                     torch.zeros(source.shape[0], dtype=torch.long, device=source.device))
    scaled = source if scale is None else source * scale.unsqueeze(-1)
    total = torch.logsumexp(scaled, -1)
    valid = torch.isfinite(total)
    threshold = (total + log_smallest(source.dtype)).unsqueeze(-1)
    k = torch.where(valid, (scaled >= threshold).sum(-1), 0)
    shift = torch.where(valid, total if temperature is None else total * temperature, 0.0)
    return _Pass(group, group.rows, source, scale, temperature, k, shift=shift)


# ----------------------------------------------------------------------------- fixed shapes


@dataclass(frozen=True)
class _Static:
    """What a group's fixed-shape computation is specialized on (all host values)."""

    family: Family
    fixed: bool
    capped: bool
    bounded: bool
    flags: bool
    width: int
    iterations: int
    below_two: bool
    above_two: bool

    @classmethod
    def of(cls, group: Group) -> _Static:
        """The group's static shape, made once per plan (kept in ``group.derived``)."""
        static = group.derived.get("static")
        if static is None:
            static = group.derived["static"] = cls(
                group.family, group.fixed, group.capped, group.bounded, group.flags,
                group.width, group.iterations, group.below_two, group.above_two)
        return static


@dataclass(frozen=True)
class _JointStatic:
    """What the joint pass is specialized on: each group's `_Static` and the shared width."""

    statics: tuple[_Static, ...]
    width: int


def fixed_shape_group(rows: Tensor, static: _Static, values: Mapping, logits: bool,
                      scale: Tensor | None):
    """Step 1 for one group (``values``: its per-row values, `plan.Group.values`): a fixed
    sequence of ops on fixed shapes, no host sync, no write. Returns the fields of `_Window`."""
    cand = candidates(rows, static.width, logits=logits, scale=scale)
    decoded = _support_and_map(cand, static, values)
    needs = None if decoded.uncertain is None else decoded.uncertain & cand.valid
    return (cand.index[:, : decoded.log_q.shape[-1]], decoded.log_q, decoded.k * cand.valid,
            cand.valid, needs, decoded.past)


def joint_groups(rows: Tensor, joint: _JointStatic, positions: tuple[Tensor, ...],
                 values: tuple[Mapping, ...], logits: bool, scale: Tensor | None):
    """Step 1 for several groups in one pass: one candidate set of ``joint.width`` for all
    ``rows``, each group's support and map on its own rows' candidates (``positions``: the
    group's rows within ``rows``). A fixed sequence of ops on fixed shapes, no host sync.
    Returns the fields of `_Window` for all the rows."""
    cand = candidates(rows, joint.width, logits=logits, scale=scale)
    n, width = cand.x.shape
    log_q = cand.x.new_full((n, width), -math.inf)
    k = torch.zeros(n, dtype=torch.long, device=rows.device)
    flags = any(static.flags for static in joint.statics)
    needs = torch.zeros(n, dtype=torch.bool, device=rows.device) if flags else None
    past = torch.zeros(n, dtype=torch.bool, device=rows.device) if flags else None
    for i, static in enumerate(joint.statics):
        where = positions[i]
        decoded = _support_and_map(select(cand, where, static.width), static, values[i])
        short = width - decoded.log_q.shape[-1]
        rows_log_q = decoded.log_q if short == 0 else \
            torch.nn.functional.pad(decoded.log_q, (0, short), value=-math.inf)
        log_q.index_copy_(0, where, rows_log_q)
        k.index_copy_(0, where, decoded.k)
        if decoded.uncertain is not None and needs is not None:  # (`families.may_flag` says when)
            needs.index_copy_(0, where, decoded.uncertain)
        if decoded.past is not None and past is not None:
            past.index_copy_(0, where, decoded.past)
    # Past a group's own support its candidates are off the support: -inf there is right.
    return (cand.index, log_q, k * cand.valid, cand.valid,
            None if needs is None else needs & cand.valid, past)


def _support_and_map(cand: Candidates, static: _Static, values: Mapping) -> Decoded:
    """The support size and the map on the candidates. Iterative families whose every support
    fits the first window (adaptive groups with `Group.bounded`, fixed sizes up to `WINDOW`)
    take the fixed Newton iterations' answer as final without computing their certificates
    (convergence, near-ties), so such groups never sync. Evidence, not a proof: on a sweep of
    extreme inputs the certificates never fail there (`tests/test_gpu_readiness.py` computes
    them and requires it). Elsewhere a row the window may not hold still goes to the exact
    path."""
    family = static.family
    alpha, size = values["alpha"], values["size"]
    if static.fixed:
        # (at least 1: a row that is not a distribution has no positive entry, and is never
        # written)
        k = torch.minimum(cand.known, size).clamp(1, static.width) \
            if isinstance(size, Tensor) else cand.known.clamp(1, min(size, static.width))
        if family in ITERATIVE_FAMILIES:
            return iterative_fixed(family, cand, alpha, k, static.width, static.iterations,
                                   static.below_two, static.above_two, certify=static.flags)
        return Decoded(k, closed_map(family, cand, k, static.width), None)
    low, limit = support_range(cand, values, static.capped)
    if family in CLOSED_GAP_FAMILIES:
        return closed_search(family, cand, values["lam"], limit, static.width, static.bounded,
                             low=low)
    return iterative_search(family, cand, alpha, values["lam"], limit, static.width,
                            static.iterations, static.bounded, static.below_two,
                            static.above_two, certify=static.flags, low=low)


#: Peak bytes per (row, candidate) of a fixed-k group (measured: 59 for dual 3/2, k = 20000).
_WIDE_BYTES_PER_ENTRY = 96


def _chunked(group: Group, static: _Static, source: Tensor, logits: bool,
             scale: Tensor | None, temperature: Tensor | None, chunk: int, inplace: bool
             ) -> _Pass:
    """A fixed top-k wider than the memory budget allows for every row at once: each chunk of
    rows start to end (candidates, map, its own sync and exact path when the family may flag,
    write), so its [rows, width] float64 arrays stay bounded. The pass writes its rows itself:
    into ``source`` (the batch in place, or a copy of it, or the gathered rows)."""
    if group.rows is None and not inplace:
        source = source.clone()
    k = torch.zeros(source.shape[0], dtype=torch.long, device=source.device)
    exact_rows = 0
    for start in range(0, source.shape[0], chunk):
        piece = slice(start, start + chunk)
        part = source[piece]
        part_scale = None if scale is None else scale[piece]
        part_temperature = None if temperature is None else temperature[piece]
        values = {name: _rows_of(value, piece) for name, value in group.values.items()}
        window = _Window(*fixed_shape_group(part, static, values, logits, part_scale))
        keep = window.valid
        if window.needs is not None and bool(window.needs.any()):  # (a sync per chunk)
            redo = window.needs.nonzero().squeeze(-1)
            exact_rows += redo.numel()
            done = torch.zeros_like(keep)
            part_k = window.k.clone()
            decode_exact(part, part_k, part, _exact_inputs(group, part.device, piece),
                         logits=logits, scale=part_scale, rows=redo, done=done)
            keep = keep & ~done
            window = window._replace(k=torch.where(done, part_k, window.k))
        _write_window(part, window, keep, logits, part_temperature)
        k[piece] = window.k
    return _Pass(group, group.rows, source, scale, temperature, k, written=True,
                 exact_rows=exact_rows)


def _rows_of(value, piece: slice):
    return value[piece] if isinstance(value, Tensor) else value


# ----------------------------------------------------------------------------- 2. exact path


#: Width of the exact path's first candidate round; a row whose k* passes it gets `GROWTH`
#: times more (at most what the rows need: their k_max or fixed k, else the row).
INITIAL_CANDIDATES = 64
GROWTH = 8
#: A round wider than 1 / `FULL_SORT_FRACTION` of the row takes the whole row (a top-k that
#: large costs about a full sort).
FULL_SORT_FRACTION = 4
#: Bytes of float64 work arrays one piece of a round (or a wide fixed-k chunk) may hold.
MEMORY_BUDGET = 256 * 1024 * 1024
#: Peak bytes of an exact round per (row, candidate) (measured; output included).
_BYTES_PER_ENTRY = 400


def _final_maps(plan: ExactPlan, cand: Candidates, k: Tensor, alpha: Tensor, cache: Tensor,
                cached: Tensor) -> Tensor:
    """log T_k for every row: from the search's cache where it has it, else solved now."""
    todo = (~cached).nonzero().squeeze(-1)
    width = int(k.max())
    if todo.numel() == 0:
        return cache[:, :width]
    sub = take(cand, todo)
    fresh = log_renorm(plan.family, plan.mode, sub.log_x[:, :width], k[todo], alpha[todo],
                       log_deficit(sub, k[todo]), plan.generator)
    out = cache[:, :width].clone()
    out[todo] = fresh
    return out


class _Sink(NamedTuple):
    """Where finished rows go: ``out`` [N, V], ``k_out`` [N], ``done`` [N] (set for every
    finished row), how log q becomes the written values (`write.output_values`: the scores'
    dtype, logits scaled by the temperature) and ``clear`` (the value a row is reset to just
    before its support is written)."""

    out: Tensor
    k_out: Tensor
    done: Tensor | None
    logits: bool
    temperature: Tensor | None
    clear: float


def _exact_round(scores: Tensor, plan: ExactPlan, now: Tensor, width: int, low: Tensor,
                 aims: Tensor, sink: _Sink, scale: Tensor | None) -> Tensor:
    """One candidate round for the rows ``now``; returns the rows that need a wider one (with
    their certified lower bounds in ``low``, the scalars their probes aimed at in ``aims``)."""
    every = now.numel() == scores.shape[0]
    rows_now = scores if every else scores.index_select(0, now)
    rows_scale = None if scale is None else (scale if every else scale.index_select(0, now))
    cand = candidates(rows_now, width, logits=sink.logits, scale=rows_scale)
    if not bool(cand.valid.all()):  # rows that are not distributions are left alone
        good = cand.valid.nonzero().squeeze(-1)
        now, cand = now[good], take(cand, good)
    if now.numel() == 0:
        return now
    k, cache, cached, done, aim = support_sizes(plan, cand, now, low[now], aims[now])
    if width >= scores.shape[-1]:
        done = torch.ones_like(done)
    fin = done.nonzero().squeeze(-1)
    if fin.numel():
        sub = cand if fin.numel() == now.numel() else take(cand, fin)  # (all: no copy)
        log_q = _final_maps(plan, sub, k[fin], plan.alpha[now[fin]], cache[fin], cached[fin])
        _write_finished(sink, now[fin], sub.index[:, : log_q.shape[-1]], log_q, k[fin])
    again = (~done).nonzero().squeeze(-1)
    low[now[again]], aims[now[again]] = k[again].clamp_max(width), aim[again]
    return now[again]


def _write_finished(sink: _Sink, rows: Tensor, index: Tensor, log_q: Tensor, k: Tensor
                    ) -> None:
    """Write finished rows (`write.write_support`); a NaN is an error, never an output."""
    if bool(torch.isnan(log_q).any()):
        raise FloatingPointError(
            f"the exact path produced NaN for {int(torch.isnan(log_q).any(-1).sum())} row(s)")
    temperature = None if sink.temperature is None else sink.temperature[rows]
    values = output_values(log_q, sink.logits, sink.out.dtype, temperature)
    write_support(sink.out, index, values, sink.clear, rows=rows)
    sink.k_out[rows] = k
    if sink.done is not None:
        sink.done[rows] = True


def _widest(plan: ExactPlan, rows: Tensor, vocab: int) -> int:
    """The most candidates any of ``rows`` needs: its fixed k, else its k_max, else the whole
    row (one host read per call: a server's `--max-support` caps every row)."""
    fixed, cap = plan.fixed_k[rows], plan.k_max[rows]
    need = torch.where(fixed > 0, fixed, torch.where(cap > 0, cap, vocab))
    return min(int(need.max()), vocab)


def decode_exact(out: Tensor, k_out: Tensor, scores: Tensor, plan: ExactPlan, *,
                 logits: bool, scale: Tensor | None = None, rows: Tensor | None = None,
                 low: Tensor | None = None, done: Tensor | None = None) -> None:
    """Decode the rows of ``scores`` ([n, V] logits, or probabilities) by the search, in rounds
    of candidates, and write the supports into ``out`` ([n, V], may be ``scores``: each
    finished row reset to -inf or 0, then its support written; a row never finished keeps what
    it had) and the sizes into ``k_out``; rows that are not distributions are left alone.
    ``scale`` ([n]): inverse temperatures (logits: T log q is written). ``done`` ([n] bool):
    set for every row finished. ``rows`` (sorted, default all) limits the work to those rows;
    ``low`` ([n], default 1): certified lower bounds on their k* (a row known to pass the
    first round's width starts wider). ``plan`` holds the parameters of all n rows."""
    n, vocab = scores.shape
    pending = torch.arange(n, device=scores.device) if rows is None else rows
    if pending.numel() == 0:
        return
    bounds = torch.ones(n, dtype=torch.long, device=scores.device) if low is None \
        else low.clone()
    aims = torch.full((n,), math.nan, dtype=torch.float64, device=scores.device)
    temperature = None if scale is None else torch.reciprocal(scale)
    sink = _Sink(out, k_out, done, logits, temperature, -math.inf if logits else 0.0)
    width = min(max(INITIAL_CANDIDATES, 2), vocab)
    widest = _widest(plan, pending, vocab)
    while pending.numel():
        if width < vocab:
            # Rows that need more candidates than this round has (a fixed k larger than its
            # width, or a k* known to be at least its width) wait for a wider round.
            ready = (plan.fixed_k[pending] <= width) & (bounds[pending] < width)
            now, later = pending[ready], pending[~ready]
        else:
            now, later = pending, pending[:0]
        piece = max(1, MEMORY_BUDGET // max(1, width * _BYTES_PER_ENTRY))
        for start in range(0, now.numel(), piece):
            later = torch.cat([later, _exact_round(scores, plan, now[start:start + piece],
                                                   width, bounds, aims, sink, scale)])
        pending = torch.sort(later).values
        grown = width * GROWTH
        grown = vocab if grown * FULL_SORT_FRACTION >= vocab else grown
        # No wider than the rows' sizes need (at once where the round after would be the
        # widest: a round between only delays them), and wider than this round.
        width = min(vocab, max(widest if grown * 2 >= widest else grown, width + 1))


def _exact(p: _Pass, out: Tensor | None, logits: bool, any_flagged: bool) -> None:
    """Step 2 for one pass: its uncertified rows (after the sync), or every row of an
    exact-family group, through the exact path, from the pass's scores (still as given) into
    the pass's output rows."""
    exact_family = isinstance(p.owner, Group) and p.owner.family == Family.EXACT
    flagged = p.window is not None and p.window.needs is not None and any_flagged
    if not (exact_family or flagged):
        return
    target = out if p.rows is None else p.source
    p.done = torch.zeros(p.k.shape[0], dtype=torch.bool, device=p.k.device)
    if exact_family:
        decode_exact(target, p.k, p.source, _exact_inputs(p.owner, p.source.device),
                     logits=logits, scale=p.scale, done=p.done)
        return
    groups = [(p.owner, None)] if isinstance(p.owner, Group) else \
        [(group, where) for group, where in zip(p.owner.groups, p.owner.positions, strict=True)
         if group.flags]
    k = p.k.clone()
    try:
        for group, where in groups:
            needs = p.window.needs if where is None else p.window.needs.index_select(0, where)
            redo = needs.nonzero().squeeze(-1)
            if redo.numel() == 0:
                continue
            if where is not None:  # positions in the joint pass, in order (`decode_exact`)
                redo = torch.sort(where.index_select(0, redo)).values
            past = p.window.past
            low = None if past is None else torch.where(past, group.width, 1)
            # Uncertified rows are distributions (``needs`` excludes the others).
            decode_exact(target, k, p.source,
                         _exact_inputs(group, p.source.device, where=where, total=k.shape[0]),
                         logits=logits, scale=p.scale, rows=redo, low=low, done=p.done)
    finally:
        p.k = torch.where(p.done, k, p.k)


def _exact_inputs(group: Group, device: torch.device, piece: slice | None = None,
                  where: Tensor | None = None, total: int = 0):
    """The group's parameters for the exact path, one per row of the group (or of its rows
    ``piece``), or (``where``) spread over ``total`` rows of which ``where`` are the group's
    (the others get the group's first values and are never decoded)."""
    key = ("exact inputs", device)
    if key not in group.derived:  # once per plan: pinned, non-blocking copies
        group.derived[key] = {
            name: to_device(group.host[name], dtype, device).expand(group.count)
            for name, dtype in (("alpha", torch.float64), ("lam", torch.float64),
                                ("size", torch.long), ("cap", torch.long),
                                *((name, ROW_DTYPES[name]) for name in ROW_FIELDS))}
    full = group.derived[key]

    def per_row(name: str) -> Tensor:
        values = full[name]
        if piece is not None:
            values = values[piece]
        if where is not None:
            values = values[:1].expand(total).clone().index_copy_(0, where, values)
        return values

    alpha, lam, size, cap = (per_row(name) for name in ("alpha", "lam", "size", "cap"))
    fixed = size if group.fixed else torch.zeros_like(size)
    values = {name: per_row(name) for name in ROW_FIELDS}
    return exact_plan(group.mode, alpha, lam, fixed, cap, group.generator,
                      None if group.generator is not None else group.family, values)


def _unfinished(p: _Pass) -> int:
    """Rows of a pass the exact path should have decoded and did not (after a failure)."""
    if p.done is None:
        return 0
    if isinstance(p.owner, Group) and p.owner.family == Family.EXACT:
        return int(((p.k == 0) & ~p.done).sum())
    return int((p.window.needs & ~p.done).sum())


# ----------------------------------------------------------------------------- 3. write


def _finish(p: _Pass, out: Tensor | None, scores: Tensor, logits: bool) -> Tensor:
    """Step 3 for one pass: write its rows (the fixed answer where the exact path did not
    replace it) into ``out``, or into the gathered rows, then copied into ``out``; ``out``
    None: made here from the scores (one read, one write)."""
    exact_family = isinstance(p.owner, Group) and p.owner.family == Family.EXACT
    target = p.source if p.rows is not None else out
    if p.written:  # a chunked pass wrote ``p.source`` itself
        if p.rows is None:
            if out is None:
                return p.source
            if out is not p.source:
                out.copy_(p.source)
            return out
    elif exact_family:
        pass  # the exact path wrote ``target``
    elif p.window is not None:
        keep = p.window.valid if p.done is None else p.window.valid & ~p.done
        written = _write_window(target, p.window, keep, logits, p.temperature,
                                source=scores if target is None else None)
        if target is None:
            out = written
    elif p.shift is not None:  # keep all, logits: log q = T (scale * logits - log-normalizer)
        shift = p.shift.unsqueeze(-1).to(scores.dtype)
        if target is None:
            out = scores - shift
        else:
            target.sub_(shift)
    else:  # keep all, probabilities
        normalized, p.k = _keep_all(p.source)
        if target is None:
            out = normalized
        else:
            target.copy_(normalized)
    if p.rows is not None:
        out.index_copy_(0, p.rows, p.source)
    return out


def _write_window(target: Tensor | None, window: _Window, keep: Tensor, logits: bool,
                  temperature: Tensor | None, source: Tensor | None = None) -> Tensor:
    dtype = (target if target is not None else source).dtype
    values = output_values(window.log_q, logits, dtype, temperature)
    return write_support(target, window.index, values, -math.inf if logits else 0.0,
                         keep=keep, source=source)


def _keep_all(p2: Tensor) -> tuple[Tensor, Tensor]:
    """Probabilities, lambda -> 0 without a cap: k* is the whole support, renormalized.

    One pass in the input dtype (the float32 sum is a cascade: relative error ~1e-7, and never
    below the largest entry, so every quotient is in [0, 1]); rows that are not distributions
    are returned unchanged with k = 0. k counts the nonzero entries of the output.
    """
    normalized = p2.clamp_min(0)
    total = normalized.sum(-1, keepdim=True)
    usable = torch.isfinite(total) & (total > 0)
    normalized.div_(torch.where(usable, total, 1.0))
    # sign() sums exactly in float (counts < 2^24); bool reductions are 10x slower on CPU.
    support = torch.where(usable.squeeze(-1), normalized.sign().sum(-1), 0.0).long()
    if not bool(usable.all()):
        normalized = torch.where(usable, normalized, p2)
    return normalized, support


def step_memory_bound(batch: int, vocab: int, dtype: torch.dtype = torch.float32) -> int:
    """Upper bound, in bytes, of the extra memory one `decode_step` allocates for ``batch``
    rows of ``vocab`` scores, whatever the parameters (the output itself not counted):

    * three [batch, vocab] tensors of the score dtype: a gathered copy of a pass's rows, the
      temporary of a log-sum-exp (inside the op, in eager mode) and the exact path's copy of
      its rows (or a keep-all pass's count);
    * per row, the candidate arrays of the window (the W * BLOCK gathered entries and a few
      float64 [W] arrays) and the iterative families' float64 [K, K] Newton arrays (K <= W);
    * `MEMORY_BUDGET` for what runs in row chunks: the exact path (uncertified rows) and
      fixed-k groups wider than the window. The two never run at the same time.
    """
    item = torch.empty((), dtype=dtype).element_size()
    full = 3 * batch * vocab * item
    candidate = batch * (WIDE_WINDOW * 64 * item + 16 * WIDE_WINDOW * 8)
    newton = batch * 8 * WINDOW * WINDOW * 8
    return full + candidate + newton + MEMORY_BUDGET


__all__ = ["MEMORY_BUDGET", "UNBOUNDED", "decode_exact", "decode_step", "step_memory_bound"]
