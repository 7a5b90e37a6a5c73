"""JSONL and OpenAI batch shards: the lines of one byte range of a file → rows.

A line belongs to the shard holding its first byte. A reader whose range starts inside the
file backs up one byte and skips to the end of that line: whatever line was running at
`start` belongs to the shard before. It then reads lines while their first byte is before
`end`; the last one may run past `end`. Blank lines are skipped and get no row. Compressed
files are one shard, read whole through the decompressor.

Each non-blank line is parsed on its own, so a malformed line is an error row naming the file
and the line (its number when the shard starts the file, else its byte offset), not a failed
file. Lines not selected (already committed) are counted but never parsed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from pipeline.batch.columns import ERROR, ID, ROW
from pipeline.batch.stages.read.cells import (
    RowBuffer,
    adapter_cell,
    apply_overrides,
    derived_id,
    extra_columns,
    json_cell,
    messages_value,
    text_prompt,
)
from pipeline.batch.stages.read.openai_batch import batch_row
from pipeline.batch.units import RowSelection, Shard
from pipeline.spec import JobSpec
from pipeline.storage import filesystem_for

# Read-ahead per request: a whole small shard in one GET, big ones in bounded steps.
MIN_BLOCK_BYTES = 256 * 1024
MAX_BLOCK_BYTES = 16 * 1024**2


def iter_shard_lines(spec: JobSpec, shard: Shard) -> Iterator[tuple[int, int | None, bytes]]:
    """(byte offset, 1-based line number or None when unknown, line) of each non-blank line."""
    fs, path = filesystem_for(shard.uri, spec.storage)
    if shard.kind == "whole_file":
        with fs.open(path, "rb", compression="infer") as handle:
            offset = 0
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield offset, number, line
                offset += len(line)
        return
    block = min(max(shard.end - shard.start + 64 * 1024, MIN_BLOCK_BYTES), MAX_BLOCK_BYTES)
    with fs.open(path, "rb", block_size=block) as handle:
        number: int | None = 1
        if shard.start > 0:
            handle.seek(shard.start - 1)
            handle.readline()  # the rest of the line running at `start`: the shard before's
            number = None
        offset = handle.tell()
        while offset < shard.end:
            line = handle.readline()
            if not line:
                break
            if line.strip():
                yield offset, number, line
            offset += len(line)
            if number is not None:
                number += 1


def jsonl_row(spec: JobSpec, obj: dict[str, Any], row: dict[str, Any], where: str) -> None:
    """Fill `row` from one parsed `input.format: jsonl` line."""
    inp = spec.input
    # Passthrough and override keys may be absent from a line (null); the prompt source may not.
    required = [c for c in (inp.id_column, inp.prompt_column, inp.messages_column) if c]
    required += spec.prompt_columns()
    missing = [c for c in required if c not in obj]
    if inp.id_column and obj.get(inp.id_column) is not None:
        row[ID] = str(obj[inp.id_column])
    if missing:
        row[ERROR] = f"{where}: missing field(s) {missing}; the line has {sorted(obj)[:20]}"
        return
    if inp.id_column and obj[inp.id_column] is None:
        row[ERROR] = f"{where}: id column {inp.id_column!r} is null"
        return
    if inp.prompt_column:
        text_prompt(row, inp.prompt_column, obj[inp.prompt_column], where)
    if inp.messages_column:
        messages_value(row, inp.messages_column, obj[inp.messages_column], where)
    if inp.adapter_column:  # a line without the key runs on the model itself
        adapter_cell(spec, row, obj.get(inp.adapter_column), where)
    for name in extra_columns(spec):
        row[name] = json_cell(obj.get(name))
    apply_overrides(spec, row, obj, where)


def read_jsonl_shard(
    spec: JobSpec, shard: Shard, selection: RowSelection, rows: RowBuffer, where: list[str]
) -> int:
    """Append the selected rows of a JSONL shard to `rows`; returns the shard's row count."""
    to_row = batch_row if spec.input.format == "openai_batch" else jsonl_row
    count = 0
    for offset, number, line in iter_shard_lines(spec, shard):
        if shard.max_rows is not None and count >= shard.max_rows:
            break
        index = count
        count += 1
        if not selection.wants(index):
            continue
        place = f"{shard.uri} line {number}" if number is not None else f"{shard.uri} byte {offset}"
        row: dict[str, Any] = {ROW: index, ID: derived_id(shard.uri, offset), ERROR: None}
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            row[ERROR] = f"{place}: not valid JSON ({exc})"
        else:
            if isinstance(obj, dict):
                to_row(spec, obj, row, place)
            else:
                row[ERROR] = f"{place}: expected a JSON object, got {type(obj).__name__}"
        rows.append(row)
        where.append(place)
    return count
