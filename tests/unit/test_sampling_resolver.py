"""One sampling resolver (pipeline/openai/sampling.py): every OpenAI parameter walked through
the three ways a request reaches an engine, which must give the same SamplingParams:

- Serve: the body parsed by the request models, capped and resolved (to_engine_request);
- a batch row: a jsonl row whose columns are the job's `sampling.overrides` (read, the prompt
  stage's sampling, the engine actor's row_sampling); a value no column can carry
  (ignore_eos) is the job's own setting, as a row cannot change it;
- a Batch API line: the job the Batch API builds for a served model (job_spec_data), the line
  read like Serve reads a body, then the same prompt stage and actor steps.

And the one set of bounds: a value out of range is refused by all three, naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engines.api import SamplingParams
from pipeline.batch.columns import ERROR
from pipeline.batch.stages.prompts import resolve_sampling
from pipeline.batch.stages.read.cells import apply_overrides, override_columns
from pipeline.batch.stages.read.openai_batch import batch_row
from pipeline.batch.stages.rows import row_sampling
from pipeline.openai.errors import ApiError
from pipeline.openai.sampling import OPENAI_DEFAULTS, check, resolve
from pipeline.serve.batch_api.jobs import job_spec_data
from pipeline.serve.protocol.requests import parse_request, to_engine_request
from pipeline.serve.spec import parse_serve_spec
from pipeline.spec import parse_job_spec
from tests.unit.test_serve_protocol import _FakeTokenizer, _info

MESSAGES = [{"role": "user", "content": "hi"}]

# Every OpenAI (and vLLM-extension) body parameter that reaches SamplingParams, with a value
# that is not its default, and the SamplingParams field and value it becomes.
WALK: dict[str, tuple[Any, str, Any]] = {
    "max_tokens": (7, "max_tokens", 7),
    "max_completion_tokens": (9, "max_tokens", 9),
    "temperature": (0.7, "temperature", 0.7),
    "top_p": (0.9, "top_p", 0.9),
    "top_k": (5, "top_k", 5),
    "seed": (1234, "seed", 1234),
    "stop": (["END"], "stop", ("END",)),
    "stop_token_ids": ([5, 9], "stop_token_ids", (5, 9)),
    "ignore_eos": (True, "ignore_eos", True),
    "frequency_penalty": (0.5, "frequency_penalty", 0.5),
    "presence_penalty": (-0.5, "presence_penalty", -0.5),
    "repetition_penalty": (1.2, "repetition_penalty", 1.2),
    "min_p": (0.1, "min_p", 0.1),
    "min_tokens": (2, "min_tokens", 2),
    "logit_bias": ({"5": 10}, "logit_bias", ((5, 10.0),)),
    "bad_words": (["foo"], "bad_words", ("foo",)),
    "response_format": ({"type": "json_object"}, "response_format", "json_object"),
    "top_logprobs": (3, "logprobs", 3),  # with logprobs: true (chat)
}
# The batch row's override column per field (what `sampling.overrides` can name).
ROW_COLUMNS = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_p": "min_p",
    "min_tokens": "min_tokens",
    "logit_bias": "logit_bias",
    "bad_words": "bad_words",
    "response_format": "response_format",
    "logprobs": "logprobs",
}
SERVE_FILE = {
    "models": [
        {
            "name": "m",
            "model": {"path": "/models/m"},
            "limits": {"max_tokens": 100, "default_max_tokens": 50},
            "batch": {"max_tokens": 16},
        }
    ],
    "batch_api": {"uri": "/tmp/batches"},
}


def _body(name: str) -> dict[str, Any]:
    wire = WALK[name][0]
    body: dict[str, Any] = {"model": "m", "messages": MESSAGES, name: wire}
    if name == "top_logprobs":
        body["logprobs"] = True
    if name not in ("max_tokens", "max_completion_tokens"):
        body["max_tokens"] = 8
    return body


def _serve(body: dict[str, Any]) -> SamplingParams:
    served = parse_serve_spec(SERVE_FILE).models[0]
    request = parse_request(body, "chat")
    prepared = to_engine_request(request, "chat", served, _FakeTokenizer(), _info(1000))
    return prepared.engine_request.sampling


def _through_the_pipeline(spec: Any, row: dict[str, Any]) -> SamplingParams:
    """What the prompt stage and the engine actor make of a read row."""
    assert row.get(ERROR) is None, row[ERROR]
    stage, problem = resolve_sampling(row, spec, override_columns(spec))
    assert problem is None, problem
    return row_sampling({**row, **stage}, spec.sampling)


def _batch_api(body: dict[str, Any]) -> SamplingParams:
    spec = parse_serve_spec(SERVE_FILE)
    job = parse_job_spec(
        job_spec_data("batch_x", spec.models[0], spec, "/tmp/in.jsonl", "/tmp/out")
    )
    line = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": body}
    row: dict[str, Any] = {"id": "c1", ERROR: None}
    batch_row(job, line, row, "line 1")
    return _through_the_pipeline(job, row)


def _batch_row(name: str) -> SamplingParams:
    """A jsonl row carrying the value in an override column (the job's sampling section for
    what no column carries), on a job whose defaults are OpenAI's."""
    wire, field, _ = WALK[name]
    column_field = "logprobs" if name == "top_logprobs" else field
    sampling: dict[str, Any] = {"max_tokens": 8, "temperature": 1.0}
    cells: dict[str, Any] = {}
    if column_field in ROW_COLUMNS:
        sampling["overrides"] = {column_field: f"col_{column_field}"}
        cells[f"col_{column_field}"] = wire
    else:
        sampling[field] = wire
    spec = parse_job_spec(
        {
            "name": "walk",
            "input": {"uri": "/tmp/in.jsonl", "format": "jsonl", "prompt_column": "q"},
            "model": {"path": "/models/m"},
            "output": {"uri": "/tmp/out"},
            "sampling": sampling,
        }
    )
    row: dict[str, Any] = {"id": "r1", "prompt": "hi", ERROR: None}
    apply_overrides(spec, row, cells, "row 1")
    return _through_the_pipeline(spec, row)


@pytest.mark.parametrize("name", list(WALK))
def test_every_parameter_resolves_the_same_in_serve_a_batch_row_and_a_batch_api_line(
    name: str,
) -> None:
    _, field, expected = WALK[name]
    served = _serve(_body(name))
    line = _batch_api(_body(name))
    row = _batch_row(name)
    got = getattr(served, field)
    if field == "response_format":
        got = got.kind
        assert line.response_format == served.response_format == row.response_format
    assert got == expected, (name, got)
    assert served == line == row, (name, served, line, row)


def test_what_nobody_says_is_openais_default_in_all_three() -> None:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 8}
    served, line = _serve(body), _batch_api(body)
    assert served == line == resolve({"max_tokens": 8})
    assert served.temperature == OPENAI_DEFAULTS["temperature"] == 1.0


@pytest.mark.parametrize(
    ("name", "value"),
    [("temperature", 2.5), ("top_p", 0.0), ("top_k", -2), ("seed", 2**64), ("max_tokens", 0)],
)
def test_one_set_of_bounds_refuses_the_same_values_everywhere(name: str, value: Any) -> None:
    assert check(name, value) is not None
    with pytest.raises(ApiError) as refused:
        _serve({"model": "m", "messages": MESSAGES, "max_tokens": 8, name: value})
    assert refused.value.status == 400 and name in str(refused.value)
    line = {
        "custom_id": "c1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": MESSAGES, name: value},
    }
    spec = parse_serve_spec(SERVE_FILE)
    job = parse_job_spec(
        job_spec_data("batch_x", spec.models[0], spec, "/tmp/in.jsonl", "/tmp/out")
    )
    row: dict[str, Any] = {"id": "c1", ERROR: None}
    batch_row(job, line, row, "line 1")
    if row[ERROR] is None:  # a value the reader takes: the prompt stage checks its range
        _, problem = resolve_sampling(row, job, override_columns(job))
        assert problem is not None and name in problem
    else:
        assert name in row[ERROR]
    # A job's own sampling section is held to the same bounds.
    if name in ("temperature", "top_p", "top_k", "max_tokens"):
        with pytest.raises(Exception, match=name):
            parse_job_spec(
                {
                    "name": "x",
                    "input": {"uri": "/tmp/in.jsonl", "format": "jsonl", "prompt_column": "q"},
                    "model": {"path": str(Path("/models/m"))},
                    "output": {"uri": "/tmp/out"},
                    "sampling": {name: value},
                }
            )
