"""Per-row parameters as device columns, indexed by slot: what the Triton step reads.

vLLM's Model Runner V2 keeps each request's sampling parameters in persistent device buffers of
``max_num_reqs`` entries, indexed by the request's slot, written when a request is added and read
inside its kernels through the step's row -> slot mapping (``expanded_idx_mapping``): no host
plan per step. A `RowTable` is that for Bregman decoding: one entry per slot (V2), or per batch
row of a `plan.Plan` (V1, the public calls: slot = row), each column a host numpy array and its
device copy:

=============  =======  ===============================================================
column         dtype    meaning
=============  =======  ===============================================================
family         int32    0: not decoded (a plain request), else 1 + the index of its
                        `families.Family`
route          int8     1 + the index of its `families.Route` (what decodes it)
fixed          int32    1: a fixed support size (generalized top-k)
size           int64    fixed: the size; adaptive: the cap k_max (`candidates.UNBOUNDED`:
                        none)
alpha, lam     float64  the row's alpha and lambda
iterations     int32    Newton iterations of an iterative family
                        (`families.newton_iterations` of the row's own alpha)
scale          float32  1 / T: the row's inverse temperature (Model Runner V2), else 1
temperature    float32  T
mode           int8     1 + the index of the row's mode in ``engine_metrics.MODES``
=============  =======  ===============================================================

Host-only columns decide, per step and without a sync, what the step is specialized on: the
candidate width (``width``: 64, or 256 for the closed-form families at small lambda and fixed
sizes above 64, `families.window_width`), whether some row may need the search (``flags``:
the window may hand it over, `families.may_flag`; or the route column says only the search
decodes it, `families.route`) and how many candidates the search needs to decide it
(``reach``: the fixed size, or min(k_max, `families.support_bound` + 1)).

Imports only torch and numpy (the kernels, `bregman_vllm.kernels`, import Triton).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .core.candidates import UNBOUNDED
from .core.families import (
    Family,
    Route,
    may_flag,
    newton_iterations,
    route,
    support_bound,
    width_class,
    window_width,
)
from .core.plan import REQUEST_NAMES, Plan, classify, row_values
from .params import DECODING_MODES, BregmanParams

Tensor = torch.Tensor

#: The family column's codes (0: a row that is not decoded).
FAMILY_CODES: dict[Family, int] = {family: code for code, family in enumerate(Family, start=1)}
FAMILIES: dict[int, Family] = {code: family for family, code in FAMILY_CODES.items()}
#: The route column's codes.
ROUTE_CODES: dict[Route, int] = {way: code for code, way in enumerate(Route, start=1)}
MODES = DECODING_MODES  # (the mode column is 1 + an index here, as in engine_metrics)

#: (name, dtype) of every device column.
COLUMNS: tuple[tuple[str, torch.dtype], ...] = (
    ("family", torch.int32), ("route", torch.int8), ("fixed", torch.int32), ("size", torch.int64),
    ("alpha", torch.float64), ("lam", torch.float64), ("iterations", torch.int32),
    ("scale", torch.float32), ("temperature", torch.float32), ("mode", torch.int8))
#: Host-only columns: the candidate width a row needs, whether the window may hand it to the
#: search.
_HOST = (("width", np.int32), ("flags", np.bool_), ("reach", np.int64))


@dataclass(frozen=True)
class Row:
    """One row's entries of every column (see the module docstring)."""

    family: Family
    fixed: bool
    size: int
    alpha: float
    lam: float
    mode: str
    route: Route
    width: int
    flags: bool
    reach: int = 0  # the candidates the search needs to decide the row (module docstring)

    @classmethod
    def of(cls, family: Family, fixed: bool, alpha: float, lam: float, size: int, mode: str
           ) -> Row:
        """A row from its classification (`plan.classify`: ``size`` is the fixed size, or for
        an adaptive row the cap, `UNBOUNDED` for none); its route and window by `families`."""
        way = route(family, fixed, size)
        if way == Route.KEEP:
            return cls(family, fixed, size, alpha, lam, mode, way, 0, False)
        # (k* <= bound: the window or the search decides it on bound + 1 candidates)
        largest = size if fixed else min(size, support_bound(mode, alpha, lam) + 1)
        width = window_width(family, lam, fixed, largest)
        flags = way == Route.WINDOW and may_flag(family, fixed, largest, width)
        return cls(family, fixed, size, alpha, lam, mode, way, width_class(width), flags,
                   largest)

    @classmethod
    def of_request(cls, params: BregmanParams, vocab: int) -> Row:
        """The row of a request's (valid) parameters."""
        family, fixed, alpha, lam, size, cap, _ = classify(
            params.mode, float(params.alpha), float(params.lam), params.top_k or 0,
            params.k_max or 0, None, False, REQUEST_NAMES, vocab, row_values(params))
        return cls.of(family, fixed, alpha, lam, size if fixed else (cap or UNBOUNDED),
                      params.mode)

    @property
    def iterations(self) -> int:
        return newton_iterations(self.family, [self.alpha])


class RowTable:
    """Device columns of per-slot parameters (see the module docstring).

    `write` changes a slot on the host (Model Runner V2's ``add_request``); `flush` copies the
    columns to the device (``apply_staged_writes``: through pinned memory, non-blocking, ordered
    before any kernel of the next step by the stream; PyTorch's pinned-memory cache reuses a
    staging buffer only once its copy is done). On a CPU the columns are the host arrays."""

    def __init__(self, slots: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.slots = slots
        self.host = {name: np.zeros(slots, dtype=torch.empty((), dtype=dtype).numpy().dtype)
                     for name, dtype in COLUMNS}
        self.host.update({name: np.zeros(slots, dtype=dtype) for name, dtype in _HOST})
        self.host["scale"][:] = 1.0
        self.host["temperature"][:] = 1.0
        if self.device.type == "cpu":
            self.columns = {name: torch.from_numpy(self.host[name]) for name, _ in COLUMNS}
        else:
            self.columns = {name: torch.empty(slots, dtype=dtype, device=self.device)
                            for name, dtype in COLUMNS}
        self._dirty = self.device.type != "cpu"
        #: The temperatures are a plan's own device columns (`of_plan`): some row is scaled.
        self.scaled = False
        # `layout`'s last answer and what it was read from (writes since, the slots): a
        # step over the same batch reads it once per batch change, not per step.
        self._writes = 0
        self._layout: tuple[tuple[int, bool, bytes | None], Layout | None] | None = None

    def write(self, slot: int, row: Row | None, temperature: float = 1.0) -> None:
        """Set a slot on the host (None: a request that is not decoded)."""
        columns = self.host
        if row is None:
            columns["family"][slot] = 0
            for name in ("route", "mode", "width", "flags", "reach"):
                columns[name][slot] = 0
        else:
            values = {"family": FAMILY_CODES[row.family], "route": ROUTE_CODES[row.route],
                      "fixed": int(row.fixed), "size": row.size, "alpha": row.alpha,
                      "lam": row.lam, "iterations": row.iterations,
                      "mode": MODES.index(row.mode) + 1, "width": row.width,
                      "flags": row.flags, "reach": row.reach}
            for name, value in values.items():
                columns[name][slot] = value
        columns["scale"][slot] = 1.0 / temperature
        columns["temperature"][slot] = temperature
        self._dirty = self.device.type != "cpu"
        self._writes += 1

    def flush(self) -> None:
        """Copy the columns written since the last flush to the device."""
        if not self._dirty:
            return
        self._dirty = False
        pin = self.device.type == "cuda"
        for name, column in self.columns.items():
            staging = torch.from_numpy(self.host[name])
            column.copy_(staging.pin_memory() if pin else staging, non_blocking=pin)

    def layout(self, slots: np.ndarray | Sequence[int] | None = None) -> Layout | None:
        """What a step over the rows of ``slots`` (host values; None: every slot) is specialized
        on, read from the host columns; None when none of them is decoded. The same slots with
        no write since: the last answer, not read again."""
        pick = slice(None) if slots is None else np.asarray(slots)
        key = (self._writes, self.scaled, None if slots is None else pick.tobytes())
        if self._layout is not None and self._layout[0] == key:
            return self._layout[1]
        host = self.host
        family = host["family"][pick]
        layout = None
        if family.any():
            width = int(host["width"][pick].max())
            scaled = self.scaled or bool((host["temperature"][pick][family > 0] != 1.0).any())
            searched = host["flags"][pick] | (host["route"][pick] == ROUTE_CODES[Route.SEARCH])
            sync = bool(searched.any())
            reach = int(host["reach"][pick][searched].max()) if sync else 0
            layout = Layout(width_class(width), sync, scaled, reach)
        self._layout = (key, layout)
        return layout

    @classmethod
    def of_plan(cls, plan: Plan, device: torch.device) -> RowTable:
        """The table of a plan's batch, slot = row (host work once per plan: a loop over its
        rows); the temperatures are the plan's own device columns."""
        table = cls(plan.batch, device)
        for group in plan.groups:
            positions = group.host_rows if group.host_rows is not None else range(plan.batch)
            for i, position in enumerate(positions):
                # (a uniform group lists its shared values once)
                host = {name: values[min(i, len(values) - 1)]
                        for name, values in group.host.items()}
                table.write(position, Row.of(group.family, group.fixed, host["alpha"],
                                             host["lam"], host["size"], group.mode))
        table.flush()
        if plan.scale is not None and plan.temperature is not None:
            table.columns["scale"] = plan.scale
            table.columns["temperature"] = plan.temperature
            table.scaled = True
        return table


@dataclass(frozen=True)
class Layout:
    """What one step is specialized on (host values, `RowTable.layout`)."""

    width: int  # candidates per row: `families.WINDOW` or `families.WIDE_WINDOW`
    sync: bool  # some row may need the search (the kernels' search pass; their wide pass
    #             for rows it cannot decide on its candidates: ``reach``)
    scaled: bool  # some row has a temperature other than 1
    reach: int = 0  # the most candidates a row that may need the search needs (`Row.reach`)

