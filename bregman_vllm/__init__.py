"""bregman-vllm: Bregman decoding (Noarov et al., "Foundations of Top-k Decoding for Language
Models") as a vLLM sampling plugin.

Layout:
    bregman_vllm.params     the one parameter model (pure Python; the server imports only this)
    bregman_vllm.decode     the public calls (bregman_decode, ...)
    bregman_vllm.backend    the step's backend, chosen in one place: the kernels or the core's
    bregman_vllm.core       the math core: primal/dual alpha maps, exact k* (imports only torch)
    bregman_vllm.kernels    the CUDA step as Triton kernels (imported only when chosen)
    bregman_vllm.adapter    the vLLM V1 logits processor (thin adapter over the core)

Public names are imported lazily so that ``import bregman_vllm.params`` does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .params import BregmanParamError, BregmanParams

__version__ = "0.1.0"

_LAZY = {
    "BregmanOutput": ("bregman_vllm.decode", "BregmanOutput"),
    "bregman_decode": ("bregman_vllm.decode", "bregman_decode"),
    "bregman_decode_logits": ("bregman_vllm.decode", "bregman_decode_logits"),
    "renormalize": ("bregman_vllm.decode", "renormalize"),
    "BregmanGenerator": ("bregman_vllm.core.generators", "BregmanGenerator"),
    "AlphaGenerator": ("bregman_vllm.core.generators", "AlphaGenerator"),
    "BregmanLogitsProcessor": ("bregman_vllm.adapter.processor", "BregmanLogitsProcessor"),
}

__all__ = [
    "AlphaGenerator",
    "BregmanGenerator",
    "BregmanLogitsProcessor",
    "BregmanOutput",
    "BregmanParamError",
    "BregmanParams",
    "bregman_decode",
    "bregman_decode_logits",
    "renormalize",
]

if TYPE_CHECKING:  # pragma: no cover
    from .adapter.processor import BregmanLogitsProcessor
    from .core.generators import AlphaGenerator, BregmanGenerator
    from .decode import BregmanOutput, bregman_decode, bregman_decode_logits, renormalize


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'bregman_vllm' has no attribute {name!r}")
