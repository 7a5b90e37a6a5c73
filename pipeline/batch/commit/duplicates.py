"""Duplicate ids across shards, found with bounded memory once every row is committed.

Within a shard, the prompt actor marks a repeated id while it reads (an error row naming the
shard). Across shards no single process may hold every id, so the check is a hash-partitioned
pass over the committed parts, as Ray tasks:

    map     per group of parts: read the `id` column of the rows that are not errors already;
            send each id, with its part, position and shard row, to partition crc32(id) % P
            (P = rows / PARTITION_ROWS)
    reduce  per partition: exact duplicates among its ids; every occurrence but the first
            (lowest shard, then row) is a duplicate
    mark    per part holding duplicates: the part is written again with those rows as error
            rows naming the first occurrence, and replaces the old one in the manifest

Each task holds one group of parts or one partition: memory is bounded by PARTITION_ROWS ids,
whatever the job's size. The driver holds only object references (groups x partitions). It
runs for inputs whose ids come from the data (`input.id_column`, OpenAI batch `custom_id`);
derived ids are unique by construction.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.batch.commit.parts import (
    REPLACEMENT_DISPATCH,
    PartName,
    PartRecord,
    conform,
    read_part,
    read_part_record,
    write_part,
)
from pipeline.batch.commit.stats import RowStats
from pipeline.batch.units import RowRanges
from pipeline.spec import StorageSpec
from pipeline.storage import OutputDir, RetryPolicy

PARTITION_ROWS = 2_000_000  # ids one reduce task holds at most (about 100-200 MB)
PARTS_PER_MAP = 16
MARK_SEQ_BASE = 9000  # replacement parts of this check: seq 9000.. (retry-errors use less)
TASK_CPUS = 0.25
MAX_EXAMPLES = 20
# What a map task sends a reduce task, typed here and never by the values: a group of parts
# whose rows are all errors (or none) sends empty columns, which Arrow would type `null`, and
# the reduce's concatenation of them with the other groups' would fail.
MAP_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("part", pa.string()),
        ("position", pa.int64()),
        ("shard", pa.int64()),
        ("row", pa.int64()),
    ]
)


@dataclass
class DuplicateReport:
    """What the check found."""

    num_duplicates: int = 0  # rows whose id an earlier row already has
    examples: list[dict[str, Any]] = field(default_factory=list)  # id, first, repeats
    marks: dict[str, dict[int, str]] = field(default_factory=dict)  # part -> position -> first

    def to_json(self) -> dict[str, Any]:
        return {"num_duplicates": self.num_duplicates, "examples": self.examples}


def _partition_of(ids: list[str], partitions: int) -> list[int]:
    return [zlib.crc32(i.encode()) % partitions for i in ids]


def _map(
    out_uri: str,
    storage: StorageSpec,
    parts: list[tuple[str, int, list[list[int]]]],
    partitions: int,
) -> list[pa.Table] | pa.Table:
    """(part name, shard, shard row ranges) per part → one table of ids per partition."""

    out = OutputDir(out_uri, storage)
    columns: dict[str, list[Any]] = {"id": [], "part": [], "position": [], "shard": [], "row": []}
    for name, shard, spans in parts:
        rows = list(RowRanges.from_json(spans))
        table = read_part(out, name, columns=["id", "finish_reason"])
        ids = table.column("id").to_pylist()  # string, as the output schema has it
        # Rows that are errors already (a repeat within a shard among them) are left out: only
        # results can collide.
        ok = pc.fill_null(pc.not_equal(table.column("finish_reason"), "error"), True).to_pylist()
        keep = [i for i, good in enumerate(ok) if good]
        columns["id"] += [ids[i] for i in keep]
        columns["part"] += [name] * len(keep)
        columns["position"] += keep
        columns["shard"] += [shard] * len(keep)
        columns["row"] += [rows[i] for i in keep]
    table = pa.table(columns, schema=MAP_SCHEMA)
    which = pa.array(_partition_of(columns["id"], partitions), pa.int32())
    tables = [table.filter(pc.equal(which, p)) for p in range(partitions)]
    # One return value per partition (Ray's num_returns); with one, the value itself.
    return tables if partitions > 1 else tables[0]


def _reduce(*tables: pa.Table) -> dict[str, Any]:
    """Duplicates among one partition's ids: {count, examples, marks}."""
    table = pa.concat_tables([t.cast(MAP_SCHEMA) for t in tables] or [MAP_SCHEMA.empty_table()])
    counts = pc.value_counts(table.column("id"))
    repeated = counts.filter(pc.greater(counts.field("counts"), 1)).field("values")
    report: dict[str, Any] = {"count": 0, "examples": [], "marks": {}}
    if len(repeated) == 0:
        return report
    rows = table.filter(pc.is_in(table.column("id"), value_set=repeated)).to_pylist()
    by_id: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_id.setdefault(row["id"], []).append(row)
    for row_id, found in sorted(by_id.items()):
        found.sort(key=lambda r: (r["shard"], r["row"]))
        first = found[0]
        where = f"{first['part']} (shard {first['shard']}, row {first['row']})"
        for later in found[1:]:
            report["marks"].setdefault(later["part"], {})[later["position"]] = where
        report["count"] += len(found) - 1
        if len(report["examples"]) < MAX_EXAMPLES:
            report["examples"].append(
                {"id": row_id, "first": where, "repeats": [r["part"] for r in found[1:]]}
            )
    return report


def find_duplicate_ids(
    out_uri: str, storage: StorageSpec, parts: list[PartRecord]
) -> DuplicateReport:
    """Run the map and reduce tasks over the committed parts (a Ray session must be up)."""
    import ray

    total = sum(p.sums.rows for p in parts)
    partitions = max(1, math.ceil(total / PARTITION_ROWS))
    groups = [parts[i : i + PARTS_PER_MAP] for i in range(0, len(parts), PARTS_PER_MAP)]
    mapper = ray.remote(num_cpus=TASK_CPUS)(_map).options(num_returns=partitions)
    reducer = ray.remote(num_cpus=TASK_CPUS)(_reduce)
    outputs = []
    for group in groups:
        args = [(p.name, p.shard, p.rows.to_json()) for p in group]
        refs = mapper.remote(out_uri, storage, args, partitions)
        outputs.append(refs if partitions > 1 else [refs])
    report = DuplicateReport()
    for partition in range(partitions):
        found = ray.get(reducer.remote(*(refs[partition] for refs in outputs)))
        report.num_duplicates += found["count"]
        report.examples += found["examples"][: MAX_EXAMPLES - len(report.examples)]
        for name, marks in found["marks"].items():
            report.marks.setdefault(name, {}).update(marks)
    return report


def _mark(
    out_uri: str,
    storage: StorageSpec,
    record: PartRecord,
    marks: dict[int, str],
    run: int,
    seq: int,
    schema: pa.Schema,
) -> PartRecord:
    """Write `record`'s part again with the marked rows as duplicate-id error rows."""
    import dataclasses

    out = OutputDir(out_uri, storage, RetryPolicy(storage.retry_s))
    table = read_part(out, record.name)
    errors = table.column("error").to_pylist()
    reasons = table.column("finish_reason").to_pylist()
    ids = table.column("id").to_pylist()
    for position, first in marks.items():
        errors[position] = (
            f"duplicate id {ids[position]!r}: the same id is on an earlier row, in {first}; "
            "every row needs a unique id (fix the input, or set input.id_column to null)"
        )
        reasons[position] = "error"
    for name, values in (("error", errors), ("finish_reason", reasons)):
        index = table.schema.get_field_index(name)
        table = table.set_column(index, name, pa.array(values, table.schema.field(index).type))
    old = read_part_record(out, record.name)
    replaced = (old.stats if old else None) or RowStats.of_table(conform(table, schema))
    table = table.append_column("_row", pa.array(list(record.rows), pa.int64()))
    name = PartName(record.shard, run, REPLACEMENT_DISPATCH, seq)
    new = write_part(out, name, table, schema, record.actor_id, replaces=record.name)
    return dataclasses.replace(new, replaced_stats=replaced, new_rows=0)


def mark_duplicates(
    out_uri: str,
    storage: StorageSpec,
    report: DuplicateReport,
    records: dict[str, PartRecord],
    run: int,
    schema: pa.Schema,
) -> list[PartRecord]:
    """Replacement parts for every part holding duplicates (Ray tasks, one per part)."""
    import ray

    marker = ray.remote(num_cpus=TASK_CPUS)(_mark)
    refs = []
    per_shard: dict[int, int] = {}  # replacement parts of one shard in this run: distinct names
    for name, marks in sorted(report.marks.items()):
        record = records[name]
        seq = MARK_SEQ_BASE + per_shard.get(record.shard, 0)
        per_shard[record.shard] = per_shard.get(record.shard, 0) + 1
        refs.append(marker.remote(out_uri, storage, record, marks, run, seq, schema))
    return ray.get(refs)
