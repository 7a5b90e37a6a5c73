"""Reading inputs from S3 (moto over real HTTP) into rows with ids, columns and error rows."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.batch.plan import preflight
from pipeline.batch.read import derived_id, read_dataset
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
    ds = read_dataset(spec, list_input_files(spec)).materialize()
    return ds.take_all(), ds.num_blocks()


def parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def test_parquet_ids_columns_and_overrides(ray_local, s3_server: S3Server, bucket: str) -> None:
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
    s3_server.put(uri, parquet_bytes(table))
    spec = make_spec(
        s3_server.storage_spec(),
        {
            "uri": uri,
            "format": "parquet",
            "id_column": "qid",
            "prompt_column": "question",
            "passthrough_columns": ["user"],
        },
        sampling={"overrides": {"max_tokens": "budget"}},
    )
    rows, num_blocks = collect(spec)
    by_id = {r["id"]: r for r in rows}
    assert sorted(by_id) == sorted(f"q{i}" for i in range(10))
    assert by_id["q3"]["prompt"] == "question number 3"
    assert by_id["q3"]["user"] == 103
    assert by_id["q0"]["budget"] == 8 and by_id["q1"]["budget"] is None
    assert all(r["error"] is None and r["messages"] is None for r in rows)
    assert "ignored" not in rows[0]
    # 10 rows with batch_size 4: several blocks, so two engine actors would both get work.
    assert num_blocks >= 2


def test_jsonl_malformed_line_is_an_error_row(ray_local, s3_server: S3Server, bucket: str) -> None:
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
    # Nothing dropped: 5 non-blank lines, ids from the 0-based line number.
    assert sorted(by_id) == sorted(derived_id(uri, i) for i in (0, 1, 3, 4, 5))
    first = by_id[derived_id(uri, 0)]
    assert first["error"] is None and first["tag"] == "a"
    assert json.loads(first["messages"]) == [{"role": "user", "content": "hello"}]
    bad_json = by_id[derived_id(uri, 1)]["error"]
    assert bad_json.startswith(f"{uri} line 2: not valid JSON")
    # A chat given as JSON text is kept as text; prompts validates its content later.
    assert by_id[derived_id(uri, 3)]["messages"] == "[]"
    assert "missing field(s) ['messages']" in by_id[derived_id(uri, 4)]["error"]
    assert "line 6: expected a JSON object" in by_id[derived_id(uri, 5)]["error"]


def test_openai_batch_lines(ray_local, s3_server: S3Server, bucket: str) -> None:
    uri = f"s3://{bucket}/batch/requests.jsonl"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0.7}
    requests = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "comp-1", "url": "/v1/completions", "body": {"prompt": "Once", "seed": 5}},
        {"custom_id": "emb-1", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "n-1", "url": "/v1/chat/completions", "body": {**chat, "n": 3}},
        {"custom_id": "nobody", "url": "/v1/chat/completions"},
        {
            "custom_id": "mct",
            "url": "/v1/chat/completions",
            "body": {"messages": chat["messages"], "max_completion_tokens": 3},
        },
    ]
    text = "\n".join(json.dumps(r) for r in requests) + "\n{truncated\n"
    s3_server.put(uri, text)
    spec = make_spec(s3_server.storage_spec(), {"uri": uri, "format": "openai_batch"})
    rows, _ = collect(spec)
    by_id = {r["id"]: r for r in rows}
    assert set(by_id) == {"chat-1", "comp-1", "emb-1", "n-1", "nobody", "mct", derived_id(uri, 6)}
    ok = by_id["chat-1"]
    assert ok["error"] is None and ok["max_tokens"] == 12 and ok["temperature"] == 0.7
    assert json.loads(ok["messages"])[0]["content"] == "hi"
    assert by_id["comp-1"]["prompt"] == "Once" and by_id["comp-1"]["seed"] == 5
    assert by_id["comp-1"]["max_tokens"] is None
    assert "unsupported url '/v1/embeddings'" in by_id["emb-1"]["error"]
    assert "unsupported body parameter n=3" in by_id["n-1"]["error"]
    assert "missing body" in by_id["nobody"]["error"]
    assert by_id["mct"]["max_tokens"] == 3
    assert "line 7: not valid JSON" in by_id[derived_id(uri, 6)]["error"]


def test_glob_across_files_and_limit(ray_local, s3_server: S3Server, bucket: str) -> None:
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


def test_parquet_messages_and_gzip_jsonl_without_ray(s3_server: S3Server, bucket: str) -> None:
    from pipeline.batch.read import read_file

    chats = [[{"role": "user", "content": f"hi {i}"}] for i in range(3)]
    s3_server.put(f"s3://{bucket}/chat.parquet", parquet_bytes(pa.table({"chat": chats})))
    spec = make_spec(
        s3_server.storage_spec(),
        {"uri": f"s3://{bucket}/chat.parquet", "format": "parquet", "messages_column": "chat"},
    )
    (file,) = list_input_files(spec)
    table = read_file(spec, file)
    assert [json.loads(m) for m in table.column("messages").to_pylist()] == chats
    assert table.column("error").to_pylist() == [None] * 3

    import gzip

    body = "\n".join(json.dumps({"q": f"question {i}"}) for i in range(4)).encode()
    s3_server.put(f"s3://{bucket}/in.jsonl.gz", gzip.compress(body))
    spec = make_spec(
        s3_server.storage_spec(),
        {"uri": f"s3://{bucket}/in.jsonl.gz", "format": "jsonl", "prompt_column": "q"},
    )
    (file,) = list_input_files(spec)
    assert read_file(spec, file).column("prompt").to_pylist() == [f"question {i}" for i in range(4)]


def test_concurrent_materialize_downloads_once(
    s3_server: S3Server, bucket: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.storage import filesystem_for

    prefix = f"s3://{bucket}/models/shared"
    uploaded = s3_server.upload_dir(tiny_model_dir, prefix)
    storage = s3_server.storage_spec()
    fs, _ = filesystem_for(prefix, storage)  # s3fs caches instances: the one the code uses
    downloads: list[str] = []
    real_get_file = fs.get_file

    def counting_get_file(rpath: str, lpath: str, **kwargs: Any) -> Any:
        downloads.append(rpath)
        time.sleep(0.05)  # widen the window in which a second downloader could start
        return real_get_file(rpath, lpath, **kwargs)

    monkeypatch.setattr(fs, "get_file", counting_get_file)
    cache = str(tmp_path / "cache")
    with ThreadPoolExecutor(max_workers=4) as pool:
        paths = list(pool.map(lambda _: materialize_model(prefix, cache, storage), range(4)))
    assert len(set(paths)) == 1
    assert sorted(downloads) == sorted(u[len("s3://") :] for u in uploaded)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_chunked_reading_keeps_row_indexes(tmp_path: Path, fmt: str) -> None:
    from pipeline.batch.read import iter_file

    path = tmp_path / f"in.{fmt}"
    questions = [f"q{i}" for i in range(5)]
    if fmt == "parquet":
        pq.write_table(pa.table({"q": questions}), path, row_group_size=3)
    else:
        path.write_text("\n".join(json.dumps({"q": q}) for q in questions))
    spec = make_spec(StorageSpec(), {"uri": str(path), "format": fmt, "prompt_column": "q"})
    (file,) = list_input_files(spec)
    chunks = list(iter_file(spec, file, chunk_rows=2))
    assert len(chunks) >= 3 and all(0 < t.num_rows <= 2 for t in chunks)
    ids = [i for t in chunks for i in t.column("id").to_pylist()]
    assert ids == [derived_id(file.uri, i) for i in range(5)]
    assert [p for t in chunks for p in t.column("prompt").to_pylist()] == questions
    capped = list(iter_file(spec, file, max_rows=3, chunk_rows=2))
    assert [p for t in capped for p in t.column("prompt").to_pylist()] == questions[:3]


def test_override_values_that_do_not_fit_are_error_rows(tmp_path: Path) -> None:
    from pipeline.batch.read import read_file

    path = tmp_path / "in.jsonl"
    lines = [{"q": "a", "s": 2**70}, {"q": "b", "s": 1.5}, {"q": "c", "s": 7}, {"q": "d"}]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    spec = make_spec(
        StorageSpec(),
        {"uri": str(path), "format": "jsonl", "prompt_column": "q"},
        sampling={"overrides": {"seed": "s"}},
    )
    (file,) = list_input_files(spec)
    table = read_file(spec, file)
    errors = table.column("error").to_pylist()
    assert "line 1: column 's' (sampling.overrides.seed)" in errors[0]
    assert "does not fit in a 64-bit integer" in errors[0]
    assert "line 2: column 's' (sampling.overrides.seed): 1.5 is not an integer" in errors[1]
    assert errors[2:] == [None, None]
    assert table.column("s").to_pylist() == [None, None, 7, None]


def test_corrupt_parquet_fails_naming_the_file(tmp_path: Path) -> None:
    from pipeline.batch.read import read_file
    from pipeline.storage import StorageError

    path = tmp_path / "broken.parquet"
    path.write_bytes(b"this is not parquet")
    spec = make_spec(StorageSpec(), {"uri": str(path), "format": "parquet", "prompt_column": "q"})
    (file,) = list_input_files(spec)
    with pytest.raises(StorageError, match=rf"cannot read {path} as input.format parquet"):
        read_file(spec, file)


def test_blocks_are_cut_inside_the_read_task_with_most_cpus_taken(
    ray_local, s3_server: S3Server, bucket: str
) -> None:
    """Engines holding 1.5 of the 2 CPUs leave 0.5: a one-CPU repartition step would never be
    scheduled (the read hangs); the cutting runs in the 1/4-CPU read task instead."""
    body = "\n".join(json.dumps({"k": f"r{i}", "q": f"text {i}"}) for i in range(10))
    s3_server.put(f"s3://{bucket}/in/one.jsonl", body)
    spec = make_spec(
        s3_server.storage_spec(),
        {
            "uri": f"s3://{bucket}/in/one.jsonl",
            "format": "jsonl",
            "id_column": "k",
            "prompt_column": "q",
        },
    )

    @ray_local.remote(num_cpus=1.5)
    class Engines:
        def ready(self) -> bool:
            return True

    engines = Engines.remote()
    try:
        ray_local.get(engines.ready.remote())
        ds = read_dataset(spec, list_input_files(spec)).materialize()
        assert sorted(r["id"] for r in ds.take_all()) == sorted(f"r{i}" for i in range(10))
        assert ds.num_blocks() == 3  # batch_size 4: 4 + 4 + 2 rows, one file
        assert "_read_units)->StreamingRepartition" in ds.stats()  # one fused task
    finally:
        ray_local.kill(engines)
