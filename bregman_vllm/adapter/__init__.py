"""vLLM adapter: the logits processor registered as a ``vllm.logits_processors`` plugin."""

from .processor import BregmanLogitsProcessor, request_params

__all__ = ["BregmanLogitsProcessor", "request_params"]
