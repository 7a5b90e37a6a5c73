"""input.format ray_data: spec validation names the field and the fix; the source fingerprint
changes with the source and its arguments, not with a secret
(pipeline.batch.stages.read.sources)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from pipeline.batch.stages.read.sources import SourceFingerprint, source_fingerprint
from pipeline.batch.stages.read.staging import MARKER_NAME, STAGING_DIR, Snapshot, stage_input
from pipeline.spec import InputSpec, SpecError, StorageSpec, parse_job_spec
from pipeline.spec.sources import reader_names


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


# --- credentials: never written, never hashed ------------------------------------------------

# The credential keys each reader the docs name takes, as its library spells them, each with a
# value no output may hold. A rotation changes every value.
SECRET = "PLAINTEXT-CREDENTIAL-{}-{}"
CREDENTIAL_KEYS = {
    # pyiceberg catalog properties (REST, S3, ADLS, GCS)
    "read_iceberg": [
        "token",
        "credential",
        "s3.access-key-id",
        "s3.secret-access-key",
        "s3.session-token",
        "adls.account-key",
        "adls.sas-token",
        "adls.client-secret",
        "gcs.oauth2.token",
        "header.Authorization",
    ],
    # deltalake / object_store storage options (AWS, Azure, GCS)
    "read_delta": [
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "account_key",
        "azure_storage_account_key",
        "sas_token",
        "azure_storage_sas_key",
        "client_secret",
        "azure_client_secret",
        "bearer_token",
        "google_service_account_key",
        "service_account_key",
        "google_application_credentials",
        "service_account",
    ],
    # lance storage options (the same object_store names)
    "read_lance": ["aws_secret_access_key", "account_key", "sas_token", "service_account_key"],
}


def _reader_input(reader: str, tmp_path: Path, rotation: int) -> InputSpec:
    secrets = {k: SECRET.format(k, rotation) for k in CREDENTIAL_KEYS[reader]}
    if reader == "read_iceberg":
        args: dict[str, Any] = {
            "table_identifier": "db.prompts",
            "snapshot_id": 7,
            "catalog_kwargs": {
                "name": "main",
                "type": "rest",
                "uri": "https://catalog.example.com",
                **secrets,
            },
        }
    elif reader == "read_delta":
        args = {"path": "s3://bucket/table", "version": 3, "storage_options": secrets}
    else:
        if not (tmp_path / "ds.lance").exists():
            (tmp_path / "ds.lance").mkdir()
            (tmp_path / "ds.lance" / "data.bin").write_bytes(b"x")
        args = {"uri": str(tmp_path / "ds.lance"), "storage_options": secrets}
    return InputSpec(format="ray_data", reader=reader, reader_args=args)


@pytest.mark.parametrize("reader", sorted(CREDENTIAL_KEYS))
def test_no_credential_is_written_or_hashed_and_rotating_one_keeps_the_snapshot(
    reader: str, tmp_path: Path
) -> None:
    import json

    from pipeline.batch.commit.manifest import spec_snapshot

    storage = StorageSpec()
    first = source_fingerprint(_reader_input(reader, tmp_path, 1), storage)
    rotated = source_fingerprint(_reader_input(reader, tmp_path, 2), storage)
    assert rotated.value == first.value and rotated.key == first.key
    written = json.dumps(first.to_json())
    assert "PLAINTEXT-CREDENTIAL" not in written, written
    # What locates the data is kept (it is what the snapshot is of).
    if reader == "read_iceberg":
        assert first.args["catalog_kwargs"]["uri"] == "https://catalog.example.com"
        assert first.args["table_identifier"] == "db.prompts"
    # The manifest's copy of the spec holds none either.
    job = parse_job_spec(
        _job(
            {
                "format": "ray_data",
                "reader": reader,
                "reader_args": dict(_reader_input(reader, tmp_path, 1).reader_args),
                "prompt_column": "text",
            }
        )
    )
    assert "PLAINTEXT-CREDENTIAL" not in json.dumps(spec_snapshot(job))
    # A change in what is read still changes the fingerprint.
    other = _reader_input(reader, tmp_path, 1)
    moved = dict(other.reader_args)
    key = {"read_iceberg": "table_identifier", "read_delta": "path", "read_lance": "uri"}[reader]
    moved[key] = moved[key] + "_other" if reader != "read_lance" else str(tmp_path / "ds.lance")
    if reader != "read_lance":
        changed = source_fingerprint(other.model_copy(update={"reader_args": moved}), storage)
        assert changed.value != first.value


def test_uris_lose_their_passwords_and_signatures() -> None:
    from pipeline.spec.redact import redact

    args = {
        "uri": "mongodb://app:hunter2@db.example.com:27017/?authSource=admin&password=x2",
        "paths": [
            "https://acct.blob.core.windows.net/c/in.csv?sv=2024-01-01&se=2026&sig=S1GNATURE",
            "https://bucket.s3.amazonaws.com/in.csv?X-Amz-Credential=AKIA&X-Amz-Signature=ab12"
            "&X-Amz-Security-Token=tok&X-Amz-Expires=60",
        ],
    }
    text = str(redact({"reader_args": args}))
    for secret in ("hunter2", "app:", "x2", "S1GNATURE", "AKIA", "ab12", "tok&"):
        assert secret not in text, (secret, text)
    assert "db.example.com:27017" in text and "authSource=admin" in text
    assert "se=2026" in text and "X-Amz-Expires=60" in text  # the terms, not the signature


def test_settings_that_are_not_credentials_are_not_masked() -> None:
    """Token counts and the like in the spec stay in the manifest's copy of it."""
    from pipeline.spec.redact import is_credential

    for name in (
        "max_tokens",
        "kv_cache_tokens",
        "max_num_tokens",
        "id_column",
        "keyword",
        "stop_token_ids",
        "eos_token_id",
    ):
        assert not is_credential(name), name
    for name in ("token", "api-key", "s3.secret-access-key", "sas_token", "X-Amz-Signature"):
        assert is_credential(name), name
