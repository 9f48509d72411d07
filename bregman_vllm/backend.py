"""The decoding step's backend, chosen in one place: the Triton kernels or the torch step.

Both steps take a `core.plan.Plan` and return a `core.result.StepResult` with the same supports
and maps (tests/test_kernels.py): the kernels (`bregman_vllm.kernels`: four launches, no host
plan, no sync for bounded supports) run on CUDA tensors, the torch step (`core.step`: eager
ops, the fast ones on a CPU) elsewhere. This module is the only one that imports both; the
core never imports the kernels.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

from .core.plan import Plan
from .core.result import StepResult
from .core.step import decode_step

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "torch")
_WARNED: set[str] = set()


def chosen_backend(device: torch.device) -> str:
    """``BREGMAN_BACKEND``: "auto" (the default) runs the kernels on CUDA tensors and the torch
    step elsewhere; "triton" runs the kernels on any tensors (CPU tensors under Triton's
    interpreter: ``TRITON_INTERPRET=1`` set before Triton is imported); "torch" runs the torch
    step. Returns "triton" or "torch"."""
    return _backend_choice(os.environ.get("BREGMAN_BACKEND", "auto"), device.type)


@functools.lru_cache(maxsize=16)
def _backend_choice(setting: str, device_type: str) -> str:
    # Parsed once per (setting, device): the public calls ask at every call.
    choice = setting.strip().lower()
    if choice not in BACKENDS:
        raise ValueError(f"BREGMAN_BACKEND must be one of {', '.join(BACKENDS)}, got "
                         f"{setting!r}")
    if choice == "auto":
        choice = "triton" if device_type == "cuda" else "torch"
    if choice == "triton" and importlib.util.find_spec("triton") is None:
        if setting.strip().lower() == "triton":
            raise ValueError("BREGMAN_BACKEND=triton needs the triton package")
        if "triton" not in _WARNED:
            _WARNED.add("triton")
            logger.warning("Triton is not installed: the Bregman step runs on torch ops")
        return "torch"
    return choice


def decode(scores: torch.Tensor, plan: Plan, *, logits: bool, inplace: bool = False,
           backend: str | None = None) -> StepResult:
    """The step on ``scores`` ([N, V]) by ``backend`` ("triton" or "torch"; default:
    `chosen_backend`): `core.step.decode_step`'s contract, whichever runs it. Float64 scores,
    tiny vocabularies and user generators stay on the torch step."""
    if (backend or chosen_backend(scores.device)) == "triton" and \
            all(group.generator is None for group in plan.groups):
        from . import kernels

        if kernels.usable(scores):
            return kernels.decode_plan(scores, plan, logits=logits, inplace=inplace)
    return decode_step(scores, plan, logits=logits, inplace=inplace)
