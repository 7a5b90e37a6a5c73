"""Parquet shards: the row groups of one shard → rows.

Only the columns the job needs are read (id, prompt or messages, passthrough, template and
override columns), and only the shard's row groups, so a shard costs its own column chunks.
A column the job names but the file lacks makes every row of the file an error row naming the
column and the field that asks for it.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.batch.columns import ADAPTER, BODY_SAMPLING, ERROR, ID, MESSAGES, PROMPT, ROW
from pipeline.batch.stages.read.cells import (
    adapter_cell,
    apply_overrides,
    column_types,
    derived_id,
    messages_value,
    output_names,
    text_prompt,
)
from pipeline.batch.stages.schema import fit_column
from pipeline.batch.units import RowSelection, Shard
from pipeline.spec import JobSpec
from pipeline.storage import filesystem_for


def columns_needed(spec: JobSpec) -> dict[str, str]:
    """Input column -> the spec field that asks for it (for "column not found" errors)."""
    inp = spec.input
    needed = {c: "input.id_column" for c in [inp.id_column] if c}
    needed.update({c: "input.prompt_column" for c in [inp.prompt_column] if c})
    needed.update({c: "input.messages_column" for c in [inp.messages_column] if c})
    needed.update({c: "input.adapter_column" for c in [inp.adapter_column] if c})
    for c in inp.passthrough_columns:
        needed.setdefault(c, "input.passthrough_columns")
    for c in spec.template_columns():
        needed.setdefault(c, "prompt.template")
    for c in spec.input.image_columns:
        needed.setdefault(c, "input.image_columns")
    for field, c in spec.sampling.overrides.items():
        needed.setdefault(c, f"sampling.overrides.{field}")
    return needed


def _read_groups(spec: JobSpec, shard: Shard) -> tuple[pa.Table, list[str], str | None]:
    """(the needed columns of the shard's rows, names present, an error for missing columns)."""
    import pyarrow.parquet as pq

    needed = columns_needed(spec)
    fs, path = filesystem_for(shard.uri, spec.storage)
    with fs.open(path, "rb") as handle:
        parquet = pq.ParquetFile(handle)
        available = parquet.schema_arrow.names
        present = [c for c in needed if c in available]
        missing = [c for c in needed if c not in available]
        problem = None
        if missing:
            fields = ", ".join(f"{c!r} ({needed[c]})" for c in missing)
            problem = f"{shard.uri}: column(s) {fields} not found; the file has {available[:20]}"
        if present and shard.row_groups:
            table = parquet.read_row_groups(list(shard.row_groups), columns=present)
        else:
            table = pa.table({"_": pa.nulls(shard.num_rows or 0)})
    return table.slice(0, shard.num_rows), present, problem


def read_parquet_shard(
    spec: JobSpec, shard: Shard, selection: RowSelection, passthrough: list[pa.Field]
) -> tuple[pa.Table, int]:
    """(the selected rows of a Parquet shard as a read table, the shard's row count)."""

    table, present, file_error = _read_groups(spec, shard)
    count = table.num_rows
    if selection.only is None and not selection.skip:
        keep = list(range(count))
    else:
        keep = [i for i in range(count) if selection.wants(i)]
    if len(keep) != count:
        table = table.take(pa.array(keep, type=pa.int64()))
    inp = spec.input

    def values(name: str | None) -> list[Any] | None:
        return table.column(name).to_pylist() if name and name in present else None

    ids, prompts, chats, adapters = (
        values(inp.id_column),
        values(inp.prompt_column),
        values(inp.messages_column),
        values(inp.adapter_column),
    )
    overrides = {c: values(c) for c in spec.sampling.overrides.values() if c in present}
    core: dict[str, list[Any]] = {ID: [], PROMPT: [], MESSAGES: [], ERROR: []}
    coerced: dict[str, list[Any]] = {c: [] for c in overrides}
    row_sampling: list[Any] = []  # BODY_SAMPLING, when overrides set shared-table fields
    row_adapters: list[Any] = []  # ADAPTER, when the job lists adapters
    where: list[str] = []
    for i, index in enumerate(keep):
        place = f"{shard.uri} row {shard.start + index}"
        row: dict[str, Any] = {ID: derived_id(shard.uri, shard.start + index), ERROR: file_error}
        if ids is not None:
            if ids[i] is None:
                row[ERROR] = row[ERROR] or f"{place}: id column {inp.id_column!r} is null"
            else:
                row[ID] = str(ids[i])
        if prompts is not None:
            text_prompt(row, inp.prompt_column or "", prompts[i], place)
        if chats is not None:
            messages_value(row, inp.messages_column or "", chats[i], place)
        if adapters is not None:
            adapter_cell(spec, row, adapters[i], place)
        apply_overrides(spec, row, {c: v[i] for c, v in overrides.items()}, place)  # type: ignore[index]
        for name in core:
            core[name].append(row.get(name))
        for name in coerced:
            coerced[name].append(row.get(name))
        row_sampling.append(row.get(BODY_SAMPLING))
        row_adapters.append(row.get(ADAPTER))
        where.append(place)

    types = column_types(spec, passthrough)
    fixed = {f.name: f.type for f in passthrough}
    arrays: dict[str, Any] = {ROW: pa.array(keep, type=pa.int64())}
    arrays.update({name: pa.array(core[name], type=pa.string()) for name in core})
    for name in output_names(spec):
        if name in arrays:
            continue
        if name in coerced:
            arrays[name] = pa.array(coerced[name], type=types[name])
        elif name == BODY_SAMPLING:
            arrays[name] = pa.array(row_sampling, type=pa.string())
        elif name == ADAPTER:
            arrays[name] = pa.array(row_adapters, type=pa.string())
        elif name in present and name in fixed:
            column = table.column(name)
            try:
                if not _casts_plainly(column.type, fixed[name]):
                    raise pa.ArrowInvalid("not a plain cast")  # checked cell by cell instead
                arrays[name] = pc.cast(column, fixed[name]).combine_chunks()
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                # Some cells do not fit the fixed type: those rows become error rows.
                array, problems = fit_column(name, column.to_pylist(), fixed[name])
                arrays[name] = array
                for i, problem in enumerate(problems):
                    if problem is not None and core[ERROR][i] is None:
                        core[ERROR][i] = f"{where[i]}: {problem}"
                arrays[ERROR] = pa.array(core[ERROR], type=pa.string())
        elif name in present:
            arrays[name] = table.column(name).combine_chunks()
        else:
            arrays[name] = pa.nulls(len(keep), type=types.get(name, pa.null()))
    return pa.Table.from_arrays(list(arrays.values()), names=list(arrays)), count


def _casts_plainly(source: pa.DataType, target: pa.DataType) -> bool:
    """Whether Arrow's cast keeps every value as it is. It would also turn True into 1 and
    "12" into 12, which fit_column refuses cell by cell (those rows become error rows)."""
    if source == target or pa.types.is_null(source) or pa.types.is_string(target):
        return True
    # A bool or a text into a number, a date, ...: only cell by cell.
    return not (pa.types.is_boolean(source) or pa.types.is_string(source))
