"""One sampling resolver for every path a request takes: a Serve request, a Batch API line, a
batch row (its override columns), a Ray Data processor row.

    the request's own values ─┐   (None: the request did not say)
    the configured defaults  ─┼──► resolve() ──► engines.api.SamplingParams
    OpenAI's defaults        ─┘   (one precedence, one set of bounds)

The configured defaults are a job's sampling section (`configured(spec.sampling)`) or a
served model's; OpenAI's (OPENAI_DEFAULTS) apply where neither says. Every value passes the
same bounds (`check`: pipeline.spec.sampling's constants, which the job spec's and Serve's
request models use too), and a problem raises SamplingError naming the field, which each path
turns into its own error shape (Serve: 400 with `param`; batch: an error row naming the column
or body field).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from engines.api import PROCESSING_FIELDS, SamplingParams
from pipeline.spec.sampling import (
    LOGPROBS_RANGE,
    MAX_TEMPERATURE,
    SAMPLES_RANGE,
    TOP_P_RANGE,
    SamplingSpec,
)

# What a request that says nothing gets where nothing is configured: OpenAI's defaults (and
# the neutral values of the extensions).
OPENAI_DEFAULTS: dict[str, Any] = {
    field.name: field.default
    for field in dataclasses.fields(SamplingParams)
    if field.name != "max_tokens"  # no default: the caller's (a cap, a job's) always
}
FIELDS = tuple(field.name for field in dataclasses.fields(SamplingParams))
_INT64 = (-(2**63), 2**63)


class SamplingError(ValueError):
    """A sampling value that cannot be used: `field` names it, str() says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check(field: str, value: Any) -> str | None:
    """None if `value` is within the bounds of the sampling field, else what is wrong with it
    (the one set of bounds; the engine's own SamplingParams checks the rest)."""
    if field in ("max_tokens", "top_k", "seed", "logprobs", "n") and (
        isinstance(value, bool) or not isinstance(value, int)
    ):
        return "must be an integer"
    if field == "max_tokens" and value < 1:
        return "must be >= 1"
    if field == "top_k" and value < 0:
        return "must be >= 0 (0 disables)"
    if field == "logprobs" and not LOGPROBS_RANGE[0] <= value <= LOGPROBS_RANGE[1]:
        return f"must be in [{LOGPROBS_RANGE[0]}, {LOGPROBS_RANGE[1]}]"
    if field == "n" and not SAMPLES_RANGE[0] <= value <= SAMPLES_RANGE[1]:
        return f"must be in [{SAMPLES_RANGE[0]}, {SAMPLES_RANGE[1]}]"
    if field == "seed" and not _INT64[0] <= value < _INT64[1]:
        return "must fit in int64"
    if field in ("temperature", "top_p"):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            return "must be a finite number"
        if field == "temperature" and value < 0:
            return "must be >= 0"
        if field == "temperature" and value > MAX_TEMPERATURE:
            return f"must be <= {MAX_TEMPERATURE:g}"
        if field == "top_p" and not TOP_P_RANGE[0] < value <= TOP_P_RANGE[1]:
            return f"must be in ({TOP_P_RANGE[0]:g}, {TOP_P_RANGE[1]:g}]"
    return None


def configured(spec: SamplingSpec) -> dict[str, Any]:
    """A job's sampling section as configured defaults (its per-row seed is the caller's:
    pipeline.batch derives it from the row's id)."""
    values: dict[str, Any] = {
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "top_p": spec.top_p,
        "top_k": spec.top_k,
        "stop": tuple(spec.stop),
        "stop_token_ids": tuple(spec.stop_token_ids),
        "ignore_eos": spec.ignore_eos,
        "logprobs": spec.logprobs,
        "prompt_logprobs": spec.prompt_logprobs,
    }
    values.update({name: getattr(spec, name) for name in PROCESSING_FIELDS})
    return values


def resolve(
    request: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
) -> SamplingParams:
    """SamplingParams from the request's values over `defaults` over OPENAI_DEFAULTS (a value
    of None is one not given). Raises SamplingError naming the field a value breaks."""
    defaults = defaults or {}
    values: dict[str, Any] = {}
    for field in FIELDS:
        value = request.get(field)
        if value is None:
            value = defaults.get(field)
        if value is None:
            value = OPENAI_DEFAULTS.get(field)
        if value is None and field == "max_tokens":
            raise SamplingError(field, "max_tokens is neither in the request nor configured")
        values[field] = value
    try:
        params = SamplingParams(**values)
    except ValueError as exc:
        # The engine's own checks (ranges, penalties, bias values): name the field.
        text = str(exc)
        field = next((f for f in FIELDS if f"{f} " in text), "sampling")
        raise SamplingError(field, text) from None
    # The bounds the API adds to the engine's (temperature at most OpenAI's 2, a seed in int64).
    for field in ("temperature", "seed"):
        value = values[field]
        problem = None if value is None else check(field, value)
        if problem is not None:
            raise SamplingError(field, f"invalid sampling params: {field} {problem}, got {value!r}")
    return params
