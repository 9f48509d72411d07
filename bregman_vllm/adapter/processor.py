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

Robustness: request values are validated at admission (`validate_params`, HTTP 400 with the
parameter model's message). `apply()` never raises: an exception inside a logits processor kills
every request on the server, so a failure is logged and the step's logits are left unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from ..core.decode import decode_logits_rows, plan_rows
from ..params import BregmanParamError, BregmanParams

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

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


class BregmanLogitsProcessor(LogitsProcessor):
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

    def __init__(self, vllm_config: VllmConfig, device: torch.device,
                 is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self.enabled = _claim(vllm_config)
        self.requests: dict[int, BregmanParams] = {}
        self.batch_size = 0
        self.groups: list[_ModeGroup] = []
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

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.requests:
            return logits
        try:
            if self._stale:
                self._rebuild()
            for group in self.groups:
                if group.contiguous_prefix and group.count == logits.shape[0]:
                    logits, _ = decode_logits_rows(logits, group.plan)
                else:
                    decoded, _ = decode_logits_rows(logits[group.rows], group.plan)
                    logits[group.rows] = decoded
        except Exception:  # never let one request take the engine down
            self._failures += 1
            if self._failures <= 3:
                logger.exception("Bregman decoding failed; logits left unchanged this step")
        return logits
