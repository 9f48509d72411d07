"""k* per decoding step: how adaptive a Bregman configuration was (arXiv 2505.19371, App. H.5).

Two sources, both giving the support size k* of every generated position:

``local`` (`LocalKStar`)
    Recomputed exactly, offline: the base model is run with transformers from a local model
    directory over prompt + generated tokens (one forward pass per sample), each generated
    position's distribution ``p = softmax(logits / T)`` is formed with the request's temperature
    (vLLM's processor sees the temperature-scaled logits) and `bregman_decode` solves problem
    (2) of arXiv 2505.19371 for it, batched over positions, returning k*. Works with any
    endpoint serving the same weights. Caveat: the endpoint's numerics (e.g. vLLM on CPU runs
    float32 checkpoints in bfloat16 unless started with ``--dtype float32``) differ slightly
    from the local forward pass, so k* can differ at positions where the cost gap sits right
    at lambda.

``logprobs`` (`Generation.support_sizes`)
    Reported by the engine itself: when vLLM runs with ``--logprobs-mode processed_logprobs``,
    the top logprobs it returns are those of the distribution that was actually sampled, in which
    every token outside the Bregman support has log-probability -inf. Asking for the top-N
    logprobs (N >= k_max, within the server's ``--max-logprobs``) and counting the finite ones
    gives k* exactly (saturating at N when there is no cap).
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Sequence
from typing import Any

from .configs import DecodingConfig

logger = logging.getLogger(__name__)


class LocalKStar:
    """Recompute k* with the base model's weights from a local Hugging Face model directory."""

    def __init__(self, model_dir: str, dtype: str = "float32", threads: int | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype))
        self.model.eval()
        self._prefix: tuple[int, ...] = ()
        self._prefix_cache: Any = None

    def _cached_prefix(self, prefix: Sequence[int]) -> Any:
        """A fresh copy of the key/value cache of ``prefix`` (computed once): GSM8K prompts
        share their ~900-token 8-shot prefix, which then runs once instead of per sample."""
        key = tuple(prefix)
        if key != self._prefix:
            with self.torch.no_grad():
                out = self.model(input_ids=self.torch.tensor([list(key)]), use_cache=True)
            self._prefix, self._prefix_cache = key, out.past_key_values
        return copy.deepcopy(self._prefix_cache)

    def distributions(self, prompt_ids: Sequence[int], generated_ids: Sequence[int],
                      temperature: float, prefix_len: int = 0):
        """``softmax(logits / T)`` (float64) at every generated position: [len(generated), V].

        ``prefix_len``: the first tokens of the prompt are a prefix shared by many calls, whose
        key/value cache is reused.
        """
        torch = self.torch
        if not generated_ids:
            return torch.empty(0, 0, dtype=torch.float64)
        # The last generated token is never an input: its successor was not sampled.
        ids = [*prompt_ids, *generated_ids[:-1]]
        start = len(prompt_ids) - 1  # the position whose logits give the first generated token
        prefix_len = min(prefix_len, start)
        with torch.no_grad():
            if prefix_len > 0:
                cache = self._cached_prefix(ids[:prefix_len])
                logits = self.model(input_ids=torch.tensor([ids[prefix_len:]]),
                                    past_key_values=cache, use_cache=True).logits[0]
                start -= prefix_len
            else:
                logits = self.model(input_ids=torch.tensor([ids])).logits[0]
        steps = logits[start:start + len(generated_ids)].to(torch.float64)
        return torch.softmax(steps / temperature, dim=-1)

    def support_sizes(self, prompt_ids: Sequence[int], generated_ids: Sequence[int],
                      config: DecodingConfig, prefix_len: int = 0) -> list[int]:
        """k* of every generated position under ``config`` (an adaptive Bregman configuration)."""
        from .. import bregman_decode

        if not config.adaptive:
            raise ValueError(f"{config.label} has no adaptive k*")
        if not generated_ids:
            return []
        if not prompt_ids:
            raise ValueError("k* needs a non-empty prompt (the first position has no context)")
        probs = self.distributions(prompt_ids, generated_ids, config.temperature, prefix_len)
        alpha = float(config.alpha) if config.alpha is not None else math.nan
        out = bregman_decode(probs, alpha=alpha, lam=float(config.lam or 0.0),
                             mode=config.mode or "primal", k_max=config.k_max)
        return [int(k) for k in out.k.tolist()]


def common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix shared by every sequence."""
    if not sequences:
        return 0
    first = sequences[0]
    n = min(len(s) for s in sequences)
    for i in range(n):
        if any(s[i] != first[i] for s in sequences):
            return i
    return n


def agreement(a: Sequence[int], b: Sequence[int]) -> float:
    """Fraction of positions where two k* sources agree (over the common length)."""
    n = min(len(a), len(b))
    if n == 0:
        return math.nan
    return sum(1 for x, y in zip(a[:n], b[:n], strict=True) if x == y) / n
