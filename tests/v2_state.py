"""vLLM's own Model Runner V2 request state, built on the CPU for tests of the processor's V2
interface (no stand-in: the object Model Runner V2 hands to custom logits processors).

`vllm.v1.worker.gpu.states.RequestState` runs on CPU tensors: only its UVA buffers want
pinned memory, which a CPU machine may not have; vLLM itself falls back to device memory
there, and `is_uva_available` is told so for the construction (as
`tests/test_processor_v2.py`'s V2 sampler test does).
"""

from __future__ import annotations

import torch


def v2_request_state(max_num_reqs: int, vocab_size: int, device: str = "cpu"):
    """`LogitsProcRequestState.from_request_state` of a real `RequestState` of
    ``max_num_reqs`` slots (a model length of 64 tokens: the processor reads no token ids)."""
    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcRequestState
    from vllm.v1.worker.gpu.states import RequestState

    original = buffer_utils.is_uva_available
    buffer_utils.is_uva_available = lambda: False
    try:
        states = RequestState(max_num_reqs=max_num_reqs, max_model_len=64,
                              max_num_batched_tokens=64, num_speculative_steps=0,
                              vocab_size=vocab_size, device=torch.device(device))
    finally:
        buffer_utils.is_uva_available = original
    return LogitsProcRequestState.from_request_state(states)
