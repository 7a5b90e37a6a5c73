"""Staging a ray_data input: the source written once as Parquet, then read like format parquet.

    stage_input(spec) ─▶ source fingerprint (pipeline.batch.stages.read.sources)
                      ─▶ refuse if the output's rows came from another snapshot (not --fresh)
                      ─▶ reuse <output>/_staging/input-<key>/ if its marker is there, else:
                         Ray Data writes the Dataset to <key>/<attempt>/*.parquet, and the
                         marker `_snapshot.json` (files, rows, source) is created last
                      ─▶ the spec with input.format parquet and input.uri the snapshot's files

Why a snapshot: the shard scheduler's guarantees (shards cut from a fixed listing, rows
numbered in file order, a resume re-reading exactly the rows it misses) need an input that
does not change between runs, and most Ray Data sources (a table, a query) have no byte ranges
to cut. Written once, the snapshot is an ordinary Parquet input, with every guarantee of one.

The marker is created only if absent (If-None-Match on S3, a hard link locally) after every
data file is written, so a snapshot without a marker is never read, and of two runs staging
the same source at once, the first marker wins and the other run reads that snapshot: each
attempt writes under its own directory, so neither overwrites the other's files.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.batch.commit.committer import ResumeRefused
from pipeline.batch.commit.manifest import read_manifest
from pipeline.batch.session import ray_session
from pipeline.batch.stages.read.sources import (
    SourceFingerprint,
    arrow_filesystem,
    open_dataset,
    source_fingerprint,
)
from pipeline.spec import JobSpec, SpecError
from pipeline.storage import (
    OutputDir,
    PreconditionFailed,
    RetryPolicy,
    expand_uri,
    filesystem_for,
    join_uri,
)

logger = logging.getLogger(__name__)

STAGING_DIR = "_staging"  # under output.uri; `_` keeps it out of input listings
MARKER_NAME = "_snapshot.json"
# Rows per Parquet row group of a snapshot. Shards are whole row groups, so this bounds the
# smallest shard: small enough for the scheduler to cut a few dozen rows, large enough that a
# million-row snapshot is not mostly footers.
ROW_GROUP_ROWS = 1024


@dataclass(frozen=True)
class Snapshot:
    """A complete staged snapshot: what its marker says."""

    uri: str  # the directory holding exactly its Parquet files
    source: SourceFingerprint
    files: list[dict[str, Any]]  # [{uri, size, rows}], sorted by uri
    num_rows: int

    def to_json(self) -> str:
        return json.dumps(
            {
                "uri": self.uri,
                "source": self.source.to_json(),
                "files": self.files,
                "num_rows": self.num_rows,
            },
            indent=1,
            default=str,
        )

    @classmethod
    def from_json(cls, text: str) -> Snapshot:
        data = json.loads(text)
        return cls(
            uri=str(data["uri"]),
            source=SourceFingerprint.from_json(data["source"]),
            files=list(data["files"]),
            num_rows=int(data["num_rows"]),
        )


def stage_input(
    spec: JobSpec, *, fresh: bool = False, emit: Callable[[str], None] | None = None
) -> JobSpec:
    """For `input.format: ray_data`, the spec to run: format parquet on the staged snapshot
    (staged now, or reused). Any other format: `spec` as it is.

    Raises SpecError for a source that cannot be read, ResumeRefused when the output holds rows
    generated from another snapshot of the source (unless `fresh`)."""
    if spec.input.format != "ray_data":
        return spec
    say = emit or logger.info
    source = source_fingerprint(spec.input, spec.storage)
    if not fresh:
        _refuse_another_snapshot(spec, source)
    where = _snapshot_dir(spec, source.key)
    snapshot = read_snapshot(where)
    if snapshot is not None:
        _check_files(spec, snapshot, where)
        say(
            f"input: reusing the staged snapshot {snapshot.uri} ({snapshot.num_rows} rows, "
            f"{source.version.describe()}); nothing is read from the source"
        )
    else:
        snapshot = _write_snapshot(spec, source, where)
        say(f"input: staged {snapshot.num_rows} rows of {source.source} at {snapshot.uri}")
    return staged_spec(spec, snapshot)


def staged_spec(spec: JobSpec, snapshot: Snapshot) -> JobSpec:
    """`spec` reading the snapshot as format parquet (what the manifest records as its input;
    the snapshot's marker keeps where it came from)."""
    staged = spec.input.model_copy(
        update={
            "format": "parquet",
            "uri": snapshot.uri,
            "reader": None,
            "reader_args": {},
            "dataset": None,
        }
    )
    return spec.model_copy(update={"input": staged})


def _snapshot_dir(spec: JobSpec, key: str) -> OutputDir:
    uri = join_uri(join_uri(spec.output.uri, STAGING_DIR), key)
    return OutputDir(uri, spec.storage, RetryPolicy(spec.storage.retry_s))


def read_snapshot(where: OutputDir) -> Snapshot | None:
    """The complete snapshot in `where`, or None without a marker (never staged, or a staging
    that did not finish)."""
    found = where.read_versioned(MARKER_NAME)
    return Snapshot.from_json(found.data.decode()) if found is not None else None


def _check_files(spec: JobSpec, snapshot: Snapshot, where: OutputDir) -> None:
    """A reused snapshot must still hold exactly the files its marker lists (SpecError, with
    what to do, if some were deleted, changed or added)."""
    try:
        listed = {f.uri: f.size for f in expand_uri(snapshot.uri, spec.storage, field="input")}
    except SpecError:
        listed = {}
    if listed != {str(f["uri"]): int(f["size"]) for f in snapshot.files}:
        raise SpecError(
            f"input: the staged snapshot at {snapshot.uri} no longer holds the files its "
            f"{MARKER_NAME} lists (deleted or changed); delete {where.uri}/ and rerun with "
            "--fresh to stage the source again"
        )


def _refuse_another_snapshot(spec: JobSpec, source: SourceFingerprint) -> None:
    """ResumeRefused, before anything is staged, when the output's committed rows were
    generated from a snapshot with another fingerprint: the source (or its arguments) changed.
    The manifest's input.uri names that snapshot's directory."""

    out = OutputDir(spec.output.uri, spec.storage)
    manifest = read_manifest(out)
    if manifest is None:
        return
    staged_uri = str((manifest.spec.get("input") or {}).get("uri") or "")
    root = join_uri(out.uri, STAGING_DIR) + "/"
    if not staged_uri.startswith(root):
        return  # another kind of input: the committer names the change (input)
    key = staged_uri[len(root) :].split("/", 1)[0]
    if key == source.key:
        return
    before = read_snapshot(_snapshot_dir(spec, key))
    raise ResumeRefused(
        f"{out.uri} was generated from another snapshot of input (format ray_data): "
        f"{source.describe_change(before.source if before else None)}. Mixing the rows would "
        "make the output inconsistent; rerun with --fresh to stage the source as it is now and "
        "start over (deletes the committed parts), or set output.uri to a new prefix"
    )


def _write_snapshot(spec: JobSpec, source: SourceFingerprint, where: OutputDir) -> Snapshot:
    """Write the source under a fresh attempt directory, then create the marker; if another
    run's marker got there first, use that snapshot."""

    data_uri = join_uri(where.uri, uuid.uuid4().hex[:12])
    fs, path = filesystem_for(data_uri, spec.storage)
    with ray_session():
        dataset = open_dataset(spec.input, source, spec.storage)
        dataset.write_parquet(path, filesystem=arrow_filesystem(fs), row_group_size=ROW_GROUP_ROWS)
    files = _written_files(spec, data_uri)
    # Files have no snapshot to pin: a file changed while it was read makes a snapshot of no
    # single version.
    if (
        source.version.kind == "listing"
        and source_fingerprint(spec.input, spec.storage).value != source.value
    ):
        _discard(fs, path)
        raise SpecError(
            f"input.reader_args: the files {source.source} reads changed while they were "
            f"staged; rerun once they stop changing"
        )
    snapshot = Snapshot(data_uri, source, files, sum(int(f["rows"]) for f in files))
    try:
        where.create(MARKER_NAME, snapshot.to_json().encode())
    except PreconditionFailed:
        # The marker is created once, with this attempt's own directory in it: one that is
        # not ours means another run's snapshot won, and this copy is nobody's.
        won = read_snapshot(where)
        if won is None:
            raise
        if won.uri != data_uri:
            _discard(fs, path)
        return won
    return snapshot


def _discard(fs: Any, path: str) -> None:
    """Delete a staged copy no marker names (best effort: a leftover costs storage only)."""
    try:
        fs.rm(path, recursive=True)
    except Exception:
        logger.warning("could not delete the unused staged copy at %s", path, exc_info=True)


def _written_files(spec: JobSpec, data_uri: str) -> list[dict[str, Any]]:
    """The snapshot's files with their row counts, from the Parquet footers."""
    import pyarrow.parquet as pq

    try:
        listed = expand_uri(data_uri, spec.storage, field="input")
    except SpecError:
        listed = []
    if not listed:
        raise SpecError(
            f"input: the ray_data source ({spec.input.reader or spec.input.dataset}) has no "
            "rows to stage; check input.reader_args"
        )
    files = []
    for item in listed:
        fs, path = filesystem_for(item.uri, spec.storage)
        with fs.open(path, "rb") as handle:
            rows = pq.ParquetFile(handle).metadata.num_rows
        files.append({"uri": item.uri, "size": item.size, "rows": rows})
    return files
