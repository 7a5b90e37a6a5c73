"""Reading inputs from S3 (moto over real HTTP) and local files: shards, and rows with ids,
columns and error rows."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.batch.driver.plan import preflight
from pipeline.batch.driver.run import plan_input
from pipeline.batch.driver.shards import plan_shards
from pipeline.batch.stages.read import derived_id, read_shard
from pipeline.spec import JobSpec, SpecError, StorageSpec, parse_job_spec
from pipeline.storage import COMPLETE_MARKER, list_input_files, materialize_model
from tests.integration.s3_server import S3Server


def make_spec(storage: StorageSpec, input_section: dict[str, Any], **sections: Any) -> JobSpec:
    data = {
        "name": "read-test",
        "input": input_section,
        "model": {"path": "/unused"},
        "output": {"uri": "/tmp/unused"},
        "storage": storage.model_dump(),
        "resources": {"batch_size": 4},
        **sections,
    }
    return parse_job_spec(data)


def collect(spec: JobSpec) -> tuple[list[dict[str, Any]], int]:
    """Every row of the job's input (through its shards) and the number of shards."""
    plan, passthrough = plan_input(spec, list_input_files(spec))
    rows = [
        r for s in plan.shards for r in read_shard(spec, s, None, passthrough).table.to_pylist()
    ]
    return rows, len(plan)


def read_all(spec: JobSpec) -> pa.Table:
    """The rows of a job's input as one table, in input order."""
    plan, passthrough = plan_input(spec, list_input_files(spec))
    return pa.concat_tables(read_shard(spec, s, None, passthrough).table for s in plan.shards)


def offsets(lines: list[str]) -> list[int]:
    """Byte offset of each line of a file written as "\n".join(lines)."""
    out, at = [], 0
    for line in lines:
        out.append(at)
        at += len(line.encode()) + 1
    return out


def parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def test_parquet_ids_columns_and_overrides(s3_server: S3Server, bucket: str) -> None:
    uri = f"s3://{bucket}/in/prompts.parquet"
    table = pa.table(
        {
            "qid": [f"q{i}" for i in range(10)],
            "question": [f"question number {i}" for i in range(10)],
            "user": list(range(100, 110)),
            "budget": [8, None, 16, 4, 4, 4, 4, 4, 4, 4],
            "ignored": ["x"] * 10,
        }
    )
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=4)
    s3_server.put(uri, sink.getvalue())
    spec = make_spec(
        s3_server.storage_spec(),
        {
            "uri": uri,
            "format": "parquet",
            "id_column": "qid",
            "prompt_column": "question",
            "passthrough_columns": ["user"],
            "shard_rows": 4,
        },
        sampling={"overrides": {"max_tokens": "budget"}},
    )
    rows, num_shards = collect(spec)
    by_id = {r["id"]: r for r in rows}
    assert sorted(by_id) == sorted(f"q{i}" for i in range(10))
    assert by_id["q3"]["prompt"] == "question number 3"
    assert by_id["q3"]["user"] == 103
    assert by_id["q0"]["budget"] == 8 and by_id["q1"]["budget"] is None
    assert all(r["error"] is None and r["messages"] is None for r in rows)
    assert "ignored" not in rows[0]
    # Three row groups (4 + 4 + 2 rows) of at most shard_rows: one shard each.
    assert num_shards == 3


def test_jsonl_malformed_line_is_an_error_row(s3_server: S3Server, bucket: str) -> None:
    uri = f"s3://{bucket}/in/chat.jsonl"
    lines = [
        json.dumps({"messages": [{"role": "user", "content": "hello"}], "tag": "a"}),
        "{not json",
        "",
        json.dumps({"messages": "[]", "tag": "c"}),
        json.dumps({"tag": "d"}),
        json.dumps(["not", "an", "object"]),
    ]
    s3_server.put(uri, "\n".join(lines) + "\n")
    spec = make_spec(
        s3_server.storage_spec(),
        {
            "uri": uri,
            "format": "jsonl",
            "messages_column": "messages",
            "passthrough_columns": ["tag"],
        },
    )
    rows, _ = collect(spec)
    by_id = {r["id"]: r for r in rows}
    at = offsets(lines)
    # Nothing dropped: 5 non-blank lines, ids from the line's byte offset.
    assert sorted(by_id) == sorted(derived_id(uri, at[i]) for i in (0, 1, 3, 4, 5))
    first = by_id[derived_id(uri, at[0])]
    assert first["error"] is None and first["tag"] == "a"
    assert json.loads(first["messages"]) == [{"role": "user", "content": "hello"}]
    bad_json = by_id[derived_id(uri, at[1])]["error"]
    assert bad_json.startswith(f"{uri} line 2: not valid JSON")
    # A chat given as JSON text is kept as text; prompts validates its content later.
    assert by_id[derived_id(uri, at[3])]["messages"] == "[]"
    assert "missing field(s) ['messages']" in by_id[derived_id(uri, at[4])]["error"]
    assert "line 6: expected a JSON object" in by_id[derived_id(uri, at[5])]["error"]


def test_openai_batch_lines(s3_server: S3Server, bucket: str) -> None:
    uri = f"s3://{bucket}/batch/requests.jsonl"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0.7}
    requests = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "comp-1", "url": "/v1/completions", "body": {"prompt": "Once", "seed": 5}},
        {"custom_id": "emb-1", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "mod-1", "url": "/v1/moderations", "body": {"input": "x"}},
        {"custom_id": "n-1", "url": "/v1/chat/completions", "body": {**chat, "best_of": 3}},
        {"custom_id": "n-3", "url": "/v1/chat/completions", "body": {**chat, "n": 3}},
        {"custom_id": "nobody", "url": "/v1/chat/completions"},
        {
            "custom_id": "mct",
            "url": "/v1/chat/completions",
            "body": {"messages": chat["messages"], "max_completion_tokens": 3},
        },
    ]
    lines = [json.dumps(r) for r in requests] + ["{truncated"]
    s3_server.put(uri, "\n".join(lines) + "\n")
    broken = derived_id(uri, offsets(lines)[8])
    spec = make_spec(s3_server.storage_spec(), {"uri": uri, "format": "openai_batch"})
    rows, _ = collect(spec)
    by_id = {r["id"]: r for r in rows}
    assert set(by_id) == {
        "chat-1",
        "comp-1",
        "emb-1",
        "mod-1",
        "n-1",
        "n-3",
        "nobody",
        "mct",
        broken,
    }
    ok = by_id["chat-1"]
    assert ok["error"] is None and ok["max_tokens"] == 12 and ok["temperature"] == 0.7
    assert json.loads(ok["messages"])[0]["content"] == "hi"
    assert by_id["comp-1"]["prompt"] == "Once" and by_id["comp-1"]["seed"] == 5
    assert by_id["comp-1"]["max_tokens"] is None
    assert "unsupported url '/v1/moderations'" in by_id["mod-1"]["error"]
    # An embeddings line reads as its text, and is an error row in a job that generates.
    assert by_id["emb-1"]["prompt"] == "x" and "task generate" in by_id["emb-1"]["error"]
    assert "unsupported body parameter best_of=3" in by_id["n-1"]["error"]
    assert by_id["n-3"]["error"] is None and by_id["n-3"]["num_samples"] == 3
    assert "missing body" in by_id["nobody"]["error"]
    assert by_id["mct"]["max_tokens"] == 3
    assert "line 9: not valid JSON" in by_id[broken]["error"]


def test_glob_across_files_and_limit(s3_server: S3Server, bucket: str) -> None:
    for part in range(3):
        body = "\n".join(json.dumps({"k": f"p{part}-{i}", "q": f"text {i}"}) for i in range(5))
        s3_server.put(f"s3://{bucket}/in/part-{part}.jsonl", body)
    s3_server.put(f"s3://{bucket}/in/other.txt", "not an input")
    s3_server.put(f"s3://{bucket}/in/_SUCCESS", "")
    base = {"uri": f"s3://{bucket}/in/part-*.jsonl", "format": "jsonl", "id_column": "k"}
    spec = make_spec(s3_server.storage_spec(), {**base, "prompt_column": "q"})
    files = list_input_files(spec)
    assert [f.uri for f in files] == [f"s3://{bucket}/in/part-{p}.jsonl" for p in range(3)]
    assert all(f.size > 0 and f.version for f in files)
    rows, _ = collect(spec)
    assert sorted(r["id"] for r in rows) == sorted(f"p{p}-{i}" for p in range(3) for i in range(5))

    limited = make_spec(s3_server.storage_spec(), {**base, "prompt_column": "q", "limit": 7})
    rows, _ = collect(limited)
    # input order: all of part-0, then the first two rows of part-1
    assert sorted(r["id"] for r in rows) == sorted([f"p0-{i}" for i in range(5)] + ["p1-0", "p1-1"])


def test_no_matching_file_names_the_uri(s3_server: S3Server, bucket: str) -> None:
    spec = make_spec(
        s3_server.storage_spec(),
        {"uri": f"s3://{bucket}/missing/*.jsonl", "format": "jsonl", "prompt_column": "q"},
    )
    with pytest.raises(
        SpecError, match=rf"input.uri: no input file matches 's3://{bucket}/missing"
    ):
        list_input_files(spec)


def test_unreachable_endpoint_fails_fast(aws_env) -> None:
    storage = StorageSpec(endpoint_url="http://127.0.0.1:9")  # nothing listens on port 9
    spec = make_spec(
        storage, {"uri": "s3://nightly/in/*.jsonl", "format": "jsonl", "prompt_column": "q"}
    )
    start = time.monotonic()
    with pytest.raises(SpecError) as info:
        preflight(spec)
    assert time.monotonic() - start < 15
    message = str(info.value)
    assert "s3://nightly/in/*.jsonl" in message and "http://127.0.0.1:9" in message


def test_materialize_model_downloads_once(
    s3_server: S3Server, bucket: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    prefix = f"s3://{bucket}/models/tiny"
    s3_server.upload_dir(tiny_model_dir, prefix)
    storage = s3_server.storage_spec()
    cache = tmp_path / "cache"
    first = materialize_model(prefix, str(cache), storage)
    assert (first / COMPLETE_MARKER).is_file()
    assert sorted(p.name for p in first.iterdir() if p.name != COMPLETE_MARKER) == sorted(
        p.name for p in tiny_model_dir.iterdir()
    )
    assert (first / "config.json").read_bytes() == (tiny_model_dir / "config.json").read_bytes()
    # Tamper with the local copy: a second call must reuse it, not download again.
    (first / "config.json").write_text("{}")
    second = materialize_model(prefix, str(cache), storage)
    assert second == first and (second / "config.json").read_text() == "{}"
    # A changed remote listing is a new cache entry.
    s3_server.put(f"{prefix}/extra.txt", "new file")
    third = materialize_model(prefix, str(cache), storage)
    assert third != first and (third / "extra.txt").read_text() == "new file"

    with pytest.raises(SpecError, match=r"model.path: .* has no config.json"):
        materialize_model(f"s3://{bucket}/models/nothing", str(cache), storage)


@pytest.mark.parametrize(
    "name",
    [
        "../../escaped.txt",  # two levels up: beside the cache directory
        "sub/../../escaped.txt",  # up past the model's own directory, into the cache
        "{tmp}/escaped.txt",  # "models/x//tmp/...": an absolute path once joined
    ],
)
def test_a_key_that_leads_out_of_the_cache_is_refused(
    s3_server: S3Server, bucket: str, tiny_model_dir: Path, tmp_path: Path, name: str
) -> None:
    name = name.format(tmp=tmp_path)  # the absolute case stays inside this test's directory
    prefix = f"s3://{bucket}/models/crafted"
    s3_server.upload_dir(tiny_model_dir, prefix)
    s3_server.put(f"{prefix}/{name}", "written where it does not belong")
    cache = tmp_path / "area" / "cache"
    with pytest.raises(SpecError) as info:
        materialize_model(prefix, str(cache), s3_server.storage_spec())
    message = str(info.value)
    assert message.startswith("model.path: ") and f"{prefix}/{name}" in message, message
    # Refused before any download: nothing written, inside the cache or out.
    written = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    assert written == [], written


def test_parquet_messages_and_gzip_jsonl_without_ray(s3_server: S3Server, bucket: str) -> None:
    chats = [[{"role": "user", "content": f"hi {i}"}] for i in range(3)]
    s3_server.put(f"s3://{bucket}/chat.parquet", parquet_bytes(pa.table({"chat": chats})))
    spec = make_spec(
        s3_server.storage_spec(),
        {"uri": f"s3://{bucket}/chat.parquet", "format": "parquet", "messages_column": "chat"},
    )
    table = read_all(spec)
    assert [json.loads(m) for m in table.column("messages").to_pylist()] == chats
    assert table.column("error").to_pylist() == [None] * 3

    import gzip

    body = "\n".join(json.dumps({"q": f"question {i}"}) for i in range(4)).encode()
    s3_server.put(f"s3://{bucket}/in.jsonl.gz", gzip.compress(body))
    spec = make_spec(
        s3_server.storage_spec(),
        {"uri": f"s3://{bucket}/in.jsonl.gz", "format": "jsonl", "prompt_column": "q"},
    )
    assert plan_shards(spec, list_input_files(spec)).shards[0].kind == "whole_file"
    assert read_all(spec).column("prompt").to_pylist() == [f"question {i}" for i in range(4)]


def test_concurrent_materialize_downloads_once(
    s3_server: S3Server, bucket: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.storage import models

    prefix = f"s3://{bucket}/models/shared"
    uploaded = s3_server.upload_dir(tiny_model_dir, prefix)
    storage = s3_server.storage_spec()
    passes: list[list[str]] = []
    real_download_all = models._download_all

    def counting_download_all(fs: Any, root: str, files: dict, *args: Any) -> None:
        passes.append(sorted(files))
        time.sleep(0.05)  # widen the window in which a second downloader could start
        real_download_all(fs, root, files, *args)

    # The download pass itself is counted, not the filesystem's calls: how fsspec builds and
    # caches its instances differs between releases (one per thread in older ones).
    monkeypatch.setattr(models, "_download_all", counting_download_all)
    cache = str(tmp_path / "cache")
    with ThreadPoolExecutor(max_workers=4) as pool:
        paths = list(pool.map(lambda _: materialize_model(prefix, cache, storage), range(4)))
    assert len(set(paths)) == 1
    assert passes == [sorted(u[len(prefix) + 1 :] for u in uploaded)]  # one pass, every file
    assert all((Path(paths[0]) / name).is_file() for name in passes[0])


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_shards_split_one_file_and_keep_ids(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"in.{fmt}"
    questions = [f"q{i}" for i in range(5)]
    lines = [json.dumps({"q": q}) for q in questions]
    if fmt == "parquet":
        pq.write_table(pa.table({"q": questions}), path, row_group_size=2)
        size = {"shard_rows": 2}
    else:
        path.write_text("\n".join(lines))
        size = {"shard_bytes": 1024}
        path.write_text("\n".join(lines) + "\n" + "\n" * 2000)  # blank tail: more bytes
    spec = make_spec(StorageSpec(), {"uri": str(path), "format": fmt, "prompt_column": "q", **size})
    (file,) = list_input_files(spec)
    plan = plan_shards(spec, [file])
    assert len(plan) >= 2, "one file feeds several shards"
    table = read_all(spec)
    assert table.column("prompt").to_pylist() == questions
    positions = list(range(5)) if fmt == "parquet" else offsets(lines)
    assert table.column("id").to_pylist() == [derived_id(file.uri, p) for p in positions]
    limited = make_spec(
        StorageSpec(), {"uri": str(path), "format": fmt, "prompt_column": "q", "limit": 3, **size}
    )
    assert read_all(limited).column("prompt").to_pylist() == questions[:3]


def test_override_values_that_do_not_fit_are_error_rows(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    lines = [{"q": "a", "s": 2**70}, {"q": "b", "s": 1.5}, {"q": "c", "s": 7}, {"q": "d"}]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    spec = make_spec(
        StorageSpec(),
        {"uri": str(path), "format": "jsonl", "prompt_column": "q"},
        sampling={"overrides": {"seed": "s"}},
    )
    table = read_all(spec)
    errors = table.column("error").to_pylist()
    assert "line 1: column 's' (sampling.overrides.seed)" in errors[0]
    assert "does not fit in a 64-bit integer" in errors[0]
    assert "line 2: column 's' (sampling.overrides.seed): 1.5 is not an integer" in errors[1]
    assert errors[2:] == [None, None]
    assert table.column("s").to_pylist() == [None, None, 7, None]


def test_corrupt_parquet_fails_naming_the_file(tmp_path: Path) -> None:
    from pipeline.storage import StorageError

    path = tmp_path / "broken.parquet"
    path.write_bytes(b"this is not parquet")
    spec = make_spec(StorageSpec(), {"uri": str(path), "format": "parquet", "prompt_column": "q"})
    with pytest.raises(StorageError, match=rf"cannot read {path} as input.format parquet"):
        read_all(spec)


def test_passthrough_types_are_fixed_up_front_and_cells_that_do_not_fit_are_errors(
    tmp_path: Path,
) -> None:
    path = tmp_path / "mixed.jsonl"
    values: list[Any] = [i for i in range(1200)] + ["twelve hundred", 1201, {"nested": 1}]
    path.write_text("\n".join(json.dumps({"q": f"q{i}", "n": v}) for i, v in enumerate(values)))
    spec = make_spec(
        StorageSpec(),
        {
            "uri": str(path),
            "format": "jsonl",
            "prompt_column": "q",
            "passthrough_columns": ["n"],
            "shard_bytes": 4096,
        },
    )
    plan, passthrough = plan_input(spec, list_input_files(spec))
    assert passthrough == [pa.field("n", pa.int64())]  # from the first 1,000 lines
    assert len(plan) > 3
    table = read_all(spec)
    assert table.schema.field("n").type == pa.int64()
    prompts, messages = table.column("prompt").to_pylist(), table.column("error").to_pylist()
    errors = dict(zip(prompts, messages, strict=True))
    assert errors["q1201"] is None and errors["q5"] is None
    for bad in ("q1200", "q1202"):
        assert "column 'n'" in errors[bad] and "int64" in errors[bad], errors[bad]
        assert "input.passthrough_types.n" in errors[bad]
    declared = make_spec(
        StorageSpec(),
        {
            "uri": str(path),
            "format": "jsonl",
            "prompt_column": "q",
            "passthrough_columns": ["n"],
            "passthrough_types": {"n": "json"},
        },
    )
    table = read_all(declared)
    assert table.column("error").null_count == table.num_rows  # json keeps every value
    # Text stays text; numbers, objects and lists become their JSON text.
    assert table.column("n").to_pylist()[1200:] == ["twelve hundred", "1201", '{"nested": 1}']


def test_parquet_passthrough_types_unify_across_files(tmp_path: Path) -> None:
    pq.write_table(pa.table({"q": ["a"], "u": pa.array([1], pa.int32())}), tmp_path / "a.parquet")
    pq.write_table(
        pa.table({"q": ["b"], "u": pa.array([2**40], pa.int64())}), tmp_path / "b.parquet"
    )
    spec = make_spec(
        StorageSpec(),
        {
            "uri": str(tmp_path),
            "format": "parquet",
            "prompt_column": "q",
            "passthrough_columns": ["u"],
        },
    )
    _, passthrough = plan_input(spec, list_input_files(spec))
    assert passthrough == [pa.field("u", pa.int64())]
    assert read_all(spec).column("u").to_pylist() == [1, 2**40]


def test_a_parquet_bool_in_a_numeric_passthrough_column_is_an_error_not_a_number(
    tmp_path: Path,
) -> None:
    """Arrow's cast would write True as 1 without a word: a cell that does not plainly fit its
    column's declared type is an error row, as the same cell in JSONL is."""
    pq.write_table(pa.table({"q": ["a", "b"], "n": [True, None]}), tmp_path / "a.parquet")
    spec = make_spec(
        StorageSpec(),
        {
            "uri": str(tmp_path),
            "format": "parquet",
            "prompt_column": "q",
            "passthrough_columns": ["n"],
            "passthrough_types": {"n": "int64"},
        },
    )
    table = read_all(spec)
    assert table.column("n").to_pylist() == [None, None]
    errors = table.column("error").to_pylist()
    assert errors[0] is not None and "input.passthrough_types.n" in errors[0] and errors[1] is None


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_overrides_of_shared_sampling_fields_reach_each_rows_params(
    tmp_path: Path, fmt: str
) -> None:
    from pipeline.batch.stages.rows import row_sampling

    rows = [
        {"q": "a", "stops": ["END", "STOP"], "ids": [5, 9], "bias": {"7": 3.0}, "pen": 0.5},
        {"q": "b", "stops": None, "ids": None, "bias": None, "pen": None},
        {"q": "c", "stops": [""], "ids": [1], "bias": {"x": 1}, "pen": 0.0},
    ]
    path = tmp_path / f"in.{fmt}"
    if fmt == "parquet":  # objects as JSON text in Parquet (a struct cannot have id keys)
        cells = [{**r, "bias": None if r["bias"] is None else json.dumps(r["bias"])} for r in rows]
        pq.write_table(pa.Table.from_pylist(cells), path)
    else:
        path.write_text("\n".join(json.dumps(r) for r in rows))
    overrides = {
        "stop": "stops",
        "stop_token_ids": "ids",
        "logit_bias": "bias",
        "presence_penalty": "pen",
    }
    spec = make_spec(
        StorageSpec(),
        {"uri": str(path), "format": fmt, "prompt_column": "q"},
        sampling={"stop": ["job"], "frequency_penalty": 1.0, "overrides": overrides},
    )
    read = read_all(spec).to_pylist()
    first = row_sampling(read[0], spec.sampling)
    assert first.stop == ("END", "STOP") and first.stop_token_ids == (5, 9)
    assert first.logit_bias == ((7, 3.0),) and first.presence_penalty == 0.5
    assert first.frequency_penalty == 1.0  # the job's, where no column overrides it
    second = row_sampling(read[1], spec.sampling)  # null cells keep the job's values
    assert second.stop == ("job",) and second.logit_bias == () and second.presence_penalty == 0
    assert read[2]["error"] is not None and "sampling.overrides.stop" in read[2]["error"]
