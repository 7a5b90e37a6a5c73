"""`input.format: ray_data` on a local Ray with the reference engine: an Iceberg table (SQL
catalog in a sqlite file, data on the S3 server over HTTP), a Delta table (local), read_csv,
read_json on S3 and a `module:function` Dataset are staged once as Parquet under the output
prefix and run as format parquet: every id committed once, a rerun reuses the snapshot and
commits nothing, a changed source is refused naming what changed."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from pipeline.batch.driver.run import ResumeRefused, RunResult, run_job
from pipeline.spec import JobSpec
from tests.integration.s3_server import S3Server
from tests.integration.test_pipeline import assert_exactly_once, make_spec

pytestmark = pytest.mark.timeout(300)

ROWS = 24


def _prompts(start: int, count: int) -> pa.Table:
    return pa.table(
        {
            "qid": [f"q{i:03d}" for i in range(start, start + count)],
            "question": [f"Tell me about item {i}." for i in range(start, start + count)],
            "user": pa.array(range(start, start + count), pa.int64()),
        }
    )


def _ray_data_input(**source: Any) -> dict[str, Any]:
    return {
        "format": "ray_data",
        "id_column": "qid",
        "prompt_column": "question",
        "passthrough_columns": ["user"],
        **source,
    }


def _s3_rows(server: S3Server, prefix: str) -> pa.Table:
    """The committed rows (part files) directly under an s3:// output prefix."""
    uris = server.list_uris(prefix)
    parts = [u for u in uris if u.rsplit("/", 1)[-1].startswith("part-")]
    return pa.concat_tables([pq.read_table(io.BytesIO(server.get(u))) for u in parts])


def _local_rows(out: Path) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in sorted(out.glob("part-*.parquet"))])


def _local_listing(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


# --- Iceberg: SQL catalog (sqlite), data on S3 ------------------------------------------------


@pytest.fixture(scope="module")
def iceberg(
    ray_local: Any,
    s3_server: S3Server,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    from pyiceberg.catalog import load_catalog

    bucket = s3_server.make_bucket()
    catalog_kwargs = {
        "name": "local",
        "type": "sql",
        "uri": f"sqlite:///{tmp_path_factory.mktemp('iceberg')}/catalog.db",
        "warehouse": f"s3://{bucket}/warehouse",
        "s3.endpoint": s3_server.endpoint_url,
        "s3.region": "us-east-1",
    }
    props = {k: v for k, v in catalog_kwargs.items() if k != "name"}
    catalog = load_catalog("local", **props)
    catalog.create_namespace("db")
    table = catalog.create_table("db.prompts", schema=_prompts(0, 1).schema)
    table.append(_prompts(0, ROWS))
    spec = make_spec(
        "iceberg-job",
        _ray_data_input(
            reader="read_iceberg",
            reader_args={"table_identifier": "db.prompts", "catalog_kwargs": catalog_kwargs},
        ),
        f"s3://{bucket}/out/",
        s3_server,
        tiny_model_dir,
    )
    said: list[str] = []
    result = run_job(spec, emit=said.append)
    return {"spec": spec, "result": result, "said": said, "table": table}


def test_iceberg_table_is_staged_once_and_run_exactly_once(
    iceberg: dict[str, Any], s3_server: S3Server
) -> None:
    spec: JobSpec = iceberg["spec"]
    result: RunResult = iceberg["result"]
    assert result.status == "complete" and result.rows_written == ROWS
    rows = _s3_rows(s3_server, spec.output.uri)
    assert_exactly_once(rows, [f"q{i:03d}" for i in range(ROWS)])
    assert sorted(rows.column("user").to_pylist()) == list(range(ROWS))
    listing = s3_server.list_uris(spec.output.uri)
    markers = [u for u in listing if u.endswith("/_snapshot.json")]
    assert len(markers) == 1 and "/_staging/input-" in markers[0]
    snapshot = json.loads(s3_server.get(markers[0]))
    assert snapshot["num_rows"] == ROWS
    current = iceberg["table"].current_snapshot().snapshot_id
    assert snapshot["source"]["version"] == {
        "kind": "iceberg_snapshot",
        "value": current,
        "pin": {"snapshot_id": current},
    }
    assert any(f"staged {ROWS} rows of read_iceberg" in line for line in iceberg["said"])
    # The manifest records the snapshot it read, as a parquet input.
    manifest = json.loads(s3_server.get(f"{spec.output.uri.rstrip('/')}/_manifest.json"))
    assert manifest["spec"]["input"]["format"] == "parquet"
    assert manifest["spec"]["input"]["uri"].startswith(markers[0].rsplit("/", 1)[0])


def test_iceberg_rerun_reuses_the_snapshot_and_commits_nothing(
    iceberg: dict[str, Any], s3_server: S3Server
) -> None:
    spec: JobSpec = iceberg["spec"]
    before = s3_server.list_uris(spec.output.uri)
    said: list[str] = []
    again = run_job(spec, emit=said.append)
    assert again.status == "already_complete" and again.rows_written == 0
    assert any("reusing the staged snapshot" in line for line in said)
    assert not any("staged " in line and "reusing" not in line for line in said)
    assert s3_server.list_uris(spec.output.uri) == before


def test_iceberg_table_changed_is_refused_naming_the_snapshot(
    iceberg: dict[str, Any], s3_server: S3Server
) -> None:
    spec: JobSpec = iceberg["spec"]
    iceberg["table"].append(_prompts(ROWS, 6))  # a new Iceberg snapshot
    before = s3_server.list_uris(spec.output.uri)
    with pytest.raises(ResumeRefused) as info:
        run_job(spec)
    message = str(info.value)
    assert "another snapshot of input (format ray_data)" in message
    assert "iceberg snapshot" in message and "--fresh" in message
    assert s3_server.list_uris(spec.output.uri) == before  # nothing staged, nothing written


# --- Delta: a local table, local output --------------------------------------------------------


def test_delta_table_staged_run_rerun_and_changed(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from deltalake import write_deltalake

    table_path = tmp_path / "delta"
    write_deltalake(str(table_path), _prompts(0, ROWS))
    out = tmp_path / "out"
    spec = make_spec(
        "delta-job",
        # Derived ids: no id column, the snapshot's file and row give each row its id.
        {
            "format": "ray_data",
            "reader": "read_delta",
            "reader_args": {"path": str(table_path)},
            "prompt_column": "question",
            "passthrough_columns": ["qid"],
        },
        str(out),
        s3_server,
        tiny_model_dir,
    )
    result = run_job(spec)
    assert result.status == "complete" and result.rows_written == ROWS
    rows = _local_rows(out)
    assert rows.num_rows == ROWS and len(set(rows.column("id").to_pylist())) == ROWS
    assert sorted(rows.column("qid").to_pylist()) == [f"q{i:03d}" for i in range(ROWS)]
    snapshots = list((out / "_staging").glob("input-*/_snapshot.json"))
    assert len(snapshots) == 1
    assert json.loads(snapshots[0].read_text())["source"]["version"]["value"] == 0

    before = _local_listing(out)
    said: list[str] = []
    again = run_job(spec, emit=said.append)
    assert again.status == "already_complete" and again.rows_written == 0
    assert any("reusing the staged snapshot" in line for line in said)
    assert _local_listing(out) == before

    write_deltalake(str(table_path), _prompts(ROWS, 4), mode="append")  # version 1
    with pytest.raises(ResumeRefused, match=r"delta version 0 when .*delta version 1 now.*--fresh"):
        run_job(spec)
    assert _local_listing(out) == before

    # --fresh stages the table as it is now and starts over.
    fresh = run_job(spec, fresh=True)
    assert fresh.status == "complete" and fresh.rows_written == ROWS + 4
    assert _local_rows(out).num_rows == ROWS + 4
    assert len(list((out / "_staging").glob("input-*/_snapshot.json"))) == 2


# --- simple readers and a function ------------------------------------------------------------


def test_read_csv_local(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    source = tmp_path / "prompts.csv"
    pacsv.write_csv(_prompts(0, 12), source)
    out = tmp_path / "out"
    spec = make_spec(
        "csv-job",
        _ray_data_input(reader="read_csv", reader_args={"paths": str(source)}),
        str(out),
        s3_server,
        tiny_model_dir,
    )
    assert run_job(spec).status == "complete"
    assert_exactly_once(_local_rows(out), [f"q{i:03d}" for i in range(12)])
    snapshot = json.loads(next((out / "_staging").glob("input-*/_snapshot.json")).read_text())
    assert snapshot["source"]["version"]["kind"] == "listing"
    assert snapshot["source"]["version"]["value"][0]["uri"] == str(source)


def test_read_json_on_s3(ray_local: Any, s3_server: S3Server, tiny_model_dir: Path) -> None:
    bucket = s3_server.make_bucket()
    lines = _prompts(0, 10).to_pylist()
    s3_server.put(f"s3://{bucket}/in/prompts.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    spec = make_spec(
        "json-job",
        _ray_data_input(reader="read_json", reader_args={"paths": f"s3://{bucket}/in/"}),
        f"s3://{bucket}/out/",
        s3_server,
        tiny_model_dir,
    )
    assert run_job(spec).status == "complete"
    assert_exactly_once(_s3_rows(s3_server, spec.output.uri), [x["qid"] for x in lines])


def prompts_dataset(count: int, offset: int = 0) -> Any:
    """An `input.dataset` function: any Dataset the job's code builds."""
    import ray.data

    return ray.data.from_arrow(_prompts(offset, count))


def test_module_function_dataset(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    spec = make_spec(
        "function-job",
        _ray_data_input(
            dataset="tests.integration.test_ray_data_sources:prompts_dataset",
            reader_args={"count": 9, "offset": 100},
        ),
        str(out),
        s3_server,
        tiny_model_dir,
    )
    assert run_job(spec).status == "complete"
    assert_exactly_once(_local_rows(out), [f"q{i:03d}" for i in range(100, 109)])
    said: list[str] = []
    assert run_job(spec, emit=said.append).status == "already_complete"
    assert any("reusing the staged snapshot" in line for line in said)


def test_a_staging_that_lost_the_race_leaves_no_copy_behind(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two runs stage one source at once; the second to create the marker uses the first's
    snapshot, and its own copy (named by no marker) is deleted, not left to cost storage."""
    from pipeline.batch.stages.read import staging as stage
    from pipeline.batch.stages.read.sources import source_fingerprint
    from pipeline.storage import OutputDir

    source = tmp_path / "prompts.csv"
    pacsv.write_csv(_prompts(0, 4), source)
    spec = make_spec(
        "csv-race",
        _ray_data_input(reader="read_csv", reader_args={"paths": str(source)}),
        str(tmp_path / "out"),
        s3_server,
        tiny_model_dir,
    )
    fingerprint = source_fingerprint(spec.input, spec.storage)
    where = OutputDir(str(tmp_path / "out" / "_staging" / fingerprint.key), spec.storage)
    first = stage._write_snapshot(spec, fingerprint, where)
    second = stage._write_snapshot(spec, fingerprint, where)  # the marker is there already
    assert second == first
    copies = [p.name for p in Path(where.root).iterdir() if p.is_dir()]
    assert copies == [first.uri.rsplit("/", 1)[-1]]
