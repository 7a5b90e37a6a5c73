"""The `sampling` section: sampling defaults and per-row overrides."""

from __future__ import annotations

import functools
from typing import Any

from pydantic import Field, PrivateAttr, field_validator, model_validator

from engines.api import MAX_LOGPROBS, MAX_SAMPLES, PROCESSING_FIELDS, ResponseFormat
from engines.strict import StrictModel
from pipeline.spec.response_format import parse_response_format, to_json

# The one set of bounds of a request's sampling values, wherever they come from: a job's
# sampling section (below), a row's override column, a Batch API line or a Serve request
# (pipeline.openai.sampling.check, pipeline.openai.models). OpenAI's where it publishes them.
MAX_TEMPERATURE = 2.0
TOP_P_RANGE = (0.0, 1.0)  # (exclusive, inclusive]
LOGPROBS_RANGE = (0, MAX_LOGPROBS)
SAMPLES_RANGE = (1, MAX_SAMPLES)


class SamplingSpec(StrictModel):
    _format: ResponseFormat | None = PrivateAttr(default=None)  # parsed response_format
    max_tokens: int = Field(256, ge=1, description="Tokens to generate at most per row.")
    temperature: float = Field(0.0, ge=0, le=MAX_TEMPERATURE, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass; 1 disables.")
    top_k: int = Field(0, ge=0, description="Keep only the k most likely tokens; 0 disables.")
    seed: int | None = Field(
        None,
        description="Base seed; each row samples with hash(seed, row id), so reruns are "
        "reproducible whatever the batching.",
    )
    stop: list[str] = Field(default_factory=list, description="Stop strings (cut from the text).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop token ids.")
    ignore_eos: bool = Field(False, description="Generate past end-of-sequence (benchmarks).")
    response_format: dict[str, Any] | None = Field(
        None,
        description="Constrain every row's text while it is generated: "
        "{type: json_schema, schema: {...}} (or OpenAI's {type: json_schema, json_schema: "
        "{name, schema}}), {type: json_object}, {type: regex, regex: ...} or {type: choice, "
        "choices: [...]}. Output rows get `parsed`: whether the text is whole and valid. "
        "Null: free text.",
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="Per output token, its logprob and this many most likely alternatives "
        "(0: the chosen token's only), from the model's own distribution (before temperature "
        "and masks), in a nested `logprobs` output column. Null: none.",
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="Scoring: for every prompt token after the first, its logprob given the "
        "tokens before it and this many most likely alternatives, in a nested "
        "`prompt_logprobs` output column (its first entry null). Such rows compute their "
        "whole prompt (the prefix cache keeps no logits). Null: none.",
    )
    frequency_penalty: float = Field(
        0.0,
        ge=-2,
        le=2,
        description="OpenAI's: subtract this x the times a token was already generated from "
        "its logit (generated tokens only, not the prompt). 0 disables.",
    )
    presence_penalty: float = Field(
        0.0,
        ge=-2,
        le=2,
        description="OpenAI's: subtract this from the logit of every token already generated. "
        "0 disables.",
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0,
        description="Hugging Face's / vLLM's: a token seen in the prompt or the output has its "
        "logit divided by this when positive, multiplied when negative (> 1 discourages "
        "repeats). 1 disables.",
    )
    min_p: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Drop tokens whose probability (after temperature) is below min_p x the "
        "most likely token's, before top_k / top_p. 0 disables.",
    )
    min_tokens: int = Field(
        0,
        ge=0,
        description="EOS and stop_token_ids cannot end a row (and stop strings do not match) "
        "before this many output tokens.",
    )
    logit_bias: dict[int, float] = Field(
        default_factory=dict,
        description="Token id -> bias in [-100, 100] added to its logit (OpenAI's logit_bias); "
        "-100 all but bans a token, 100 all but forces it.",
    )
    bad_words: list[str] = Field(
        default_factory=list,
        description="Words the output must not contain: each is tokenized as given and with a "
        "leading space, and its last token is banned wherever the output ends with the tokens "
        "before it (vLLM's rule).",
    )
    n: int = Field(
        1,
        ge=1,
        le=128,
        description="Samples per row (OpenAI's n), each with its own seed stream (the row's "
        "seed + i). The prompt is computed once and its KV shared by the samples (reference "
        "engine). With n > 1 possible, the output gets a `samples` list column (index, text, "
        "finish_reason, completion_tokens, parsed, logprobs, completion_token_ids per sample); "
        "the row's text, finish_reason, parsed and logprobs are sample 0's, and its "
        "completion_tokens, gpu_seconds and cost cover all samples. A row is an error row "
        "when any sample fails.",
    )
    overrides: dict[str, str] = Field(
        default_factory=dict,
        description="Per-row overrides: sampling field -> input column, e.g. "
        "{max_tokens: max_tokens_col}. A null cell keeps the default. response_format's "
        "column holds a format as JSON text or an object (a row may carry its own schema); "
        "stop (a string or a list), stop_token_ids, logit_bias ({token id: bias}) and "
        "bad_words columns hold lists / objects, or them as JSON text; reasoning_effort "
        "(low | medium | high) replaces prompt.reasoning_effort for the row. Fields: "
        "max_tokens, "
        "temperature, top_p, top_k, seed, response_format, logprobs, n, stop, stop_token_ids, "
        "frequency_penalty, presence_penalty, repetition_penalty, min_p, min_tokens, "
        "logit_bias, bad_words, reasoning_effort.",
    )

    @functools.cached_property
    def format_text(self) -> str | None:
        """`response_format` as a row's column holds it (canonical JSON text), made once per
        spec: every row of a job gets it, and a schema is not small."""
        return to_json(self._format)

    @property
    def parsed_format(self) -> ResponseFormat | None:
        """`response_format` as the engine takes it, parsed once, when the spec was read."""
        return self._format

    @model_validator(mode="after")
    def _readable_format(self) -> SamplingSpec:
        # FormatError is a ValueError naming sampling.response_format; pydantic reports it.
        self._format = parse_response_format(self.response_format, "sampling.response_format")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[int, float]) -> dict[int, float]:
        bad = {t: b for t, b in value.items() if t < 0 or not -100 <= b <= 100}
        if bad:
            raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100]: {bad}")
        return value

    @field_validator("bad_words")
    @classmethod
    def _words(cls, value: list[str]) -> list[str]:
        if any(not w.strip() for w in value):
            raise ValueError("bad_words must be non-blank strings")
        return value

    @field_validator("overrides")
    @classmethod
    def _known_override_fields(cls, value: dict[str, str]) -> dict[str, str]:
        allowed = {
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "response_format",
            "logprobs",
            "n",
            "reasoning_effort",
            "tools",
            "tool_choice",
            # The parameters Serve and openai_batch lines share (pipeline.openai.params).
            "stop",
            "stop_token_ids",
            *PROCESSING_FIELDS,
        }
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise ValueError(
                f"unknown sampling.overrides field(s) {unknown}; allowed: {sorted(allowed)}"
            )
        return value
