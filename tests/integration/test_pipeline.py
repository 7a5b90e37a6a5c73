"""The whole batch pipeline on a local Ray with the reference engine and S3 over HTTP.

Every job reads from and writes to the moto S3 server; the checks are on what a reader of the
output prefix sees: each input id exactly once, the documented schema, manifest totals equal
to the rows, error rows with messages, resume and refusal behaviour.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pipeline.batch.commit.parts import list_part_names, read_part, table_to_parquet
from pipeline.batch.driver.run import ResumeRefused, RunResult, run_job
from pipeline.batch.stages.schema import RESULT_FIELDS, TOKEN_IDS_FIELD
from pipeline.spec import JobSpec, parse_job_spec
from pipeline.storage import OutputDir
from tests.integration.s3_server import S3Server

pytestmark = pytest.mark.timeout(300)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and key in out else value
    return out


def make_spec(
    name: str, input_: dict[str, Any], output_uri: str, server: S3Server, model: Path, **extra: Any
) -> JobSpec:
    data = {
        "name": name,
        "input": input_,
        "model": {"path": str(model), "name": "tiny"},
        "engine": {"kind": "reference", "device": "cpu", "max_batch_size": 16},
        "sampling": {"max_tokens": 6, "temperature": 0.0},
        "resources": {
            "num_actors": 1,
            "cpus_per_actor": 0.25,
            "batch_size": 4,
            "max_in_flight": 16,
        },
        "output": {"uri": output_uri, "rows_per_file": 7, "report": False},
        "storage": {"endpoint_url": server.endpoint_url},
        "cost": {"device_hour_usd": 1.0, "price_per_million": {"input": 1.0, "output": 2.0}},
    }
    return parse_job_spec(_merge(data, extra))


def s3_jsonl_job(
    name: str, lines: list[dict[str, Any]], server: S3Server, model: Path, **extra: Any
) -> JobSpec:
    """A job over `lines` ({"id", "text"} objects) uploaded as one JSONL file to a new bucket,
    writing under that bucket's out/."""
    bucket = server.make_bucket()
    uri = f"s3://{bucket}/in/{name}.jsonl"
    server.put(uri, "".join(json.dumps(x) + "\n" for x in lines))
    source = {"uri": uri, "format": "jsonl", "id_column": "id", "prompt_column": "text"}
    return make_spec(name, source, f"s3://{bucket}/out/", server, model, **extra)


def read_output(server: S3Server, prefix: str) -> tuple[pa.Table, list[str]]:
    """All committed rows under an s3:// prefix, and the names of the objects there."""
    uris = server.list_uris(prefix)
    parts = [u for u in uris if u.rsplit("/", 1)[-1].startswith("part-")]
    tables = [pq.read_table(io.BytesIO(server.get(u))) for u in parts]
    return pa.concat_tables(tables), [u.rsplit("/", 1)[-1] for u in uris]


def count_ray_sessions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the Ray sessions a job opens: outermost entries of
    pipeline.batch.driver.run.ray_session (one entered inside another reuses it)."""
    import pipeline.batch.driver.run as run_module

    opened, depth = [0], [0]
    real = run_module.ray_session

    @contextlib.contextmanager
    def counted() -> Iterator[None]:
        opened[0] += depth[0] == 0
        depth[0] += 1
        try:
            with real():
                yield
        finally:
            depth[0] -= 1

    monkeypatch.setattr(run_module, "ray_session", counted)
    return opened


def manifest_of(server: S3Server, prefix: str) -> dict[str, Any]:
    return json.loads(server.get(f"{prefix.rstrip('/')}/_manifest.json"))


def assert_exactly_once(table: pa.Table, expected_ids: list[str]) -> None:
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "an id appears twice"
    assert sorted(ids) == sorted(expected_ids)


def assert_totals_match(manifest: dict[str, Any], table: pa.Table) -> None:
    totals = manifest["totals"]
    assert totals["rows"] == table.num_rows
    errors = pc.sum(pc.equal(table.column("finish_reason"), "error")).as_py() or 0
    assert totals["rows_error"] == errors
    assert totals["completion_tokens"] == pc.sum(table.column("completion_tokens")).as_py()
    assert totals["prompt_tokens"] == pc.sum(table.column("prompt_tokens")).as_py()
    assert totals["rows_usd"] == pytest.approx(pc.sum(table.column("cost_usd")).as_py())
    assert sum(p["rows"] for p in manifest["parts"]) == table.num_rows
    # Per shard: its row count, complete, and the sums of its parts.
    shards = manifest["shards"]
    assert sum(s["rows"] for s in shards) == table.num_rows
    assert sum(s["errors"] for s in shards) == errors
    assert all(s["complete"] and s["rows"] == s["num_rows"] for s in shards)
    assert sorted(n for s in shards for n in s["parts"]) == sorted(
        p["name"] for p in manifest["parts"]
    )


# --- parquet, two actors -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def parquet_job(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path
) -> tuple[JobSpec, RunResult, list[str]]:
    bucket = s3_server.make_bucket()
    ids = [f"q{i:03d}" for i in range(40)]
    table = pa.table(
        {
            "qid": ids,
            "question": [f"Tell me about item {i} and the river." for i in range(40)],
            "user": pa.array(range(40), pa.int64()),
            "budget": pa.array([40 + i % 5 for i in range(40)], pa.int64()),
        }
    )
    s3_server.put(f"s3://{bucket}/in/a.parquet", table_to_parquet(table.slice(0, 25)))
    s3_server.put(f"s3://{bucket}/in/b.parquet", table_to_parquet(table.slice(25)))
    spec = make_spec(
        "parquet-job",
        {
            "uri": f"s3://{bucket}/in/",
            "format": "parquet",
            "id_column": "qid",
            "prompt_column": "question",
            "passthrough_columns": ["user"],
        },
        f"s3://{bucket}/out/",
        s3_server,
        tiny_model_dir,
        resources={"num_actors": 2},
        # ignore_eos: each row decodes exactly its budget, long enough (40+ tokens) that a
        # block is still in flight when the next is dispatched, so both actors get work even
        # on an idle machine where the tiny model is very fast
        sampling={"overrides": {"max_tokens": "budget"}, "ignore_eos": True},
        output={"include_token_ids": True},
    )
    return spec, run_job(spec), ids


def test_parquet_s3_two_actors_every_id_once_with_documented_schema(
    parquet_job: tuple[JobSpec, RunResult, list[str]], s3_server: S3Server
) -> None:
    spec, result, ids = parquet_job
    assert result.status == "complete" and result.exit_code == 0
    table, names = read_output(s3_server, spec.output.uri)
    assert "_SUCCESS" in names and "_manifest.json" in names
    assert_exactly_once(table, ids)

    expected = ["id", "user", *(f.name for f in RESULT_FIELDS), TOKEN_IDS_FIELD.name]
    assert table.column_names == expected
    assert table.schema.field("user").type == pa.int64()
    assert table.schema.field("completion_token_ids").type == pa.list_(pa.int32())
    assert set(table.column("finish_reason").to_pylist()) == {"length"}
    assert table.column("error").null_count == table.num_rows
    rows = {r["id"]: r for r in table.to_pylist()}
    for i, row_id in enumerate(ids):  # passthrough and the per-row max_tokens override
        assert rows[row_id]["user"] == i
        assert rows[row_id]["completion_tokens"] == 40 + i % 5
        assert len(rows[row_id]["completion_token_ids"]) == rows[row_id]["completion_tokens"]
    assert min(table.column("gpu_seconds").to_pylist()) > 0
    assert min(table.column("list_price_usd").to_pylist()) > 0
    assert len(set(table.column("actor_id").to_pylist())) == 2, "both actors served rows"
    out = OutputDir(spec.output.uri, spec.storage)
    for name in list_part_names(out):
        assert read_part(out, name).num_rows <= 7

    manifest = manifest_of(s3_server, spec.output.uri)
    assert manifest["status"] == "complete"
    assert_totals_match(manifest, table)
    assert len(manifest["runs"]) == 1 and len(manifest["runs"][0]["actors"]) >= 2
    assert manifest["totals"]["load_s"] > 0


def test_finished_job_rerun_is_a_no_op(
    parquet_job: tuple[JobSpec, RunResult, list[str]], s3_server: S3Server
) -> None:
    spec, _, _ = parquet_job
    before = s3_server.list_uris(spec.output.uri)
    again = run_job(spec)
    assert again.status == "already_complete"
    assert again.rows_written == 0 and again.parts_written == []
    assert "already complete" in again.message
    assert s3_server.list_uris(spec.output.uri) == before


def test_changed_sampling_is_refused_naming_it(
    parquet_job: tuple[JobSpec, RunResult, list[str]], s3_server: S3Server
) -> None:
    spec, _, _ = parquet_job
    hotter = spec.model_copy(
        update={"sampling": spec.sampling.model_copy(update={"temperature": 0.9})}
    )
    before = s3_server.list_uris(spec.output.uri)
    with pytest.raises(ResumeRefused, match=r"sampling changed.*--fresh"):
        run_job(hotter)
    assert s3_server.list_uris(spec.output.uri) == before


# --- JSONL with bad rows, then --retry-errors ------------------------------------------------


@pytest.fixture(scope="module")
def jsonl_job(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path
) -> tuple[JobSpec, RunResult, list[str]]:
    bucket = s3_server.make_bucket()
    good = [{"id": f"g{i}", "text": f"Write about the {i} bridges."} for i in range(10)]
    lines = [json.dumps(r) for r in good]
    lines.append(json.dumps({"id": "empty", "text": ""}))
    lines.append('{"id": "broken", "text": "no closing brace"')
    lines.append(json.dumps({"id": "long", "text": "river bucket " * 1500}))
    s3_server.put(f"s3://{bucket}/in/prompts.jsonl", "\n".join(lines) + "\n")
    spec = make_spec(
        "jsonl-job",
        {
            "uri": f"s3://{bucket}/in/prompts.jsonl",
            "format": "jsonl",
            "id_column": "id",
            "prompt_column": "text",
        },
        f"s3://{bucket}/out",
        s3_server,
        tiny_model_dir,
        limits={"max_error_fraction": 0.1},
        engine={"max_model_len": 512},
    )
    return spec, run_job(spec), [r["id"] for r in good]


def test_bad_rows_become_error_rows_and_exit_code_3(
    jsonl_job: tuple[JobSpec, RunResult, list[str]], s3_server: S3Server
) -> None:
    spec, result, good_ids = jsonl_job
    assert result.status == "complete"
    table, names = read_output(s3_server, spec.output.uri)
    assert "_SUCCESS" in names
    errors = {r["id"]: r for r in table.to_pylist() if r["finish_reason"] == "error"}
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 13
    assert set(good_ids) <= set(ids)
    assert all(errors[i]["error"] for i in errors)
    assert "empty" in errors and "long" in errors
    # the malformed line has a derived id; its message names the problem
    broken = [r for i, r in errors.items() if i not in ("empty", "long")]
    assert len(broken) == 1 and "json" in broken[0]["error"].lower()
    assert "context length" in errors["long"]["error"]
    assert all(errors[i]["text"] == "" and errors[i]["completion_tokens"] == 0 for i in errors)
    assert result.totals["rows_error"] == 3
    assert result.over_error_limit and result.exit_code == 3
    assert_totals_match(manifest_of(s3_server, spec.output.uri), table)


def mark_rows_failed(out: OutputDir, ids: set[str]) -> None:
    """Turn committed rows into error rows, as a transient failure would have left them: the
    part files and their records in the manifest (the commit record) are rewritten together."""
    from pipeline.batch.commit.parts import PartRecord, read_part_record
    from pipeline.batch.commit.stats import RowStats

    manifest = json.loads(out.read("_manifest.json"))
    for entry in manifest["parts"]:
        table = read_part(out, entry["name"])
        hit = pc.is_in(table.column("id"), value_set=pa.array(sorted(ids)))
        if not pc.any(hit).as_py():
            continue
        reason = pc.if_else(hit, "error", table.column("finish_reason"))
        table = table.set_column(
            table.schema.get_field_index("finish_reason"), "finish_reason", reason
        )
        error = pc.if_else(hit, "transient failure", table.column("error"))
        table = table.set_column(table.schema.get_field_index("error"), "error", error)
        footer = read_part_record(out, entry["name"])
        assert footer is not None
        stats = RowStats.of_table(table)
        record = PartRecord.from_json({**footer.to_json(), **stats.sums.to_json()})
        meta = {b"tokenmill.part": json.dumps(record.to_json(with_stats=True)).encode()}
        data = table_to_parquet(table, meta)
        out.put(entry["name"], data)
        entry.update(stats.sums.to_json())
        entry["size_bytes"], entry["version"] = out.stat(entry["name"])
    out.put("_manifest.json", json.dumps(manifest).encode())


def test_retry_errors_supersedes_old_error_rows(
    jsonl_job: tuple[JobSpec, RunResult, list[str]], s3_server: S3Server
) -> None:
    spec, _, good_ids = jsonl_job
    out = OutputDir(spec.output.uri, spec.storage)
    flaky = set(good_ids[:2])
    mark_rows_failed(out, flaky)
    parts_before = set(list_part_names(out))

    result = run_job(spec, retry_errors=True)
    assert result.status == "complete"
    assert result.rows_written == 5  # 2 flaky + 3 that fail again
    assert {p.split("-")[2] for p in result.parts_written} == {"00002"}
    assert result.superseded_parts and set(result.superseded_parts) <= parts_before
    table, names = read_output(s3_server, spec.output.uri)
    assert "_SUCCESS" in names
    assert not set(result.superseded_parts) & {n for n in names}, "replaced parts are gone"
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 13
    rows = {r["id"]: r for r in table.to_pylist()}
    assert all(rows[i]["finish_reason"] != "error" for i in flaky)
    assert result.totals["rows_error"] == 3
    manifest = manifest_of(s3_server, spec.output.uri)
    assert [r["mode"] for r in manifest["runs"]] == ["run", "retry-errors"]
    assert_totals_match(manifest, table)


# --- OpenAI batch JSONL ----------------------------------------------------------------------


def test_openai_batch_on_s3(ray_local: Any, s3_server: S3Server, tiny_model_dir: Path) -> None:
    bucket = s3_server.make_bucket()
    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"Say something about {i} rivers."}],
                "max_tokens": 3 + i % 3,
            },
        }
        for i in range(8)
    ]
    lines.append({"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {}})
    s3_server.put(f"s3://{bucket}/batch/input.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    spec = make_spec(
        "batch-job",
        {"uri": f"s3://{bucket}/batch/input.jsonl", "format": "openai_batch"},
        f"s3://{bucket}/batch-out/",
        s3_server,
        tiny_model_dir,
        limits={"max_error_fraction": 0.5},
    )
    result = run_job(spec)
    assert result.status == "complete" and result.exit_code == 0
    table, _ = read_output(s3_server, spec.output.uri)
    assert_exactly_once(table, [x["custom_id"] for x in lines])
    rows = {r["id"]: r for r in table.to_pylist()}
    # A generate job says an embeddings line needs the other task, before reading its body.
    assert "does not fit this job's task generate" in rows["emb"]["error"]
    for i in range(8):
        assert rows[f"req-{i}"]["finish_reason"] in ("stop", "length")
        assert rows[f"req-{i}"]["completion_tokens"] <= 3 + i % 3
    assert_totals_match(manifest_of(s3_server, spec.output.uri), table)

    # --fresh replaces the old output instead of mixing: one attempt, each id once.
    s3_server.put(f"{spec.output.uri}notes.txt", "not ours")
    greedy_stop = spec.model_copy(
        update={"sampling": spec.sampling.model_copy(update={"stop": ["."]})}
    )
    with pytest.raises(ResumeRefused, match="sampling changed"):
        run_job(greedy_stop)
    again = run_job(greedy_stop, fresh=True)
    assert again.status == "complete" and again.attempt == 1
    table, names = read_output(s3_server, spec.output.uri)
    assert_exactly_once(table, [x["custom_id"] for x in lines])
    assert "notes.txt" in names  # --fresh deletes only the job's own files
    manifest = manifest_of(s3_server, spec.output.uri)
    assert len(manifest["runs"]) == 1
    assert manifest["spec"]["sampling"]["stop"] == ["."]


def test_duplicate_ids_in_a_shard_become_error_rows(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = [{"id": f"d{i % 4}", "text": f"Count {i} boats."} for i in range(6)]
    spec = s3_jsonl_job(
        "dup-job", lines, s3_server, tiny_model_dir, limits={"max_error_fraction": 0.5}
    )
    sessions = count_ray_sessions(monkeypatch)
    result = run_job(spec)
    # One shard: the prompt actor marked the repeats while reading; the cross-shard pass
    # cannot find more and is not run.
    assert sessions[0] == 1
    assert manifest_of(s3_server, spec.output.uri)["duplicate_ids"]["skipped"] == "one shard"
    assert result.status == "complete"
    table, _ = read_output(s3_server, spec.output.uri)
    assert table.num_rows == 6, "every input row is in the output once"
    errors = [r for r in table.to_pylist() if r["finish_reason"] == "error"]
    assert sorted(r["id"] for r in errors) == ["d0", "d1"]  # the later copies
    assert all("duplicate id" in r["error"] for r in errors)
    firsts = [r for r in table.to_pylist() if r["finish_reason"] != "error"]
    assert sorted(r["id"] for r in firsts) == ["d0", "d1", "d2", "d3"]


# --- storage faults and mixed passthrough types ----------------------------------------------


def test_throttled_part_writes_do_not_fail_the_job(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path
) -> None:
    lines = [{"id": f"t{i}", "text": f"Name {i} lakes."} for i in range(12)]
    spec = s3_jsonl_job("throttled", lines, s3_server, tiny_model_dir, storage={"retry_s": 60})
    # Enough 503s in a row that the quick attempts inside botocore and s3fs give up: only the
    # commit path's own retries (storage.retry_s) get the part written.
    bucket = spec.output.uri.split("/")[2]
    fault = s3_server.fail_next("PUT", f"/{bucket}/out/part-", times=6)
    result = run_job(spec)
    assert result.status == "complete" and fault.served == 6
    table, names = read_output(s3_server, spec.output.uri)
    assert "_SUCCESS" in names
    assert_exactly_once(table, [x["id"] for x in lines])


def test_mixed_passthrough_types_make_error_rows_not_a_crash(
    ray_local: Any, tmp_path: Path, tiny_model_dir: Path
) -> None:
    src = tmp_path / "mixed.jsonl"
    values: list[Any] = [*range(1100), "n/a", 7.5, [1, 2]]  # ints first, then other types
    src.write_text(
        "".join(
            json.dumps({"id": f"m{i}", "q": f"Say {i}.", "n": v}) + "\n"
            for i, v in enumerate(values)
        )
    )
    out = tmp_path / "out"
    spec = parse_job_spec(
        {
            "name": "mixed",
            "input": {
                "uri": str(src),
                "format": "jsonl",
                "id_column": "id",
                "prompt_column": "q",
                "passthrough_columns": ["n"],
                "shard_bytes": 8192,
            },
            "model": {"path": str(tiny_model_dir)},
            "engine": {"kind": "reference", "device": "cpu", "max_batch_size": 32},
            "sampling": {"max_tokens": 1},
            "resources": {"num_actors": 1, "cpus_per_actor": 0.5},
            "output": {"uri": str(out), "report": False},
        }
    )
    result = run_job(spec)
    assert result.status == "complete"
    table = pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("part-*.parquet")))
    assert table.num_rows == len(values) and table.schema.field("n").type == pa.int64()
    errors = {r["id"]: r["error"] for r in table.to_pylist() if r["finish_reason"] == "error"}
    assert sorted(errors) == ["m1100", "m1101", "m1102"]
    assert all("column 'n'" in e and "int64" in e for e in errors.values())


def test_duplicate_ids_across_shards_become_error_rows_naming_the_first(
    ray_local: Any, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, ids in (("a", ["x1", "x2", "x3"]), ("b", ["x4", "x2", "x5", "x3"])):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps({"id": i, "q": f"Say {i}."}) + "\n" for i in ids)
        )
    out = tmp_path / "out"
    spec = parse_job_spec(
        {
            "name": "dups",
            "input": {
                "uri": str(tmp_path / "*.jsonl"),
                "format": "jsonl",
                "id_column": "id",
                "prompt_column": "q",
            },
            "model": {"path": str(tiny_model_dir)},
            "engine": {"kind": "reference", "device": "cpu"},
            "sampling": {"max_tokens": 2},
            "resources": {"num_actors": 1, "cpus_per_actor": 0.5},
            "output": {"uri": str(out), "report": False},
            "limits": {"max_error_fraction": 0.5},
        }
    )
    sessions = count_ray_sessions(monkeypatch)
    result = run_job(spec)
    assert result.status == "complete"
    assert sessions[0] == 1, "the cross-shard pass runs in the job's own Ray session"
    table = pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("part-*.parquet")))
    assert table.num_rows == 7  # every input row, once
    errors = [r for r in table.to_pylist() if r["finish_reason"] == "error"]
    assert sorted(r["id"] for r in errors) == ["x2", "x3"]  # the copies in the second file
    assert all("duplicate id" in r["error"] and "shard 0" in r["error"] for r in errors)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["duplicate_ids"]["num_duplicates"] == 2
    assert {e["id"] for e in manifest["duplicate_ids"]["examples"]} == {"x2", "x3"}
    assert manifest["totals"]["rows_error"] == 2
    assert {p.name for p in out.glob("part-*.parquet")} == {p["name"] for p in manifest["parts"]}


def test_stop_at_ends_the_run_with_what_finished_and_a_rerun_resumes(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path
) -> None:
    """limits.stop_at (a Batch API completion window): the run stops taking rows at that wall
    time, commits what finished and ends incomplete; without the deadline a rerun adds exactly
    the missing rows."""
    import time

    lines = [{"id": f"d{i:03d}", "text": f"Deadline row {i}."} for i in range(40)]
    spec = s3_jsonl_job("deadline", lines, s3_server, tiny_model_dir)
    said: list[str] = []
    past = spec.model_copy(update={"limits": spec.limits.model_copy(update={"stop_at": 1.0})})
    result = run_job(past, emit=said.append)
    assert result.status == "incomplete" and result.exit_code == 1
    assert any("limits.stop_at" in line for line in said)
    assert result.rows_written < 40 and "rerun the same command" in result.message
    later = spec.model_copy(
        update={"limits": spec.limits.model_copy(update={"stop_at": time.time() + 3600})}
    )
    done = run_job(later)  # a far deadline changes nothing, and the output resumes
    assert done.status == "complete"
    table, _ = read_output(s3_server, spec.output.uri)
    assert_exactly_once(table, [x["id"] for x in lines])
