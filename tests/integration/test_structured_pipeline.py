"""Structured output through the whole batch pipeline (local Ray, S3 over HTTP, Parquet).

A random tiny model writes JSON only because the engine masks its logits; the output's
`parsed` column and an independent jsonschema check must agree on every row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from pipeline.batch.driver.run import run_job
from tests.integration.s3_server import S3Server
from tests.integration.test_pipeline import (
    assert_exactly_once,
    make_spec,
    manifest_of,
    read_output,
    s3_jsonl_job,
)
from tests.integration.test_structured_output import XGRAMMAR_0_1

pytestmark = pytest.mark.timeout(600)

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["spam", "ham", "unsure"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
        "words": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "meta": {
            "type": "object",
            "properties": {"lang": {"type": "string", "maxLength": 3}},
            "required": ["lang"],
            "additionalProperties": False,
        },
    },
    "required": ["label", "score", "words", "meta"],
    "additionalProperties": False,
}
LABELS = ["yes", "no", "maybe later"]


def test_thousand_rows_with_a_schema_and_per_row_formats(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path
) -> None:
    lines: list[dict[str, Any]] = []
    for i in range(1000):
        line: dict[str, Any] = {"id": f"r{i:04d}", "text": f"Classify message {i} about the city."}
        if i % 10 == 0:  # a row may carry its own format
            line["fmt"] = {"type": "choice", "choices": LABELS}
        lines.append(line)
    lines.append({"id": "bad", "text": "x", "fmt": {"type": "regex"}})
    spec = s3_jsonl_job(
        "structured",
        lines,
        s3_server,
        tiny_model_dir,
        sampling={
            "max_tokens": 96,
            "temperature": 0.7,
            "seed": 5,
            "response_format": {"type": "json_schema", "schema": SCHEMA},
            "overrides": {"response_format": "fmt"},
        },
        engine={"max_batch_size": 64},
        resources={"batch_size": 128, "max_in_flight": 64},
        output={"rows_per_file": 400},
    )
    result = run_job(spec)
    assert result.status == "complete"
    table, _ = read_output(s3_server, spec.output.uri)
    assert_exactly_once(table, [x["id"] for x in lines])
    rows = {r["id"]: r for r in table.to_pylist()}

    bad = rows.pop("bad")
    assert bad["finish_reason"] == "error" and "'fmt'" in bad["error"] and "regex" in bad["error"]
    surrogates = 0
    for row_id, row in rows.items():
        assert row["finish_reason"] == "stop", (row_id, row["text"], row["error"])
        if XGRAMMAR_0_1 and "\ufffd" in row["text"]:
            # xgrammar 0.1.x's known gap (tests/integration/test_structured_output.py): the
            # row says it is not whole and valid, and is never passed off as such.
            surrogates += 1
            continue
        assert row["parsed"] is True, (row_id, row["text"])
        if int(row_id[1:]) % 10 == 0:
            assert row["text"] in LABELS
        else:
            jsonschema.validate(json.loads(row["text"]), SCHEMA)
    assert surrogates <= len(rows) // 10
    assert manifest_of(s3_server, spec.output.uri)["totals"]["rows"] == 1001


def test_openai_batch_lines_with_response_format_are_honoured(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path
) -> None:
    bucket = s3_server.make_bucket()
    uri = f"s3://{bucket}/in/batch.jsonl"
    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True},
    }
    bodies = {
        "schema": {"response_format": schema_format},
        "object": {"response_format": {"type": "json_object"}},
        "text": {"response_format": {"type": "text"}, "logprobs": True, "top_logprobs": 2},
        "broken": {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
    }
    lines = [
        {
            "custom_id": name,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"Judge {name}."}],
                "max_tokens": 120,
                **body,
            },
        }
        for name, body in bodies.items()
    ]
    s3_server.put(uri, "".join(json.dumps(x) + "\n" for x in lines))
    spec = make_spec(
        "openai-structured",
        {"uri": uri, "format": "openai_batch"},
        f"s3://{bucket}/out/",
        s3_server,
        tiny_model_dir,
        sampling={"max_tokens": 120},
    )
    assert run_job(spec).status == "complete"
    table, _ = read_output(s3_server, spec.output.uri)
    rows = {r["id"]: r for r in table.to_pylist()}
    jsonschema.validate(json.loads(rows["schema"]["text"]), SCHEMA)
    assert rows["schema"]["parsed"] is True
    if rows["object"]["finish_reason"] == "stop":  # an open object may hit max_tokens
        assert isinstance(json.loads(rows["object"]["text"]), dict)
    assert rows["object"]["parsed"] is (rows["object"]["finish_reason"] == "stop")
    assert rows["text"]["parsed"] is None and rows["text"]["finish_reason"] != "error"
    # logprobs: one entry per output token with two sorted alternatives; none where not asked.
    logprobs = rows["text"]["logprobs"]
    assert len(logprobs) == rows["text"]["completion_tokens"] > 0
    for entry in logprobs:
        assert entry["logprob"] <= 0 and len(entry["top"]) == 2
        assert entry["top"][0]["logprob"] >= entry["top"][1]["logprob"]
    assert rows["schema"]["logprobs"] is None
    assert rows["broken"]["finish_reason"] == "error"
    assert "json_schema.schema" in rows["broken"]["error"]
