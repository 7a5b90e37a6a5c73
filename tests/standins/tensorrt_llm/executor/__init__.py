"""Stand-in for `tensorrt_llm.executor` (1.2): only what the adapter imports."""

from tensorrt_llm.executor.request import LoRARequest
from tensorrt_llm.executor.utils import RequestError

__all__ = ["LoRARequest", "RequestError"]
