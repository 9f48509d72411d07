"""vLLM V1 logits processor: per-request Bregman decoding inside the engine.

A thin adapter over `bregman_vllm.core`. Per request, ``SamplingParams.extra_args`` (which vLLM's
OpenAI server fills from ``vllm_xargs``) may hold ``bregman_mode`` ("primal" | "dual" | "off"),
``bregman_alpha``, ``bregman_lambda``, ``bregman_top_k`` and ``bregman_k_max``; missing values take
the defaults of `bregman_vllm.params`. A request without any ``bregman_*`` key is untouched.

Where it runs in vLLM's sampler (vllm/v1/sample/sampler.py), for each decode step:

1. raw logprobs are taken (returned to the user unless ``logprobs_mode=processed_logprobs``);
2. non-argmax-invariant processors (min_tokens, logit_bias), penalties;
3. greedy rows take their argmax here; the rest are divided by their temperature;
4. argmax-invariant processors - this one, after vLLM's min_p - see the temperature-scaled logits:
   it computes p = softmax(logits / T), q = Bregman(p) and writes log q (-inf off the support);
5. the request's own top_k / top_p then apply to q, and the token is sampled.

Bregman decoding keeps the most likely tokens (greedy property) and renormalizes monotonically,
so the argmax is unchanged: the processor is argmax-invariant and greedy requests are unaffected.
vLLM refuses custom logits processors with speculative decoding and pooling models.

State: the batch's Bregman rows and their parameters live in device tensors rebuilt only when a
`BatchUpdate` changes the batch (removed, then added, then moved: unidirectional or swap).
`apply()` runs one vectorized decode per mode over all Bregman rows, whatever their alpha/lambda.

vLLM's Model Runner V2 (the default on GPUs with Triton in vLLM 0.32) loads processors from the
same entry point but through a different interface, and rejects V1-only classes at start-up, so
this class implements both. Under V2, ``apply()`` runs before temperature: the processor divides
by each request's temperature itself and writes T log q, which the runner's own division by T
turns into log q, keeping the V1 semantics above.

Robustness: request values are validated at admission (`validate_params`, HTTP 400 with the
parameter model's message). `apply()` never raises: an exception inside a logits processor kills
every request on the server, so a failure is logged and the step's logits are left unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from abc import ABC
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

try:  # vLLM >= 0.32: Model Runner V2 has its own processor interface
    from vllm.v1.worker.gpu.sample.logits_processor.interface import (
        LogitsProcessor as RunnerV2LogitsProcessor,
    )
except ImportError:  # pragma: no cover - older vLLM
    RunnerV2LogitsProcessor = ABC

from ..core.decode import decode_logits_rows, plan_rows
from ..params import BregmanParamError, BregmanParams

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext

# Temperatures below this are greedy in vLLM's samplers (_SAMPLING_EPS).
_GREEDY_TEMPERATURE = 1e-5

logger = logging.getLogger(__name__)

# One active instance per engine: with the plugin installed, naming the class again with
# --logits-processors would make vLLM build it twice and decode every step twice. VllmConfig is
# unhashable, so engines are tracked by id() with a weak reference to detect reuse of an id.
_ACTIVE: dict[int, weakref.ref] = {}


def request_params(extra_args: Mapping[str, Any] | None) -> BregmanParams | None:
    """The validated Bregman parameters of a request, or None when it does not use them."""
    params = BregmanParams.from_mapping(extra_args)
    if params is None or not params.enabled:
        return None
    return params


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


class _ModeGroup:
    """The rows of one decoding mode and their per-row parameters, on the device."""

    def __init__(self, mode: str, rows: list[int], params: list[BregmanParams],
                 device: torch.device) -> None:
        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        self.mode = mode
        self.count = len(rows)
        self.rows = tensor(rows, torch.long)
        self.contiguous_prefix = rows == list(range(len(rows)))
        self.plan = plan_rows(
            mode,
            alpha=tensor([p.alpha for p in params], torch.float64),
            lam=tensor([p.lam for p in params], torch.float64),
            top_k=tensor([p.top_k or 0 for p in params], torch.long),
            k_max=tensor([p.k_max or 0 for p in params], torch.long),
        )


class _SlotTable:
    """V2: per-slot parameters on the device, indexed by request slot (0 = not Bregman)."""

    def __init__(self, requests: dict[int, BregmanParams], temperatures: dict[int, float],
                 device: torch.device) -> None:
        size = max(requests, default=-1) + 1
        codes = {"primal": 1, "dual": 2}
        mode = [0] * size
        alpha, lam, top, cap, temp = [1.0] * size, [0.0] * size, [0] * size, [0] * size, \
            [1.0] * size
        for slot, params in requests.items():
            mode[slot] = codes[params.mode]
            alpha[slot], lam[slot] = params.alpha, params.lam
            top[slot], cap[slot] = params.top_k or 0, params.k_max or 0
            temp[slot] = temperatures[slot]
        self.mode = torch.tensor(mode or [0], dtype=torch.long, device=device)
        self.alpha = torch.tensor(alpha or [1.0], dtype=torch.float64, device=device)
        self.lam = torch.tensor(lam or [0.0], dtype=torch.float64, device=device)
        self.top_k = torch.tensor(top or [0], dtype=torch.long, device=device)
        self.k_max = torch.tensor(cap or [0], dtype=torch.long, device=device)
        self.temperature = torch.tensor(temp or [1.0], dtype=torch.float32, device=device)


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
        if len(args) == 1:
            self.device = torch.device(args[0].device)
            self.runner_v2 = True
        else:
            self.device = torch.device(args[0])
            self.runner_v2 = False
        self.enabled = _claim(vllm_config)
        self.requests: dict[int, BregmanParams] = {}  # batch row (V1) or request slot (V2)
        self.temperatures: dict[int, float] = {}  # V2: per slot
        self.batch_size = 0
        self.groups: list[_ModeGroup] = []
        self.slots: _SlotTable | None = None
        self._stale = False
        self._failures = 0

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Reject bad ``bregman_*`` values at admission (ValueError -> HTTP 400)."""
        request_params(sampling_params.extra_args)

    def is_argmax_invariant(self) -> bool:
        """Greedy selection and monotone renormalization keep the argmax (Theorem
        greedy_optimal), so vLLM may skip this processor for greedy requests."""
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None or not self.enabled:
            return
        self.batch_size = batch_update.batch_size
        changed = False
        for index in batch_update.removed:
            changed |= self.requests.pop(index, None) is not None
        for index, params, _prompt, _output in batch_update.added:
            try:
                wanted = request_params(params.extra_args if params is not None else None)
            except BregmanParamError as error:  # validate_params ran already; be defensive
                logger.warning("ignoring invalid Bregman parameters: %s", error)
                wanted = None
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
        if changed:
            self._stale = True

    def _rebuild(self) -> None:
        groups = []
        for mode in ("primal", "dual"):
            rows = sorted(i for i, p in self.requests.items() if p.mode == mode)
            if rows:
                groups.append(_ModeGroup(mode, rows, [self.requests[i] for i in rows],
                                         self.device))
        self.groups = groups
        self._stale = False

    def apply(self, logits: torch.Tensor, ctx: LogitsContext | None = None) -> torch.Tensor:
        if not self.requests or not self.enabled:
            return logits
        try:
            if ctx is None:
                return self._apply_rows(logits)
            return self._apply_slots(logits, ctx)
        except Exception:  # never let one request take the engine down
            self._failures += 1
            if self._failures <= 3:
                logger.exception("Bregman decoding failed; logits left unchanged this step")
            return logits

    def _apply_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """V1: rows are batch positions, kept in order by `update_state`."""
        if self._stale:
            self._rebuild()
        for group in self.groups:
            if group.contiguous_prefix and group.count == logits.shape[0]:
                logits, _ = decode_logits_rows(logits, group.plan)
            else:
                decoded, _ = decode_logits_rows(logits[group.rows], group.plan)
                logits[group.rows] = decoded
        return logits

    # ------------------------------------------------------------------ Model Runner V2

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        """V2: (re)initialize a request slot; True when this request is Bregman-decoded."""
        wanted = None
        if self.enabled:
            try:
                wanted = request_params(sampling_params.extra_args)
            except BregmanParamError as error:  # validate_params ran already; be defensive
                logger.warning("ignoring invalid Bregman parameters: %s", error)
        # Greedy requests are unaffected by an argmax-invariant processor: skip them.
        if wanted is not None and sampling_params.temperature >= _GREEDY_TEMPERATURE:
            self.requests[req_idx] = wanted
            self.temperatures[req_idx] = float(sampling_params.temperature)
            self._stale = True
            return True
        if self.requests.pop(req_idx, None) is not None:
            self.temperatures.pop(req_idx, None)
            self._stale = True
        return False

    def apply_staged_writes(self) -> None:
        """V2 hook; the slot table is rebuilt lazily on the next `apply()`."""

    def _apply_slots(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        """V2: rows are reordered every step; ctx maps each row to its request slot."""
        if self._stale or self.slots is None:
            self.slots = _SlotTable(self.requests, self.temperatures, self.device)
            self._stale = False
        table = self.slots
        row_slots = ctx.expanded_idx_mapping.to(torch.long)
        row_mode = table.mode[row_slots.clamp_max(table.mode.shape[0] - 1)]
        row_mode = torch.where(row_slots < table.mode.shape[0], row_mode, 0)
        for code, mode in enumerate(("primal", "dual"), start=1):
            rows = (row_mode == code).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            slots = row_slots[rows]
            plan = plan_rows(mode, table.alpha[slots], table.lam[slots], table.top_k[slots],
                             table.k_max[slots], validate=False)
            temperature = table.temperature[slots].unsqueeze(-1)
            decoded, _ = decode_logits_rows(logits[rows] / temperature, plan)
            logits[rows] = decoded * temperature  # the runner divides by T next
        return logits
