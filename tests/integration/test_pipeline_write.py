"""The commit protocol without Ray: parts, committed state, superseding, fingerprint, manifest.

Runs against a local directory and against the S3 test server (real HTTP), since the two
commit paths differ (rename vs one PUT).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.batch.commit.fingerprint import COMPONENTS, Fingerprint, job_fingerprint
from pipeline.batch.commit.manifest import (
    Manifest,
    RunRecord,
    read_manifest,
    redact,
    write_manifest,
)
from pipeline.batch.commit.parts import (
    RESULT_FIELDS,
    OutputDir,
    PartName,
    PartWriter,
    conform,
    drop_superseded,
    list_parts,
    load_committed,
    output_schema,
    read_part,
)
from pipeline.spec import JobSpec, StorageSpec, parse_job_spec
from pipeline.storage import InputFile


def _rows(ids: list[str], errors: set[str] = frozenset()) -> pa.Table:
    """Output rows in the fixed schema (one passthrough column, `user`)."""
    schema = output_schema([pa.field("user", pa.int64())])
    now = dt.datetime.now(dt.timezone.utc)
    values = {
        "id": ids,
        "user": list(range(len(ids))),
        "text": ["" if i in errors else f"answer {i}" for i in ids],
        "finish_reason": ["error" if i in errors else "stop" for i in ids],
        "error": ["boom" if i in errors else None for i in ids],
        "finished_at": [now] * len(ids),
    }
    columns = []
    for f in schema:
        if f.name in values:
            columns.append(pa.array(values[f.name], type=f.type))
        elif pa.types.is_floating(f.type):
            columns.append(pa.array([0.5] * len(ids), type=f.type))
        elif pa.types.is_integer(f.type):
            columns.append(pa.array([3] * len(ids), type=f.type))
        else:
            columns.append(pa.array(["x"] * len(ids), type=f.type))
    return pa.Table.from_arrays(columns, schema=schema)


@pytest.fixture(params=["local", "s3"])
def out(request: pytest.FixtureRequest, tmp_path: Path) -> OutputDir:
    if request.param == "local":
        return OutputDir(str(tmp_path / "out"), StorageSpec())
    server = request.getfixturevalue("s3_server")
    bucket = server.make_bucket()
    return OutputDir(f"s3://{bucket}/results/", server.storage_spec())


def test_parts_hold_at_most_rows_per_file_and_every_row_once(out: OutputDir) -> None:
    ids = [f"r{i}" for i in range(23)]
    writer = PartWriter(out, attempt=1, schema=_rows([]).schema, rows_per_file=5)
    committed = []
    for start in range(0, 23, 4):  # batches that do not line up with part boundaries
        committed += writer.add(_rows(ids[start : start + 4]))
    committed += writer.close()

    parts = list_parts(out)
    assert [p.name for p in parts] == committed
    assert [p.seq for p in parts] == list(range(5))
    sizes = [read_part(out, p).num_rows for p in parts]
    assert sizes == [5, 5, 5, 5, 3]
    read_back = [i for p in parts for i in read_part(out, p).column("id").to_pylist()]
    assert read_back == ids
    assert read_part(out, parts[0]).schema == _rows([]).schema


def test_writer_drops_an_id_repeated_within_its_attempt(out: OutputDir) -> None:
    writer = PartWriter(out, attempt=1, schema=_rows([]).schema, rows_per_file=100)
    writer.add(_rows(["a", "b"]))
    writer.add(_rows(["b", "c"]))  # a retried task re-emitting "b"
    writer.close()
    state = load_committed(out)
    assert sorted(state.ids.to_pylist()) == ["a", "b", "c"]
    assert writer.stats.duplicates_dropped == 1


def test_committed_state_latest_attempt_wins_and_superseded_parts_are_rewritten(
    out: OutputDir,
) -> None:
    schema = _rows([]).schema
    first = PartWriter(out, attempt=1, schema=schema, rows_per_file=3)
    first.add(_rows(["a", "b", "c", "d"], errors={"b", "d"}))
    first.close()
    state = load_committed(out)
    assert sorted(state.error_ids.to_pylist()) == ["b", "d"]
    assert state.next_attempt == 2

    retry = PartWriter(out, attempt=state.next_attempt, schema=schema, rows_per_file=3)
    retry.add(_rows(["b", "d"]))  # both succeed now
    retry.close()
    state = load_committed(out)
    # Before the rewrite both copies exist; the state already sees only the latest.
    assert sorted(state.ids.to_pylist()) == ["a", "b", "c", "d"]
    assert state.error_ids.to_pylist() == []
    assert state.superseded == {
        "part-00001-000000.parquet": ["b"],
        "part-00001-000001.parquet": ["d"],
    }

    rewritten = drop_superseded(out, state)
    assert rewritten == ["part-00001-000000.parquet", "part-00001-000001.parquet"]
    names = [p.name for p in list_parts(out)]
    # part 1-1 held only "d": it is gone, not left empty.
    assert names == ["part-00001-000000.parquet", "part-00002-000000.parquet"]
    all_rows = pa.concat_tables(read_part(out, p) for p in list_parts(out))
    assert sorted(all_rows.column("id").to_pylist()) == ["a", "b", "c", "d"]
    assert set(all_rows.column("finish_reason").to_pylist()) == {"stop"}
    assert load_committed(out).superseded == {}


def test_clear_removes_only_job_files(out: OutputDir) -> None:
    writer = PartWriter(out, 1, _rows([]).schema, 10)
    writer.add(_rows(["a"]))
    writer.close()
    out.put_atomic("_SUCCESS", b"")
    out.put_atomic("notes.txt", b"keep me")
    out.clear()
    assert out.names() == ["notes.txt"]


def test_conform_casts_and_names_missing_columns() -> None:
    schema = output_schema()
    table = _rows(["a"]).drop_columns(["user"])
    table = table.set_column(
        table.column_names.index("prompt_tokens"), "prompt_tokens", pa.array([3], pa.int64())
    )
    assert conform(table, schema).schema == schema
    with pytest.raises(ValueError, match="lacks column"):
        conform(table.drop_columns(["text"]), schema)
    assert [f.name for f in RESULT_FIELDS][:3] == ["text", "finish_reason", "error"]


def test_part_names_parse_and_order() -> None:
    assert PartName.parse("part-00002-000010.parquet") == PartName(2, 10)
    assert PartName.parse("part-2-10.parquet") is None
    assert PartName.parse("_SUCCESS") is None
    assert sorted([PartName(2, 0), PartName(1, 5)]) == [PartName(1, 5), PartName(2, 0)]


def test_local_commit_leaves_no_temp_file_and_a_valid_parquet(tmp_path: Path) -> None:
    out = OutputDir(str(tmp_path), StorageSpec())
    writer = PartWriter(out, 1, _rows([]).schema, 10)
    writer.add(_rows(["a", "b"]))
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-00001-000000.parquet"]
    assert pq.read_table(tmp_path / "part-00001-000000.parquet").num_rows == 2


# --- fingerprint and manifest ----------------------------------------------------------------


def _spec(tmp_path: Path, **sampling: object) -> JobSpec:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"hidden_size": 8}')
    (model / "model.safetensors").write_bytes(b"0" * 100)
    return parse_job_spec(
        {
            "name": "fp",
            "input": {"uri": "s3://b/in.jsonl", "format": "jsonl", "prompt_column": "p"},
            "model": {"path": str(model)},
            "sampling": {"max_tokens": 8, **sampling},
            "output": {"uri": str(tmp_path / "out")},
        }
    )


def test_fingerprint_names_the_changed_component(tmp_path: Path) -> None:
    files = [InputFile(uri="s3://b/in.jsonl", size=10, version="etag1")]
    base = job_fingerprint(_spec(tmp_path), files)
    assert set(base.components) == set(COMPONENTS)
    assert job_fingerprint(_spec(tmp_path), files) == base  # deterministic

    hotter = job_fingerprint(_spec(tmp_path, temperature=0.7), files)
    assert hotter.changed_components(base) == ["sampling"]

    edited = [InputFile(uri="s3://b/in.jsonl", size=10, version="etag2")]
    assert job_fingerprint(_spec(tmp_path), edited).changed_components(base) == ["input"]

    spec = _spec(tmp_path)
    (tmp_path / "model" / "model.safetensors").write_bytes(b"0" * 101)  # new weights
    assert job_fingerprint(spec, files).changed_components(base) == ["model"]
    assert Fingerprint.from_json(base.to_json()) == base


def test_fingerprint_tells_quantizations_apart(tmp_path: Path) -> None:
    files = [InputFile(uri="s3://b/in.jsonl", size=10, version="etag1")]
    plain = _spec(tmp_path)

    def quantized(fmt: str) -> JobSpec:
        data = plain.model_dump(mode="json")
        data["model"]["quantization"] = {"format": fmt}
        return parse_job_spec(data)

    base = job_fingerprint(plain, files)
    fp8 = job_fingerprint(quantized("fp8"), files)
    assert fp8.changed_components(base) == ["model"]
    assert job_fingerprint(quantized("nvfp4"), files).changed_components(fp8) == ["model"]


def test_manifest_redaction_keeps_token_counts() -> None:
    spec = {
        "sampling": {"max_tokens": 8, "stop_token_ids": [1]},
        "engine": {"max_num_tokens": 64, "kv_cache_tokens": 512},
        "model": {"tokenizer": "t"},
        "env": {"AWS_SESSION_TOKEN": "s", "auth_token": "a", "aws_secret_access_key": "k"},
    }
    assert redact(spec) == {
        "sampling": {"max_tokens": 8, "stop_token_ids": [1]},
        "engine": {"max_num_tokens": 64, "kv_cache_tokens": 512},
        "model": {"tokenizer": "t"},
        "env": {"AWS_SESSION_TOKEN": "***", "auth_token": "***", "aws_secret_access_key": "***"},
    }


def test_manifest_round_trip_and_redaction(tmp_path: Path) -> None:
    out = OutputDir(str(tmp_path), StorageSpec())
    assert read_manifest(out) is None
    manifest = Manifest(
        job="j",
        status="running",
        fingerprint={"value": "v", "components": {}},
        spec=redact({"storage": {"endpoint_url": "https://user:pw@host"}, "api_key": "k"}),
        input_files=[],
        runs=[RunRecord(attempt=1, started_at="t", mode="run")],
    )
    write_manifest(out, manifest)
    back = read_manifest(out)
    assert back is not None and back.runs[0].attempt == 1
    assert back.spec == {"storage": {"endpoint_url": "https://***@host"}, "api_key": "***"}
