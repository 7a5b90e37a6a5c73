"""Input shards: the unit of work and of commit, derived deterministically from the listing.

A shard is a slice of one input file:

- Parquet: a run of consecutive row groups (rows [start, end) of the file). Row groups are
  never split, so reading a shard fetches exactly its column chunks; a row group larger than
  the target is a shard of its own.
- JSONL / OpenAI batch: a byte range [start, end). A line belongs to the shard that holds its
  first byte, so ranges can be cut anywhere and still give every line to exactly one shard.
  Compressed files (.gz, .zst, ...) cannot be entered in the middle: one shard each.

The plan depends only on the listing (URIs, sizes, versions), the Parquet footers and the
shard settings, so a rerun of the same job derives the same shards; its hash is part of the
job fingerprint. Within a shard, rows are numbered 0.. in file order (`row index`); committed
rows are tracked per shard as `RowRanges` of those indexes, never as ids.

`input.shard_rows` / `input.shard_bytes` set the target size; left null, the size is chosen so
that every engine slot (actors x shards each works on at once, the autoscaling maximum where
the pool scales) gets SHARDS_PER_SLOT shards, and a job at least TARGET_SHARDS: many more
shards than slots, so every slot has work until the end. [MIN, MAX] bounds keep each shard's
prepared rows small. The slots a plan was made for are kept in the manifest, and a resume plans
for the same number whatever its own pool, so it derives the same shards. What is still
unbalanced at the very end, the scheduler evens out by splitting the tail (scheduler.py).
"""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa

from pipeline.batch.units import Shard, ShardKind, ShardPlan
from pipeline.spec import JobSpec
from pipeline.storage import InputFile, StorageError, filesystem_for

TARGET_SHARDS = 256  # the fewest shards a job aims for (enough for a small pool's tail)
SHARDS_PER_SLOT = 4  # and at least this many per engine slot
MIN_SHARD_ROWS = 64
MAX_SHARD_ROWS = 20_000
MIN_SHARD_BYTES = 16 * 1024
MAX_SHARD_BYTES = 256 * 1024**2
# Bytes read from the first JSONL file to estimate bytes per line (for the shard size).
SAMPLE_BYTES = 256 * 1024
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zstd", ".lz4", ".snappy")
FOOTER_THREADS = 16


# --- row index ranges --------------------------------------------------------------------------


# --- shards ------------------------------------------------------------------------------------


def clamp(value: float, low: int, high: int) -> int:
    return int(min(max(math.ceil(value), low), high))


def target_shards(slots: int | None) -> int:
    """How many shards a plan for `slots` engine slots aims for."""
    return max(TARGET_SHARDS, SHARDS_PER_SLOT * (slots or 0))


# --- Parquet -----------------------------------------------------------------------------------


def parquet_footer(spec: JobSpec, file: InputFile) -> tuple[list[int], pa.Schema]:
    """Rows per row group and the Arrow schema of one Parquet file (from its footer only).

    Raises StorageError naming the file when it is not Parquet or cannot be read."""
    import pyarrow.parquet as pq

    fs, path = filesystem_for(file.uri, spec.storage)
    try:
        with fs.open(path, "rb") as handle:
            parquet = pq.ParquetFile(handle)
            meta = parquet.metadata
            sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            return sizes, parquet.schema_arrow
    except (pa.ArrowInvalid, OSError) as exc:
        raise StorageError(
            f"cannot read {file.uri} as input.format parquet: {type(exc).__name__}: {exc}"
        ) from exc


def _parquet_plan(spec: JobSpec, files: list[InputFile], slots: int | None) -> ShardPlan:
    with ThreadPoolExecutor(FOOTER_THREADS, thread_name_prefix="parquet-footer") as pool:
        footers = list(pool.map(lambda f: parquet_footer(spec, f), files))
    groups = [sizes for sizes, _ in footers]
    limit = spec.input.limit
    total = sum(sum(g) for g in groups)
    total = total if limit is None else min(total, limit)
    aim = target_shards(slots)
    target = spec.input.shard_rows or clamp(total / aim, MIN_SHARD_ROWS, MAX_SHARD_ROWS)
    shards: list[Shard] = []
    left = total  # rows still to plan (input.limit cuts the input in input order)

    def emit(file: InputFile, start: int, chosen: list[int], rows: int) -> None:
        shards.append(
            Shard(
                index=len(shards),
                uri=file.uri,
                file_size=file.size,
                file_version=file.version,
                kind="row_groups",
                start=start,
                end=start + rows,
                row_groups=tuple(chosen),
                num_rows=rows,
            )
        )

    for file, sizes in zip(files, groups, strict=True):
        start, chosen, rows = 0, [], 0  # the shard being filled: first row, groups, rows
        for group, size in enumerate(sizes):
            if left - rows <= 0:
                break
            if chosen and rows + size > target:
                emit(file, start, chosen, rows)
                start, left = start + rows, left - rows
                chosen, rows = [], 0
            # The limit may end inside a row group: the shard then reads part of it.
            chosen.append(group)
            rows += min(size, left - rows)
        if chosen:
            emit(file, start, chosen, rows)
            left -= rows
        if left <= 0:
            break
    return ShardPlan(tuple(shards), target, tuple(schema for _, schema in footers))


# --- JSONL -------------------------------------------------------------------------------------


def is_compressed(uri: str) -> bool:
    return uri.lower().endswith(COMPRESSED_SUFFIXES)


def bytes_per_line(spec: JobSpec, file: InputFile) -> float:
    """Mean bytes per line in the first SAMPLE_BYTES of a file (a deterministic estimate)."""
    fs, path = filesystem_for(file.uri, spec.storage)
    with fs.open(path, "rb", compression="infer" if is_compressed(file.uri) else None) as handle:
        sample = handle.read(SAMPLE_BYTES)
    lines = sample.count(b"\n")
    if lines == 0:
        return float(max(len(sample), 1))
    return len(sample) / lines


def _jsonl_limit_end(spec: JobSpec, file: InputFile, rows: int) -> tuple[int, int]:
    """(rows found, byte offset after the `rows`-th non-blank line) of one file."""
    fs, path = filesystem_for(file.uri, spec.storage)
    found, offset = 0, 0
    with fs.open(path, "rb") as handle:
        for line in handle:
            offset += len(line)
            if line.strip():
                found += 1
                if found >= rows:
                    break
    return found, offset


def _jsonl_plan(spec: JobSpec, files: list[InputFile], slots: int | None) -> ShardPlan:
    limit = spec.input.limit
    spans: list[tuple[InputFile, int, int | None]] = []  # (file, end byte, row cap)
    left = limit
    for file in files:
        if left is not None and left <= 0:
            break
        if left is None:
            spans.append((file, file.size, None))
        elif is_compressed(file.uri):
            spans.append((file, file.size, left))
            left -= count_lines(spec, file)
        else:
            found, end = _jsonl_limit_end(spec, file, left)
            spans.append((file, end, None))
            left -= found
    total_bytes = sum(end for _, end, _ in spans)
    if spec.input.shard_bytes:
        target = spec.input.shard_bytes
    else:
        per_line = bytes_per_line(spec, spans[0][0]) if spans else 1.0
        target = clamp(
            max(total_bytes / target_shards(slots), MIN_SHARD_ROWS * per_line),
            MIN_SHARD_BYTES,
            int(min(MAX_SHARD_BYTES, MAX_SHARD_ROWS * per_line)) or MIN_SHARD_BYTES,
        )
    shards: list[Shard] = []
    for file, end, cap in spans:
        pieces: list[tuple[ShardKind, int, int]]
        if is_compressed(file.uri):
            pieces = [("whole_file", 0, file.size)]
        else:
            count = max(1, math.ceil(end / target))
            step = math.ceil(end / count) if end else 0
            pieces = [("byte_range", i * step, min((i + 1) * step, end)) for i in range(count)]
        for kind, start, stop in pieces:
            shards.append(
                Shard(
                    index=len(shards),
                    uri=file.uri,
                    file_size=file.size,
                    file_version=file.version,
                    kind=kind,
                    start=start,
                    end=stop,
                    max_rows=cap if kind == "whole_file" else None,
                )
            )
    return ShardPlan(tuple(shards), target)


def count_lines(spec: JobSpec, file: InputFile) -> int:
    fs, path = filesystem_for(file.uri, spec.storage)
    with fs.open(path, "rb", compression="infer") as handle:
        return sum(1 for line in handle if line.strip())


def plan_shards(spec: JobSpec, files: list[InputFile], slots: int | None = None) -> ShardPlan:
    """The job's shards, in listing order, sized for `slots` engine slots (see the module
    docstring; None: TARGET_SHARDS alone, as plans made before slots were recorded)."""
    if spec.input.format == "parquet":
        plan = _parquet_plan(spec, files, slots)
    else:
        plan = _jsonl_plan(spec, files, slots)
    return dataclasses.replace(plan, slots=slots)
