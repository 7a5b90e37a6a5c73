"""STAND-IN for NVIDIA TensorRT-LLM — not the real package. For CPU tests only.

The real `tensorrt_llm` cannot be imported on machines without CUDA and MPI, so the adapter
(engines/trtllm.py) is tested against this small package, written to the signatures of the
TensorRT-LLM 1.2 LLM API (`LLM`, `SamplingParams`, `llmapi` configs, `RequestOutput` with
`CompletionOutput.request_perf_metrics`). It records the arguments it is given (`LLM.instances`)
and mimics the behaviours the adapter relies on: unknown constructor arguments raise
ValueError, TensorRT-backend-only arguments (quant_config, build_config, ...) raise on the
PyTorch `LLM`, prompts longer than max_num_tokens raise without chunked prefill, results carry
timedelta perf metrics on the monotonic clock. Tests put `tests/standins` on sys.path
themselves; nothing else imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tensorrt_llm._core import (
    PYTORCH_ONLY_ARGS,
    TENSORRT_ONLY_ARGS,
    CompletionOutput,
    LlmCore,
    RequestOutput,
)

__version__ = "1.2.0+standin"
IS_STANDIN = True


@dataclass
class SamplingParams:
    """1.2 fields the adapter uses (defaults as in the real class: max_tokens=32)."""

    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    top_p: float | None = None
    temperature: float | None = None
    seed: int | None = None
    min_tokens: int | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    return_perf_metrics: bool = False

    def __post_init__(self) -> None:
        if self.top_k is not None and self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")


class LLM(LlmCore):
    """The PyTorch-backend LLM (the default `tensorrt_llm.LLM` in 1.x)."""

    backend = "pytorch"
    extra_args: dict[str, Any] = PYTORCH_ONLY_ARGS
    rejected_args: dict[str, Any] = TENSORRT_ONLY_ARGS


__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
