"""The decoding step: a batch of scores in, the Bregman-decoded batch out, with a plan.

This is the hot path (vLLM calls it once per generated token for the whole batch). The plan
(`plan`) groups rows by formula family; groups of one window size class share one pass (a
`plan.Joint`: a batch mixing alphas, modes and lambdas is one pass, split only for each
family's formulas on its rows' candidates), the others (lambda = 0, the exact family, wide
fixed top-k) run alone. Each pass, in order:

1. p = softmax(logits) (or the given probabilities, negatives counted as 0), rows gathered from
   the batch only when the pass does not cover the whole batch;
2. the candidates: the top `width` entries and the deficits R_k (`candidates`);
3. per family, the support size and the map: fixed k, or the adaptive k* (the minimizer of
   cost(k), eq. (6) of arXiv 2505.19371) over a fixed window of sizes (`window`), with a
   certificate for rows whose answer could lie outside what the window decided;
4. the output: log q (or q) on the support, -inf (or 0) elsewhere; rows that are not
   distributions (NaN, no mass) come back unchanged.

Then one host sync, only for plans that can produce uncertified rows: if any row of any group
is uncertified, those rows are decoded again by the exact path (`exact`, value-dependent). Plans
whose every support fits the window (every row's k_max, or a fixed top-k, at most the window)
never sync, whatever the family (`_support_and_map`). Everything before the sync is a fixed
sequence of ops on fixed shapes.

Extra memory of one step (besides the output) is bounded for any parameters: the
probabilities of the decoded rows (one [n, V] tensor in the score dtype), a gathered copy of the
scores when a group is not the whole batch, O(n W) float64 candidate arrays, O(n K^2) float64
Newton arrays for the iterative families (K = window <= 64), and row chunks of at most
`exact.MEMORY_BUDGET` bytes for fixed-k groups wider than the window and for the exact path.
No float64 [n, V] array is ever made. `step_memory_bound` gives the bound in bytes.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import types
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .candidates import UNBOUNDED, Candidates, candidates
from .exact import MEMORY_BUDGET, _keep_all, decode_exact, exact_plan
from .families import CLOSED_GAP_FAMILIES, ITERATIVE_FAMILIES, Family
from .plan import WIDE_WINDOW, WINDOW, Group, Joint, Plan
from .window import Decoded, closed_map, closed_search, iterative_fixed, iterative_search

Tensor = torch.Tensor
logger = logging.getLogger(__name__)


class _Result(NamedTuple):
    out: Tensor  # [n, V] the group's decoded rows
    k: Tensor  # [n]
    needs: Tensor | None  # [n] rows to decode again with the exact path (None: none can)
    p: Tensor | None  # [n, V] probabilities, kept for the exact path
    past: Tensor | None = None  # [n] rows whose k* is certified to be >= the window


@dataclass
class StepStats:
    """Host counts of one or more steps, filled in by `decode_step` when the caller passes one
    (telemetry: ``bregman_exact_path_rows_total``)."""

    #: Rows the fixed-shape step could not certify and handed to the exact path (counted at the
    #: step's one host sync; no sync of its own).
    uncertified_rows: int = 0


def decode_step(scores: Tensor, plan: Plan, *, logits: bool, inplace: bool = False,
                stats: StepStats | None = None) -> tuple[Tensor, Tensor]:
    """Decode the rows of ``scores`` ([N, V] logits, or probabilities with ``logits=False``)
    that the plan's groups name. Returns (decoded [N, V], k [N]); rows outside every group are
    left as they are (and get k = 0). With ``inplace`` the result is written into ``scores``.
    With ``stats``, the rows handed to the exact path are added to it.

    Exceptions propagate. With ``inplace``, one raised by the exact path after the fixed step
    wrote the whole batch carries ``bregman_uncertified_rows`` (the rows that keep the fixed
    step's uncertified answer, a distribution on the window): ``scores`` is then decoded and
    must not be decoded again.
    """
    # (result, group or joint pass, batch rows of the result: None = every row in order)
    results: list[tuple[_Result, Group | Joint, Tensor | None]] = [
        (_decode_group(scores, group, logits, inplace), group, group.rows)
        for group in plan.alone]
    results += [(_decode_joint(scores, joint, logits, inplace), joint, joint.rows)
                for joint in plan.joints]
    # The step's only host sync: how many rows need the exact path.
    counts = [result.needs.sum() for result, _, _ in results if result.needs is not None]
    uncertified = int(torch.stack(counts).sum() if len(counts) > 1 else counts[0]) \
        if counts else 0
    if stats is not None:
        stats.uncertified_rows += uncertified
    if uncertified:
        try:
            results = [(_redo(result, owner, logits), owner, rows)
                       for result, owner, rows in results]
        except Exception as error:
            if inplace and any(rows is None for _, _, rows in results):
                # ``scores`` already holds the step's output: tell the caller not to decode
                # it again, and how many rows kept the window's uncertified answer.
                error.bregman_uncertified_rows = uncertified  # type: ignore[attr-defined]
            raise
    if len(results) == 1 and results[0][2] is None:
        return results[0][0].out, results[0][0].k  # (``scores`` itself when inplace)
    out = scores if inplace else scores.clone()
    k = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)
    for result, _, rows in results:
        rows = torch.arange(scores.shape[0], device=scores.device) if rows is None else rows
        out.index_copy_(0, rows, result.out)
        k.index_copy_(0, rows, result.k)
    return out, k


def _decode_joint(scores: Tensor, joint: Joint, logits: bool, inplace: bool) -> _Result:
    """The joint pass (`joint_groups`) over the union of its groups' rows."""
    rows = scores if joint.rows is None else scores.index_select(0, joint.rows)
    writable = inplace or (joint.rows is not None and logits)
    if "static" not in joint.derived:  # once per plan
        joint.derived["static"] = _JointStatic(
            tuple(_Static.of(group) for group in joint.groups), joint.width)
        joint.derived["values"] = tuple(
            tuple(getattr(group, name) for group in joint.groups)
            for name in ("alpha", "lam", "size"))
    static = joint.derived["static"]
    args = (joint.positions, *joint.derived["values"], logits, writable)
    if compile_enabled(rows.device) and not _COMPILED.get("failed"):
        try:
            return _Result(*compiled_group(static)(rows, *args))
        except Exception:  # a compiler that cannot handle this device: stay eager for good
            logger.warning("torch.compile of the Bregman step failed; running it eagerly",
                           exc_info=True)
            _COMPILED["failed"] = True
    return _Result(*joint_groups(rows, static, *args))


def _redo(result: _Result, owner: Group | Joint, logits: bool) -> _Result:
    """`_redo_uncertified` for a group, or for each group of the joint pass on its rows."""
    if isinstance(owner, Group):
        return _redo_uncertified(result, owner, logits)
    for group, where in zip(owner.groups, owner.positions, strict=True):
        if _may_flag(_Static.of(group)):
            result = _redo_uncertified(result, group, logits, where)
    return result


def _decode_group(scores: Tensor, group: Group, logits: bool, inplace: bool) -> _Result:
    rows = scores if group.rows is None else scores.index_select(0, group.rows)
    # A gathered copy is ours to overwrite, unless it doubles as the probabilities (which the
    # exact path may still need).
    writable = inplace or (group.rows is not None and logits)
    if group.family == Family.KEEP_ALL:
        out, k = _keep_all_logits(rows) if logits else _keep_all(rows)
        if writable and out is not rows:
            out = rows.copy_(out)
        return _Result(out, k, None, None)
    if group.family == Family.EXACT:
        result = _exact_rows(rows, _probabilities(rows, logits, writable), group, logits)
        if writable:
            rows.copy_(result.out)
            result = result._replace(out=rows)
        return result
    static = _Static.of(group)
    chunk = max(1, MEMORY_BUDGET // (static.width * _WIDE_BYTES_PER_ENTRY))
    if rows.shape[0] <= chunk:
        return _Result(*_fast(rows, static, group.alpha, group.lam, group.size, logits,
                              writable))
    # A wide fixed top-k: rows in chunks, so its [rows, width] float64 arrays stay bounded.
    out = rows if writable else rows.clone()
    parts = [_fast(out[piece], static, _rows_of(group.alpha, piece), _rows_of(group.lam, piece),
                   _rows_of(group.size, piece), logits, True)
             for piece in (slice(start, start + chunk)
                           for start in range(0, rows.shape[0], chunk))]
    k = torch.cat([part[1] for part in parts])
    needs = None if parts[0][2] is None else torch.cat([part[2] for part in parts])
    # Fixed-k rows: no window search, so no ``past`` bound (parts[0][4] is None).
    return _Result(out, k, needs, torch.cat([part[3] for part in parts]))


def _rows_of(value, piece: slice):
    return value[piece] if isinstance(value, Tensor) else value


def _probabilities(rows: Tensor, logits: bool, writable: bool) -> Tensor:
    """softmax(rows), or the given probabilities (copied when the rows will be overwritten).
    Negative probabilities are never candidates (they sort last) and their values are clamped
    to 0 where they are (`candidates.candidates`)."""
    if logits:
        return torch.softmax(rows, -1)
    return rows.clone() if writable else rows


@dataclass(frozen=True)
class _Static:
    """What a group's fixed-shape computation is specialized on (all host values)."""

    family: Family
    fixed: bool
    capped: bool
    bounded: bool
    width: int
    window: int
    iterations: int
    below_two: bool
    above_two: bool

    @classmethod
    def of(cls, group: Group) -> _Static:
        """The group's static shape, made once per plan (kept in ``group.derived``)."""
        static = group.derived.get("static")
        if static is None:
            static = group.derived["static"] = cls(
                group.family, group.fixed, group.capped, group.bounded, group.width,
                group.window, group.iterations, group.below_two, group.above_two)
        return static


def fixed_shape_group(rows: Tensor, static: _Static, alpha, lam, size, logits: bool,
                      writable: bool
                      ) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor | None]:
    """Steps 1-4 of the module docstring for one group: a fixed sequence of ops on fixed
    shapes, no host sync. Returns (decoded rows, k, rows needing the exact path or None, the
    probabilities, rows among those whose k* is certified >= the window or None)."""
    p = _probabilities(rows, logits, writable)
    cand = candidates(p, static.width)
    valid = _valid(cand, logits)
    decoded = _support_and_map(cand, static, alpha, lam, size)
    out = _write(rows, cand.index[:, : decoded.log_q.shape[-1]], decoded.log_q, valid, logits,
                 writable)
    needs = None if decoded.uncertain is None else decoded.uncertain & valid
    return out, decoded.k * valid, needs, p, decoded.past


def _valid(cand: Candidates, logits: bool) -> Tensor:
    """Rows that are distributions (others are returned as given)."""
    return (cand.total > 0) if logits else (cand.total > 0) & (cand.total < math.inf)


def _write(rows: Tensor, index: Tensor, log_q: Tensor, valid: Tensor, logits: bool,
           writable: bool) -> Tensor:
    """Step 4: log q (or q) at ``index``, -inf (or 0) elsewhere, on the valid rows."""
    values = log_q if logits else torch.exp(log_q)
    # Rows that are not distributions get their own values back.
    values = torch.where(valid.unsqueeze(-1), values.to(rows.dtype), torch.gather(rows, 1, index))
    # Off the support: -inf (logits) or 0 (probabilities) on valid rows, the row's own values
    # elsewhere; as one-sided bounds per row, each one fast pass (measured on CPU at
    # [64, 128256]: an in-place one-sided clamp 0.3 ms; a two-sided clamp with tensor bounds,
    # a broadcast where or masked_fill 2.4 to 4.4 ms).
    high = torch.where(valid, -math.inf if logits else 0.0, math.inf).unsqueeze(-1)
    high = high.to(rows.dtype)
    out = rows.clamp_(max=high) if writable else torch.minimum(rows, high)
    if not logits:
        out = out.clamp_(min=torch.where(valid, 0.0, -math.inf).unsqueeze(-1).to(rows.dtype))
    return out.scatter_(1, index, values)


@dataclass(frozen=True)
class _JointStatic:
    """What the joint pass is specialized on: each group's `_Static` and the shared width."""

    statics: tuple[_Static, ...]
    width: int


def _may_flag(static: _Static) -> bool:
    """Whether a group's rows can come back uncertified (then the step syncs once): adaptive
    groups whose supports may pass the window, and iterative fixed sizes wider than `WINDOW`
    (`_support_and_map` asks for the certificates exactly there)."""
    if static.fixed:
        return static.family in ITERATIVE_FAMILIES and static.width > WINDOW
    return not static.bounded


def joint_groups(rows: Tensor, joint: _JointStatic, positions: tuple[Tensor, ...],
                 alphas: tuple, lams: tuple, sizes: tuple, logits: bool, writable: bool
                 ) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor | None]:
    """Steps 1-4 for several groups in one pass: one softmax and one candidate set of
    ``joint.width`` for all ``rows``, each group's support and map on its own rows'
    candidates (``positions``: the group's rows within ``rows``), one write of the output.
    A fixed sequence of ops on fixed shapes, no host sync. Returns what `fixed_shape_group`
    returns, for all the rows."""
    p = _probabilities(rows, logits, writable)
    cand = candidates(p, joint.width)
    valid = _valid(cand, logits)
    n, width = cand.x.shape
    log_q = cand.x.new_full((n, width), -math.inf)
    k = torch.zeros(n, dtype=torch.long, device=rows.device)
    flags = any(_may_flag(static) for static in joint.statics)
    needs = torch.zeros(n, dtype=torch.bool, device=rows.device) if flags else None
    past = torch.zeros(n, dtype=torch.bool, device=rows.device) if flags else None
    for i, static in enumerate(joint.statics):
        where = positions[i]
        decoded = _support_and_map(_select(cand, where, static.width), static, alphas[i],
                                   lams[i], sizes[i])
        short = width - decoded.log_q.shape[-1]
        rows_log_q = decoded.log_q if short == 0 else \
            torch.nn.functional.pad(decoded.log_q, (0, short), value=-math.inf)
        log_q.index_copy_(0, where, rows_log_q)
        k.index_copy_(0, where, decoded.k)
        if decoded.uncertain is not None and needs is not None:  # (`_may_flag` says when)
            needs.index_copy_(0, where, decoded.uncertain)
        if decoded.past is not None and past is not None:
            past.index_copy_(0, where, decoded.past)
    # Past a group's own support its candidates are off the support: -inf there is right.
    out = _write(rows, cand.index, log_q, valid, logits, writable)
    return out, k * valid, None if needs is None else needs & valid, p, past


def _select(cand: Candidates, where: Tensor, width: int) -> Candidates:
    """The candidates of the rows ``where``, cut to the first ``width`` (what `candidates`
    gives for that width: the deficits do not depend on it, the count of known positive
    entries does)."""
    x = cand.x[:, :width].index_select(0, where)
    deficit = cand.deficit[:, :width].index_select(0, where)
    index = cand.index[:, :width].index_select(0, where)
    total = cand.total.index_select(0, where)
    if width == cand.x.shape[-1]:
        return Candidates(x, index, deficit, total, cand.known.index_select(0, where))
    # Every positive entry is among the first ``width`` unless all are positive and mass
    # (R_width) lies beyond them.
    incomplete = (x[:, -1] > 0) & (deficit[:, -1] > 0)
    known = (x > 0).sum(-1).masked_fill_(incomplete, UNBOUNDED)
    return Candidates(x, index, deficit, total, known)


def _support_and_map(cand: Candidates, static: _Static, alpha, lam, size) -> Decoded:
    """Step 3. Iterative families whose every support fits the first window (adaptive groups
    with `Group.bounded`, fixed sizes up to `WINDOW`) take the fixed Newton iterations' answer
    as final without computing their certificates (convergence, near-ties), so such groups
    never sync. Evidence, not a proof: on a sweep of extreme inputs the certificates never fail
    there (`tests/test_gpu_readiness.py` computes them and requires it). Elsewhere a row the
    window may not hold still goes to the exact path."""
    family = static.family
    if static.fixed:
        k = torch.minimum(cand.known, size) if isinstance(size, Tensor) \
            else cand.known.clamp_max(size)
        if family in ITERATIVE_FAMILIES:
            return iterative_fixed(family, cand, alpha, k, static.width, static.iterations,
                                   static.below_two, static.above_two,
                                   certify=_may_flag(static))
        return Decoded(k, closed_map(family, cand, k, static.width), None)
    if not static.capped:
        limit = cand.known
    elif isinstance(size, Tensor):
        limit = torch.minimum(cand.known, size)
    else:
        limit = cand.known.clamp_max(size)
    if family in CLOSED_GAP_FAMILIES:
        return closed_search(family, cand, lam, limit, static.window, static.bounded)
    return iterative_search(family, cand, alpha, lam, limit, static.window, static.iterations,
                            static.bounded, static.below_two, static.above_two,
                            certify=_may_flag(static))


# ----------------------------------------------------------------------------- compilation

_COMPILED: dict[object, object] = {}


def compile_enabled(device: torch.device) -> bool:
    """``BREGMAN_COMPILE``: "1" compiles the fixed-shape groups with torch.compile (fullgraph)
    everywhere, "auto" on CUDA only, "0" (the default) never.

    Off by default: a group is compiled at its first use, inside a decoding step (about 10 s
    per family on a CPU), so every request on the engine would wait for it, and the compiled
    path has not yet been measured on a GPU (`benchmarks/bench_core.py --compile 1`)."""
    return _compile_choice(os.environ.get("BREGMAN_COMPILE", "0"), device.type)


@functools.lru_cache(maxsize=16)
def _compile_choice(setting: str, device_type: str) -> bool:
    # Parsed once per (setting, device): the step asks at every group of every call.
    setting = setting.strip().lower()
    if setting in ("1", "true", "yes", "on"):
        return True
    if setting in ("0", "false", "no", "off"):
        return False
    return device_type == "cuda"


def _group_entry(rows: Tensor, alpha, lam, size, logits: bool, writable: bool):
    return fixed_shape_group(rows, STATIC, alpha, lam, size, logits, writable)  # noqa: F821


def _joint_entry(rows: Tensor, positions, alphas, lams, sizes, logits: bool, writable: bool):
    return joint_groups(rows, STATIC, positions, alphas, lams, sizes, logits,  # noqa: F821
                        writable)


def compiled_group(static: _Static | _JointStatic):
    """`fixed_shape_group` for one group shape (or `joint_groups` for one joint shape) under
    torch.compile (fullgraph), made on first use (about 10 s per family on a CPU).

    Each shape gets a function of its own (its own code object, with ``static`` a constant of
    its globals), so torch.compile's caches of two families never meet: the graph is
    specialized on the shape, while batch sizes and parameter values stay graph inputs (no
    recompile per value).
    """
    compiled = _COMPILED.get(static)
    if compiled is None:
        if isinstance(static, _JointStatic):
            kind, code = "joint", _joint_entry.__code__
        else:
            kind, code = static.family.value, _group_entry.__code__
        name = f"bregman_{kind}_group_{len(_COMPILED)}"
        entry = types.FunctionType(code.replace(co_name=name),
                                   {**globals(), "STATIC": static}, name)
        compiled = _COMPILED[static] = torch.compile(entry, fullgraph=True)
    return compiled


def _fast(rows: Tensor, static: _Static, alpha, lam, size, logits: bool, writable: bool
          ) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor | None]:
    if compile_enabled(rows.device) and not _COMPILED.get("failed"):
        try:
            return compiled_group(static)(rows, alpha, lam, size, logits, writable)
        except Exception:  # a compiler that cannot handle this device: stay eager for good
            logger.warning("torch.compile of the Bregman step failed; running it eagerly",
                           exc_info=True)
            _COMPILED["failed"] = True
    return fixed_shape_group(rows, static, alpha, lam, size, logits, writable)


# ----------------------------------------------------------------------------- exact path


def _exact_inputs(group: Group, device: torch.device, where: Tensor | None = None,
                  total_rows: int = 0):
    """The group's parameters for the exact path, one per row of the group, or (``where``)
    spread over ``total_rows`` rows of which ``where`` are the group's (the others get the
    group's first values and are never decoded)."""
    def per_row(name: str, dtype: torch.dtype) -> Tensor:
        values = torch.tensor(group.host[name], dtype=dtype, device=device)
        if values.numel() == 1:  # shared by the whole group
            values = values.expand(group.count)
        if where is not None:
            values = values[:1].expand(total_rows).clone().index_copy_(0, where, values)
        return values

    alpha = per_row("alpha", torch.float64)
    lam = per_row("lam", torch.float64)
    size = per_row("size", torch.long)
    cap = per_row("cap", torch.long)
    fixed = size if group.fixed else torch.zeros_like(size)
    return exact_plan(group.mode, alpha, lam, fixed, cap, group.generator)


def _writer(logits: bool, dtype: torch.dtype):
    if logits:
        return lambda log_q: log_q.to(dtype)
    return lambda log_q: torch.exp(log_q).to(dtype)


def _exact_rows(rows: Tensor, p: Tensor, group: Group, logits: bool) -> _Result:
    """EXACT-family rows: the whole group through the exact path."""
    out, k = _filled(rows, p, logits)
    decode_exact(out, k, p, _exact_inputs(group, rows.device), _writer(logits, rows.dtype))
    return _Result(out, k, None, None)


def _filled(rows: Tensor, p: Tensor, logits: bool) -> tuple[Tensor, Tensor]:
    """Output rows pre-filled off the support; rows that are not distributions kept as given."""
    total = p.sum(-1, dtype=torch.float64)
    valid = (total > 0) & (total < math.inf)
    out = torch.where(valid.unsqueeze(-1), -math.inf if logits else 0.0, rows)
    return out, torch.zeros(rows.shape[0], dtype=torch.long, device=rows.device)


def _redo_uncertified(result: _Result, group: Group, logits: bool,
                      where: Tensor | None = None) -> _Result:
    """Decode the group's uncertified rows again with the exact path (after the sync), in
    place: their window answer is cleared and the exact supports written over it. Rows the
    window showed to need more sizes than it has skip the exact path's first round.
    ``where``: the group's rows within ``result`` when it holds a joint pass (None: all)."""
    if result.needs is None:
        return result
    needs = result.needs if where is None else result.needs.index_select(0, where)
    redo = needs.nonzero().squeeze(-1)
    if redo.numel() == 0:
        return result
    n = result.out.shape[0]
    if where is not None:  # positions in the joint result, in order (`exact.decode_exact`)
        redo = torch.sort(where.index_select(0, redo)).values
    low = None if result.past is None else torch.where(result.past, group.window, 1)
    # Uncertified rows are distributions (``needs`` excludes the others): cleared off the
    # support as the exact path writes them. No row is gathered: the exact path reads and
    # writes the rows ``redo`` in place.
    decode_exact(result.out, result.k, result.p,
                 _exact_inputs(group, result.p.device, where, n),
                 _writer(logits, result.out.dtype), rows=redo, low=low,
                 clear=-math.inf if logits else 0.0)
    return result


# ----------------------------------------------------------------------------- keep all


def _keep_all_logits(rows: Tensor) -> tuple[Tensor, Tensor]:
    """lambda = 0 without a cap: the whole support, renormalized (log_softmax); rows that are
    not distributions come back unchanged with k = 0."""
    total = torch.logsumexp(rows, -1, keepdim=True)
    usable = torch.isfinite(total)
    out = torch.where(usable, rows - total, rows)
    # Count the entries whose probability is nonzero in the score dtype (as a softmax gives).
    support = torch.where(usable.squeeze(-1), torch.softmax(rows, -1).sign().sum(-1), 0.0)
    return out, support.long()


#: Peak bytes per (row, candidate) of a fixed-k group (measured: 59 for dual 3/2, k = 20000).
_WIDE_BYTES_PER_ENTRY = 96


def step_memory_bound(batch: int, vocab: int, dtype: torch.dtype = torch.float32) -> int:
    """Upper bound, in bytes, of the extra memory one `decode_step` allocates for ``batch``
    rows of ``vocab`` scores, whatever the parameters (the output itself not counted):

    * three [batch, vocab] tensors of the score dtype: the probabilities, a gathered copy of
      a group's rows and its decoded rows (the output of the public API);
    * per row, the candidate arrays of the window (the W * BLOCK gathered entries and a few
      float64 [W] arrays) and the iterative families' float64 [K, K] Newton arrays (K <= W);
    * `exact.MEMORY_BUDGET` for what runs in row chunks: the exact path (uncertified rows) and
      fixed-k groups wider than the window. The two never run at the same time.
    """
    item = torch.empty((), dtype=dtype).element_size()
    full = 3 * batch * vocab * item
    candidate = batch * (WIDE_WINDOW * 64 * item + 16 * WIDE_WINDOW * 8)
    newton = batch * 8 * WINDOW * WINDOW * 8
    return full + candidate + newton + MEMORY_BUDGET
