"""The shared OpenAI parameter table (pipeline/openai/params.py): walked entry by entry, each
parameter gets the same treatment in a Serve request and in an openai_batch line: the same
SamplingParams value when supported, the same refusal when its value is invalid, and, for the
parameters not implemented, acceptance at "off" and refusal otherwise."""

from __future__ import annotations

from typing import Any

import pytest

from engines.api import SamplingParams
from pipeline.batch.columns import BODY_SAMPLING, ERROR
from pipeline.batch.stages.read.openai_batch import parse_batch_request
from pipeline.batch.stages.rows import row_sampling
from pipeline.openai import params
from pipeline.openai.errors import ApiError
from pipeline.openai.models import CHAT_TOOL_FIELDS
from pipeline.serve.protocol.requests import parse_request, to_engine_request
from pipeline.spec import SamplingSpec
from tests.unit.test_serve_protocol import _FakeTokenizer, _info, _served

MESSAGES = [{"role": "user", "content": "hi"}]

# parameter -> (a valid wire value, the SamplingParams value it becomes, an invalid value)
CASES: dict[str, tuple[Any, Any, Any]] = {
    "frequency_penalty": (0.5, 0.5, 2.5),
    "presence_penalty": (-1, -1.0, "-1"),
    "repetition_penalty": (1.3, 1.3, 0),
    "min_p": (0.2, 0.2, 1.5),
    "min_tokens": (3, 3, 2.5),
    "logit_bias": ({"5": 10, "7": -100}, ((5, 10.0), (7, -100.0)), {"5": 101}),
    "bad_words": (["foo", "bar baz"], ("foo", "bar baz"), [""]),
    "stop": ("END", ("END",), ["a", "b", "c", "d", "e"]),
    "stop_token_ids": ([5, 9], (5, 9), [-1]),
}


def _serve(extra: dict[str, Any]) -> SamplingParams:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 8, **extra}
    prepared = to_engine_request(
        parse_request(body, "chat"),
        "chat",
        _served(default_max_tokens=50),
        _FakeTokenizer(),
        _info(1000),
    )
    return prepared.engine_request.sampling


def _batch(extra: dict[str, Any]) -> tuple[SamplingParams | None, str | None]:
    line = {
        "custom_id": "c1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": MESSAGES, "max_tokens": 8, **extra},
    }
    parsed = parse_batch_request(line)
    if parsed[ERROR]:
        return None, parsed[ERROR]
    row = {"id": "c1", **parsed}
    return row_sampling(row, SamplingSpec()), None


def test_every_supported_parameter_has_a_case() -> None:
    assert set(CASES) == set(params.BATCH_SAMPLING)
    assert set(params.SAMPLING) <= set(params.BATCH_SAMPLING)


@pytest.mark.parametrize("name", list(CASES))
def test_supported_parameters_become_the_same_sampling_value(name: str) -> None:
    wire, expected, _ = CASES[name]
    field = params.BATCH_SAMPLING[name].field
    served = _serve({name: wire})
    batched, error = _batch({name: wire})
    assert error is None
    assert getattr(served, field) == getattr(batched, field) == expected
    # null is absent in both: the default
    assert getattr(_serve({name: None}), field) == getattr(_batch({name: None})[0], field)


@pytest.mark.parametrize("name", list(CASES))
def test_invalid_values_are_refused_by_both_naming_the_parameter(name: str) -> None:
    _, _, bad = CASES[name]
    with pytest.raises(ApiError) as caught:
        _serve({name: bad})
    assert caught.value.status == 400 and name in str(caught.value)
    if name in params.SAMPLING:  # read by the table: the error names it as its param
        assert caught.value.body()["error"]["param"] == name
    batched, error = _batch({name: bad})
    assert batched is None and name in error


@pytest.mark.parametrize("name", list(params.REFUSED))
def test_unimplemented_parameters_pass_only_when_off(name: str) -> None:
    for neutral in params.REFUSED[name]:
        _serve({name: neutral})
        assert _batch({name: neutral})[1] is None
    with pytest.raises(ApiError) as caught:
        _serve({name: {"on": True}})
    # Serve's chat reads tools and tool_choice (pipeline.openai.tools): a bad value is
    # invalid there; batch lines refuse them until they run them.
    code = "invalid_value" if name in CHAT_TOOL_FIELDS else "unsupported_parameter"
    assert caught.value.body()["error"]["code"] == code
    assert caught.value.body()["error"]["param"] == name
    batched, error = _batch({name: {"on": True}})
    assert batched is None and name in error


def test_a_batch_line_without_shared_parameters_carries_none() -> None:
    line = {
        "custom_id": "c",
        "url": "/v1/completions",
        "body": {"model": "m", "prompt": "x"},
    }
    assert parse_batch_request(line)[BODY_SAMPLING] is None


def test_batch_line_values_replace_the_jobs() -> None:
    spec = SamplingSpec(frequency_penalty=1.0, stop=["job"], logit_bias={1: 2.0})
    parsed = parse_batch_request(
        {
            "custom_id": "c",
            "url": "/v1/completions",
            "body": {"model": "m", "prompt": "x", "stop": ["row"], "presence_penalty": 0.5},
        }
    )
    sampling = row_sampling({"id": "c", **parsed}, spec)
    assert sampling.stop == ("row",)
    assert (sampling.frequency_penalty, sampling.presence_penalty) == (1.0, 0.5)
    assert sampling.logit_bias == ((1, 2.0),)
