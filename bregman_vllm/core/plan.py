"""Plan: the per-row parameters of a batch, validated and grouped by formula family, on the host.

A plan is built once per batch change (in vLLM: when requests join, leave or move) and reused
at every decoding step. Everything that depends only on the parameters happens here, on the
host, with no device sync: validation (`bregman_vllm.params`), the family of each row
(`families`), the candidate width and search window of each group, the Newton iteration count,
and the device copies of per-row values (pinned, non-blocking on CUDA).

Each `Group` holds the rows of one family, either every row of the batch in order (``rows is
None``; the common case, no row gather) or the positions listed in ``rows``. Per-row values are
Python numbers when the whole group shares them (no tensor at all, the common case of one
request configuration) or device tensors otherwise. Groups of one window size class are
decoded in one pass over their rows (`Plan.passes`, made once per plan with the device copies
of their positions), so that a batch mixing families is not a pass per family.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import NamedTuple

import torch

from ..params import BregmanParamError, BregmanParams, check_alpha, parse_lambda, parse_mode
from .candidates import UNBOUNDED
from .families import (
    Family,
    Route,
    family_of,
    keeps_all,
    may_flag,
    newton_iterations,
    route,
    support_bound,
    width_class,
    window_width,
)
from .generators import BregmanGenerator

Tensor = torch.Tensor

#: The fields of `BregmanParams` the plan interprets itself (the family, the support sizes).
_INTERPRETED = ("mode", "alpha", "lam", "top_k", "k_max")
#: Every other field of the parameter model reaches the core as it is, per row, by name
#: (`Group.values`, `ExactPlan.values`), absent (None) as 0:
#: a new request field is read by the function that uses it, with no plumbing in between.
ROW_FIELDS: tuple[str, ...] = tuple(
    spec.name for spec in fields(BregmanParams) if spec.name not in _INTERPRETED)


def row_values(params: BregmanParams) -> tuple:
    """The `ROW_FIELDS` of one request (None as 0)."""
    return tuple(0 if getattr(params, name) is None else getattr(params, name)
                 for name in ROW_FIELDS)


#: Their defaults: the rows of the public functions, which take no such field.
DEFAULT_ROW_VALUES = row_values(BregmanParams())
#: The device dtype of each per-row value, from the parameter model's annotations: float64
#: for real values, int64 for integers (sizes, counts).
ROW_DTYPES: dict[str, torch.dtype] = {
    "alpha": torch.float64, "lam": torch.float64, "size": torch.long, "cap": torch.long,
    **{spec.name: torch.float64 if "float" in str(spec.type) else torch.long
       for spec in fields(BregmanParams) if spec.name in ROW_FIELDS}}


@dataclass(frozen=True)
class Group:
    """Rows of one formula family; see the module docstring."""

    family: Family
    mode: str
    fixed: bool  # fixed support size (generalized top-k): no search
    rows: Tensor | None  # device positions in the batch; None = every row, in order
    count: int
    #: Per-row values by name, each a Python number (shared by the group) or a device tensor:
    #: "alpha", "lam", "size" (fixed: the support size; adaptive: the cap k_max, UNBOUNDED:
    #: none) and every field of `ROW_FIELDS`.
    values: Mapping[str, float | int | Tensor]
    capped: bool  # adaptive rows with a cap (the limit is min(cap, #positive))
    width: int  # candidates per row (adaptive: the support sizes searched at once)
    bounded: bool  # every row's cap fits the window: certified without a window check
    #: Some row may come back from the window uncertified (`families.may_flag`): the step
    #: syncs once to hand those to the search.
    flags: bool = False
    iterations: int = 0
    below_two: bool = False  # POWER: some alpha < 2 (b < 1)
    above_two: bool = False  # POWER: some alpha > 2
    generator: BregmanGenerator | None = None
    host: dict[str, list] = field(default_factory=dict, repr=False)  # per-row host values
    host_rows: tuple[int, ...] | None = field(default=None, repr=False)  # ``rows`` on the host
    #: Host values the step derives from the group, once per plan (`step`).
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    def rows_or_all(self, device: torch.device) -> Tensor:
        if self.rows is not None:
            return self.rows
        return torch.arange(self.count, device=device)


@dataclass(frozen=True)
class Joint:
    """Window groups decoded in one pass (`step.decode_step`): one softmax and one candidate
    set of ``width`` for the union of their rows, then each group's formulas on its own rows'
    candidates. ``rows``: the union's batch positions (None: every row, in order);
    ``positions``: each group's rows as positions within the union."""

    groups: tuple[Group, ...]
    rows: Tensor | None
    positions: tuple[Tensor, ...]
    width: int
    derived: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class Plan:
    groups: tuple[Group, ...]
    batch: int  # rows of the batch the plan was made for
    vocab: int
    #: Per batch row, the inverse temperature of the scores (logits): the step decodes
    #: softmax(scale * logits) and writes T log q (vLLM's Model Runner V2 divides by T after
    #: the processor). None: 1 for every row.
    scale: Tensor | None = None
    temperature: Tensor | None = None  # 1 / scale, on the device
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    def passes(self) -> tuple[tuple[Group, ...], tuple[Joint, ...]]:
        """The groups decoded in a pass of their own, and the joint passes (`Joint`): window
        groups of one width class (up to `WINDOW` candidates, or up to `WIDE_WINDOW`), two or
        more (a wider candidate set would cost the narrower groups' rows more than their own
        pass). Made once per plan (per batch change in vLLM), with the device copies of the
        positions."""
        cached = self.derived.get("passes")
        if cached is not None:
            return cached
        by_width: dict[int, list[Group]] = {}
        for group in self.groups:
            if route(group.family, group.fixed, group.width) == Route.WINDOW:
                by_width.setdefault(width_class(group.width), []).append(group)
        joints = tuple(_joint(members, self.batch) for members in by_width.values()
                       if len(members) >= 2)
        shared = {id(group) for joint in joints for group in joint.groups}
        alone = tuple(group for group in self.groups if id(group) not in shared)
        self.derived["passes"] = (alone, joints)
        return alone, joints

    def with_groups(self, groups: tuple[Group, ...]) -> Plan:
        """This plan's batch (its temperatures too) with only ``groups``."""
        return Plan(groups, self.batch, self.vocab, self.scale, self.temperature)


def _joint(members: list[Group], batch: int) -> Joint:
    union = sorted(row for group in members for row in _host_rows(group, batch))
    index = {row: i for i, row in enumerate(union)}
    # Two or more groups partition rows, so each has its own ``rows`` tensor.
    device = next(group.rows.device for group in members if group.rows is not None)
    rows = None if union == list(range(batch)) else to_device(union, torch.long, device)
    positions = tuple(
        to_device([index[row] for row in _host_rows(group, batch)], torch.long, device)
        for group in members)
    return Joint(tuple(members), rows, positions, max(group.width for group in members))


def _host_rows(group: Group, batch: int) -> tuple[int, ...]:
    if group.rows is None:
        return tuple(range(batch))
    if group.host_rows is None:  # a group made without them
        return tuple(group.rows.tolist())
    return group.host_rows


def _as_list(value, name: str, batch_shape: tuple[int, ...]) -> list | None:
    """Host values of one parameter: None for a shared Python number, else one per row (a
    tensor broadcasts to the batch shape, a sequence gives one value per flattened row)."""
    if value is None or (isinstance(value, (int, float, str)) and not isinstance(value, bool)):
        return None
    if isinstance(value, bool):
        raise BregmanParamError(name, f"must be a number, got {value!r}")
    batch = math.prod(batch_shape)
    if isinstance(value, Tensor):
        try:
            value = torch.broadcast_to(value.detach(), batch_shape)
        except RuntimeError:
            raise BregmanParamError(name, f"shape {tuple(value.shape)} does not broadcast to the "
                                    f"batch shape {tuple(batch_shape)}") from None
        return value.reshape(-1).tolist()
    values = list(value)
    if len(values) != batch:
        raise BregmanParamError(name, f"{len(values)} values for a batch of {batch} rows")
    return values


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BregmanParamError(name, f"must be a number, got {value!r}")
    return float(value)


def _size(value, name: str) -> int:
    """0 (not set) or an integer >= 1."""
    if value is None:
        return 0
    if isinstance(value, bool):
        raise BregmanParamError(name, f"must be an integer >= 1, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or value < 0:
        text = "must hold integers >= 1 (or 0 for 'not set')" if isinstance(value, (int, float)) \
            else f"must be an integer >= 1, got {value!r}"
        raise BregmanParamError(name, text)
    return value


#: The request fields of the four shared parameters, as error messages name them.
REQUEST_NAMES = ("bregman_alpha", "bregman_lambda", "bregman_top_k", "bregman_k_max")


def make_plan(mode: str, alpha, lam, top_k=None, k_max=None, *,
              batch_shape: tuple[int, ...] | int, vocab: int, device: torch.device | str,
              generator: BregmanGenerator | None = None, validate: bool = True,
              names: tuple[str, str, str, str] = ("alpha", "lam", "top_k", "k_max")) -> Plan:
    """Validate and group per-row parameters (each a number, a sequence or a tensor of one
    value per row; ``top_k`` / ``k_max`` None or 0 = not set). Host work only, apart from the
    device copies of per-row values (and a ``.tolist()`` when tensors are given)."""
    mode = parse_mode(mode, "mode", allow_off=False)
    device = torch.device(device)
    batch_shape = (batch_shape,) if isinstance(batch_shape, int) else tuple(batch_shape)
    batch = math.prod(batch_shape)
    alpha_name, lam_name, top_name, cap_name = names
    if generator is not None and alpha is not None:
        raise BregmanParamError(alpha_name, "give either alpha or generator, not both")
    if generator is None and alpha is None:
        raise BregmanParamError(alpha_name, "is required")
    if generator is not None and not isinstance(generator, BregmanGenerator):
        raise BregmanParamError(
            "generator", "must implement phi, dphi, d2phi and inv_dphi (BregmanGenerator)")
    alphas = _as_list(alpha if generator is None else 0.0, alpha_name, batch_shape)
    lams = _as_list(lam, lam_name, batch_shape)
    tops = _as_list(top_k, top_name, batch_shape)
    caps = _as_list(k_max, cap_name, batch_shape)
    # A shared number must be a valid size; per-row values may be 0 ("not set" for that row).
    for value, name in ((top_k, top_name), (k_max, cap_name)):
        if value is not None and not isinstance(value, (Tensor, list, tuple)) \
                and _size(value, name) == 0:
            raise BregmanParamError(name, f"must be an integer >= 1, got {value!r}")
    if alphas is None and lams is None and tops is None and caps is None:
        shared = _shared(mode, alpha, lam, top_k, k_max, generator, validate, names, vocab)
        return Plan((_group(shared[0], mode, shared[1], None, batch, [shared], device,
                            generator, vocab, uniform=True),), batch, vocab)
    rows = _rows(mode, alpha, lam, top_k, k_max, alphas, lams, tops, caps, batch, generator,
                 validate, names, vocab)
    by_key: dict[tuple[Family, bool], list[int]] = {}
    for index, row in enumerate(rows):
        by_key.setdefault((row[0], row[1]), []).append(index)
    groups = []
    for (family, fixed), members in by_key.items():
        every = len(members) == batch
        position = None if every else to_device(members, torch.long, device)
        groups.append(_group(family, mode, fixed, position, len(members),
                             [rows[i] for i in members], device, generator, vocab,
                             host_rows=tuple(members)))
    return Plan(tuple(groups), batch, vocab)


#: family, fixed, alpha, lam, size, cap, the `ROW_FIELDS` values
Row = tuple[Family, bool, float, float, int, int, tuple]


def classify(mode: str, alpha: float, lam: float, top: int, cap: int, generator,
              validate: bool, names, vocab: int, extra: tuple = DEFAULT_ROW_VALUES) -> Row:
    alpha_name, lam_name, top_name, cap_name = names
    if validate:
        parse_lambda(lam, lam_name)
        for name, value in ((top_name, top), (cap_name, cap)):
            if value < 0:
                raise BregmanParamError(name, f"must be an integer >= 1, got {value}")
    if generator is None and validate:
        check_alpha(alpha, mode, fixed_k=top > 0, field=alpha_name)
    # The vocabulary bounds every support: larger sizes are clamped (never an error).
    top, cap = min(top, vocab), min(cap, vocab)
    fixed_size = min(top, cap) if top and cap else top
    # lambda = 0, or a lambda below which no token can be dropped (within `KEEP_ALL_TOLERANCE`):
    # k* is every positive entry, so with a cap k* = k_max.
    valid_alpha = generator is None and math.isfinite(alpha) and \
        alpha > (1.0 if mode == "dual" else 0.0)
    every = not top and (keeps_all(mode, alpha, lam, vocab) if valid_alpha else lam == 0.0)
    if every and cap:
        fixed_size = cap
    fixed = fixed_size > 0
    if generator is not None:
        return (Family.KEEP_ALL if every and not fixed else Family.EXACT, fixed, 0.0, lam,
                fixed_size, cap, extra)
    family = family_of(mode, alpha, fixed, keep_all=every)
    if family == Family.KEEP_ALL:
        fixed = False
    return (family, fixed, alpha, lam, fixed_size, cap, extra)


def rows_family(mode: str, alphas: Sequence[float], fixed: bool) -> Family:
    """The family of rows decoded together outside a plan (the exact path called on its own):
    their one alpha's (`families.family_of`), or `Family.EXACT` (the general maps) for several
    alphas. Lambda = 0 is the exact path's to solve there (never ``KEEP_ALL``)."""
    values = set(alphas)
    if len(values) != 1:
        return Family.EXACT
    return family_of(mode, values.pop(), fixed)


def _shared(mode, alpha, lam, top_k, k_max, generator, validate, names, vocab):
    a = 0.0 if generator is not None else _alpha_number(alpha, names[0])
    return classify(mode, a, _number(lam, names[1]), _size(top_k, names[2]),
                     _size(k_max, names[3]), generator, validate, names, vocab)


def _alpha_number(value, name: str) -> float:
    if isinstance(value, str):
        from ..params import parse_alpha

        return parse_alpha(value, name)
    return _number(value, name)


def _rows(mode, alpha, lam, top_k, k_max, alphas, lams, tops, caps, batch, generator,
          validate, names, vocab) -> list[Row]:
    alpha_value = None if alphas is not None else (
        0.0 if generator is not None else _alpha_number(alpha, names[0]))
    lam_value = None if lams is not None else _number(lam, names[1])
    top_value = None if tops is not None else _size(top_k, names[2])
    cap_value = None if caps is not None else _size(k_max, names[3])
    seen: dict[tuple, Row] = {}
    out = []
    for i in range(batch):
        key = (alphas[i] if alphas is not None else alpha_value,
               lams[i] if lams is not None else lam_value,
               tops[i] if tops is not None else top_value,
               caps[i] if caps is not None else cap_value)
        row = seen.get(key)
        if row is None:
            a = key[0] if generator is not None else _alpha_number(key[0], names[0])
            row = classify(mode, float(a), _number(key[1], names[1]), _size(key[2], names[2]),
                            _size(key[3], names[3]), generator, validate, names, vocab)
            seen[key] = row
        out.append(row)
    return out


def plan_requests(requests: Sequence[tuple[int, object]], *, batch: int, vocab: int,
                  device: torch.device | str, temperatures: Sequence[float] | None = None) -> Plan:
    """The plan of a vLLM batch: ``requests`` lists (batch position,
    `bregman_vllm.params.BregmanParams`, valid by construction: not validated again) for the
    rows to decode; other rows are left alone.
    ``temperatures``: per batch row, the temperature the caller divides the logits by after
    the step (`Plan.scale`); None: the logits are decoded as they are.

    Host work only (the parameters were validated at admission), plus pinned, non-blocking
    copies of the group positions and per-row values.
    """
    device = torch.device(device)
    by_key: dict[tuple[str, Family, bool], list[tuple[int, Row]]] = {}
    names = REQUEST_NAMES
    seen: dict[object, Row] = {}
    for position, params in requests:
        row = seen.get(params)
        if row is None:
            row = seen[params] = classify(
                params.mode, float(params.alpha), float(params.lam), params.top_k or 0,
                params.k_max or 0, None, False, names, vocab, row_values(params))
        by_key.setdefault((params.mode, row[0], row[1]), []).append((position, row))
    groups = []
    for (mode, family, fixed), members in by_key.items():
        positions = [position for position, _ in members]
        every = positions == list(range(batch))
        rows = None if every else to_device(positions, torch.long, device)
        groups.append(_group(family, mode, fixed, rows, len(members),
                             [row for _, row in members], device, None, vocab,
                             host_rows=tuple(positions)))
    scale = temperature = None
    if temperatures is not None and any(t != 1.0 for t in temperatures):
        scale = to_device([1.0 / t for t in temperatures], torch.float32, device)
        temperature = to_device(list(temperatures), torch.float32, device)
    return Plan(tuple(groups), batch, vocab, scale, temperature)


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Host values on ``device``: a pinned, non-blocking copy on CUDA (the stream orders it
    before any kernel that reads it), a plain tensor elsewhere."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _per_row(values: list, dtype: torch.dtype, device: torch.device, uniform: bool):
    """A Python number when every row shares the value, else a device tensor."""
    if uniform or all(v == values[0] for v in values):
        return values[0]
    return to_device(values, dtype, device)


def _group(family: Family, mode: str, fixed: bool, rows: Tensor | None, count: int,
           members: list[Row], device: torch.device, generator, vocab: int,
           uniform: bool = False, host_rows: tuple[int, ...] | None = None) -> Group:
    alphas, lams, sizes, caps = ([row[i] for row in members] for i in range(2, 6))
    extra = {name: [row[6][i] for row in members] for i, name in enumerate(ROW_FIELDS)}
    capped = any(c > 0 for c in caps)
    if fixed:
        width = window_width(family, 0.0, True, max(sizes))
        bounded, flags = True, may_flag(family, True, width, width)
    else:
        cap_values = [c if c > 0 else UNBOUNDED for c in caps]
        # No support is larger than the vocabulary, or than k*'s bound from the parameters.
        largest = min(max(min(cap, support_bound(mode, a, lm) + 1) for cap, a, lm
                          in zip(cap_values, alphas, lams, strict=True)), vocab)
        width = window_width(family, min(lams), False, largest)
        flags = may_flag(family, False, largest, width)
        bounded = not flags
        sizes = cap_values
    iterations = newton_iterations(family, alphas)
    below = family == Family.POWER and any(a < 2.0 for a in alphas)
    above = family == Family.POWER and any(a > 2.0 for a in alphas)
    host = {"alpha": alphas, "lam": lams, "size": sizes, "cap": caps, **extra}
    values = {name: _per_row(host[name], ROW_DTYPES[name], device, uniform)
              for name in ("alpha", "lam", "size", *ROW_FIELDS)}
    return Group(family=family, mode=mode, fixed=fixed, rows=rows, count=count, values=values,
                 capped=capped, width=width, bounded=bounded, flags=flags,
                 iterations=iterations, below_two=below, above_two=above, generator=generator,
                 host=host, host_rows=None if rows is None else host_rows)


class ExactPlan(NamedTuple):
    """Per-row parameters of the exact path (all [n] tensors; fixed_k / k_max: 0 = none), the
    rows' formula family (one plan group: decided once, by the plan; None with a user
    generator) and the other per-row values by name (`ROW_FIELDS`, [n] tensors)."""

    mode: str
    alpha: Tensor
    lam: Tensor
    fixed_k: Tensor
    k_max: Tensor
    generator: BregmanGenerator | None = None
    family: Family | None = None
    values: Mapping[str, Tensor] = MappingProxyType({})


def exact_plan(mode: str, alpha: Tensor, lam: Tensor, fixed_k: Tensor, k_max: Tensor,
               generator: BregmanGenerator | None = None, family: Family | None = None,
               values: Mapping[str, Tensor] | None = None) -> ExactPlan:
    """The exact path's parameters. ``family``: the rows' family when the caller has it (a
    plan group); else the plan's (`rows_family`). ``values``: the `ROW_FIELDS`
    (default: their defaults)."""
    if family is None and generator is None:
        family = rows_family(mode, alpha.tolist(), bool((fixed_k > 0).all()))
    if values is None:
        values = {name: torch.full_like(fixed_k, default, dtype=ROW_DTYPES[name])
                  for name, default in zip(ROW_FIELDS, DEFAULT_ROW_VALUES, strict=True)}
    return ExactPlan(mode, alpha, lam, fixed_k, k_max, generator, family, values)
