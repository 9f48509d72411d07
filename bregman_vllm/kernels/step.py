"""The decoding step as Triton kernels (four; six with the search pass; seven and a sort with
the wide pass): no host plan, no host sync.

The CUDA step of `bregman_vllm.core.step` (which stays the CPU path and the reference every
kernel is tested against), shaped as vLLM's Model Runner V2 builds its own sampler
(`vllm/v1/worker/gpu/sample/`): one short kernel per stage, one program per row (or per row and
vocabulary chunk), each row's parameters read from device columns (`rows.RowTable`)
through the step's row -> slot mapping, rows of plain requests skipped inside the kernels. In
order:

1. `_read_kernel` (the one read of the batch; row x vocabulary chunk): the maximum and the mass
   (log-sum-exp of the scaled logits, or sum of the probabilities) of every block of `BLOCK`
   entries;
2. `_select_kernel` (a program per row): the row's log-normalizer from the block masses, then
   its K candidates: the K blocks with the largest maxima hold the K largest entries; their
   entries' order keys (`formulas.order_key`: value bits and index in one int64) go through
   `tl.topk`, a chunk of blocks at a time; the mass of everything else from positive terms (the
   other blocks' masses, the chosen blocks' other entries); x, log x, R_k and the positions
   into a [n, K] scratch;
3. `_decode_kernel` (a program per row): the row's family formulas (`formulas`): the support
   size (fixed, or the adaptive k* over the window) and log T_k* on the candidates, the values
   to write (T log q, or q), and the search's flags: ``needs`` (the search must decode the
   row: k* past the window, a near-tie, an unconverged solve, the ``EXACT`` family, a fixed
   size wider than the widest window) and ``low`` (a certified lower bound on its k*);
4. the search pass (`_search_pass`, launched when the layout says some row may need it,
   `rows.Layout.sync`): `_select_kernel` again, at the search's C candidates and for the rows
   left ``needs`` only (the others leave at once, no host read), then `_search_kernel` (a
   program per row): the torch search's algorithm (`kernels.search`, `core.search`: the floor
   of the gaps, probes on the multiplier, exact gaps, the map of k*) in float64, or a fixed
   size's map, or the closed-form gaps over C; C is 64 or 256 for rows bounded there (their
   cap, or `families.support_bound`), else `SEARCH_WIDTH` (`search_width`);
5. the wide pass (`_wide_pass`, launched when some row's reach, `rows.Row.reach`, passes the
   search's widest candidates on rows longer than them): one `torch.sort` of the batch
   (descending, ties by index, the order of `formulas.order_key`), or, where the layout's
   reach is within half the row, one `torch.topk` of its reach rounded up to a power of two
   (a select, the candidates' compaction and their sort); then `wide.wide_kernel` (a program
   per row; rows the search pass decided leave at once): the same search over the sorted
   candidates in global memory, a block at a time, which decides every k*; its values
   overwrite the candidates' first k*;
6. `_write_kernel` (row x vocabulary chunk): -inf (or 0) off the support, the values on it (the
   window's, the search's or the wide pass's), in place on the logits (or into a new tensor:
   rows not decoded copied); keep-all rows (lambda -> 0) shifted by T times their
   log-normalizer; rows not decoded and rows that are not distributions (NaN, +inf, all -inf)
   untouched.

Four launches when no row may need the search, six when some row may, seven and the sort when
some row may pass the search's candidates; no host sync in any case (no data-dependent shape
either: the sort takes the whole batch). A row whose map comes out NaN is not written with it:
it keeps the window's answer, or is left as it came.

Specialization: each kernel is compiled per (candidate width K or C, logits or probabilities,
in place), by `warm_up` at construction; row counts are grid sizes, the row -> slot mapping is
always a tensor (the identity for a plan's table), strides are not specialized on: no batch
recompiles.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..core.candidates import BLOCK, log_smallest, under_smallest
from ..core.families import WIDE_WINDOW, WINDOW
from ..core.plan import Plan
from ..core.result import StepResult
from ..rows import Layout, RowTable
from .formulas import (
    ARGMAX,
    DUAL_THREE,
    DUAL_THREE_HALVES,
    INTERPRET,
    ROUTE_KEEP,
    ROUTE_SEARCH,
    ROUTE_WINDOW,
    WATER,
    closed_gap_family,
    closed_map_at,
    closed_search,
    exp64,
    iterative_family,
    iterative_fixed,
    iterative_search,
    key_index,
    key_value,
    known_count,
    log64,
    order_key,
    request_at,
    shifted,
    top_keys,
)
from .search import fixed_map, search_row

# (the search pass's widest candidate set, `wide.SEARCH_WIDTH`: rows whose k* may pass the
# windows get it; rows bounded by a window's width get that width, `search_width`)
from .wide import SEARCH_WIDTH, WIDE_BLOCK, wide_kernel

Tensor = torch.Tensor

#: Blocks per tile of the read kernel ([TILE, BLOCK] entries at a time).
TILE = 16
#: Blocks per chunk of the candidate selection (CHUNK * BLOCK keys through one top-k; under
#: the interpreter `formulas.rank_top`'s [N, N] comparison must stay within Triton's largest
#: tensor, 2^20 elements).
CHUNK = 16 if INTERPRET else 32
#: Programs the read and write kernels aim for (a few per streaming multiprocessor).
PROGRAMS = 1024
#: Entries per program of the write kernel, at least.
WRITE_CHUNK = 8192
#: Score dtypes the kernels read (float64 scores take the torch step).
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: The search pass's widths, narrowest first.
SEARCH_WIDTHS = (WINDOW, WIDE_WINDOW, SEARCH_WIDTH)
#: Candidates per step of the write kernel's loop over the search's values.
SEARCH_TILE = tl.constexpr(64)


class KernelStep(NamedTuple):
    """What `decode` returns."""

    out: Tensor  # [N, V] the decoded batch (``scores`` itself when in place)
    k: Tensor  # [N] support sizes (0 for rows not decoded)


# ----------------------------------------------------------------------------- 1. read


@triton.jit(do_not_specialize=["stride"])
def _read_kernel(scores_ptr, stride, vocab, blocks, map_ptr, family_ptr, scale_ptr,
                 max_ptr, mass_ptr, LOGITS: tl.constexpr, TILE: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Block maxima and masses of one row's chunk of blocks (`candidates._top`'s reads 1 and
    2 in one: `candidates._mass`)."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(map_ptr + row).to(tl.int64)
    if tl.load(family_ptr + slot) == 0:
        return
    scale = tl.load(scale_ptr + slot)
    per = tl.cdiv(blocks, tl.num_programs(1))
    first = tl.program_id(1) * per
    last = tl.minimum(first + per, blocks)
    lanes = tl.arange(0, BLOCK)
    for start in range(first, last, TILE):
        block = start + tl.arange(0, TILE)
        offsets = block[:, None] * BLOCK + lanes[None, :]
        inside = (block[:, None] < last) & (offsets < vocab)
        values = tl.load(scores_ptr + row * stride + offsets, mask=inside,
                         other=float("-inf")).to(tl.float32)
        top = tl.max(values, axis=1)
        if LOGITS:
            # log-sum-exp of the scaled entries (an all -inf block: -inf; NaN, +inf: NaN)
            reference = top * scale
            reference = tl.where(reference == float("-inf"), 0.0, reference)
            mass = reference + tl.log(tl.sum(tl.exp(values * scale - reference[:, None]),
                                             axis=1))
        else:  # entries <= 0 count as zero (NaN stays: the row is not a distribution)
            mass = tl.sum(tl.where(inside & ~(values < 0), values, 0.0), axis=1)
        kept = block < last
        tl.store(max_ptr + row * blocks + block, top, mask=kept)
        tl.store(mass_ptr + row * blocks + block, mass, mask=kept)


# ----------------------------------------------------------------------------- 2. candidates


@triton.jit(do_not_specialize=["stride"])
def _select_kernel(scores_ptr, stride, vocab, blocks, map_ptr, family_ptr, route_ptr,
                   scale_ptr, max_ptr, mass_ptr, x_ptr, log_x_ptr, deficit_ptr,
                   index_ptr, total_ptr, valid_ptr, needs_ptr, LOGITS: tl.constexpr,
                   K: tl.constexpr, KB: tl.constexpr, NBP: tl.constexpr, CHUNK: tl.constexpr,
                   BLOCK: tl.constexpr, SMALLEST: tl.constexpr, GATE: tl.constexpr):
    """One row's log-normalizer (or total mass) and its K candidates (`candidates.candidates`):
    x (normalized probabilities, sorted, 0 below the score dtype's smallest value), log x,
    R_(j+1) = tail + sum_(i>j) x_i from positive terms, positions; whether the row is a
    distribution. ``GATE``: the search's pass (its rows are those the decode kernel left
    ``needs``, the others leave at once; the row's total and validity are the window pass's)."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(map_ptr + row).to(tl.int64)
    family = tl.load(family_ptr + slot)
    if family == 0:
        return
    if GATE:  # noqa: SIM102 (a compile-time condition)
        if tl.load(needs_ptr + row) == 0:
            return
    scale = tl.load(scale_ptr + slot).to(tl.float64)
    listed = tl.arange(0, NBP)
    inside = listed < blocks
    block_max = tl.load(max_ptr + row * blocks + listed, mask=inside, other=float("-inf"))
    if LOGITS:
        block_mass = tl.load(mass_ptr + row * blocks + listed, mask=inside,
                             other=float("-inf")).to(tl.float64)
        top = tl.max(block_max, axis=0).to(tl.float64) * scale
        reference = tl.where(tl.abs(top) < float("inf"), top, 0.0)
        block_mass = tl.where(inside, exp64(block_mass - reference), 0.0)
        total = reference + log64(tl.sum(block_mass, axis=0))
        valid = tl.abs(total) < float("inf")
    else:
        block_mass = tl.load(mass_ptr + row * blocks + listed, mask=inside,
                             other=0.0).to(tl.float64)
        reference = tl.full((), 0.0, tl.float64)
        total = tl.sum(block_mass, axis=0)
        valid = (total > 0) & (total < float("inf"))
    # (the window's rows, `families.route`: a fixed size of a window row fits K; the search's
    # rows in its pass)
    if GATE:
        chosen_row = (tl.load(needs_ptr + row) != 0) & valid
    else:
        chosen_row = (tl.load(route_ptr + slot) == ROUTE_WINDOW) & valid
    if chosen_row:
        # The K largest entries lie in the K blocks with the largest maxima.
        chosen = top_keys(order_key(block_max, listed), KB)
        chosen_blocks = key_index(chosen)
        outside = inside & (order_key(block_max, listed) < tl.min(chosen, axis=0))
        tail = tl.sum(tl.where(outside, block_mass, 0.0), axis=0)
        lanes = tl.arange(0, BLOCK)
        # (distinct keys below every entry's, `formulas.order_key`, until the first chunk)
        best = -9223372036854775807 + tl.arange(0, K).to(tl.int64)
        for c in range(0, KB, CHUNK):
            picked = tl.gather(chosen_blocks, c + tl.arange(0, CHUNK), 0)
            offsets = picked[:, None] * BLOCK + lanes[None, :]
            values = tl.load(scores_ptr + row * stride + offsets, mask=offsets < vocab,
                             other=float("-inf")).to(tl.float32)
            keys = top_keys(tl.reshape(order_key(values, offsets), [CHUNK * BLOCK]), K)
            best = top_keys(tl.reshape(tl.join(best, keys), [2 * K]), K)
        # The chosen blocks' other entries.
        last = tl.min(best, axis=0)
        for c in range(0, KB, CHUNK):
            picked = tl.gather(chosen_blocks, c + tl.arange(0, CHUNK), 0)
            offsets = picked[:, None] * BLOCK + lanes[None, :]
            present = offsets < vocab
            values = tl.load(scores_ptr + row * stride + offsets, mask=present,
                             other=float("-inf")).to(tl.float32)
            rest = present & (order_key(values, offsets) < last)
            if LOGITS:
                terms = tl.where(rest, tl.exp(values * scale.to(tl.float32)
                                              - reference.to(tl.float32)), 0.0)
            else:  # (entries <= 0 count as zero; NaN stays)
                terms = tl.where(rest & ~(values < 0), values, 0.0)
            tail += tl.sum(tl.sum(terms, axis=1).to(tl.float64), axis=0)
        values = key_value(best).to(tl.float64)
        if LOGITS:
            scaled = values * scale
            mass = tl.sum(exp64(scaled - reference), axis=0) + tail
            total = reference + log64(mass)
            log_x = scaled - total
            x = exp64(log_x)
            x = tl.where(x > SMALLEST, x, 0.0)
            tail = tail / mass
            valid = tl.abs(total) < float("inf")
        else:
            x = tl.where(values > 0, values, 0.0)
            total = tl.sum(x, axis=0) + tail
            x = x / total
            tail = tail / total
            log_x = log64(x)
            valid = (total > 0) & (total < float("inf"))
        positions = tl.arange(0, K)
        deficit = tail + tl.cumsum(shifted(x, positions, K), 0, reverse=True)
        where = row * K + positions
        tl.store(x_ptr + where, x)
        tl.store(log_x_ptr + where, log_x)
        tl.store(deficit_ptr + where, deficit)
        tl.store(index_ptr + where, key_index(best))
    if not GATE:
        tl.store(total_ptr + row, total)
        tl.store(valid_ptr + row, valid)


# ----------------------------------------------------------------------------- 3. decode


@triton.jit
def _decode_kernel(map_ptr, family_ptr, route_ptr, fixed_ptr, size_ptr, alpha_ptr, lam_ptr,
                   iterations_ptr, temperature_ptr, x_ptr, log_x_ptr, deficit_ptr, total_ptr,
                   valid_ptr, values_ptr, k_ptr, mode_ptr, needs_ptr, flagged_ptr, low_ptr,
                   shift_ptr, bound_ptr, LOGITS: tl.constexpr, K: tl.constexpr, W: tl.constexpr,
                   LOG_SMALLEST: tl.constexpr):
    """One row's support size and map (`step._support_and_map`), the values to write and the
    search's flags. ``mode``: 0 leave the row, 1 write the window's answer, 2 keep all
    (lambda -> 0, `step._keep_all_start`: shift by T times the log-normalizer)."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(map_ptr + row).to(tl.int64)
    family = tl.load(family_ptr + slot)
    positions = tl.arange(0, K)
    k = tl.full((), 0, tl.int64)
    mode = tl.full((), 0, tl.int32)
    needs = k > 0
    low = k + 1
    shift = tl.full((), 0.0, tl.float64)
    bound = shift
    log_q = tl.full([K], float("-inf"), tl.float64)
    if family != 0:
        fixed = tl.load(fixed_ptr + slot) != 0
        size = tl.load(size_ptr + slot)
        valid = tl.load(valid_ptr + row) != 0
        temperature = tl.load(temperature_ptr + slot).to(tl.float64)
        way = tl.load(route_ptr + slot)  # (`families.route`)
        if way == ROUTE_KEEP:
            if valid:
                mode = tl.full((), 2, tl.int32)
                total = tl.load(total_ptr + row)
                if LOGITS:
                    shift = total * temperature
                    bound = (total + LOG_SMALLEST) * temperature
                else:
                    shift = total
        elif way == ROUTE_SEARCH:
            needs = valid
        elif valid:
            mode = tl.full((), 1, tl.int32)
            alpha = tl.load(alpha_ptr + slot)
            iterations = tl.load(iterations_ptr + slot)
            where = row * K + positions
            x = tl.load(x_ptr + where)
            log_x = tl.load(log_x_ptr + where)
            deficit = tl.load(deficit_ptr + where)
            iterative = iterative_family(family)
            certify = size > W
            if fixed:
                k = tl.minimum(known_count(x, deficit, positions, K), size)
                k = tl.minimum(tl.maximum(k, 1), K)
                if iterative:
                    log_q, needs = iterative_fixed(family, x, deficit, alpha, k, iterations,
                                                   certify, positions, K)
                else:
                    log_q = closed_map_at(family, log_x, deficit, k, positions, K)
            elif closed_gap_family(family):
                limit = tl.minimum(known_count(x, deficit, positions, K), size)
                lam = tl.load(lam_ptr + slot)
                k, log_q, needs = closed_search(family, x, log_x, deficit, lam, limit,
                                                positions, K)
                low = tl.where(needs, K, 1).to(tl.int64)
            else:  # the iterative families search the first window only
                near = tl.arange(0, W)
                x_near = tl.load(x_ptr + row * K + near)
                deficit_near = tl.load(deficit_ptr + row * K + near)
                limit = tl.minimum(known_count(x_near, deficit_near, near, W), size)
                lam = tl.load(lam_ptr + slot)
                k, near_log_q, needs, past = iterative_search(
                    family, x_near, deficit_near, alpha, lam, limit, iterations, certify, W)
                log_q = tl.where(positions < W,
                                 tl.gather(near_log_q, tl.minimum(positions, W - 1), 0),
                                 float("-inf"))
                low = tl.where(past, W, 1).to(tl.int64)
            if LOGITS:
                tl.store(values_ptr + row * K + positions, log_q * temperature)
            else:
                tl.store(values_ptr + row * K + positions, exp64(log_q))
    tl.store(k_ptr + row, k)
    tl.store(mode_ptr + row, mode)
    tl.store(needs_ptr + row, needs)
    tl.store(flagged_ptr + row, tl.where(needs, slot, -1).to(tl.int32))
    tl.store(low_ptr + row, low)
    tl.store(shift_ptr + row, shift)
    tl.store(bound_ptr + row, bound)


# ----------------------------------------------------------------------------- 4. search


@triton.jit(do_not_specialize=["past"])
def _search_kernel(map_ptr, family_ptr, fixed_ptr, size_ptr, alpha_ptr, lam_ptr,
                   row_mode_ptr, temperature_ptr, x_ptr, log_x_ptr, deficit_ptr, needs_ptr,
                   flagged_ptr, low_ptr, values_ptr, k_ptr, mode_ptr, past,
                   LOGITS: tl.constexpr, C: tl.constexpr):
    """The search (`kernels.search`, `core.search.support_sizes`) for one row the decode kernel left
    ``needs`` (the others leave at once), on its C candidates: a fixed size's map, the
    closed-form gaps of `formulas.closed_search`, or the probes and exact gaps of
    `search.search_row`; the values to write (``mode`` 3). A row it cannot decide on its
    candidates (k* past them while the row could grow past them) keeps ``needs`` for the wide
    pass (``past`` 1: its certified lower bound in ``low``); with ``past`` 0 (the layout knows
    no row can need that) it is written with the map of its lower bound. A map with a NaN is
    not written (the row stays flagged: the wide pass's, or the window's answer, or left as it
    came)."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(needs_ptr + row) == 0:
        return
    _slot, family, fixed, size, alpha, lam, dual, temperature = request_at(
        map_ptr, family_ptr, fixed_ptr, size_ptr, alpha_ptr, lam_ptr, row_mode_ptr,
        temperature_ptr, row)
    positions = tl.arange(0, C)
    where = row * C + positions
    x = tl.load(x_ptr + where)
    log_x = tl.load(log_x_ptr + where)
    deficit = tl.load(deficit_ptr + where)
    known = known_count(x, deficit, positions, C)
    closed = tl.where((family == DUAL_THREE_HALVES) | (family == DUAL_THREE), family, 0)
    maps = closed_gap_family(family) | (family == WATER) | (family == ARGMAX)
    if fixed:
        k = tl.maximum(tl.minimum(known, size), 1)
        done = k <= C
        k = tl.minimum(k, C)
        if maps:
            log_q = closed_map_at(family, log_x, deficit, k, positions, C)
        else:
            log_q = fixed_map(dual, closed, alpha, log_x, deficit, k, positions, C)
    elif closed_gap_family(family):
        limit = tl.minimum(known, size)
        k, log_q, beyond = closed_search(family, x, log_x, deficit, lam, limit, positions, C)
        done = ~beyond
    else:
        limit = tl.maximum(tl.minimum(known, size), 1)
        k, log_q, done = search_row(dual, closed, alpha, lam, x, log_x, deficit,
                                    tl.load(low_ptr + row), limit, positions, C)
        if ~done & (past == 0):
            k = tl.minimum(k, C)
            log_q = fixed_map(dual, closed, alpha, log_x, deficit, k, positions, C)
    # (a NaN is never written: the row stays flagged, for the wide pass or as the window left
    # it)
    bad = tl.max((log_q != log_q).to(tl.int32), axis=0) > 0
    if (done | (past == 0)) & ~bad:
        if LOGITS:
            tl.store(values_ptr + where, log_q * temperature)
        else:
            tl.store(values_ptr + where, exp64(log_q))
        tl.store(k_ptr + row, k)
        tl.store(mode_ptr + row, 3)
        tl.store(needs_ptr + row, 0)
        tl.store(flagged_ptr + row, -1)
    else:
        tl.store(low_ptr + row, k)


# ----------------------------------------------------------------------------- 5. write


@triton.jit(do_not_specialize=["stride", "out_stride", "width", "wide_stride"])
def _write_kernel(scores_ptr, out_ptr, stride, out_stride, vocab, index_ptr, values_ptr,
                  k_ptr, mode_ptr, shift_ptr, bound_ptr, found_ptr, found_values_ptr, width,
                  wide_ptr, wide_values_ptr, wide_stride, IN_PLACE: tl.constexpr,
                  LOGITS: tl.constexpr, K: tl.constexpr, TILE: tl.constexpr):
    """One row's chunk of the output (`write.write_support`, `step._finish`): ``mode`` 1 the
    window's values (K candidates), 3 the search's (``width`` candidates, ``found_*``), 4 the
    wide pass's (the first k of the sorted row, ``wide_*``), 2 the keep-all shift."""
    row = tl.program_id(0).to(tl.int64)
    mode = tl.load(mode_ptr + row).to(tl.int32)
    per = tl.cdiv(vocab, tl.num_programs(1))
    first = tl.program_id(1) * per
    last = tl.minimum(first + per, vocab)
    lanes = tl.arange(0, TILE)
    source = scores_ptr + row * stride
    target = out_ptr + row * out_stride
    if (mode == 1) | (mode == 3) | (mode == 4):
        fill = float("-inf") if LOGITS else 0.0
        for start in range(first, last, TILE):
            offsets = start + lanes
            tl.store(target + offsets, tl.full([TILE], fill, tl.float32), mask=offsets < last)
        tl.debug_barrier()  # the fill before the support's values, within the program
        if mode == 1:
            candidates = tl.arange(0, K)
            index = tl.load(index_ptr + row * K + candidates)
            values = tl.load(values_ptr + row * K + candidates)
            tl.store(target + index, values, mask=(index >= first) & (index < last))
        elif mode == 3:
            for start in range(0, width, SEARCH_TILE):
                candidates = start + tl.arange(0, SEARCH_TILE)
                index = tl.load(found_ptr + row * width + candidates)
                values = tl.load(found_values_ptr + row * width + candidates)
                tl.store(target + index, values, mask=(index >= first) & (index < last))
        else:
            support = tl.load(k_ptr + row)
            for done in range(0, support, SEARCH_TILE):
                candidates = done + tl.arange(0, SEARCH_TILE)
                on = candidates < support
                index = tl.load(wide_ptr + row * wide_stride + candidates, mask=on, other=-1)
                values = tl.load(wide_values_ptr + row * wide_stride + candidates, mask=on)
                tl.store(target + index, values, mask=on & (index >= first) & (index < last))
    elif mode == 2:
        shift = tl.load(shift_ptr + row).to(tl.float32)
        bound = tl.load(bound_ptr + row)
        count = tl.zeros([TILE], tl.int64)
        for start in range(first, last, TILE):
            offsets = start + lanes
            present = offsets < last
            values = tl.load(source + offsets, mask=present, other=float("-inf"))
            values = values.to(tl.float32)
            if LOGITS:
                out = values - shift
                count += (present & (values >= bound)).to(tl.int64)
            else:
                out = tl.where(values < 0, 0.0, values) / shift
                count += (present & (out > 0)).to(tl.int64)
            tl.store(target + offsets, out, mask=present)
        tl.atomic_add(k_ptr + row, tl.sum(count, axis=0))
    elif not IN_PLACE:  # (in place, a row left as it is is not touched)
        for start in range(first, last, TILE):
            offsets = start + lanes
            present = offsets < last
            tl.store(target + offsets, tl.load(source + offsets, mask=present), mask=present)


# ----------------------------------------------------------------------------- host


#: Kernel launches by this process (`_launch`), for tests and benchmarks.
LAUNCHES = [0]


def _launch(kernel, grid: tuple[int, ...], *args, **meta) -> None:
    """Launch a kernel (counted: `LAUNCHES`)."""
    LAUNCHES[0] += 1
    kernel[grid](*args, **meta)


class _Workspace(NamedTuple):
    block_max: Tensor
    block_mass: Tensor
    x: Tensor
    log_x: Tensor
    deficit: Tensor
    index: Tensor
    total: Tensor
    valid: Tensor
    values: Tensor
    mode: Tensor
    needs: Tensor
    flagged: Tensor  # [n] int32: the slot of a row the search must decode, else -1
    low: Tensor
    shift: Tensor
    bound: Tensor


#: Scratch buffers by key, with the batch size they hold (`_scratch`).
_BUFFERS: dict[tuple, tuple[int, tuple]] = {}
#: Views of a key's buffers for n rows (and a width), by (key, n, ...): a step allocates nothing.
_VIEWS: dict[tuple, tuple] = {}


def _scratch(key: tuple, n: int, extra: tuple, make, view, keep: int = 16):
    """Buffers ``make(size)`` per ``key``, grown by doubling to the largest batch seen (at most
    ``keep`` sets of a kind, ``key[0]``), and ``view(buffers)``, their first n rows, cached by
    (key, n, *extra): the batch size changes nearly every step in an engine; the stream orders
    one step's use after the last's."""
    cached = _VIEWS.get((key, n, *extra))
    if cached is not None:
        return cached
    held = _BUFFERS.get(key)
    if held is None or held[0] < n:
        size = triton.next_power_of_2(max(n, 1))
        kind = [entry for entry in _BUFFERS if entry[0] == key[0]]
        if key not in _BUFFERS and len(kind) >= keep:
            _BUFFERS.pop(kind[0])
        held = _BUFFERS[key] = (size, make(size))
        for stale in [entry for entry in _VIEWS if entry[0] == key]:
            del _VIEWS[stale]  # (views of the buffers just replaced)
    if len(_VIEWS) >= 4096:
        _VIEWS.clear()
    views = _VIEWS[(key, n, *extra)] = view(held[1])
    return views


def _workspace(n: int, blocks: int, width: int, dtype: torch.dtype, device: torch.device,
               search: bool = False) -> _Workspace:
    """The step's scratch: one set of buffers per vocabulary, window, dtype, device and thread
    (`_scratch`). ``search``: the search pass's (its candidates, index and values; the window's
    stay as the decode kernel left them, the answer of a row no search could write)."""

    def make(size: int) -> _Workspace:
        def empty(*shape, kind=torch.float64):
            return torch.empty((size, *shape), dtype=kind, device=device)

        return _Workspace(
            empty(blocks, kind=torch.float32), empty(blocks, kind=torch.float32),
            empty(width), empty(width), empty(width), empty(width, kind=torch.long), empty(),
            empty(kind=torch.bool), empty(width, kind=dtype), empty(kind=torch.int32),
            empty(kind=torch.bool), empty(kind=torch.int32), empty(kind=torch.long), empty(),
            empty())

    key = ("step", blocks, width, dtype, device, threading.get_ident(), search)
    return _scratch(key, n, (), make, lambda space: _Workspace(*(b[:n] for b in space)))


_IDENTITY: dict[tuple[int, torch.device], Tensor] = {}


def _identity(n: int, device: torch.device) -> Tensor:
    """The mapping of a table whose slots are the rows (made once per batch size), int64 as
    Model Runner V2's ``expanded_idx_mapping``: one compiled variant for both interfaces."""
    key = (n, device)
    mapping = _IDENTITY.get(key)
    if mapping is None:
        if len(_IDENTITY) >= 1024:
            _IDENTITY.clear()
        mapping = _IDENTITY[key] = torch.arange(n, dtype=torch.int64, device=device)
    return mapping


def decode(scores: Tensor, table: RowTable, layout: Layout, *, logits: bool,
           inplace: bool = False, mapping: Tensor | None = None) -> KernelStep:
    """Decode the rows of ``scores`` ([N, V], float32 / float16 / bfloat16) whose slot
    (``mapping[row]``, or the row itself) the table decodes; other rows are left as they are
    (k = 0). ``layout``: what the step is specialized on (`RowTable.layout` of the step's
    slots). Four launches; with ``layout.sync`` six (the search pass, `_search_pass`), and
    seven and one sort where some row's reach passes the search's candidates (`search_width`:
    the wide pass, `_wide_pass`). No host sync."""
    n, vocab = scores.shape
    device = scores.device
    width = layout.width
    blocks = triton.cdiv(vocab, BLOCK)
    space = _workspace(n, blocks, width, scores.dtype, device)
    out = scores if inplace else torch.empty((n, vocab), dtype=scores.dtype, device=device)
    k = torch.empty(n, dtype=torch.long, device=device)
    columns = table.columns
    if mapping is None:
        mapping = _identity(n, device)
    elif mapping.dtype != torch.int64:  # (vLLM's is int64: the variant the warm-up compiled)
        mapping = mapping.long()
    splits = max(1, min(triton.cdiv(blocks, TILE), triton.cdiv(PROGRAMS, n)))
    _launch(_read_kernel, (n, splits), scores, scores.stride(0), vocab, blocks, mapping,
            columns["family"], columns["scale"], space.block_max, space.block_mass,
            LOGITS=logits, TILE=TILE, BLOCK=BLOCK, num_warps=4)
    _select(scores, space, space, mapping, columns, width, logits, gate=False)
    _launch(_decode_kernel, (n,), mapping, columns["family"], columns["route"], columns["fixed"],
            columns["size"], columns["alpha"], columns["lam"], columns["iterations"],
            columns["temperature"], space.x, space.log_x, space.deficit, space.total,
            space.valid, space.values, k, space.mode, space.needs, space.flagged, space.low,
            space.shift, space.bound, K=width, W=WINDOW, LOG_SMALLEST=log_smallest(scores.dtype),
            LOGITS=logits, num_warps=8)
    found, wide = None, None
    if layout.sync:  # some row may need the search: its pass, rows without it leave at once
        candidates, past = search_width(layout.reach, vocab)
        found = _workspace(n, blocks, candidates, scores.dtype, device, search=True)
        _search_pass(scores, space, found, k, mapping, columns, candidates, logits, past)
        if past:  # some row's k* may pass the candidates: the wide pass, on sorted rows
            wide = _wide_pass(scores, space, k, mapping, columns, logits,
                              wide_width(layout.reach, vocab))
    # (a row still flagged gets the window's answer, or is left as it came)
    _write(scores, out, k, space, width, logits, inplace, found=found, wide=wide)
    return KernelStep(out, k)


def search_width(reach: int, vocab: int) -> tuple[int, bool]:
    """The search pass's candidates for rows that need at most ``reach`` of them (`Layout.reach`,
    `rows.Row.reach`): the narrowest of `SEARCH_WIDTHS` that holds them, and whether some row
    may need the wide pass (reach past the widest, on rows longer than it)."""
    # (no more than the power of two at or above the row: every entry is then a candidate, and
    # the select kernel's chunks of blocks hold at least that many)
    row = triton.next_power_of_2(triton.cdiv(vocab, BLOCK)) * BLOCK
    for candidates in SEARCH_WIDTHS:
        if reach <= candidates:
            return min(candidates, row), False
    return min(SEARCH_WIDTH, row), vocab > SEARCH_WIDTH


def _select(scores: Tensor, space: _Workspace, into: _Workspace, mapping: Tensor,
            columns: dict[str, Tensor], width: int, logits: bool, gate: bool) -> None:
    """The select kernel: the window's candidates (``gate`` False), or the search's for the rows
    the decode kernel left ``needs`` (``into``: the search pass's workspace)."""
    n, vocab = scores.shape
    blocks = triton.cdiv(vocab, BLOCK)
    listed = triton.next_power_of_2(blocks)
    chosen = min(width, listed)
    _launch(_select_kernel, (n,), scores, scores.stride(0), vocab, blocks, mapping,
            columns["family"], columns["route"], columns["scale"],
            space.block_max, space.block_mass, into.x, into.log_x, into.deficit,
            into.index, space.total, space.valid, space.needs, K=width, KB=chosen, NBP=listed,
            CHUNK=min(chosen, CHUNK), BLOCK=BLOCK, SMALLEST=under_smallest(scores.dtype),
            LOGITS=logits, GATE=gate, num_warps=8)


def _search_pass(scores: Tensor, space: _Workspace, found: _Workspace, k: Tensor,
                 mapping: Tensor, columns: dict[str, Tensor], width: int, logits: bool,
                 past: bool) -> None:
    """The search's two launches: its candidates for the rows left ``needs`` (`_select`), then
    `_search_kernel` on them (``past``: the wide pass follows, for rows past them)."""
    n = scores.shape[0]
    _select(scores, space, found, mapping, columns, width, logits, gate=True)
    _launch(_search_kernel, (n,), mapping, columns["family"], columns["fixed"],
            columns["size"], columns["alpha"], columns["lam"], columns["mode"],
            columns["temperature"], found.x, found.log_x, found.deficit, space.needs,
            space.flagged, space.low, found.values, k, space.mode, int(past),
            LOGITS=logits, C=width, num_warps=8)


def _write(scores: Tensor, out: Tensor, k: Tensor, space: _Workspace, width: int,
           logits: bool, inplace: bool, found: _Workspace | None = None,
           wide: _Wide | None = None) -> None:
    n, vocab = scores.shape
    splits = max(1, min(triton.cdiv(vocab, WRITE_CHUNK), triton.cdiv(PROGRAMS, n)))
    searched = space if found is None else found
    sorted_ = (space.index, space.values, 0) if wide is None else \
        (wide.index, wide.values, wide.values.stride(0))
    _launch(_write_kernel, (n, splits), scores, out, scores.stride(0), out.stride(0), vocab,
            space.index, space.values, k, space.mode, space.shift, space.bound,
            searched.index, searched.values, 0 if found is None else found.x.shape[1],
            *sorted_, IN_PLACE=inplace, LOGITS=logits, K=width, TILE=1024, num_warps=4)


class _Wide(NamedTuple):
    """The wide pass's scratch for n rows of ``width`` candidates: the sorted candidates (their
    values overwritten with the values to write on the support), their positions, the suffix
    sums of each row's blocks, the dual's inner roots."""

    values: Tensor  # [n, width] the scores' dtype
    index: Tensor  # [n, width] int64
    tails: Tensor  # [n, blocks + 1] float64
    inner: Tensor  # [n, width] float64


def _wide_workspace(n: int, width: int, vocab: int, dtype: torch.dtype,
                    device: torch.device) -> _Wide:
    """`_Wide` buffers per vocabulary, dtype, device and thread (`_scratch`), and their first n
    rows of ``width`` candidates as contiguous views."""
    blocks = triton.cdiv(vocab, WIDE_BLOCK)

    def make(size: int) -> _Wide:
        return _Wide(torch.empty(size * vocab, dtype=dtype, device=device),
                     torch.empty(size * vocab, dtype=torch.long, device=device),
                     torch.empty((size, blocks + 1), dtype=torch.float64, device=device),
                     torch.empty(size * vocab, dtype=torch.float64, device=device))

    def view(space: _Wide) -> _Wide:
        return _Wide(space.values[: n * width].view(n, width),
                     space.index[: n * width].view(n, width), space.tails[:n],
                     space.inner[: n * width].view(n, width))

    key = ("wide", vocab, dtype, device, threading.get_ident())
    return _scratch(key, n, (width,), make, view, keep=4)


def wide_width(reach: int, vocab: int) -> int:
    """The wide pass's candidates for rows that need at most ``reach`` of them (`Layout.reach`):
    the power of two at or above it, or the whole row."""
    return vocab if reach >= vocab else min(vocab, triton.next_power_of_2(reach))


def _wide_pass(scores: Tensor, space: _Workspace, k: Tensor, mapping: Tensor,
               columns: dict[str, Tensor], logits: bool, width: int) -> _Wide:
    """Rows the search pass left ``needs``, on ``width`` sorted candidates each: the whole rows
    (one `torch.sort` of the batch, descending, ties by index as `formulas.order_key`) or their
    top ``width`` entries (`torch.topk`: a radix select, the candidates' compaction and their
    sort), then `wide.wide_kernel` (rows not flagged leave at once)."""
    n, vocab = scores.shape
    wide = _wide_workspace(n, width, vocab, scores.dtype, scores.device)
    if width >= vocab:
        torch.sort(scores, dim=1, descending=True, stable=True, out=(wide.values, wide.index))
    else:
        torch.topk(scores, width, dim=1, largest=True, sorted=True,
                   out=(wide.values, wide.index))
    _launch(wide_kernel, (n,), wide.values, width, width, scores, scores.stride(0), vocab,
            mapping, columns["family"], columns["fixed"], columns["size"], columns["alpha"],
            columns["lam"], columns["mode"], columns["temperature"], columns["scale"],
            space.total, space.needs, space.flagged, space.low, wide.tails,
            wide.tails.stride(0), wide.inner, k, space.mode, LOGITS=logits,
            SMALLEST=under_smallest(scores.dtype), B=WIDE_BLOCK, num_warps=8)
    return wide


# ----------------------------------------------------------------------------- plans


def decode_plan(scores: Tensor, plan: Plan, *, logits: bool, inplace: bool = False):
    """`core.step.decode_step` through the kernels: the plan's rows as a table (slot = row;
    made once per plan, and kept across plans of the same shared parameters, as the public
    calls make one per call)."""
    table, layout = _table_of(plan, scores.device)
    result = decode(scores, table, layout, logits=logits, inplace=inplace)
    return StepResult(result.out, result.k, 0)


_TABLES: dict[tuple, tuple[RowTable, Layout]] = {}


def _table_of(plan: Plan, device: torch.device) -> tuple[RowTable, Layout]:
    cached = plan.derived.get("table")
    if cached is not None:
        return cached
    key = None
    if plan.scale is None and len(plan.groups) == 1 and plan.groups[0].rows is None:
        group = plan.groups[0]  # one parameter set for the whole batch
        key = (group.family, group.fixed, group.mode, plan.batch, device,
               tuple((name, tuple(values)) for name, values in group.host.items()))
        cached = _TABLES.get(key)
    if cached is None:
        table = RowTable.of_plan(plan, device)
        cached = (table, table.layout() or Layout(WINDOW, False, False))
        if key is not None:
            if len(_TABLES) >= 64:
                _TABLES.pop(next(iter(_TABLES)))
            _TABLES[key] = cached
    plan.derived["table"] = cached
    return cached


def usable(scores: Tensor) -> bool:
    """Whether the kernels take these scores: [N, V] of a dtype they read, with V at least
    the widest window (under the interpreter, at most 1024 blocks: `CHUNK`)."""
    vocab = scores.shape[-1]
    return scores.dim() == 2 and scores.dtype in DTYPES and vocab >= WIDE_WINDOW and \
        (not INTERPRET or vocab <= 1024 * BLOCK)


# ----------------------------------------------------------------------------- warm-up


def warm_up(device: torch.device | str, vocab: int, *, dtype: torch.dtype = torch.float32
            ) -> float:
    """Compile every kernel a processor's steps run (both windows; the search pass at each of
    its widths; the wide pass) on two dummy rows of ``vocab`` logits, so that no decoding step
    compiles (on the interpreter: runs them once). Returns the seconds it took."""
    import time

    from ..params import BregmanParams
    from ..rows import Row

    start = time.perf_counter()
    device = torch.device(device)
    table = RowTable(2, device)
    table.write(0, Row.of_request(BregmanParams(alpha=1.5, lam=1e-2), vocab), 0.7)
    table.write(1, Row.of_request(BregmanParams(alpha=3.0, lam=1e-3, k_max=50), vocab))
    table.flush()
    g = torch.Generator().manual_seed(0)
    for width in (WINDOW, WIDE_WINDOW):
        scores = (torch.randn(2, vocab, generator=g) * 4).to(device, dtype)
        step = decode(scores, table, Layout(width, False, True), logits=True, inplace=True)
        space = _workspace(2, triton.cdiv(vocab, BLOCK), width, dtype, device)
    # (the search's variants: its rows here leave at once, as none needs it)
    for candidates in sorted({search_width(reach, vocab)[0] for reach in SEARCH_WIDTHS}):
        found = _workspace(2, triton.cdiv(vocab, BLOCK), candidates, dtype, device, search=True)
        _search_pass(scores, space, found, step.k, _identity(2, device), table.columns,
                     candidates, True, False)
    _wide_pass(scores, space, step.k, _identity(2, device), table.columns, True, vocab)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


__all__ = [
    "LAUNCHES",
    "KernelStep",
    "decode",
    "decode_plan",
    "usable",
    "warm_up",
]
