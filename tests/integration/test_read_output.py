"""read_output: a committed output prefix as a Ray Data Dataset, on the S3 server and locally.

One job runs to completion on S3; the checks are that the Dataset holds exactly the rows of
the parts the manifest lists (a stray Parquet file in the prefix, even one named like a part,
is not read), and that an output whose manifest is not complete is refused with its state.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.batch.commit.parts import table_to_parquet
from pipeline.batch.driver.run import run_job
from pipeline.data import OutputIncomplete, OutputNotFound, read_output
from pipeline.spec import JobSpec
from tests.integration.s3_server import S3Server
from tests.integration.test_pipeline import s3_jsonl_job

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def data_context(ray_local: Any) -> Any:
    import ray.data

    ctx = ray.data.DataContext.get_current()
    saved = (ctx.execution_no_progress_timeout_s, ctx.enable_progress_bars)
    ctx.execution_no_progress_timeout_s = 120
    ctx.enable_progress_bars = False
    yield ctx
    ctx.execution_no_progress_timeout_s, ctx.enable_progress_bars = saved


@pytest.fixture(scope="module")
def output(data_context: Any, s3_server: S3Server, tiny_model_dir: Path) -> JobSpec:
    """A complete output with several parts, and stray files beside its parts."""
    lines = [{"id": f"r{i:02d}", "text": f"Write about the {i} bridges."} for i in range(20)]
    spec = s3_jsonl_job("read-output", lines, s3_server, tiny_model_dir)
    assert run_job(spec).status == "complete"
    stray = table_to_parquet(pa.table({"id": ["stray"], "text": ["not committed"]}))
    prefix = spec.output.uri.rstrip("/")
    s3_server.put(f"{prefix}/part-000999-00009-01-0000.parquet", stray)  # named like a part
    s3_server.put(f"{prefix}/extra.parquet", stray)
    return spec


def committed(s3_server: S3Server, spec: JobSpec) -> tuple[dict[str, Any], pa.Table]:
    """The manifest and the rows of the parts it lists (read without read_output)."""
    prefix = spec.output.uri.rstrip("/")
    manifest = json.loads(s3_server.get(f"{prefix}/_manifest.json"))
    tables = [
        pq.read_table(io.BytesIO(s3_server.get(f"{prefix}/{p['name']}"))) for p in manifest["parts"]
    ]
    return manifest, pa.concat_tables(tables)


def test_a_complete_output_is_exactly_its_committed_parts(
    output: JobSpec, s3_server: S3Server
) -> None:
    manifest, parts = committed(s3_server, output)
    assert len(manifest["parts"]) > 1
    ds = read_output(output.output.uri, storage=output.storage)
    rows = pa.Table.from_pylist(ds.take_all())
    ids = rows.column("id").to_pylist()
    assert sorted(ids) == sorted(parts.column("id").to_pylist())
    assert len(ids) == len(set(ids)) == manifest["totals"]["rows"] == 20
    assert "stray" not in ids
    assert rows.column_names == parts.column_names
    by_id = {r["id"]: r["text"] for r in parts.to_pylist()}
    assert {r["id"]: r["text"] for r in rows.to_pylist()} == by_id


def test_an_incomplete_output_is_refused_naming_its_state(
    output: JobSpec, s3_server: S3Server
) -> None:
    """A copy of the output whose manifest says a run is still writing it (no _SUCCESS)."""
    manifest, _ = committed(s3_server, output)
    prefix = output.output.uri.rstrip("/")
    copy = prefix.rsplit("/", 1)[0] + "/running"
    kept = manifest["parts"][:-1]  # the last part not yet committed: a stray for now
    for part in manifest["parts"]:
        s3_server.put(f"{copy}/{part['name']}", s3_server.get(f"{prefix}/{part['name']}"))
    running = {**manifest, "status": "running", "parts": kept}
    s3_server.put(f"{copy}/_manifest.json", json.dumps(running))

    with pytest.raises(OutputIncomplete) as refused:
        read_output(copy, storage=output.storage)
    message = str(refused.value)
    assert "output is running" in message
    assert f"{sum(p['rows'] for p in kept)} rows committed in {len(kept)} parts" in message
    assert "allow_incomplete=True" in message

    rows = read_output(copy, allow_incomplete=True, storage=output.storage).take_all()
    assert len(rows) == sum(p["rows"] for p in kept) < 20


def test_a_local_output_and_a_prefix_without_a_manifest(
    output: JobSpec, s3_server: S3Server, tmp_path: Path
) -> None:
    prefix = output.output.uri.rstrip("/")
    local = tmp_path / "out"
    local.mkdir()
    for uri in s3_server.list_uris(prefix + "/"):
        (local / uri.rsplit("/", 1)[-1]).write_bytes(s3_server.get(uri))
    rows = read_output(str(local)).take_all()
    assert len(rows) == 20 and "stray" not in {r["id"] for r in rows}

    with pytest.raises(OutputNotFound, match=r"no readable _manifest\.json"):
        read_output(str(tmp_path / "nothing"))
