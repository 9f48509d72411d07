"""vLLM adapter: the logits processor registered as a ``vllm.logits_processors`` plugin."""

from .amx import request_amx_permission

# vLLM imports this package in each worker process before the model runs (`amx`).
request_amx_permission()

from .processor import BregmanLogitsProcessor, request_params  # noqa: E402

__all__ = ["BregmanLogitsProcessor", "request_params"]
