"""The end-of-run duplicate-id check over parts of every shape: a part whose rows are all errors
(nothing left after filtering), a part of one row, and normal parts, for every input format
whose ids come from the data. Its map and reduce are typed by a fixed schema, never by the
values: an all-error part once sent Arrow `null` columns and the job could not complete."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.batch.commit import duplicates
from pipeline.batch.driver.run import run_job
from pipeline.spec import parse_job_spec

pytestmark = pytest.mark.timeout(300)

# Three files, three shards, three parts: two good rows; two rows without a prompt (error rows,
# a part of nothing but errors); one good row (a part of one row).
FILES = {
    "a": [("a1", "Say one."), ("a2", "Say two.")],
    "b": [("b1", ""), ("b2", None)],
    "c": [("c1", "Say three.")],
}


def _write_inputs(tmp_path: Path, fmt: str) -> dict[str, Any]:
    data = tmp_path / "in"
    data.mkdir()
    for name, rows in FILES.items():
        if fmt == "parquet":
            table = pa.table({"id": [r[0] for r in rows], "text": [r[1] for r in rows]})
            pq.write_table(table, data / f"{name}.parquet")
        elif fmt == "openai_batch":
            lines = [
                {
                    "custom_id": i,
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"model": "tiny"}
                    | ({"messages": [{"role": "user", "content": t}]} if t else {}),
                }
                for i, t in rows
            ]
            (data / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        else:  # jsonl, and ray_data reading the same files
            lines = [{"id": i, **({"text": t} if t is not None else {})} for i, t in rows]
            (data / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if fmt == "ray_data":
        paths = [str(data / f"{n}.jsonl") for n in FILES]
        return {
            "format": "ray_data",
            "reader": "read_json",
            "reader_args": {"paths": paths},
            "id_column": "id",
            "prompt_column": "text",
        }
    if fmt == "openai_batch":
        return {"format": "openai_batch", "uri": str(data / "*.jsonl")}
    ext = "parquet" if fmt == "parquet" else "jsonl"
    return {
        "format": fmt,
        "uri": str(data / f"*.{ext}"),
        "id_column": "id",
        "prompt_column": "text",
    }


def _spec(tmp_path: Path, model: Path, source: dict[str, Any], max_error_fraction: float) -> Any:
    return parse_job_spec(
        {
            "name": "dup-check",
            "input": source,
            "model": {"path": str(model), "name": "tiny"},
            "engine": {"kind": "reference", "device": "cpu"},
            "sampling": {"max_tokens": 2},
            "resources": {"num_actors": 1, "cpus_per_actor": 0.5},
            "output": {"uri": str(tmp_path / "out"), "report": False},
            "limits": {"max_error_fraction": max_error_fraction},
        }
    )


# openai_batch and ray_data in the slow set: the check reads parts, whatever made them; the
# default set keeps a Parquet and a JSONL job, and the typing itself is checked without Ray
# (test_map_and_reduce_are_typed_by_the_schema_not_the_values).
@pytest.mark.parametrize(
    "fmt",
    [
        "parquet",
        "jsonl",
        pytest.param("openai_batch", marks=pytest.mark.slow),
        pytest.param("ray_data", marks=pytest.mark.slow),
    ],
)
def test_a_job_with_an_all_error_part_and_a_one_row_part_completes(
    ray_local: Any,
    tmp_path: Path,
    tiny_model_dir: Path,
    fmt: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One map task per part (16 by default): every shape of part reaches the reduce on its own.
    monkeypatch.setattr(duplicates, "PARTS_PER_MAP", 1)
    result = run_job(_spec(tmp_path, tiny_model_dir, _write_inputs(tmp_path, fmt), 0.5))
    assert result.status == "complete" and result.exit_code == 0, result
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["totals"]["rows"] == 5 and manifest["totals"]["rows_error"] == 2
    assert manifest["duplicate_ids"]["num_duplicates"] == 0
    assert (tmp_path / "out" / "_SUCCESS").exists()


def test_past_the_error_limit_it_completes_with_exit_3_not_a_crash(
    ray_local: Any, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(duplicates, "PARTS_PER_MAP", 1)
    result = run_job(_spec(tmp_path, tiny_model_dir, _write_inputs(tmp_path, "jsonl"), 0.1))
    assert result.status == "complete" and result.over_error_limit, result
    assert result.exit_code == 3  # what `tokenmill run` exits with


def test_map_and_reduce_are_typed_by_the_schema_not_the_values() -> None:
    """Without Ray: the map's tables of an all-error group and of a normal one concatenate."""
    empty = pa.table({k: [] for k in duplicates.MAP_SCHEMA.names}, schema=duplicates.MAP_SCHEMA)
    one = pa.table(
        {"id": ["x"], "part": ["p"], "position": [0], "shard": [1], "row": [0]},
        schema=duplicates.MAP_SCHEMA,
    )
    untyped = pa.table({k: [] for k in duplicates.MAP_SCHEMA.names})  # how it came out before
    assert duplicates._reduce(empty, one, untyped)["count"] == 0
    assert duplicates._reduce()["count"] == 0
    assert duplicates._reduce(one, one)["count"] == 1
