"""Input shards → rows with a stable id: the first stage of a job.

Every input row becomes exactly one output row; nothing is dropped. A row that cannot be read
(a malformed JSON line, an OpenAI batch request we cannot serve, a missing column, a cell
that does not fit its passthrough column) becomes an *error row*: its `error` is set and the
later stages pass it through untouched. The columns are described in `read.columns`.

    read_shard(spec, shard, selection, passthrough) → ShardRows(table, num_rows)

reads one shard (pipeline.batch.driver.shards) and keeps the rows the selection wants: a resumed
shard reads its input again but never parses or generates its committed rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pipeline.batch.columns import CORE_COLUMNS, ERROR, ID, MESSAGES, PROMPT, ROW
from pipeline.batch.stages.read.cells import (
    RowBuffer,
    derived_id,
    extra_columns,
    output_names,
    override_columns,
    to_table,
)
from pipeline.batch.stages.read.jsonl import iter_shard_lines, read_jsonl_shard
from pipeline.batch.stages.read.parquet import read_parquet_shard
from pipeline.batch.units import RowRanges, RowSelection, Shard, ShardPlan
from pipeline.spec import JobSpec, SpecError
from pipeline.storage import StorageError

__all__ = [
    "CORE_COLUMNS",
    "ERROR",
    "ID",
    "MESSAGES",
    "PROMPT",
    "ROW",
    "ShardRows",
    "derived_id",
    "extra_columns",
    "override_columns",
    "read_shard",
    "sample_rows",
]


@dataclass(frozen=True)
class ShardRows:
    """The selected rows of one shard, and how many rows the shard has in all."""

    table: pa.Table  # columns: see read.columns
    num_rows: int  # every row of the shard, selected or not


def read_shard(
    spec: JobSpec,
    shard: Shard,
    selection: RowSelection | None = None,
    passthrough: list[pa.Field] | None = None,
) -> ShardRows:
    """The rows of `shard` that `selection` wants (all by default), in shard order.

    Raises StorageError naming the file when it cannot be read at all (a corrupt Parquet
    file, a dropped connection): there is no row count to make error rows from.
    """
    selection = selection or RowSelection()
    passthrough = passthrough or []
    try:
        if spec.input.format == "parquet":
            table, count = read_parquet_shard(spec, shard, selection, passthrough)
            return ShardRows(table, count)
        rows = RowBuffer.empty(output_names(spec))
        where: list[str] = []
        count = read_jsonl_shard(spec, shard, selection, rows, where)
        return ShardRows(to_table(spec, rows, passthrough, where), count)
    except (SpecError, StorageError):
        raise
    except Exception as exc:
        raise StorageError(
            f"cannot read {shard.describe()} as input.format {spec.input.format}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def sample_rows(spec: JobSpec, plan: ShardPlan, num_rows: int) -> pa.Table:
    """The first `num_rows` rows of the input, in input order (for `tokenmill plan`)."""
    tables: list[pa.Table] = []
    left = num_rows
    for shard in plan.shards:
        if left <= 0:
            break
        table = read_shard(spec, shard, RowSelection(only=RowRanges.full(left))).table
        tables.append(table)
        left -= table.num_rows
    if not tables:
        return to_table(spec, RowBuffer.empty(output_names(spec)), [], [])
    return _concat_samples(tables)


def _concat_samples(tables: list[pa.Table]) -> pa.Table:
    """One table of the shards' samples. Read without a run's fixed passthrough types, a
    column may differ between shards (int32 in one file and int64 in another, numbers in one
    JSONL file and text in the next): promoted where Arrow can, else shown as JSON text, as a
    run's passthrough column of mixed values is."""
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        pass
    import json

    names = {n for t in tables for n in t.column_names}
    mixed = {
        n for n in names if len({t.schema.field(n).type for t in tables if n in t.column_names}) > 1
    }

    def as_text(table: pa.Table) -> pa.Table:
        for name in mixed & set(table.column_names):
            index = table.schema.get_field_index(name)
            values = [
                None if v is None else json.dumps(v, default=str) if not isinstance(v, str) else v
                for v in table.column(name).to_pylist()
            ]
            table = table.set_column(index, name, pa.array(values, pa.string()))
        return table

    return pa.concat_tables([as_text(t) for t in tables], promote_options="permissive")


def sample_values(
    spec: JobSpec, plan: ShardPlan, columns: list[str], num_rows: int
) -> dict[str, list[Any]]:
    """Raw JSON values of `columns` in the first `num_rows` lines of a JSONL input."""
    import json

    values: dict[str, list[Any]] = {c: [] for c in columns}
    seen = 0
    for shard in plan.shards:
        for _, _, line in iter_shard_lines(spec, shard):
            if seen >= num_rows:
                return values
            seen += 1
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(obj, dict):
                for c in columns:
                    values[c].append(obj.get(c))
    return values
