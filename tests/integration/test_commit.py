"""The commit layer without Ray: conditional writes, parts and their footer records, the run
lease, the manifest's compare-and-swap, retries, the fingerprint.

Runs against a local directory and against the S3 test server (real HTTP), since the two
paths differ (links, flock and rename vs If-None-Match / If-Match on one PUT).
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from pipeline.batch.commit.fingerprint import COMPONENTS, Fingerprint, job_fingerprint
from pipeline.batch.commit.lease import Lease, LeaseHeld, LeaseHolder, LeaseLost, new_holder
from pipeline.batch.commit.manifest import (
    Manifest,
    ManifestConflict,
    ManifestStore,
    RunRecord,
    read_manifest,
    redact,
)
from pipeline.batch.commit.parts import (
    LEASE_NAME,
    PartName,
    list_part_names,
    read_part,
    read_part_record,
    write_part,
)
from pipeline.batch.stages.schema import output_schema
from pipeline.batch.units import RowRanges
from pipeline.spec import JobSpec, StorageSpec, parse_job_spec
from pipeline.storage import (
    InputFile,
    OutputDir,
    PreconditionFailed,
    RetryPolicy,
    StorageError,
)
from tests.integration.s3_server import S3Server


def _rows(indexes: list[int], errors: set[int] = frozenset()) -> pa.Table:
    """Output rows in the fixed schema (one passthrough column, `user`) plus `_row`."""
    schema = output_schema([pa.field("user", pa.int64())])
    now = dt.datetime.now(dt.timezone.utc)
    values = {
        "id": [f"r{i}" for i in indexes],
        "user": indexes,
        "text": ["" if i in errors else f"answer {i}" for i in indexes],
        "finish_reason": ["error" if i in errors else "stop" for i in indexes],
        "error": ["boom" if i in errors else None for i in indexes],
        "finished_at": [now] * len(indexes),
    }
    columns = []
    for f in schema:
        if f.name in values:
            columns.append(pa.array(values[f.name], type=f.type))
        elif pa.types.is_floating(f.type):
            columns.append(pa.array([0.5] * len(indexes), type=f.type))
        elif pa.types.is_integer(f.type):
            columns.append(pa.array([3] * len(indexes), type=f.type))
        else:
            columns.append(pa.array(["x"] * len(indexes), type=f.type))
    table = pa.Table.from_arrays(columns, schema=schema)
    return table.append_column("_row", pa.array(indexes, pa.int64()))


SCHEMA = output_schema([pa.field("user", pa.int64())])


@pytest.fixture(params=["local", "s3"])
def out(request: pytest.FixtureRequest, tmp_path: Path) -> OutputDir:
    if request.param == "local":
        return OutputDir(str(tmp_path / "out"), StorageSpec())
    server = request.getfixturevalue("s3_server")
    bucket = server.make_bucket()
    return OutputDir(f"s3://{bucket}/results/", server.storage_spec())


# --- conditional writes ----------------------------------------------------------------------


def test_create_is_create_only_and_replace_needs_the_current_version(out: OutputDir) -> None:
    assert out.supports_conditional_writes()
    assert out.supports_conditional_deletes()  # moto honours If-Match on DELETE
    first = out.create("obj", b"one")
    with pytest.raises(PreconditionFailed):
        out.create("obj", b"two")
    current = out.read_versioned("obj")
    assert current is not None and current.data == b"one" and current.version == first
    assert 0 <= current.age_s < 60
    second = out.replace("obj", b"three", first)
    with pytest.raises(PreconditionFailed):
        out.replace("obj", b"stale", first)  # a writer that read the old version loses
    assert out.read("obj") == b"three"
    assert out.replace("obj", b"four", second)
    with pytest.raises(PreconditionFailed):
        out.replace("absent", b"x", second)
    assert out.read_versioned("absent") is None


def test_racing_creates_have_exactly_one_winner(out: OutputDir) -> None:
    winners: list[int] = []
    barrier = threading.Barrier(8)

    def contend(i: int) -> None:
        barrier.wait()
        try:
            out.create("race", str(i).encode())
            winners.append(i)
        except PreconditionFailed:
            pass

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1
    assert out.read("race") == str(winners[0]).encode()


# --- parts -----------------------------------------------------------------------------------


def test_part_rows_are_sorted_and_its_record_is_in_the_footer(out: OutputDir) -> None:
    part = PartName(shard=3, run=2, dispatch=1, seq=0)
    table = _rows([7, 2, 3, 9, 4], errors={3})
    record = write_part(out, part, table, SCHEMA, actor_id="actor-1")
    assert list_part_names(out) == ["part-000003-00002-01-0000.parquet"] == [record.name]
    assert record.rows == RowRanges(((2, 5), (7, 8), (9, 10)))
    assert record.sums.rows == 5 and record.sums.errors == 1
    assert record.size_bytes > 0 and record.version == out.stat(record.name)[1]
    back = read_part(out, record.name)
    assert back.schema == SCHEMA  # `_row` is not an output column
    assert back.column("user").to_pylist() == [2, 3, 4, 7, 9]  # sorted by shard row
    footer = read_part_record(out, record.name)
    assert footer is not None and footer.rows == record.rows and footer.sums == record.sums
    assert footer.stats is not None and footer.stats.errors_by_kind == {"boom": 1}
    assert PartName.parse(record.name) == part
    assert PartName.parse("part-00001-000000.parquet") is None  # the old naming


# --- the lease -------------------------------------------------------------------------------


def test_second_run_is_refused_naming_the_first(out: OutputDir) -> None:
    first = Lease.acquire(out, timeout_s=60)
    first.set_attempt(4)
    with pytest.raises(LeaseHeld) as refused:
        Lease.acquire(out, timeout_s=60)
    message = str(refused.value)
    assert "attempt 4" in message and first.holder.host in message
    assert "renewed its lease" in message and "60s without renewal" in message
    first.renew()
    first.release()
    again = Lease.acquire(out, timeout_s=60)  # released: free at once
    again.release()
    assert not out.exists(LEASE_NAME)


def test_a_contender_whose_temp_file_the_holder_sweeps_is_still_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run holding the lease removes temp files at its start (remove_temp_files); a run
    contending for the lease has just written its own temp for `_lease.json` then. Its
    create must start over and end in LeaseHeld, not in a FileNotFoundError traceback."""
    holder = OutputDir(str(tmp_path / "out"), StorageSpec())
    first = Lease.acquire(holder, timeout_s=60)
    contender = OutputDir(holder.uri, holder.storage)
    write_temp = contender._local_temp
    swept: list[str] = []

    def temp_then_sweep(target: Path, data: bytes) -> str:
        tmp = write_temp(target, data)
        if not swept:  # the holder's sweep lands between the write and the link, once
            holder.remove_temp_files()
            swept.append(tmp)
        return tmp

    monkeypatch.setattr(contender, "_local_temp", temp_then_sweep)
    with pytest.raises(LeaseHeld) as refused:
        Lease.acquire(contender, timeout_s=60)
    assert swept and not Path(swept[0]).exists()  # the sweep did remove the contender's temp
    assert first.holder.host in str(refused.value) and "renewed its lease" in str(refused.value)
    # The same for a plain write: it lands whole, and no temp file is left behind.
    swept.clear()
    contender.put("notes.txt", b"written once")
    assert swept and holder.read_versioned("notes.txt").data == b"written once"
    assert not [n for n in holder.names(".") if n.endswith(".tmp")]
    first.release()


def test_a_lease_that_is_not_renewed_is_taken_over_and_the_old_holder_loses_it(
    out: OutputDir,
) -> None:
    dead = Lease.acquire(out, timeout_s=5)
    with pytest.raises(LeaseHeld):
        Lease.acquire(out, timeout_s=5)
    time.sleep(6.5)  # S3 clocks tick in whole seconds
    taker = Lease.acquire(out, timeout_s=5)
    assert taker.taken_over is not None and taker.taken_over.run_id == dead.run_id
    with pytest.raises(LeaseLost, match="taken over"):
        dead.renew()
    taker.renew()
    dead.release()  # not ours any more: must not delete the new holder's lease
    assert out.exists(LEASE_NAME)
    taker.release()


def _take_over_before(out: OutputDir, monkeypatch: pytest.MonkeyPatch, name: str) -> list[str]:
    """Make another run take the lease over just before `out` next deletes or conditionally
    writes `name`, whichever call it makes (the last moment a release can lose a race).
    Returns [the new holder's run id] once that happened."""
    other = OutputDir(out.uri, out.storage)
    taker = new_holder(60)
    taken: list[str] = []

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(target: str, *args: Any, **kwargs: Any) -> Any:
            if target == name and not taken:
                current = other.read_versioned(LEASE_NAME)
                assert current is not None
                other.replace(LEASE_NAME, taker.to_bytes(), current.version)
                taken.append(taker.run_id)
            return method(target, *args, **kwargs)

        return call

    for attr in ("delete", "delete_if", "replace"):
        if hasattr(out, attr):
            monkeypatch.setattr(out, attr, wrap(getattr(out, attr)))
    return taken


def _holder_on_storage(out: OutputDir) -> LeaseHolder | None:
    current = OutputDir(out.uri, out.storage).read_versioned(LEASE_NAME)
    return None if current is None else LeaseHolder.parse(current.data)


def _without_conditional_deletes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that ignores If-Match on DELETE (it deletes whatever the object holds)."""
    monkeypatch.setattr(
        OutputDir, "supports_conditional_deletes", lambda self: False, raising=False
    )


@pytest.mark.parametrize("deletes", ["conditional", "unconditional"])
def test_release_does_not_delete_a_lease_another_run_wrote_at_the_last_moment(
    out: OutputDir, monkeypatch: pytest.MonkeyPatch, deletes: str
) -> None:
    if deletes == "unconditional":
        _without_conditional_deletes(monkeypatch)
    mine = OutputDir(out.uri, out.storage)
    lease = Lease.acquire(mine, timeout_s=60)
    taken = _take_over_before(mine, monkeypatch, LEASE_NAME)
    lease.release()
    assert taken, "the other run never took the lease over"
    holder = _holder_on_storage(out)
    assert holder is not None, "release deleted the lease the other run had just written"
    assert holder.run_id == taken[0]


def test_where_deletes_are_not_conditional_release_leaves_a_released_lease(
    out: OutputDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    _without_conditional_deletes(monkeypatch)
    first = Lease.acquire(out, timeout_s=60)
    first.release()
    holder = _holder_on_storage(out)
    assert holder is not None and holder.run_id == first.run_id and holder.released
    second = Lease.acquire(out, timeout_s=60)  # a released lease is free at once
    assert second.taken_over is not None and second.taken_over.run_id == first.run_id
    with pytest.raises(LeaseLost):
        first.verify()
    second.verify()
    second.release()


def test_manifest_writes_are_compare_and_swap(out: OutputDir) -> None:
    manifest = Manifest(
        job="j",
        status="running",
        fingerprint={"value": "v", "components": {}},
        spec={},
        input_files=[],
        schema=[],
        shards=[],
        runs=[RunRecord(attempt=1, started_at="t", mode="run")],
    )
    mine, other = ManifestStore(out), ManifestStore(out)
    mine.write(manifest)  # creates
    assert other.read() is not None
    manifest.status = "incomplete"
    other.write(manifest)  # the other run took the output over and wrote
    with pytest.raises(ManifestConflict, match="another run"):
        mine.write(manifest)
    back = read_manifest(out)
    assert back is not None and back.runs[0].attempt == 1


# --- retries ---------------------------------------------------------------------------------


def test_throttled_puts_are_retried_until_they_succeed(s3_server: S3Server, bucket: str) -> None:
    out = OutputDir(f"s3://{bucket}/retry/", s3_server.storage_spec())
    # More failures than botocore's and s3fs's own few quick attempts absorb.
    fault = s3_server.fail_next("PUT", "/retry/part-", times=6)
    patient = out.with_retries(RetryPolicy(total_s=30, first_delay_s=0.05))
    record = write_part(patient, PartName(0, 1, 1, 0), _rows([0, 1]), SCHEMA, None)
    assert fault.served == 6
    assert read_part(out, record.name).num_rows == 2
    # Without our retries only those quick attempts are left.
    s3_server.fail_next("PUT", "/retry/part-", times=6)
    with pytest.raises(OSError):
        write_part(out, PartName(0, 1, 1, 1), _rows([2]), SCHEMA, None)
    denied = s3_server.fail_next(
        "PUT", "/retry/_manifest", times=9, status=403, code="AccessDenied"
    )
    with pytest.raises(StorageError, match="PermissionError"):
        patient.put("_manifest.json", b"{}")
    assert denied.served == 1  # permanent: not retried


def _land_then_fail(out: OutputDir, request: pytest.FixtureRequest) -> Callable[[str], Any]:
    """`arm(name)`: the next conditional write of `name` lands, then its caller sees a
    transient error (a connection reset, a 503 whose write went through) and retries it.
    S3: the test server carries the PUT out and answers 503; local: the write is made and a
    ConnectionResetError raised after it."""
    if out.is_s3:
        server: S3Server = request.getfixturevalue("s3_server")
        return lambda name: server.fail_after("PUT", "/" + out.path(name), times=1)
    monkeypatch: pytest.MonkeyPatch = request.getfixturevalue("monkeypatch")
    armed: dict[str, list[int]] = {}

    def flaky(method: Callable[..., str]) -> Callable[..., str]:
        def write(self: OutputDir, name: str, *args: Any) -> str:
            version = method(self, name, *args)
            if name in armed and not armed[name]:
                armed[name].append(1)
                raise ConnectionResetError("injected: the connection dropped after the write")
            return version

        return write

    monkeypatch.setattr(OutputDir, "_local_create", flaky(OutputDir._local_create))
    monkeypatch.setattr(OutputDir, "_local_replace", flaky(OutputDir._local_replace))

    def arm(name: str) -> list[int]:
        armed[name] = []
        return armed[name]

    return arm


def _served(fault: Any) -> bool:
    return bool(fault.served) if hasattr(fault, "served") else bool(fault)


def _manifest(run_id: str = "") -> Manifest:
    return Manifest(
        job="j",
        status="running",
        fingerprint={"value": "v", "components": {}},
        spec={},
        input_files=[],
        schema=[],
        shards=[],
        runs=[RunRecord(attempt=1, started_at="t", mode="run", run_id=run_id)],
    )


def _patient(out: OutputDir) -> OutputDir:
    return out.with_retries(RetryPolicy(total_s=30, first_delay_s=0.01))


def test_acquire_whose_create_landed_before_a_transient_error_holds_the_lease(
    out: OutputDir, request: pytest.FixtureRequest
) -> None:
    arm, patient = _land_then_fail(out, request), _patient(out)
    fault = arm(LEASE_NAME)
    lease = Lease.acquire(patient, timeout_s=60)  # not refused against its own lease
    assert _served(fault), "the injected failure was not hit"
    assert lease.version == patient.read_versioned(LEASE_NAME).version  # type: ignore[union-attr]
    lease.renew()
    lease.release()
    assert not out.exists(LEASE_NAME)


def test_a_renewal_that_landed_before_a_transient_error_keeps_the_lease(
    out: OutputDir, request: pytest.FixtureRequest
) -> None:
    arm, patient = _land_then_fail(out, request), _patient(out)
    lease = Lease.acquire(patient, timeout_s=60)
    fault = arm(LEASE_NAME)
    lease.renew()  # not LeaseLost
    assert _served(fault), "the injected failure was not hit"
    lease.renew()  # the version it holds is the one on storage
    lease.verify()
    lease.release()


def test_a_manifest_write_that_landed_before_a_transient_error_is_no_conflict(
    out: OutputDir, request: pytest.FixtureRequest
) -> None:
    arm, patient = _land_then_fail(out, request), _patient(out)
    store, manifest = ManifestStore(patient), _manifest("run-1")
    for what in ("create", "replace"):
        fault = arm("_manifest.json")
        manifest.status = "running" if what == "create" else "incomplete"
        store.write(manifest)  # not ManifestConflict
        assert _served(fault), f"the injected failure was not hit ({what})"
    store.write(manifest)  # the version it holds is the one on storage
    back = read_manifest(out)
    assert back is not None and back.status == "incomplete"


def test_a_conditional_write_that_did_not_land_still_loses(out: OutputDir) -> None:
    patient = _patient(out)
    mine, other = ManifestStore(patient), ManifestStore(patient)
    mine.write(_manifest("run-1"))
    other.read()
    other.write(_manifest("run-2"))
    with pytest.raises(ManifestConflict):
        mine.write(_manifest("run-1"))
    first = Lease.acquire(patient, timeout_s=60)
    with pytest.raises(LeaseHeld):
        Lease.acquire(patient, timeout_s=60)
    first.release()


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
    base = job_fingerprint(_spec(tmp_path), files, shard_plan="p1", schema=[["id", "string"]])
    assert set(base.components) == set(COMPONENTS)
    assert (
        job_fingerprint(_spec(tmp_path), files, shard_plan="p1", schema=[["id", "string"]]) == base
    )

    def fp(spec: JobSpec, listing: list[InputFile], **kw: object) -> Fingerprint:
        return job_fingerprint(
            spec,
            listing,
            shard_plan=kw.get("plan", "p1"),
            schema=kw.get("schema", [["id", "string"]]),
        )

    assert fp(_spec(tmp_path, temperature=0.7), files).changed_components(base) == ["sampling"]
    edited = [InputFile(uri="s3://b/in.jsonl", size=10, version="etag2")]
    assert fp(_spec(tmp_path), edited).changed_components(base) == ["input"]
    assert fp(_spec(tmp_path), files, plan="p2").changed_components(base) == ["input"]
    typed = [["id", "string"], ["user", "int64"]]
    assert fp(_spec(tmp_path), files, schema=typed).changed_components(base) == ["output"]

    spec = _spec(tmp_path)
    (tmp_path / "model" / "model.safetensors").write_bytes(b"0" * 101)  # new weights
    assert fp(spec, files).changed_components(base) == ["model"]
    assert Fingerprint.from_json(base.to_json()) == base


def test_fingerprint_tells_quantizations_and_token_ids_apart(tmp_path: Path) -> None:
    files = [InputFile(uri="s3://b/in.jsonl", size=10, version="etag1")]
    plain = _spec(tmp_path)

    def changed(**sections: dict) -> JobSpec:
        data = plain.model_dump(mode="json")
        for name, values in sections.items():
            data[name].update(values)
        return parse_job_spec(data)

    base = job_fingerprint(plain, files)
    fp8 = job_fingerprint(changed(model={"quantization": {"format": "fp8"}}), files)
    assert fp8.changed_components(base) == ["model"]
    nvfp4 = job_fingerprint(changed(model={"quantization": {"format": "nvfp4"}}), files)
    assert nvfp4.changed_components(fp8) == ["model"]
    ids = job_fingerprint(changed(output={"include_token_ids": True}), files)
    assert ids.changed_components(base) == ["output"]


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


def test_a_store_without_conditional_writes_runs_unfenced_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    out = OutputDir(str(tmp_path / "out"), StorageSpec())
    monkeypatch.setattr(OutputDir, "supports_conditional_writes", lambda self: False)
    with caplog.at_level("WARNING"):
        lease = Lease.acquire(out, timeout_s=60)
    assert not lease.fenced
    assert "cannot be fenced" in caplog.text and "one driver per output" in caplog.text
    lease.release()
