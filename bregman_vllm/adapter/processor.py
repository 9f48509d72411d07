"""vLLM logits processor: per-request Bregman decoding inside the engine.

A thin adapter over `bregman_vllm.core`. Per request, ``SamplingParams.extra_args`` (which vLLM's
OpenAI server fills from ``vllm_xargs``) may hold ``bregman_mode`` ("primal" | "dual" | "off"),
``bregman_alpha``, ``bregman_lambda``, ``bregman_top_k`` and ``bregman_k_max``; missing values take
the defaults of `bregman_vllm.params`. A request without any ``bregman_*`` key is untouched.

Two interfaces, one class (vLLM 0.32 loads processors from the same entry point for both):

* **V1 model runner** (`vllm/v1/sample/sampler.py`; the CPU runner, and GPUs with
  ``VLLM_USE_V2_MODEL_RUNNER=0``), each decode step:

  1. raw logprobs are taken (returned unless ``logprobs_mode=processed_logprobs``);
  2. non-argmax-invariant processors (min_tokens, logit_bias), penalties;
  3. greedy rows take their argmax; the rest are divided by their temperature;
  4. argmax-invariant processors - vLLM's min_p, then this one - see the temperature-scaled
     logits: p = softmax(logits / T), q = Bregman(p), log q written (-inf off the support);
  5. the request's own top_k / top_p act on q, and the token is sampled.

* **Model Runner V2** (`vllm/v1/worker/gpu/sample/sampler.py`; vLLM 0.32's default on CUDA):
  custom processors run after bias, penalties, bad words and grammar but *before* temperature,
  min_p and top-k/top-p. The core decodes p = softmax(logits / T) with each row's temperature
  folded into its log-normalizer (`core.plan.Plan.scale`; the logits are never rescaled) and
  writes T log q, so that the runner's own division by T yields log q: the distribution sampled
  from is the same as under V1, except that min_p then acts on q (under V1 it acts on p, before
  Bregman decoding).

State. Under V1 the rows to decode and their parameters are a `plan`
(`bregman_vllm.core.plan`), built on the host only when a `BatchUpdate` adds, removes or moves a
Bregman request. Under V2 with the Triton kernels (``BREGMAN_BACKEND``: the default on CUDA)
there is no plan: as vLLM's own stages do, each request's parameters live in per-slot device
columns (`rows.RowTable`, ``max_num_reqs`` entries), written in ``add_request`` and copied
to the device in ``apply_staged_writes``; `apply()` launches the kernels over
``ctx.expanded_idx_mapping`` (draft rows of speculative decoding included), which skip the rows
of plain requests themselves; the host only reads its own columns at ``idx_mapping_np`` (numpy,
no sync) for the step's candidate width and whether a row may need the exact path. Under V2 on
the torch step (a CPU) the plan is rebuilt when ``add_request`` ran or the row order changed.
Positions and per-row values reach the device by pinned, non-blocking copies. In steady state
`apply()` only runs the step, in place on vLLM's logits.

Telemetry. After each `_decode`, ``last_step`` holds the step's `core.result.StepResult`: the
support size k of every row (a device tensor, 0 for rows not decoded) and ``exact_rows``, the
number of rows the fixed-shape step handed to the exact path (a host int read at the step's one
sync; 0 when it did not sync), for metrics that must not add a sync.

Robustness. Request values are validated at admission (`validate_params`, HTTP 400 with the
parameter model's message); supports larger than the vocabulary are clamped to it. `apply()`
never raises: an exception inside a logits processor would fail every request on the engine.
If the step fails, the processor decodes each group, then each row, on its own, so only the rows
that fail keep their logits; those rows are counted (`telemetry`: the Prometheus counter
``bregman_processor_failures_total`` and a rate-limited warning with the running count).

Warm-up. With the Triton kernels, every kernel variant a step runs is compiled when the
processor is built (`bregman_vllm.kernels.warm_up`, on dummy rows of the engine's vocabulary);
a decoding step never compiles (Triton's cache, ``TRITON_CACHE_DIR``, keeps them across
restarts).

Memory. On CUDA the processor reserves the step's worst-case extra memory
(`core.step.step_memory_bound` for ``max_num_seqs`` rows) when it is built, which is before vLLM
profiles memory, so the profiler sees it and sizes the KV cache around it; the reservation is
released at the first `apply()`, into PyTorch's cache, where the step's temporaries find it.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from abc import ABC
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

try:  # vLLM >= 0.32: Model Runner V2 has its own processor interface
    from vllm.v1.worker.gpu.sample.logits_processor.interface import (
        LogitsProcessor as RunnerV2LogitsProcessor,
    )
except ImportError:  # pragma: no cover - older vLLM
    RunnerV2LogitsProcessor = ABC

from .. import lifeline
from ..backend import chosen_backend
from ..backend import decode as decode_step
from ..core.plan import Plan, plan_requests
from ..core.result import StepResult
from ..core.step import step_memory_bound
from ..params import (
    DATA_FIELDS,
    BregmanParamError,
    BregmanParams,
    bregman_keys,
    dotted,
    max_support_from_env,
)
from ..rows import Row, RowTable
from . import telemetry

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu.sample.logits_processor.interface import (
        LogitsContext,
        LogitsProcRequestState,
    )

# Temperatures below this are greedy in vLLM's samplers (_SAMPLING_EPS).
_GREEDY_TEMPERATURE = 1e-5

logger = logging.getLogger(__name__)

# One active instance per engine: with the plugin installed, naming the class again with
# --logits-processors would make vLLM build it twice and decode every step twice. VllmConfig is
# unhashable, so engines are tracked by id() with a weak reference to detect reuse of an id.
_ACTIVE: dict[int, weakref.ref] = {}


def request_params(extra_args: Mapping[str, Any] | None, max_support: int | None = None
                   ) -> BregmanParams | None:
    """The validated Bregman parameters of a request, held to ``max_support`` (a deployment's
    largest support size, `BregmanParams.within`), or None when it does not use them.

    A key meant as a Bregman field deeper in ``extra_args`` (``{"vllm_xargs": {"bregman_top_k":
    1}}``, outside `DATA_FIELDS`) is refused, naming its path: the processor reads the first
    level only, and would ignore it.
    """
    params = BregmanParams.from_mapping(extra_args)
    if extra_args:
        for path in bregman_keys(extra_args, data=DATA_FIELDS):
            if len(path) > 1:
                raise BregmanParamError(
                    "extra_args." + dotted(path), "the Bregman fields are read at the first "
                    "level of extra_args (vllm_xargs) only, so this one would be ignored")
    if params is None or not params.enabled:
        return None
    return params.within(max_support)


def _cap(params: BregmanParams) -> int:
    """The size an adaptive request's k* may be held at (its k_max; 0: none, or fixed k)."""
    return params.k_max if params.top_k is None and params.k_max is not None else 0


def _caps(rows: list[tuple[int, BregmanParams]], batch: int) -> np.ndarray:
    """`_cap` of each row of a batch (0 for rows of plain requests): the held rows' metric."""
    caps = np.zeros(batch, dtype=np.int64)
    for row, params in rows:
        caps[row] = _cap(params)
    return caps


def _claim(vllm_config: object) -> bool:
    """True for the first Bregman processor built for this engine configuration."""
    key = id(vllm_config)
    known = _ACTIVE.get(key)
    if known is not None and known() is vllm_config:
        logger.warning("BregmanLogitsProcessor is already active for this engine (plugin and "
                       "--logits-processors both name it); this copy stays inactive")
        return False
    # Not weak-referenceable: duplicates cannot be told apart, so act.
    with contextlib.suppress(TypeError):
        _ACTIVE[key] = weakref.ref(vllm_config)
    return True


def _engine_limits(vllm_config: Any) -> tuple[int | None, int | None]:
    """(vocabulary size, max_num_seqs) from a VllmConfig, when it has them."""
    vocab = rows = None
    with contextlib.suppress(Exception):
        vocab = int(vllm_config.model_config.get_vocab_size())
    with contextlib.suppress(Exception):
        rows = int(vllm_config.scheduler_config.max_num_seqs)
    return vocab, rows


class BregmanLogitsProcessor(LogitsProcessor, RunnerV2LogitsProcessor):
    """Bregman decoding (primal or dual, any alpha, adaptive k* or fixed top-k) per request.

    Example (offline; the plugin is registered through the ``vllm.logits_processors`` entry point,
    so it is loaded without flags):

        >>> from vllm import LLM, SamplingParams
        >>> llm = LLM("models/tiny-llama")  # doctest: +SKIP
        >>> params = SamplingParams(temperature=1.0, max_tokens=16,
        ...     extra_args={"bregman_mode": "primal", "bregman_alpha": 1.5,
        ...                 "bregman_lambda": 0.01})
        >>> llm.generate(["Once upon a time"], params)  # doctest: +SKIP
    """

    def __init__(self, vllm_config: VllmConfig, *args: Any) -> None:
        # V1 runner: (vllm_config, device, is_pin_memory); V2 runner: (vllm_config, req_states).
        vocab, max_rows = _engine_limits(vllm_config)
        if len(args) == 1:
            req_states: LogitsProcRequestState = args[0]
            self.device = torch.device(req_states.device)
            self.runner_v2 = True
            vocab = getattr(req_states, "vocab_size", None) or vocab
            max_rows = getattr(req_states, "max_num_reqs", None) or max_rows
        else:
            self.device = torch.device(args[0])
            self.runner_v2 = False
        self.interface = "v2" if self.runner_v2 else "v1"
        self.recorder = telemetry.StepRecorder(vllm_config, self.device, self.interface)
        self.vocab = vocab
        self.enabled = _claim(vllm_config)
        # (also a general plugin; called here too for deployments whose VLLM_PLUGINS omit it)
        lifeline.follow_parent()
        max_support_from_env()  # an invalid BREGMAN_MAX_SUPPORT stops the engine at its start
        self.backend = chosen_backend(self.device)
        #: V2 with the kernels: the per-slot parameter columns (no plan).
        self.table: RowTable | None = None
        if self.enabled and self.runner_v2 and self.backend == "triton" and vocab and max_rows:
            self.table = RowTable(max_rows, self.device)
        self.requests: dict[int, BregmanParams] = {}  # batch row (V1) or request slot (V2)
        self.temperatures: dict[int, float] = {}  # V2: per slot
        self.plan: Plan | None = None
        #: Per row of ``plan`` (V1, V2 by plan) the adaptive k_max, for the held rows' metric.
        self._caps: np.ndarray | None = None
        #: V2 with the kernels: the same per request slot, and the rows' modes and caps for the
        #: metrics, read once per layout (`RowTable.layout` answers the same object until the
        #: slots or the batch's order change).
        self._slot_caps = np.zeros(max_rows or 0, dtype=np.int64)
        self._counted: tuple[object, np.ndarray, np.ndarray] | None = None
        self._stale = True
        self._layout: tuple[int, ...] | None = None  # V2: the row -> slot order of `plan`
        #: The last step's result (see the module docstring); None before the first one.
        self.last_step: StepResult | None = None
        self._reserve = self._reserve_memory(max_rows, vocab) if self.enabled else None
        if self.enabled and vocab and self.backend == "triton":
            self._warm_up(vocab)

    def _warm_up(self, vocab: int) -> None:
        """Every kernel now, before vLLM profiles memory and serves: no step compiles. If they
        cannot be compiled here, the processor runs the torch step (one warning)."""
        from .. import kernels

        if kernels.INTERPRETED:  # (the interpreter compiles nothing)
            return
        try:
            seconds = kernels.warm_up(self.device, vocab)
        except Exception:
            logger.warning("The Bregman step's Triton kernels failed to compile; this engine "
                           "decodes with the torch step", exc_info=True)
            self.backend, self.table = "torch", None
        else:
            logger.info("Bregman kernels compiled (or loaded) in %.1f s", seconds)

    def _reserve_memory(self, rows: int | None, vocab: int | None) -> torch.Tensor | None:
        """Hold the step's worst case until the first apply() (see the module docstring)."""
        if self.device.type == "cpu" or not rows or not vocab:
            return None
        size = step_memory_bound(rows, vocab)
        return torch.empty(size, dtype=torch.uint8, device=self.device)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Reject bad ``bregman_*`` values at admission (ValueError -> HTTP 400), and sizes above
        the deployment's largest support size when ``BREGMAN_MAX_SUPPORT`` is set (for front
        ends that do not run the server's middleware)."""
        request_params(sampling_params.extra_args, max_support_from_env())

    def is_argmax_invariant(self) -> bool:
        """Greedy selection and monotone renormalization keep the argmax (Theorems 3.1 and 3.2 of
        arXiv 2505.19371), so vLLM may skip this processor for greedy requests."""
        return True

    # ------------------------------------------------------------------ V1

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None or not self.enabled:
            return
        changed = False
        for index in batch_update.removed:
            changed |= self.requests.pop(index, None) is not None
        for index, params, _prompt, _output in batch_update.added:
            # Greedy rows take their argmax before this processor runs (V1 sampler): skip them,
            # as under V2 (`add_request`), so that they are neither decoded nor counted.
            greedy = getattr(params, "temperature", 1.0) < _GREEDY_TEMPERATURE
            wanted = None if params is None or greedy else self._wanted(params.extra_args)
            if wanted is not None:
                self.requests[index] = wanted
                changed = True
            elif self.requests.pop(index, None) is not None:
                changed = True
        for first, second, direction in batch_update.moved:
            a = self.requests.pop(first, None)
            b = self.requests.pop(second, None)
            if a is not None:
                self.requests[second] = a
            if b is not None and direction == MoveDirectionality.SWAP:
                self.requests[first] = b
            changed |= a is not None or b is not None
        self._stale |= changed

    def apply(self, logits: torch.Tensor, ctx: LogitsContext | None = None) -> torch.Tensor:
        if not self.enabled or not self.requests:
            return logits
        self._reserve = None  # the first step releases the start-up reservation
        if ctx is None:
            return self._apply_rows(logits)
        return self._apply_slots(logits, ctx)

    def _apply_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """V1: rows are batch positions, kept in order by `update_state`."""
        if self._stale or self.plan is None or self.plan.batch != logits.shape[0]:
            rows = sorted(self.requests.items())
            self.plan = self._make_plan(rows, logits.shape[0], logits.shape[-1])
            self._caps = _caps(rows, logits.shape[0])
            self._stale = False
        return self._decode(logits, self.plan, self.backend)

    # ------------------------------------------------------------------ Model Runner V2

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        """V2: (re)initialize a request slot; True when this request is Bregman-decoded."""
        wanted = self._wanted(sampling_params.extra_args) if self.enabled else None
        if self.table is not None and req_idx >= self.table.slots:
            # (a slot past the max_num_reqs the processor was built with): the plan path,
            # which takes any slot, rather than an error out of vLLM's add_request
            logger.warning("Bregman: request slot %d is past the %d slots the processor was "
                           "built for; decoding with the torch step from now on", req_idx,
                           self.table.slots)
            self.table = None
        # Greedy requests are unaffected by an argmax-invariant processor: skip them.
        if wanted is not None and sampling_params.temperature >= _GREEDY_TEMPERATURE:
            row = self._row(wanted) if self.table is not None else None
            if row is not None or self.table is None:
                self.requests[req_idx] = wanted
                self.temperatures[req_idx] = float(sampling_params.temperature)
                self._stale = True
                if req_idx < len(self._slot_caps):
                    self._slot_caps[req_idx] = _cap(wanted)
                if self.table is not None:
                    self.table.write(req_idx, row, float(sampling_params.temperature))
                return True
        if self.requests.pop(req_idx, None) is not None:
            self.temperatures.pop(req_idx, None)
            self._stale = True
        if self.table is not None:
            self.table.write(req_idx, None)
        return False

    def _row(self, params: BregmanParams) -> Row | None:
        """The slot columns of a request (None, counted, if they cannot be made)."""
        try:
            return Row.of_request(params, self.vocab)
        except Exception as error:  # valid parameters always classify; be defensive
            telemetry.record_failure(1, self.interface, error)
            return None

    def apply_staged_writes(self) -> None:
        """V2: the slots written by ``add_request`` reach the device (with the kernels; on the
        torch step the plan is rebuilt at the next `apply()` when needed)."""
        if self.table is not None:
            self.table.flush()

    def _apply_slots(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        """V2: rows are reordered between steps; the mapping says which is which."""
        if self.table is not None:
            from .. import kernels

            if kernels.usable(logits):
                return self._apply_table(logits, ctx)
        return self._apply_planned(logits, ctx, self.backend)

    def _apply_table(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        """V2 with the kernels: no plan, no Python loop over rows, no sync for bounded
        supports; the slot columns decide everything on the device."""
        from .. import kernels

        table = self.table
        assert table is not None
        table.flush()  # (done by apply_staged_writes; here for callers that skip it)
        self.last_step = None
        layout = table.layout(ctx.idx_mapping_np)
        if layout is None:
            return logits
        try:
            step = kernels.decode(logits, table, layout, logits=True, inplace=True,
                                  mapping=ctx.expanded_idx_mapping)
        except Exception:
            # The kernels failed (they write only at their last launch): the torch step, by
            # plan, row by row at worst.
            return self._apply_planned(logits, ctx, backend="torch")
        self.last_step = StepResult(step.out, step.k, 0)
        caps = None
        if len(ctx.idx_mapping_np) == logits.shape[0]:
            if self._counted is None or self._counted[0] is not layout:
                self._counted = (layout, table.host["mode"][ctx.idx_mapping_np],
                                 self._slot_caps[ctx.idx_mapping_np])
            modes, caps = self._counted[1:]
        else:  # several rows per request: the modes by the device mapping, copied with k
            # (held rows are not counted there: their caps would need a device copy too)
            modes = table.columns["mode"].index_select(0, ctx.expanded_idx_mapping)
        self.recorder.record_rows(step.k, modes, caps)
        return logits

    def _apply_planned(self, logits: torch.Tensor, ctx: LogitsContext, backend: str
                       ) -> torch.Tensor:
        """V2 by a plan of the step's row order (the torch step)."""
        layout = self._row_slots(logits, ctx)
        if self._stale or layout != self._layout:
            self._plan_slots(layout, logits)
        return self._decode(logits, self.plan, backend)

    def _row_slots(self, logits: torch.Tensor, ctx: LogitsContext) -> tuple[int, ...]:
        mapping = ctx.idx_mapping_np
        if mapping is not None and len(mapping) == logits.shape[0]:
            return tuple(int(slot) for slot in mapping)
        # Several rows per request (speculative decoding): only the device mapping tells.
        return tuple(int(slot) for slot in ctx.expanded_idx_mapping.tolist())

    def _plan_slots(self, layout: tuple[int, ...], logits: torch.Tensor) -> None:
        positions = [i for i, slot in enumerate(layout) if slot in self.requests]
        self._layout, self._stale = layout, False
        if not positions:
            self.plan = None
            return
        # Plain rows keep temperature 1 here: they are not decoded.
        temperatures = [self.temperatures.get(slot, 1.0) if slot in self.requests else 1.0
                        for slot in layout]
        rows = [(i, self.requests[layout[i]]) for i in positions]
        self.plan = self._make_plan(rows, len(layout), logits.shape[-1], temperatures)
        self._caps = _caps(rows, len(layout))

    # ------------------------------------------------------------------ shared

    def _wanted(self, extra_args: Mapping[str, Any] | None) -> BregmanParams | None:
        try:
            return request_params(extra_args, max_support_from_env())
        except BregmanParamError as error:  # validate_params ran already; be defensive
            # A request that asked for Bregman decoding gets plain sampling: counted.
            telemetry.record_failure(1, self.interface, error)
            return None

    def _make_plan(self, requests: list[tuple[int, BregmanParams]], batch: int,
                   vocab: int, temperatures: list[float] | None = None) -> Plan | None:
        """The plan of these rows; a row whose parameters cannot be planned is left out (and
        counted) rather than taking the other rows down with it."""
        def plan(rows: list[tuple[int, BregmanParams]]) -> Plan:
            return plan_requests(rows, batch=batch, vocab=vocab, device=self.device,
                                 temperatures=temperatures)

        try:
            return plan(requests)
        except Exception:
            good = []
            for row in requests:
                try:
                    plan([row])
                except Exception as error:
                    telemetry.record_failure(1, self.interface, error)
                else:
                    good.append(row)
            return plan(good) if good else None

    def _decode(self, logits: torch.Tensor, plan: Plan | None, backend: str | None = None
                ) -> torch.Tensor:
        """The core's step on ``logits`` (in place; ``last_step`` holds its result); on an
        exception, group by group, then row by row, with the torch step, so that only the rows
        that fail keep their logits."""
        self.last_step = None
        if plan is None:
            return logits
        try:
            step = decode_step(logits, plan, logits=True, inplace=True, backend=backend)
        except Exception as error:
            written = getattr(error, "bregman_uncertified_rows", None)
            if written is not None:  # the batch is decoded; some rows not certified
                telemetry.record_failure(written, self.interface, error)
                return logits
            if len(plan.groups) == 1 and plan.groups[0].count == 1:
                telemetry.record_failure(1, self.interface, error)
                return logits
        else:
            self.last_step = step
            # k* and exact-path rows, outside the try: a telemetry bug never decodes twice.
            self.recorder.record(plan, step.k, step.exact_rows, self._caps)  # never raises
            return logits
        for group in plan.groups:
            single = plan.with_groups((group,))
            try:
                step = decode_step(logits, single, logits=True, inplace=True, backend="torch")
                self.recorder.record(single, step.k, step.exact_rows, self._caps)
            except Exception:
                self._decode_rows_alone(logits, group, plan)
        return logits

    def _decode_rows_alone(self, logits: torch.Tensor, group: Any, plan: Plan) -> None:
        positions = group.rows_or_all(logits.device).tolist()
        requests = dict(self._row_requests(plan))
        for position in positions:
            params = requests.get(position)
            try:
                single = plan_requests([(position, params)], batch=plan.batch,
                                       vocab=plan.vocab, device=self.device)
                single = plan.with_groups(single.groups)
                step = decode_step(logits, single, logits=True, inplace=True,
                                   backend="torch")
                self.recorder.record(single, step.k, step.exact_rows, self._caps)
            except Exception as error:
                telemetry.record_failure(1, self.interface, error)

    def _row_requests(self, plan: Plan) -> list[tuple[int, BregmanParams]]:
        """(position in the batch, params) of the rows of ``plan``."""
        if not self.runner_v2:
            return sorted(self.requests.items())
        assert self._layout is not None
        return [(i, self.requests[slot]) for i, slot in enumerate(self._layout)
                if slot in self.requests]
