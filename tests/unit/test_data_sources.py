"""input.format ray_data: spec validation names the field and the fix; the source fingerprint
changes with the source and its arguments, not with a secret (pipeline.data.sources)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from pipeline.data.sources import SourceFingerprint, reader_names, source_fingerprint
from pipeline.data.stage import MARKER_NAME, STAGING_DIR, Snapshot, stage_input
from pipeline.spec import InputSpec, SpecError, StorageSpec, parse_job_spec


def _job(input_: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "sources",
        "input": input_,
        "model": {"path": "/models/tiny"},
        "output": {"uri": "/tmp/out"},
    }


def _refused(input_: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as info:
        parse_job_spec(_job(input_))
    return str(info.value)


def test_a_reader_with_its_arguments_is_accepted() -> None:
    spec = parse_job_spec(
        _job(
            {
                "format": "ray_data",
                "reader": "read_iceberg",
                "reader_args": {"table_identifier": "db.t", "catalog_kwargs": {"type": "sql"}},
                "prompt_column": "text",
            }
        )
    )
    assert spec.input.reader == "read_iceberg" and spec.input.uris == []
    dataset = parse_job_spec(
        _job({"format": "ray_data", "dataset": "my_pkg.data:prompts", "prompt_column": "t"})
    )
    assert dataset.input.dataset == "my_pkg.data:prompts"


def test_an_unknown_reader_is_refused_listing_the_accepted_ones() -> None:
    message = _refused({"format": "ray_data", "reader": "read_icebreg"})
    assert "input.reader: 'read_icebreg' is not a ray.data reader" in message
    assert "read_iceberg" in message and "read_delta" in message and "read_csv" in message
    assert "read_datasource" not in reader_names()


def test_missing_and_unknown_reader_arguments_name_input_reader_args() -> None:
    missing = _refused({"format": "ray_data", "reader": "read_iceberg"})
    assert "input.reader_args" in missing and "table_identifier" in missing
    csv = _refused({"format": "ray_data", "reader": "read_delta", "reader_args": {}})
    assert "input.reader_args" in csv and "'path'" in csv
    unknown = _refused(
        {
            "format": "ray_data",
            "reader": "read_iceberg",
            "reader_args": {"table_identifier": "t", "tabel": "x"},
        }
    )
    assert "input.reader_args" in unknown and "tabel" in unknown


def test_uri_and_reader_do_not_go_together() -> None:
    message = _refused({"format": "ray_data", "uri": "/data/x.parquet", "reader": "read_parquet"})
    assert "input.uri does not apply to input.format ray_data" in message


def test_exactly_one_of_reader_or_dataset() -> None:
    neither = _refused({"format": "ray_data"})
    both = _refused({"format": "ray_data", "reader": "read_csv", "dataset": "m:f"})
    for message in (neither, both):
        assert "exactly one of input.reader" in message and "input.dataset" in message


def test_dataset_must_be_module_colon_function() -> None:
    message = _refused({"format": "ray_data", "dataset": "my_pkg.data.prompts"})
    assert "input.dataset" in message and "'module:function'" in message


def test_reader_fields_need_format_ray_data_and_files_need_a_uri() -> None:
    message = _refused({"uri": "/data/x.parquet", "reader": "read_csv"})
    assert "input.reader applies to input.format ray_data only" in message
    args = _refused({"uri": "/data/x.parquet", "reader_args": {"paths": "x"}})
    assert "input.reader_args applies to input.format ray_data only" in args
    assert "input.uri is required for input.format jsonl" in _refused({"format": "jsonl"})


def _csv_input(path: Path, **args: Any) -> InputSpec:
    return InputSpec(format="ray_data", reader="read_csv", reader_args={"paths": str(path), **args})


def test_file_reader_fingerprint_follows_the_listing_not_secrets(tmp_path: Path) -> None:
    data = tmp_path / "in.csv"
    data.write_text("id,text\n1,a\n")
    storage = StorageSpec()
    first = source_fingerprint(_csv_input(data, arrow_open_stream_args={}), storage)
    assert first.version.kind == "listing" and first.version.value[0]["size"] == 12
    assert source_fingerprint(_csv_input(data, arrow_open_stream_args={}), storage) == first
    # A secret-looking argument is masked: rotating it keeps the snapshot.
    a = source_fingerprint(_csv_input(data, ray_remote_args={"secret_key": "one"}), storage)
    b = source_fingerprint(_csv_input(data, ray_remote_args={"secret_key": "two"}), storage)
    assert a.value == b.value and a.args["ray_remote_args"]["secret_key"] == "***"

    data.write_text("id,text\n1,a\n2,b\n")
    os.utime(data, ns=(1, 1))
    changed = source_fingerprint(_csv_input(data, arrow_open_stream_args={}), storage)
    assert changed.value != first.value and changed.key != first.key
    assert "the files read_csv reads changed" in changed.describe_change(first)
    assert SourceFingerprint.from_json(changed.to_json()) == changed


def test_a_function_is_fingerprinted_by_name_and_arguments() -> None:
    storage = StorageSpec()
    one = InputSpec(format="ray_data", dataset="m:f", reader_args={"n": 1})
    two = InputSpec(format="ray_data", dataset="m:f", reader_args={"n": 2})
    a, b = source_fingerprint(one, storage), source_fingerprint(two, storage)
    assert a.version.kind == "none" and a.value != b.value
    assert "input.reader_args of dataset:m:f changed" in b.describe_change(a)


# --- reusing a staged snapshot (no Ray: nothing is staged) ------------------------------------


def _csv_job(tmp_path: Path) -> Any:
    data = tmp_path / "in.csv"
    data.write_text("id,text\n1,a\n")
    return parse_job_spec(
        {
            **_job(
                {
                    "format": "ray_data",
                    "reader": "read_csv",
                    "reader_args": {"paths": str(data)},
                    "prompt_column": "text",
                }
            ),
            "output": {"uri": str(tmp_path / "out")},
        }
    )


def _place_snapshot(spec: Any, with_file: bool) -> Snapshot:
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = source_fingerprint(spec.input, spec.storage)
    where = Path(spec.output.uri) / STAGING_DIR / source.key
    data = where / "attempt"
    data.mkdir(parents=True)
    part = data / "p.parquet"
    pq.write_table(pa.table({"id": [1], "text": ["a"]}), part)
    snapshot = Snapshot(
        str(data), source, [{"uri": str(part), "size": part.stat().st_size, "rows": 1}], 1
    )
    (where / MARKER_NAME).write_text(snapshot.to_json())
    if not with_file:
        part.unlink()
    return snapshot


def test_a_complete_snapshot_is_reused_as_parquet_input(tmp_path: Path) -> None:
    spec = _csv_job(tmp_path)
    snapshot = _place_snapshot(spec, with_file=True)
    said: list[str] = []
    staged = stage_input(spec, emit=said.append)  # no Ray here: it must not stage
    assert staged.input.format == "parquet" and staged.input.uri == snapshot.uri
    assert staged.input.reader is None and staged.input.reader_args == {}
    assert staged.input.prompt_column == "text"
    assert said == [
        f"input: reusing the staged snapshot {snapshot.uri} (1 rows, 1 file(s)); nothing is "
        "read from the source"
    ]
    assert stage_input(staged) is staged  # other formats pass through


def test_a_snapshot_missing_files_is_refused_with_what_to_do(tmp_path: Path) -> None:
    spec = _csv_job(tmp_path)
    _place_snapshot(spec, with_file=False)
    with pytest.raises(SpecError, match=r"no longer holds the files.*rerun with --fresh"):
        stage_input(spec)


def test_listing_a_ray_data_input_says_it_is_staged_first(tmp_path: Path) -> None:
    from pipeline.storage import list_input_files

    with pytest.raises(SpecError, match=r"input.format ray_data has no files to list before"):
        list_input_files(_csv_job(tmp_path))
