"""The sampling parameters TensorRT-LLM 1.2's PyTorch backend does not apply, applied by a
per-request logits processor with the reference engine's own code, so both kinds agree.

Why a processor rather than SamplingParams' own fields: 1.2's default sampler (TorchSampler)
accepts repetition_penalty, presence_penalty and frequency_penalty and silently ignores them
(NVIDIA/TensorRT-LLM#9442), and the C++ sampler that does apply them counts the prompt into the
presence and frequency penalties, which OpenAI's semantics leave out. A LogitsProcessor
(`SamplingParams.logits_processor`, a list on the PyTorch backend) sees each step's logits row
and the request's tokens (prompt + output) before sampling, which is where vLLM and the
reference engine edit them.

min_p is applied here too, on the raw logits: vLLM drops a token when its probability after
temperature T is below min_p x the top one's, i.e. when its logit is below
top logit + T x ln(min_p), a threshold that needs no softmax and commutes with the sampler's
own temperature, top-k and top-p that follow.

The processor is pickled into TensorRT-LLM's executor process, so it carries plain values and
builds its torch state there, on first use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from engines.api import PROCESSING_FIELDS, SamplingParams


@dataclass
class _Tokens:
    """The shape LogitsProcessing.apply reads of a request
    (engines/reference/sampling/processing.py)."""

    token_ids: list[int]
    num_prompt_tokens: int


@dataclass
class _Request:
    request_id: str


@dataclass
class _Live:
    request: _Request
    sched: _Tokens


@dataclass
class SamplingProcessor:
    """TensorRT-LLM LogitsProcessor for one request: penalties, logit bias, min_tokens, bad
    words (all through engines.reference.sampling.processing) and min_p."""

    params: SamplingParams
    num_prompt_tokens: int
    eos_token_ids: tuple[int, ...]
    bad_words: tuple[tuple[int, ...], ...] = ()
    _processing: Any = field(default=None, repr=False)

    def __call__(
        self,
        req_id: int,
        logits: Any,  # torch.Tensor [..., V]: this request's row(s) of the step, beam 1
        token_ids: list[list[int]],  # per beam: prompt + output so far
        stream_ptr: int | None,
        client_id: int | None,
    ) -> None:
        import torch

        with torch.inference_mode():
            rows = logits.reshape(-1, logits.shape[-1])  # [1, V] (a view when contiguous)
            self._apply(rows[:1], list(token_ids[0]))
            if rows.data_ptr() != logits.data_ptr():
                logits.copy_(rows.view_as(logits))

    def _apply(self, row: Any, tokens: list[int]) -> None:
        # torch: the reference engine's processing runs in TensorRT-LLM's workers only
        from engines.reference.sampling.processing import LogitsProcessing

        params = self.params
        if params.uses_logits_processing:
            if self._processing is None:
                self._processing = LogitsProcessing(row.shape[-1], row.device)
                self._processing.admit(
                    "r",
                    params,
                    tokens[: self.num_prompt_tokens],
                    self.eos_token_ids,
                    self.bad_words,
                )
            live = _Live(_Request("r"), _Tokens(tokens, self.num_prompt_tokens))
            self._processing.apply(row, [0], [live])
        if params.min_p and not params.is_greedy:
            top = row.amax(-1, keepdim=True)
            row.masked_fill_(row < top + params.temperature * math.log(params.min_p), -math.inf)


def needs_processor(params: SamplingParams) -> bool:
    """Whether a request needs a SamplingProcessor (anything past the neutral values)."""
    return params.uses_logits_processing or bool(params.min_p)


def processing_fields(params: SamplingParams) -> list[str]:
    """The names of the request's non-neutral processing fields (for messages)."""
    neutral = SamplingParams()
    return [n for n in PROCESSING_FIELDS if getattr(params, n) != getattr(neutral, n)]
