"""Parts: the Parquet files that hold a job's rows, written by engine actors, one shard each.

    part-<shard:06d>-<run:05d>-<dispatch:02d>-<seq:04d>.parquet

`shard` is the input shard the rows come from; `run` the attempt number of the run that wrote
it (one above every earlier run of the prefix; only the lease holder numbers runs); `dispatch`
counts how often the run handed the shard out (a shard whose actor died is handed out again,
and the new parts must not overwrite files of the old dispatch); `seq` counts the parts of one
dispatch. Dispatch 00 is reserved for parts that replace an earlier part (`--retry-errors`).

A part is written in one atomic step (one PUT on S3; temp file and rename on local disks) and
its rows are sorted by their index in the shard. A `PartRecord` (the rows it holds as
`RowRanges`, sums, size, version) travels to the driver; only parts the driver records in
`_manifest.json` are committed (pipeline.batch.commit.ledger). The record is also in the
file's Parquet metadata, so a part written just before a driver died can be adopted by the
next run without reading its rows.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.batch.columns import ROW
from pipeline.batch.commit.stats import RowStats, RowSums
from pipeline.batch.units import RowRanges
from pipeline.storage import OutputDir


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Select and cast `table`'s columns to `schema`; a missing result column is an error."""
    missing = [name for name in schema.names if name not in table.column_names]
    if missing:
        raise ValueError(f"output batch lacks column(s) {missing}; has {table.column_names}")
    columns = []
    for target in schema:
        column = table.column(target.name)
        if column.type != target.type:
            column = column.cast(target.type)
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=schema)


@dataclass(frozen=True)
class PartWritten:
    """An engine actor wrote a part; the driver decides whether it is committed."""

    record: PartRecord
    account: dict[str, Any]  # the actor's cost account at that time (pipeline.cost)


SUCCESS_NAME = "_SUCCESS"
MANIFEST_NAME = "_manifest.json"
LEASE_NAME = "_lease.json"
PART_RE = re.compile(r"^part-(\d{6})-(\d{5})-(\d{2})-(\d{4})\.parquet$")
METADATA_KEY = b"tokenmill.part"
REPLACEMENT_DISPATCH = 0  # dispatch number of parts written to replace another part


@dataclass(frozen=True, order=True)
class PartName:
    shard: int
    run: int  # the attempt number of the run that wrote it
    dispatch: int  # 1.. per hand-out of the shard in that run; 0: a replacement part
    seq: int  # 0.. within the dispatch

    @property
    def name(self) -> str:
        return f"part-{self.shard:06d}-{self.run:05d}-{self.dispatch:02d}-{self.seq:04d}.parquet"

    @classmethod
    def parse(cls, name: str) -> PartName | None:
        match = PART_RE.match(name)
        return cls(*(int(g) for g in match.groups())) if match else None


@dataclass(frozen=True)
class PartRecord:
    """What the driver learns of a written part, and what the manifest keeps of it."""

    name: str
    shard: int
    run: int
    rows: RowRanges  # row indexes (in the shard) it holds
    sums: RowSums  # rows, errors, tokens, cost
    size_bytes: int
    version: str  # S3 ETag or local version: a changed file no longer matches its record
    actor_id: str | None  # the engine actor that generated the rows
    written_at: float  # epoch seconds
    replaces: str | None = None  # the part this one replaces (--retry-errors), if any
    stats: RowStats | None = field(default=None, compare=False)  # merged into the job's
    replaced_stats: RowStats | None = field(default=None, compare=False)  # of `replaces`
    new_rows: int | None = field(default=None, compare=False)  # generated now (None: all)

    @property
    def generated_rows(self) -> int:
        """Rows the writing run generated: all of a part's, or a replacement's redone ones."""
        return self.sums.rows if self.new_rows is None else self.new_rows

    def to_json(self, with_stats: bool = False) -> dict[str, Any]:
        data: dict[str, Any] = {
            "name": self.name,
            "shard": self.shard,
            "run": self.run,
            **self.sums.to_json(),
            "row_ranges": self.rows.to_json(),
            "size_bytes": self.size_bytes,
            "version": self.version,
            "actor_id": self.actor_id,
            "written_at": round(self.written_at, 3),
        }
        if self.replaces:
            data["replaces"] = self.replaces
        if with_stats and self.stats is not None:
            data["stats"] = self.stats.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PartRecord:
        return cls(
            name=data["name"],
            shard=int(data["shard"]),
            run=int(data["run"]),
            rows=RowRanges.from_json(data["row_ranges"]),
            sums=RowSums.from_json(data),
            size_bytes=int(data.get("size_bytes", 0)),
            version=str(data.get("version", "")),
            actor_id=data.get("actor_id"),
            written_at=float(data.get("written_at", 0.0)),
            replaces=data.get("replaces"),
            stats=RowStats.from_json(data["stats"]) if "stats" in data else None,
        )


def list_part_names(out: OutputDir) -> list[str]:
    """Names of the part files under the prefix (committed or not), sorted."""
    return [n for n in out.names("part-") if PART_RE.match(n)]


def table_to_parquet(table: pa.Table, metadata: dict[bytes, bytes] | None = None) -> bytes:
    if metadata:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def write_part(
    out: OutputDir,
    part: PartName,
    table: pa.Table,
    schema: pa.Schema,
    actor_id: str | None,
    replaces: str | None = None,
) -> PartRecord:
    """Write the rows of `table` (output columns plus `_row`) as one part; return its record.

    Rows are sorted by `_row`, which is dropped from the file: the record's ranges say which
    shard rows the part holds, in that order."""

    order = pc.sort_indices(table, [(ROW, "ascending")])
    table = table.take(order)
    rows = RowRanges.from_indexes(table.column(ROW).to_pylist())
    body = conform(table, schema)
    stats = RowStats.of_table(body)
    record = PartRecord(
        name=part.name,
        shard=part.shard,
        run=part.run,
        rows=rows,
        sums=stats.sums,
        size_bytes=0,
        version="",
        actor_id=actor_id,
        written_at=time.time(),
        replaces=replaces,
        stats=stats,
    )
    meta = {METADATA_KEY: json.dumps(record.to_json(with_stats=True)).encode()}
    data = table_to_parquet(body, meta)
    version = out.put(part.name, data)
    return dataclasses.replace(record, size_bytes=len(data), version=version)


def read_part(
    out: OutputDir, name: str, columns: list[str] | None = None, optional: tuple[str, ...] = ()
) -> pa.Table:
    """A committed part's rows (only `columns` when given, plus those of `optional` the part
    has: columns that parts of older jobs lack)."""
    try:
        # Through a file handle, so only the requested columns' byte ranges are fetched.
        with out.fs.open(out.path(name), "rb") as handle:
            if not optional:
                return pq.read_table(handle, columns=columns)
            parquet = pq.ParquetFile(handle)  # one open: the footer says what is there
            present = set(parquet.schema_arrow.names)
            extra = [c for c in optional if c in present]
            return parquet.read(columns=None if columns is None else [*columns, *extra])
    except (pa.ArrowInvalid, OSError) as exc:
        raise RuntimeError(
            f"{out.uri}/{name}: committed part is unreadable ({exc}); delete it and rerun "
            "to regenerate its rows"
        ) from None


def read_part_record(out: OutputDir, name: str) -> PartRecord | None:
    """The record stored in a part's footer (None: not a readable tokenmill part)."""
    try:
        with out.fs.open(out.path(name), "rb") as handle:
            metadata = pq.ParquetFile(handle).schema_arrow.metadata or {}
    except (pa.ArrowInvalid, OSError):
        return None
    raw = metadata.get(METADATA_KEY)
    if raw is None:
        return None
    try:
        return PartRecord.from_json(json.loads(raw))
    except (ValueError, KeyError, TypeError):
        return None
