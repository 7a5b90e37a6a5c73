"""A batch job on engine.kind synthetic (local Ray, S3 over HTTP): the pipeline around a
synthetic engine writes what it writes around a real one, every id once with the documented
columns, and the synthetic engine's planned stops and row errors come through as rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.batch.driver.run import run_job
from pipeline.batch.stages.schema import RESULT_FIELDS, TOKEN_IDS_FIELD
from tests.integration.s3_server import S3Server
from tests.integration.test_pipeline import (
    assert_exactly_once,
    assert_totals_match,
    manifest_of,
    read_output,
    s3_jsonl_job,
)

pytestmark = pytest.mark.timeout(300)


def test_a_job_on_the_synthetic_engine(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path
) -> None:
    lines = [{"id": f"s{i:03d}", "text": f"Say something about row {i}."} for i in range(80)]
    spec = s3_jsonl_job(
        "synthetic",
        lines,
        s3_server,
        tiny_model_dir,
        engine={
            "kind": "synthetic",
            "max_batch_size": 32,
            "extra": {
                "tokens_per_s": 50000,
                "ttft_ms": 5,
                "stop_fraction": 0.3,
                "error_fraction": 0.1,
                "seed": 3,
            },
        },
        sampling={"max_tokens": 12},
        output={"include_token_ids": True},
        resources={"batch_size": 16, "max_in_flight": 32},
        limits={"max_error_fraction": 0.5},
    )
    assert run_job(spec).status == "complete"
    table, _ = read_output(s3_server, spec.output.uri)
    assert_exactly_once(table, [x["id"] for x in lines])
    assert_totals_match(manifest_of(s3_server, spec.output.uri), table)
    expected = ["id", *(f.name for f in RESULT_FIELDS), TOKEN_IDS_FIELD.name]
    assert table.schema.names == expected

    rows = table.to_pylist()
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    by_reason: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_reason.setdefault(row["finish_reason"], []).append(row)
        assert row["engine"] == "synthetic"
        assert row["completion_tokens"] == len(row["completion_token_ids"])
        assert all(0 <= t < vocab for t in row["completion_token_ids"])
    assert set(by_reason) == {"length", "stop", "error"}, {k: len(v) for k, v in by_reason.items()}
    assert all("fails this fraction" in r["error"] for r in by_reason["error"])
    assert all(r["completion_tokens"] == 12 and r["text"] for r in by_reason["length"])
    assert all(0 < r["completion_tokens"] <= 12 for r in by_reason["stop"])
    # The engine's step records reach the cost split: every row that ran was charged.
    assert all(r["gpu_seconds"] > 0 for r in rows if r["completion_tokens"])
