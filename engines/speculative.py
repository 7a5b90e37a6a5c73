"""Speculative decoding settings shared by every engine kind (plain Python, no torch).

A job's `engine.speculative` section arrives here as a dict (pipeline.engine_setup dumps the
pydantic model so engines never import the pipeline) and becomes a `SpeculativeConfig`. Which
kind supports which method is decided here too, so `tokenmill validate` and the engines give
the same answer.

Methods:
- ngram (prompt lookup): the last n tokens of a request (n from prompt_lookup_max down to
  prompt_lookup_min) are looked up in its own prompt + output; the tokens that followed the
  match are proposed. No second model; pays off when the output copies spans of the input.
- draft: a small model with the same tokenizer proposes num_tokens tokens autoregressively;
  sampled rows are verified by rejection sampling against the draft's own distribution.
- eagle3: an EAGLE-3 head (trained on the target's hidden states) proposes them.
- mtp: the model's own multi-token-prediction layers (DeepSeek-V3 style checkpoints).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from engines.api import EngineError

Method = Literal["ngram", "draft", "eagle3", "mtp"]
METHODS: tuple[str, ...] = ("ngram", "draft", "eagle3", "mtp")

# What each engine kind can run. reference: prompt lookup and a draft model (its own KV pool,
# engines/reference/speculative/draft.py); vllm 0.32: ngram and draft_model through its
# speculative_config; trtllm 1.2: the four decoding configs of its LLM API.
SUPPORTED: dict[str, tuple[str, ...]] = {
    "reference": ("ngram", "draft"),
    "vllm": ("ngram", "draft"),
    "trtllm": ("ngram", "draft", "eagle3", "mtp"),
}

DEFAULT_NUM_TOKENS = 4
DEFAULT_PROMPT_LOOKUP_MIN = 2
DEFAULT_PROMPT_LOOKUP_MAX = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """engine.speculative with the defaults filled in (see pipeline.spec.SpeculativeSpec)."""

    method: str
    num_tokens: int = DEFAULT_NUM_TOKENS  # tokens proposed per request per step
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN  # ngram: shortest match
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX  # ngram: longest match (tried first)
    model: str | None = None  # draft: draft model directory; eagle3: the EAGLE-3 head
    num_layers: int | None = None  # mtp: MTP layers used (null: the checkpoint's)
    # Speculate only in steps with at most this many running requests; None: engine default.
    disable_above_batch_size: int | None = None


def problems(kind: str, settings: Mapping[str, Any]) -> list[str]:
    """What is wrong with `settings` (engine.speculative as a dict) on engine `kind`; empty when
    it can run. Shared by the job-spec validation and the engines themselves."""
    out: list[str] = []
    method = settings.get("method")
    if method not in METHODS:
        return [f"method must be one of {', '.join(METHODS)}, got {method!r}"]
    supported = SUPPORTED.get(kind, ())
    if method not in supported:
        by_kind = "; ".join(f"{k}: {', '.join(v)}" for k, v in SUPPORTED.items())
        out.append(f"method {method} is not supported by engine.kind {kind} (supported: {by_kind})")
    for name in ("num_tokens", "prompt_lookup_min", "prompt_lookup_max", "num_layers"):
        value = settings.get(name)
        if value is not None and (not _is_int(value) or value < 1):
            out.append(f"{name} must be an integer >= 1, got {value!r}")
    limit = settings.get("disable_above_batch_size")
    if limit is not None and (not _is_int(limit) or limit < 0):
        out.append(f"disable_above_batch_size must be an integer >= 0, got {limit!r}")
    if out:
        return out
    lo, hi = settings.get("prompt_lookup_min"), settings.get("prompt_lookup_max")
    if method != "ngram" and (lo is not None or hi is not None):
        out.append("prompt_lookup_min / prompt_lookup_max apply to method ngram only")
    if lo is not None and hi is not None and lo > hi:
        out.append(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
    if kind == "trtllm" and method == "ngram" and lo not in (None, 1):
        # NGramDecodingConfig has max_matching_ngram_size only: it matches down to 1 token.
        out.append("trtllm matches n-grams down to one token: prompt_lookup_min must be 1 or null")
    model = settings.get("model")
    if method in ("draft", "eagle3") and not model:
        what = "the draft model directory" if method == "draft" else "the EAGLE-3 head checkpoint"
        out.append(f"method {method} needs model: {what}")
    if method in ("ngram", "mtp") and model:
        out.append(f"model does not apply to method {method}")
    if method != "mtp" and settings.get("num_layers") is not None:
        out.append("num_layers applies to method mtp only")
    if kind == "vllm" and settings.get("disable_above_batch_size") is not None:
        out.append(
            "vllm 0.32 has no batch-size switch for speculation: leave "
            "disable_above_batch_size null on engine.kind vllm"
        )
    return out


def resolve(kind: str, settings: Mapping[str, Any] | SpeculativeConfig | None):
    """A SpeculativeConfig from engine settings (None: speculation off); EngineError when the
    settings cannot run on `kind`, naming every problem."""
    if settings is None:
        return None
    if isinstance(settings, SpeculativeConfig):
        settings = {f.name: getattr(settings, f.name) for f in fields(SpeculativeConfig)}
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise EngineError(
            f"engine.speculative: unknown setting(s) {', '.join(unknown)}; accepted: "
            f"{', '.join(sorted(known))}"
        )
    found = problems(kind, settings)
    if found:
        raise EngineError("engine.speculative: " + "; ".join(found))
    given = {k: v for k, v in settings.items() if v is not None}
    # One bound given: the other defaults around it (max 1 alone means min 1, not min 2 > 1).
    if "prompt_lookup_max" in given and "prompt_lookup_min" not in given:
        given["prompt_lookup_min"] = min(DEFAULT_PROMPT_LOOKUP_MIN, given["prompt_lookup_max"])
    if "prompt_lookup_min" in given and "prompt_lookup_max" not in given:
        given["prompt_lookup_max"] = max(DEFAULT_PROMPT_LOOKUP_MAX, given["prompt_lookup_min"])
    return SpeculativeConfig(**given)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
