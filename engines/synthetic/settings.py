"""Settings of the synthetic engine, checked without loading anything.

The job spec validates `engine.extra` against these for `engine.kind: synthetic` (so a typo or
a negative rate fails when the job file is read, not when the actor starts), and the engine
builds them from its keyword settings.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from engines.settings import default

# Defaults sized like one H200 running a small model: tens of thousands of output tokens/s.
DEFAULT_TOKENS_PER_S = 20000.0
DEFAULT_MAX_BATCH_SIZE = default("synthetic", "max_batch_size")


@dataclass(frozen=True)
class SyntheticSettings:
    """What the synthetic engine simulates. Invalid values raise ValueError naming the field.

    tokens_per_s: output tokens per second of the whole engine, over all requests in flight.
        One step gives each running request one token and lasts at least
        (requests in the step) / tokens_per_s, so a full batch is rate-bound, a small one
        cadence-bound (step_interval_ms).
    ttft_ms: mean time from a request's scheduling to its first token (its simulated
        prefill), in milliseconds.
    ttft_jitter: spread of the time to first token as a fraction of ttft_ms: each request
        draws uniformly from ttft_ms * [1 - jitter, 1 + jitter] (0: every request the same).
    step_interval_ms: shortest step, in milliseconds (a GPU step is never free).
    output_tokens: tokens the synthetic model "wants" to say before its end-of-sequence token;
        a request with a smaller max_tokens (or ignore_eos) finishes "length" at max_tokens.
        None: every request runs to its max_tokens and finishes "length".
    stop_fraction: fraction of requests that end early with the end-of-sequence token
        (finish "stop") after a uniformly drawn number of tokens.
    error_fraction: fraction of requests that fail at their first token (finish "error",
        with an error text saying the synthetic engine chose the row to fail).
    max_batch_size: most requests running at once; the rest queue.
    max_model_len: prompt + output tokens a request may hold; None: the model's context.
    seed: with the same seed, a request (same prompt, same sampling) gets the same tokens,
        time to first token, stop and error fate, whatever else runs beside it.
    script: text every request generates instead of random tokens: the model's tokenizer
        encodes it once and each request emits exactly those token ids, then the
        end-of-sequence token (finish "stop"); a smaller max_tokens cuts it (finish
        "length"). Tests of what the pipeline makes of a known output (reasoning splits)
        use it. stop_fraction and output_tokens do not apply. None: random tokens.
    """

    tokens_per_s: float = DEFAULT_TOKENS_PER_S
    ttft_ms: float = 20.0
    ttft_jitter: float = 0.5
    step_interval_ms: float = 5.0
    output_tokens: int | None = None
    stop_fraction: float = 0.0
    error_fraction: float = 0.0
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_model_len: int | None = None
    seed: int = 0
    script: str | None = None

    def __post_init__(self) -> None:
        problems = [
            problem
            for problem in (
                _number(self, "tokens_per_s", low=0.0, low_open=True),
                _number(self, "ttft_ms", low=0.0),
                _number(self, "ttft_jitter", low=0.0, high=1.0),
                _number(self, "step_interval_ms", low=0.0, low_open=True),
                _number(self, "stop_fraction", low=0.0, high=1.0),
                _number(self, "error_fraction", low=0.0, high=1.0),
                _integer(self, "output_tokens", low=1, optional=True),
                _integer(self, "max_batch_size", low=1),
                _integer(self, "max_model_len", low=2, optional=True),
                _integer(self, "seed", low=None),
                _script(self),
            )
            if problem
        ]
        if problems:
            raise ValueError("invalid synthetic engine settings: " + "; ".join(problems))

    @classmethod
    def of(cls, settings: dict[str, Any]) -> SyntheticSettings:
        """Settings from keyword values; an unknown name is a TypeError listing the known."""
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise TypeError(
                f"SyntheticEngine got unknown setting(s) {', '.join(unknown)}; "
                f"accepted: {', '.join(SETTINGS)}"
            )
        return cls(**settings)


SETTINGS = tuple(f.name for f in dataclasses.fields(SyntheticSettings))


def _number(
    s: SyntheticSettings,
    name: str,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> str | None:
    value = getattr(s, name)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if ok:
        return None
    bounds = f"{'>' if low_open else '>='} {low}" if high is None else f"in [{low}, {high}]"
    return f"{name} must be a number {bounds}, got {value!r}"


def _integer(
    s: SyntheticSettings, name: str, low: int | None, optional: bool = False
) -> str | None:
    value = getattr(s, name)
    if optional and value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low):
        return None
    bound = "" if low is None else f" >= {low}"
    null = " or null" if optional else ""
    return f"{name} must be an integer{bound}{null}, got {value!r}"


def _script(s: SyntheticSettings) -> str | None:
    if s.script is None or (isinstance(s.script, str) and s.script):
        return None
    return f"script must be a non-empty text or null, got {s.script!r}"
