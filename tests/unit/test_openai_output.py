"""OpenAI Batch API output and error lines from output rows
(pipeline.batch.driver.openai_output)."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from pipeline.batch.driver.openai_output import (
    LineContext,
    error_line,
    expected_exports,
    export_names,
    output_line,
    part_lines,
    part_of_export,
)
from pipeline.spec import SpecError, parse_job_spec

PART = "part-000003-00001-01-0000.parquet"
CTX = LineContext(job_key="f" * 64, list_prices=True)
FINISHED = dt.datetime(2026, 5, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


def _row(**extra: object) -> dict:
    row = {
        "id": "req-1",
        "url": "/v1/chat/completions",
        "text": "Hello there",
        "finish_reason": "stop",
        "error": None,
        "prompt_tokens": 12,
        "cached_prompt_tokens": 4,
        "completion_tokens": 3,
        "gpu_seconds": 0.5,
        "cost_usd": 0.001,
        "list_price_usd": 0.0002,
        "model": "tiny",
        "actor_id": "actor-1",
        "finished_at": FINISHED,
    }
    row.update(extra)
    return row


def test_chat_output_line_has_openai_shape_with_usage_and_cost() -> None:
    line = output_line(_row(), CTX, PART, 0)
    assert line["id"].startswith("batch_req_") and line["custom_id"] == "req-1"
    assert line["error"] is None
    response = line["response"]
    assert response["status_code"] == 200
    body = response["body"]
    assert body["object"] == "chat.completion"
    assert body["id"] == "chatcmpl-" + response["request_id"]
    assert body["created"] == int(FINISHED.timestamp())
    assert body["model"] == "tiny"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello there", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    usage = body["usage"]
    assert usage["prompt_tokens"] == 12 and usage["completion_tokens"] == 3
    assert usage["total_tokens"] == 15
    assert usage["prompt_tokens_details"] == {"cached_tokens": 4}
    assert usage["cost_usd"] == 0.001 and usage["list_price_usd"] == 0.0002


def test_completion_output_line_is_a_text_completion() -> None:
    row = _row(url="/v1/completions", finish_reason="length")
    body = output_line(row, LineContext("k", list_prices=False), PART, 1)["response"]["body"]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == "Hello there"
    assert body["choices"][0]["finish_reason"] == "length"
    assert "list_price_usd" not in body["usage"]  # no list prices configured


def test_error_lines_carry_a_code_and_the_message() -> None:
    read_error = _row(
        finish_reason="error", error="in.jsonl line 3: unsupported url", actor_id=None
    )
    line = error_line(read_error, CTX, PART, 2)
    assert line["response"] is None
    assert line["error"] == {
        "code": "invalid_request",
        "message": "in.jsonl line 3: unsupported url",
    }
    engine = error_line(_row(finish_reason="error", error="engine died"), CTX, PART, 2)
    assert engine["error"]["code"] == "server_error"
    duplicate = error_line(
        _row(finish_reason="error", error="duplicate id 'req-1': the same id is on an earlier"),
        CTX,
        PART,
        2,
    )
    assert duplicate["error"]["code"] == "duplicate_custom_id"


def test_part_lines_split_rows_deterministically() -> None:
    rows = [_row(id="a"), _row(id="b", finish_reason="error", error="boom"), _row(id="c")]
    output, errors = part_lines(rows, CTX, PART)
    assert part_lines(rows, CTX, PART) == (output, errors)  # same bytes every time
    ok = [json.loads(x) for x in output.decode().splitlines()]
    failed = [json.loads(x) for x in errors.decode().splitlines()]
    assert [x["custom_id"] for x in ok] == ["a", "c"]
    assert [x["custom_id"] for x in failed] == ["b"]
    ids = [x["id"] for x in ok + failed]
    assert len(set(ids)) == 3  # unique per line
    other_job = part_lines(rows, LineContext("other", True), PART)[0]
    assert json.loads(other_job.splitlines()[0])["id"] != ok[0]["id"]


def test_export_names_round_trip() -> None:
    output, errors = export_names(PART)
    assert output == "openai-output-000003-00001-01-0000.jsonl"
    assert errors == "openai-errors-000003-00001-01-0000.jsonl"
    assert part_of_export(output) == part_of_export(errors) == PART
    assert part_of_export("report.md") is None and part_of_export("openai-output-x.jsonl") is None
    assert expected_exports(5, 0, PART) == [output]
    assert expected_exports(5, 5, PART) == [errors]
    assert expected_exports(5, 2, PART) == [output, errors]


def _spec(input_: dict) -> dict:
    return {
        "name": "j",
        "input": input_,
        "model": {"path": "/m"},
        "output": {"uri": "/tmp/out", "format": "openai_batch"},
    }


def test_output_format_needs_openai_batch_input_with_url() -> None:
    spec = parse_job_spec(
        _spec({"uri": "/in.jsonl", "format": "openai_batch", "passthrough_columns": ["url"]})
    )
    assert spec.output.format == "openai_batch"
    with pytest.raises(SpecError, match="passthrough_columns"):
        parse_job_spec(_spec({"uri": "/in.jsonl", "format": "openai_batch"}))
    with pytest.raises(SpecError, match="needs input"):
        parse_job_spec(_spec({"uri": "/in.jsonl", "format": "jsonl", "prompt_column": "p"}))


def test_embeddings_output_line_is_an_embeddings_body() -> None:
    row = _row(url="/v1/embeddings", text="", completion_tokens=0, embedding=[0.5, -0.25])
    line = output_line(row, CTX, PART, 2)
    body = line["response"]["body"]
    assert line["custom_id"] == "req-1" and line["response"]["status_code"] == 200
    assert body["object"] == "list" and body["model"] == "tiny"
    assert body["data"] == [{"object": "embedding", "index": 0, "embedding": [0.5, -0.25]}]
    assert body["usage"] == {"prompt_tokens": 12, "total_tokens": 12}


def test_embeddings_batch_lines_parse() -> None:
    from pipeline.batch.stages.read.openai_batch import parse_batch_request

    def parse(body: dict) -> dict:
        return parse_batch_request({"custom_id": "e", "url": "/v1/embeddings", "body": body})

    assert parse({"input": "hello"})["prompt"] == "hello"
    assert parse({"input": ["hello"]})["prompt"] == "hello"
    assert "encoding_format" in parse({"input": "x", "encoding_format": "base64"})["error"]
    assert "dimensions" in parse({"input": "x", "dimensions": 8})["error"]
    assert "one non-empty string" in parse({"input": ["a", "b"]})["error"]
