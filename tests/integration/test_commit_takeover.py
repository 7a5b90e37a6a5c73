"""A run that stalls and wakes after another run took its output over must not destroy what
the other run committed: the commit layer driven step by step, without Ray, on a local
directory and on the S3 test server (real HTTP).

Run A holds the lease and commits; it stops (a GC pause, SIGSTOP, a slow node) at one point of
its commit path; its lease expires, run B takes the output over and commits; then A goes on
from where it stopped. Whatever A does then, every part B's manifest lists is still there,
with B's export files, and A commits nothing more.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from pipeline.batch.commit.committer import Committer
from pipeline.batch.commit.fingerprint import Fingerprint
from pipeline.batch.commit.lease import Lease, LeaseLost
from pipeline.batch.commit.manifest import ManifestConflict, read_manifest
from pipeline.batch.commit.parts import (
    LEASE_NAME,
    PartName,
    PartWritten,
    list_part_names,
    write_part,
)
from pipeline.batch.driver.run import _export_openai_batch
from pipeline.batch.stages.schema import output_schema, schema_to_json
from pipeline.batch.units import Shard, ShardPlan
from pipeline.spec import JobSpec, StorageSpec, parse_job_spec
from pipeline.storage import OutputDir

LEASE_S = 1.0  # the lease timeout of both runs: A's lease expires while A stands still
ROWS_PER_SHARD = 4
SCHEMA = output_schema([pa.field("url", pa.string())])
FINGERPRINT = Fingerprint("f" * 64, {"model": "m"})


@pytest.fixture(params=["local", "s3"])
def out(request: pytest.FixtureRequest, tmp_path: Path) -> OutputDir:
    if request.param == "local":
        return OutputDir(str(tmp_path / "out"), StorageSpec())
    server = request.getfixturevalue("s3_server")
    return OutputDir(f"s3://{server.make_bucket()}/results/", server.storage_spec())


def _spec(tmp_path: Path, out: OutputDir, openai: bool = False) -> JobSpec:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"hidden_size": 8}')
    source = {"uri": "s3://b/in.jsonl", "format": "jsonl", "prompt_column": "p"}
    if openai:
        source = {"uri": "s3://b/in.jsonl", "format": "openai_batch"}
    return parse_job_spec(
        {
            "name": "takeover",
            "input": {**source, "passthrough_columns": ["url"]},
            "model": {"path": str(model)},
            "sampling": {"max_tokens": 8},
            "output": {"uri": out.uri, "format": "openai_batch" if openai else "parquet"},
            "storage": out.storage.model_dump(),
        }
    )


def _plan(shards: int) -> ShardPlan:
    return ShardPlan(
        tuple(
            Shard(i, "s3://b/in.jsonl", 100, "v1", "row_groups", 4 * i, 4 * i + 4, (i,), 4)
            for i in range(shards)
        ),
        target=ROWS_PER_SHARD,
    )


def _rows(shard: int) -> pa.Table:
    """A whole shard's output rows (ids s<shard>-<row>) plus `_row`."""
    indexes = list(range(ROWS_PER_SHARD))
    n = len(indexes)
    values: dict[str, list[Any]] = {
        "id": [f"s{shard}-{i}" for i in indexes],
        "url": ["/v1/chat/completions"] * n,
        "text": [f"answer {i}" for i in indexes],
        "finish_reason": ["stop"] * n,
        "error": [None] * n,
        "model": ["tiny"] * n,
        "engine": ["reference"] * n,
        "actor_id": ["actor"] * n,
        "finished_at": [dt.datetime.now(dt.timezone.utc)] * n,
    }
    columns = []
    for f in SCHEMA:
        if f.name in values:
            columns.append(pa.array(values[f.name], type=f.type))
        elif pa.types.is_floating(f.type):
            columns.append(pa.array([0.5] * n, type=f.type))
        else:
            columns.append(pa.array([3] * n, type=f.type))
    table = pa.Table.from_arrays(columns, schema=SCHEMA)
    return table.append_column("_row", pa.array(indexes, pa.int64()))


class Run:
    """One driver's commit path, step by step (what pipeline.batch.driver.run does, minus Ray)."""

    def __init__(self, out: OutputDir, spec: JobSpec, plan: ShardPlan):
        self.spec = spec
        out = OutputDir(out.uri, out.storage, out.retry)  # its own, as another process's
        self.lease = Lease.acquire(out, LEASE_S)
        self.committer = Committer(
            out, spec, plan, FINGERPRINT, schema_to_json(SCHEMA), [], self.lease
        )

    def open(self) -> None:
        self.committer.open()

    def adopt(self) -> list[str]:
        return self.committer.adopt_orphans()

    def begin(self) -> int:
        run = self.committer.begin("run", self.lease.run_id, "host", 1)
        self.lease.set_attempt(run.attempt)
        return run.attempt

    def start(self) -> int:
        self.open()
        self.adopt()
        return self.begin()

    def write(self, shard: int, seq: int = 0, report: bool = True) -> str:
        """An engine actor writes a part of `shard`; the driver hears of it when `report`."""
        assert self.committer.run is not None
        part = PartName(shard, self.committer.run.attempt, 1, seq)
        record = write_part(self.committer.out, part, _rows(shard), SCHEMA, "actor")
        if report:
            self.committer.on_part(PartWritten(record, {}))
        return record.name

    def finish(self) -> None:
        missing = self.committer.ledger.missing_rows()
        self.committer.finish("complete" if missing == 0 else "incomplete", 1.0, [], [], None)

    def export(self) -> None:
        _export_openai_batch(self.spec, self.committer)


def _wait_for_expiry() -> None:
    """Past A's lease timeout by the store's clock (S3 dates tick in whole seconds)."""
    time.sleep(LEASE_S + 1.5)


def _take_over(out: OutputDir, spec: JobSpec, plan: ShardPlan, shards: list[int]) -> Run:
    """Run B: takes the expired lease over, writes `shards` and finishes with its exports."""
    _wait_for_expiry()
    b = Run(out, spec, plan)
    assert b.lease.taken_over is not None, "B should have taken A's lease over"
    b.start()
    for shard in shards:
        b.write(shard)
    if spec.output.format == "openai_batch":
        b.export()
    b.finish()
    return b


def _check_intact(out: OutputDir, b: Run) -> None:
    """Every part B's manifest lists is on storage, with its export files; no other part is."""
    manifest = read_manifest(out)
    assert manifest is not None and manifest.runs[-1].run_id == b.lease.run_id, (
        "the manifest is no longer B's"
    )
    listed = {p["name"] for p in manifest.parts}
    on_storage = set(list_part_names(out))
    assert listed <= on_storage, f"committed parts deleted: {sorted(listed - on_storage)}"
    if b.spec.output.format == "openai_batch":
        from pipeline.batch.driver.openai_output import expected_exports

        present = set(out.names("openai-"))
        wanted = {
            n
            for r in manifest.part_records()
            for n in expected_exports(r.sums.rows, r.sums.errors, r.name)
        }
        assert wanted <= present, f"export files deleted: {sorted(wanted - present)}"
    if manifest.status == "complete":
        assert out.exists("_SUCCESS")


def _wake(step: Callable[[], Any]) -> bool:
    """A wakes and goes on with `step`; whether it found out that it lost the output."""
    try:
        step()
    except (LeaseLost, ManifestConflict):
        return True
    return False


def test_a_run_that_wakes_in_finish_deletes_no_part_of_the_run_that_took_over(
    out: OutputDir, tmp_path: Path
) -> None:
    spec, plan = _spec(tmp_path, out), _plan(3)
    a = Run(out, spec, plan)
    a.start()
    a.write(0)
    a.committer.save(force=True)
    # A stops just before finishing; B takes over and does the rest.
    b = _take_over(out, spec, plan, [1, 2])
    noticed = _wake(a.finish)
    _check_intact(out, b)
    assert noticed, "A went on as if it still held the output"
    assert read_manifest(out).status == "complete"  # type: ignore[union-attr]


def test_a_run_that_wakes_before_its_export_deletes_no_export_of_the_run_that_took_over(
    out: OutputDir, tmp_path: Path
) -> None:
    spec, plan = _spec(tmp_path, out, openai=True), _plan(2)
    a = Run(out, spec, plan)
    a.start()
    a.write(0)
    a.committer.save(force=True)
    b = _take_over(out, spec, plan, [1])
    noticed = _wake(a.export)
    _check_intact(out, b)
    assert noticed, "A went on as if it still held the output"


def test_a_run_that_wakes_while_adopting_deletes_no_part_of_the_run_that_took_over(
    out: OutputDir, tmp_path: Path
) -> None:
    spec, plan = _spec(tmp_path, out), _plan(2)
    a = Run(out, spec, plan)
    a.open()  # ... and A stops before it adopts what an earlier run left
    b = _take_over(out, spec, plan, [0])
    noticed = _wake(a.adopt)
    _check_intact(out, b)
    assert noticed, "A went on as if it still held the output"


def test_leftovers_of_a_finished_run_are_not_adopted_while_it_deletes_them(
    out: OutputDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrote a part it never heard of (its actor died before reporting it) and stopped
    incomplete; A stalls while deleting that leftover, B takes over meanwhile. B must not
    commit the leftover A is about to delete."""
    spec, plan = _spec(tmp_path, out), _plan(2)
    a = Run(out, spec, plan)
    a.start()
    a.write(0)
    leftover = a.write(1, report=False)
    taken: list[Run] = []
    delete = a.committer.out.delete

    def stall_then_delete(name: str) -> None:
        if name == leftover and not taken:
            taken.append(_take_over(out, spec, plan, []))
        delete(name)

    monkeypatch.setattr(a.committer.out, "delete", stall_then_delete)
    # A may notice it lost the output; either way it must not delete anything of B's.
    with contextlib.suppress(LeaseLost, ManifestConflict):
        a.finish()
    assert taken, "A never deleted its leftover"
    _check_intact(out, taken[0])
    manifest = read_manifest(out)
    assert manifest is not None and leftover not in {p["name"] for p in manifest.parts}


def test_lease_renewals_give_up_well_inside_a_third_of_the_timeout(
    s3_server: Any, tmp_path: Path
) -> None:
    """A store that keeps failing: the renewal stops retrying after a sixth of the timeout, long
    before another run may take the lease over (a renewal still retrying then could not tell
    the run it lost the output)."""
    from pipeline.storage import RetryPolicy

    bucket = s3_server.make_bucket()
    retry_s = 60.0  # the job's storage retries (storage.retry_s): far past the lease timeout
    out = OutputDir(f"s3://{bucket}/r/", s3_server.storage_spec(), RetryPolicy(total_s=retry_s))
    timeout = 30.0
    lease = Lease.acquire(out, timeout)
    fault = s3_server.fail_next("PUT", f"/{bucket}/r/_lease.json", times=10_000)
    try:
        # One attempt, without our retries: what a try costs here (botocore's and s3fs's own
        # few quick retries included).
        started = time.monotonic()
        with pytest.raises(OSError):
            out.with_retries(None).put(LEASE_NAME, b"x")
        one_try = time.monotonic() - started
        tries_before = fault.served
        started = time.monotonic()
        with pytest.raises(OSError):  # the store's last answer (503 SlowDown)
            lease.renew()
        took = time.monotonic() - started
    finally:
        fault.left = 0
    assert fault.served - tries_before >= 2 * tries_before, "the renewal was not retried"
    # Our retries stop starting new tries after a sixth of the timeout; the last try may
    # still run for as long as one try takes.
    bound = timeout / 6 + 2 * one_try + 1.0
    assert took < bound, (
        f"the renewal retried for {took:.1f}s; expected under {bound:.1f}s (a sixth of the "
        f"{timeout:.0f}s lease timeout plus a try of {one_try:.1f}s), not storage.retry_s"
    )
    print(f"renewal gave up after {took:.1f}s (one try {one_try:.1f}s, timeout {timeout:.0f}s)")


def test_a_fresh_run_that_stalls_while_clearing_deletes_nothing_of_the_run_that_took_over(
    out: OutputDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, plan = _spec(tmp_path, out), _plan(2)
    earlier = Run(out, spec, plan)
    earlier.start()
    earlier.write(0)
    earlier.finish()
    earlier.lease.release()
    a = Run(out, spec, plan)  # a --fresh run: it clears the output first
    taken: list[Run] = []

    def stall_first(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(name: str, *args: Any) -> Any:
            if not taken:  # A stops at its first delete; B takes over and completes
                taken.append(_take_over(out, spec, plan, [1]))
            return method(name, *args)

        return call

    for attr in ("delete", "delete_if"):
        if hasattr(a.committer.out, attr):
            monkeypatch.setattr(a.committer.out, attr, stall_first(getattr(a.committer.out, attr)))
    noticed = _wake(a.committer.clear)
    assert taken, "A deleted nothing"
    _check_intact(out, taken[0])
    assert noticed, "A went on as if it still held the output"
