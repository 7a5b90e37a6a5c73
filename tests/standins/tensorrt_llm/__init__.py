"""STAND-IN for NVIDIA TensorRT-LLM — not the real package. For CPU tests only.

The real `tensorrt_llm` cannot be imported on machines without CUDA and MPI, so the adapter
(engines/trtllm.py) is tested against this small package, written to the signatures of the
TensorRT-LLM 1.2 LLM API (`LLM`, `SamplingParams`, `llmapi` configs, `RequestOutput` with
`CompletionOutput.request_perf_metrics`). It records the arguments it is given (`LLM.instances`)
and mimics the behaviours the adapter relies on: unknown constructor arguments raise
ValueError, TensorRT-backend-only arguments (quant_config, build_config, ...) raise on the
PyTorch `LLM`, prompts longer than max_num_tokens raise without chunked prefill, results carry
timedelta perf metrics on the monotonic clock (zero for time points never reached). It also
reproduces what the real 1.2 sources do that the adapter must correct for (details in
_core.py): stop words stripped from token_ids and stop strings from the text unless
include_stop_str_in_output, the end_id token dropped by the TensorRT backend, greedy decoding
for top_k/top_p None on the C++ samplers, per-request seeds ignored by the PyTorch backend,
RequestError for a failed request, and a quantizing build that refuses to download its
calibration set. Guided decoding (GuidedDecodingParams, with guided_decoding_backend
"xgrammar" on the LLM) is enforced with xgrammar over the checkpoint's own tokenizer, and
logprobs come back in the real types (executor.result.Logprob per position); see _core.py.
Tests put `tests/standins` on sys.path themselves; nothing else imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tensorrt_llm._core import (
    PYTORCH_ONLY_ARGS,
    TENSORRT_ONLY_ARGS,
    CompletionOutput,
    LlmCore,
    RequestOutput,
)
from tensorrt_llm.sampling_params import GuidedDecodingParams

__version__ = "1.2.0+standin"
IS_STANDIN = True


@dataclass
class SamplingParams:
    """1.2 fields the adapter uses or may (defaults as in the real class: max_tokens=32).

    Behaviours copied from the real class: None means "the runtime default" (top_k 0, top_p 0,
    temperature 1), `_setup` fills end_id from the tokenizer and tokenizes stop strings only
    when end_id was left None, and stop reasons pair stop_token_ids first, then stop strings.
    """

    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    bad: str | list[str] | None = None
    bad_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    embedding_bias: Any = None  # torch.Tensor [vocab_size] float32
    # A LogitsProcessor (req_id, logits, token_ids, stream_ptr, client_id) or, on the PyTorch
    # backend only, a list of them applied in order.
    logits_processor: Any = None
    apply_batched_logits_processor: bool = False
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    top_p: float | None = None
    temperature: float | None = None
    seed: int | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_p: float | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    guided_decoding: GuidedDecodingParams | None = None
    ignore_eos: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    return_perf_metrics: bool = False
    _stop_word_ids: list[list[int]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.pad_id is None:
            self.pad_id = self.end_id
        if self.top_p is not None and not 0 <= self.top_p <= 1:
            raise ValueError(f"require 0 <= top_p <= 1, got top_p={self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"require top_k >= 0, got top_k={self.top_k}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"require temperature >= 0, got temperature={self.temperature}")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.guided_decoding is not None:
            self.guided_decoding._validate()
        # As the real _validate: logprobs=True means 1, and 0 stays 0 (falsy: no logprobs).
        self.logprobs = self.logprobs and int(self.logprobs)
        self.prompt_logprobs = self.prompt_logprobs and int(self.prompt_logprobs)

    @staticmethod
    def params_imply_greedy_decoding(
        *, temperature: float | None, top_p: float | None, top_k: int | None
    ) -> bool:
        """The PyTorch backend's rule (sampling_params.py, 1.2)."""
        return (
            (temperature is None and top_p is None and top_k is None)
            or top_k == 1
            or top_p == 0.0
            or temperature == 0
        )

    def _setup(self, tokenizer: Any) -> SamplingParams:
        if self.end_id is None:
            self.end_id = tokenizer.eos_token_id
            self.pad_id = self.end_id
        if self.stop is not None:
            strs = [self.stop] if isinstance(self.stop, str) else self.stop
            self._stop_word_ids = [tokenizer.encode(s) for s in strs]
        return self

    def _get_stop_reasons_and_words(self) -> list[tuple[int | str, list[int]]]:
        reasons: list[int | str] = list(self.stop_token_ids or [])
        words = [[t] for t in self.stop_token_ids or []]
        if self.stop is not None:
            if self._stop_word_ids is None:
                raise RuntimeError(
                    f"SamplingParams.stop ({self.stop}) is not processed by tokenizer, please "
                    "call the setup method."
                )
            reasons += [self.stop] if isinstance(self.stop, str) else list(self.stop)
            words += self._stop_word_ids
        return list(zip(reasons, words, strict=True))


class LLM(LlmCore):
    """The PyTorch-backend LLM (the default `tensorrt_llm.LLM` in 1.x)."""

    backend = "pytorch"
    extra_args: dict[str, Any] = PYTORCH_ONLY_ARGS
    rejected_args: dict[str, Any] = TENSORRT_ONLY_ARGS


__all__ = [
    "LLM",
    "CompletionOutput",
    "GuidedDecodingParams",
    "RequestOutput",
    "SamplingParams",
]
