"""One table of the OpenAI (and vLLM-extension) request parameters that Serve and batch input
lines share, so a parameter means the same in a Serve request and in a batch line:

- SAMPLING: supported; the value is read into a SamplingParams field (null means absent). A
  value the reader refuses is an error naming the parameter (Serve: 400 invalid_value; batch:
  an error row).
- TEMPLATE: supported; the value goes to the chat template (reasoning_effort).
- REFUSED: not implemented; accepted only at a value that means "off" (clients often send
  defaults explicitly), any other value is refused (Serve: 400 unsupported_parameter; batch:
  an error row), never silently ignored.

Parameters each side models itself (messages, prompt, max_tokens, temperature, top_p, seed,
n, logprobs, response_format; Serve's stream, echo, stop and stop_token_ids) are not here.
Batch lines read stop and stop_token_ids from this table, with the rules Serve's request model
applies to them.

The readers check types and shape; ranges are SamplingParams' (engines/api.py), whose
ValueError names the field in both paths.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class ParamError(ValueError):
    """A parameter's value cannot be used: `name` is the parameter, str() the message."""

    def __init__(self, name: str, message: str, unsupported: bool = False) -> None:
        super().__init__(message)
        self.name = name
        self.unsupported = unsupported  # True: not implemented; False: an invalid value


@dataclass(frozen=True)
class Sampling:
    """A supported parameter: `read` turns the wire value into SamplingParams' `field`."""

    field: str
    read: Callable[[str, Any], Any]


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ParamError(name, f"'{name}' must be a number, got {_show(value)}")
    return float(value)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(name, f"'{name}' must be an integer, got {_show(value)}")
    return value


def _logit_bias(name: str, value: Any) -> dict[int, float]:
    """OpenAI sends {"token id as text": bias}; JSON keys are always text."""
    if not isinstance(value, dict):
        raise ParamError(name, f"'{name}' must map token ids to biases, got {_show(value)}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ParamError(name, f"'{name}' keys must be token ids, got {_show(key)}") from None
        out[token] = _number(name, bias)
    return out


def _strings(limit: int | None) -> Callable[[str, Any], tuple[str, ...]]:
    def read(name: str, value: Any) -> tuple[str, ...]:
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or any(not isinstance(v, str) or not v for v in values):
            raise ParamError(
                name, f"'{name}' must be a string or a list of strings, got {_show(value)}"
            )
        if limit is not None and len(values) > limit:
            raise ParamError(name, f"'{name}' takes up to {limit} non-empty strings")
        return tuple(values)

    return read


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or any(
        isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value
    ):
        raise ParamError(name, f"'{name}' must be a list of token ids >= 0, got {_show(value)}")
    return tuple(value)


def _show(value: Any) -> str:
    import json

    try:
        return json.dumps(value)[:80]
    except (TypeError, ValueError):
        return repr(value)[:80]


SAMPLING: dict[str, Sampling] = {
    "frequency_penalty": Sampling("frequency_penalty", _number),
    "presence_penalty": Sampling("presence_penalty", _number),
    "repetition_penalty": Sampling("repetition_penalty", _number),
    "min_p": Sampling("min_p", _number),
    "min_tokens": Sampling("min_tokens", _integer),
    "logit_bias": Sampling("logit_bias", _logit_bias),
    "bad_words": Sampling("bad_words", _strings(None)),
}
# Read from this table by batch lines only (Serve's request model has them; same rules).
BATCH_SAMPLING: dict[str, Sampling] = {
    **SAMPLING,
    "stop": Sampling("stop", _strings(4)),
    "stop_token_ids": Sampling("stop_token_ids", _token_ids),
}

# Supported, but for the prompt rather than the sampler: each side passes the value to the chat
# template (prompt.reasoning_effort; a batch line's body.reasoning_effort, a Serve chat request's
# field). name -> what it does.
TEMPLATE: dict[str, str] = {
    "reasoning_effort": "low | medium | high: the chat template's reasoning_effort for this "
    "request, over the model's prompt.reasoning_effort",
}

# name -> the values that mean "off" (accepted, and dropped).
REFUSED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    # vLLM's decoding extras the engines do not implement.
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "include_stop_str_in_output": (None, False),
    "prompt_logprobs": (None, 0),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "documents": (None,),
}


def check_refused(body: Mapping[str, Any]) -> None:
    """Raise ParamError(unsupported=True) for the first REFUSED parameter not at "off"."""
    for name, neutral in REFUSED.items():
        value = body.get(name)
        if name in body and not any(type(value) is type(v) and value == v for v in neutral):
            raise ParamError(
                name,
                f"'{name}' is not supported by this server (got {_show(value)}); remove it or "
                "send its default",
                unsupported=True,
            )


def sampling_values(
    body: Mapping[str, Any], table: Mapping[str, Sampling] = SAMPLING
) -> dict[str, Any]:
    """SamplingParams keyword values of the table's parameters present in `body` (null:
    absent). Raises ParamError for a value of the wrong type or shape."""
    values: dict[str, Any] = {}
    for name, param in table.items():
        value = body.get(name)
        if value is not None:
            values[param.field] = param.read(name, value)
    return values
