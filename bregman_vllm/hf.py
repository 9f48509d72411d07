"""Bregman decoding in Hugging Face transformers: a `LogitsProcessor` for ``model.generate``.

`BregmanLogitsProcessor` turns each row of ``scores`` ([batch, vocab] logits) into log q, the
Bregman-decoded distribution of p = softmax(scores) (problem (2) / (3) of arXiv 2505.19371:
the top k* tokens, k* adaptive or fixed, renormalized by the primal or dual alpha map), with
-inf off the support. ``generate(..., do_sample=True)`` then samples from q.

Where it sits in ``generate``
    transformers (5.x) builds one `LogitsProcessorList` per call: its own processors
    (repetition penalty, min length, bad words, ...), then the processors passed as
    ``logits_processor=`` in their order, then, when ``do_sample=True``, the warpers made from the
    generation config in this order: temperature, top-h, top-k, top-p, min-p, typical, epsilon,
    eta. So with ``generate(..., temperature=T, logits_processor=[bregman])`` the temperature is
    applied *after* Bregman decoding (to log q: q^(1/T) renormalized on the support), and the
    config's ``top_k`` (50 unless the model's generation config or the call says otherwise) cuts
    the support further when k* > 50.

The paper's order (and vLLM's, and bregman-serve's): temperature first, then Bregman
    Bregman decoding acts on p = softmax(logits / T). Put a `TemperatureLogitsWarper` before the
    processor and leave ``generate``'s own temperature at 1 (`paper_order` builds that list),
    and pass ``top_k=0`` so that generate adds no top-k of its own::

        from transformers import LogitsProcessorList, TemperatureLogitsWarper
        from bregman_vllm.hf import BregmanLogitsProcessor

        processors = LogitsProcessorList([
            TemperatureLogitsWarper(0.7),
            BregmanLogitsProcessor(alpha=1.5, lam=0.01, k_max=50),
        ])
        out = model.generate(**inputs, do_sample=True, top_k=0, max_new_tokens=64,
                             logits_processor=processors)

The keyword arguments are those of `bregman_decode` (``alpha``, ``lam``, ``mode``, ``top_k``,
``k_max``, one value for the whole batch) and are validated when the processor is built, by the
math core itself, so an invalid value raises `BregmanParamError` with the same message as
`bregman_decode` (e.g. ``alpha: must be in (1, inf) for adaptive dual decoding, got 0.5; ...``).
The call is vectorized over the batch (one `bregman_decode_logits` step for every row) and
exact: ``softmax`` of its output is ``bregman_decode(softmax(scores), ...).probs``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper

from .decode import bregman_decode_logits
from .params import BregmanParamError

_HALF = (torch.float16, torch.bfloat16)


def _scalar(value: Any, name: str) -> Any:
    """Parameters are one value for the whole batch (generate's rows change with padding,
    beams and ``num_return_sequences``, so per-row values would not line up)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise BregmanParamError(name, "must be a single number for the whole batch, got a "
                                    f"tensor of shape {tuple(value.shape)}")
        return value.item()
    if isinstance(value, (list, tuple)):
        raise BregmanParamError(name, "must be a single number for the whole batch, got a "
                                f"{type(value).__name__}")
    return value


class BregmanLogitsProcessor(LogitsProcessor):
    r"""Bregman decoding of ``softmax(scores)``: log q with -inf off the support.

    For p = softmax(scores) of one row, q solves the primal problem
    min_q D_phi(q, p) + lambda ||q||_0 (``mode="primal"``) or the dual one
    min_q D_phi(p, q) + lambda ||q||_0 (``mode="dual"``), i.e. problem (2) with the Div of
    eq. (3), with
    phi_alpha(x) = x^alpha / (alpha (alpha - 1)): q keeps the top k* tokens (greedy property,
    Theorems 3.1 and 3.2), k* adaptive (the first k whose cost gap is at most lambda,
    k-convexity, Theorem 3.3), capped by ``k_max``, or fixed (``top_k``: generalized top-k), and
    renormalizes them with the alpha map (alpha = 1: standard top-k renormalization; alpha = 2:
    the same mass added to every kept token; alpha = inf: water-filling).

    Args:
        alpha: exponent of phi_alpha (a number, or "inf" / "-inf" with ``top_k``); ranges as in
            `bregman_vllm.params`.
        lam: lambda >= 0, the price per kept token (ignored with ``top_k``).
        mode: "primal" or "dual".
        top_k: fixed support size instead of the adaptive k*.
        k_max: cap on k*.

    Raises:
        BregmanParamError: at construction, for any value outside its range (same messages as
            `bregman_decode`).

    Example:
        >>> import torch
        >>> processor = BregmanLogitsProcessor(alpha=2.0, lam=0.01)
        >>> scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
        >>> [round(v, 4) for v in processor(None, scores).softmax(-1)[0].tolist()]
        [0.5167, 0.3167, 0.1667, 0.0]
    """

    def __init__(self, *, alpha: Any, lam: Any, mode: str = "primal", top_k: Any = None,
                 k_max: Any = None) -> None:
        self.kwargs = {"alpha": _scalar(alpha, "alpha"), "lam": _scalar(lam, "lam"),
                       "mode": mode, "top_k": _scalar(top_k, "top_k"),
                       "k_max": _scalar(k_max, "k_max")}
        # Validate now, with the core's own checks and messages, on a dummy two-token row.
        bregman_decode_logits(torch.zeros(1, 2), **self.kwargs)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items() if v is not None)
        return f"{type(self).__name__}({args})"

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.FloatTensor,
                 ) -> torch.FloatTensor:
        """``scores``: [batch, vocab] logits (-inf entries have probability 0). Returns log q,
        same shape and dtype; a row that is all -inf is returned unchanged."""
        if scores.dtype in _HALF:  # the k* search needs more than 8 bits of mantissa
            return bregman_decode_logits(scores.float(), **self.kwargs).to(scores.dtype)
        return bregman_decode_logits(scores, **self.kwargs)


def paper_order(temperature: float = 1.0, **bregman: Any) -> LogitsProcessorList:
    """The paper's order as a processor list: temperature first, then Bregman decoding of
    p = softmax(logits / T). Pass it as ``logits_processor=`` and leave ``generate``'s own
    ``temperature`` at 1 (and ``top_k=0``)."""
    processors: list[LogitsProcessor] = []
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    processors.append(BregmanLogitsProcessor(**bregman))
    return LogitsProcessorList(processors)
