"""Output rows → Parquet parts, committed exactly once; the committed parts are the truth.

The commit protocol
-------------------
Layout of an output prefix:

    part-<attempt:05d>-<seq:06d>.parquet   committed parts (the only rows that exist)
    _manifest.json                         fingerprint, status, parts, totals (commit.manifest)
    _SUCCESS                               written last, only when the output is complete

1. Every run is an *attempt*, numbered one above the highest attempt found in the part names
   and in the manifest's runs (a crashed attempt's number is never reused, so names never
   collide). One driver writes a prefix at a time: two concurrent runs of the same job on the
   same prefix are not guarded against (`tokenmill submit` gives each night one submission).
2. The driver alone writes parts. It consumes the generate stage's output stream and cuts it
   into parts of at most `output.rows_per_file` rows, named with the attempt and a sequence
   number. A part is serialized in memory and committed in one step: on S3 one PUT of the
   whole object (an object appears whole or not at all; a stream opened with pyarrow's
   `open_output_stream` would create a truncated object if an exception hit mid-write); on
   local disks a write to a hidden temp file followed by a rename. A part being written when
   the driver dies is therefore either complete or absent.
3. On every start the committed parts are read (id, finish_reason, attempt) and their ids are
   filtered out of the input before generation: a rerun after a crash generates only the
   rest. A row that failed (finish_reason "error") is committed like any other: it is done.
4. `--retry-errors` regenerates the ids whose latest row is an error, into new parts of a new
   attempt. Rows of a later attempt supersede rows of the same id in earlier attempts. When
   the new parts are committed, every older part holding a superseded row is rewritten without
   it (atomically, as in 2; a part left empty is deleted). If the driver dies between the two,
   the next run finishes the rewrite before anything else, so once `_SUCCESS` is present each
   id is in exactly one part. `_SUCCESS` is deleted before any run that may change the parts.
5. At the end the input ids are checked against the committed ids; only if every input id is
   committed are `_manifest.json` (status "complete") and then `_SUCCESS` written. Readers
   that see `_SUCCESS` can read every `part-*.parquet` and get each input id exactly once.

The fixed output schema is defined once here (`output_schema`); ok and error rows share it.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.spec import StorageSpec
from pipeline.storage import filesystem_for, join_uri, write_bytes_atomic

SUCCESS_NAME = "_SUCCESS"
MANIFEST_NAME = "_manifest.json"
_PART_RE = re.compile(r"^part-(\d{5})-(\d{6})\.parquet$")
_TEMP_SUFFIX = ".tmp"  # storage.write_bytes_atomic's local temp files: .<name>.<random>.tmp

# --- the output schema -----------------------------------------------------------------------

# Columns every output row has, in order; passthrough columns go right after `id`, and
# `completion_token_ids` is appended when output.include_token_ids is on.
RESULT_FIELDS: tuple[pa.Field, ...] = (
    pa.field("text", pa.string()),  # generated text ("" for error rows)
    pa.field("finish_reason", pa.string()),  # stop | length | error | cancelled
    pa.field("error", pa.string()),  # what went wrong, null on ok rows
    pa.field("prompt_tokens", pa.int32()),
    pa.field("cached_prompt_tokens", pa.int32()),  # prompt tokens served from the prefix cache
    pa.field("completion_tokens", pa.int32()),
    pa.field("queue_s", pa.float64()),  # arrival → first scheduled (null: never scheduled)
    pa.field("ttft_s", pa.float64()),  # arrival → first token
    pa.field("decode_s", pa.float64()),  # first token → finish
    pa.field("latency_s", pa.float64()),  # arrival → finish
    pa.field("gpu_seconds", pa.float64()),  # device-seconds attributed to this row
    pa.field("cost_usd", pa.float64()),  # gpu_seconds × cost.device_hour_usd / 3600
    pa.field("list_price_usd", pa.float64()),  # what a token-priced API would charge
    pa.field("model", pa.string()),  # model.display_name
    pa.field("engine", pa.string()),  # engine kind
    pa.field("actor_id", pa.string()),  # Ray actor that served the row (null: never sent)
    pa.field("finished_at", pa.timestamp("ms", tz="UTC")),  # wall time the row finished
)
TOKEN_IDS_FIELD = pa.field("completion_token_ids", pa.list_(pa.int32()))


def output_schema(
    passthrough: Iterable[pa.Field] = (), include_token_ids: bool = False
) -> pa.Schema:
    """The one schema of every part of a job: id, passthrough columns, results."""
    fields = [pa.field("id", pa.string()), *passthrough, *RESULT_FIELDS]
    if include_token_ids:
        fields.append(TOKEN_IDS_FIELD)
    return pa.schema(fields)


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


# --- storage ---------------------------------------------------------------------------------


class OutputDir:
    """One output prefix: atomic puts, reads, listing and deletion of the names in it."""

    def __init__(self, uri: str, storage: StorageSpec):
        self.uri = uri.rstrip("/")
        self.storage = storage
        self.fs, self.root = filesystem_for(self.uri, storage)
        self.root = self.root.rstrip("/")

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def names(self) -> list[str]:
        """Names directly under the prefix (empty if the prefix does not exist yet)."""
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in entries)

    def exists(self, name: str) -> bool:
        return bool(self.fs.exists(self.path(name)))

    def read(self, name: str) -> bytes:
        return bytes(self.fs.cat_file(self.path(name)))

    def put_atomic(self, name: str, data: bytes) -> None:
        """Make `name` appear with exactly `data`, or not at all (see the protocol, step 2)."""
        write_bytes_atomic(join_uri(self.uri, name), data, self.storage)

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(name))

    def remove_temp_files(self) -> None:
        """Temp files left by a driver that died mid-write (local disks only)."""
        for name in self.names():
            if name.startswith(".") and name.endswith(_TEMP_SUFFIX):
                self.delete(name)

    def clear(self) -> None:
        """Delete this job's parts, manifest and marker (for --fresh); other files stay."""
        for name in self.names():
            if (
                _PART_RE.match(name)
                or name in (SUCCESS_NAME, MANIFEST_NAME)
                or (name.startswith(".") and name.endswith(_TEMP_SUFFIX))
            ):
                self.delete(name)


# --- parts -----------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class PartName:
    attempt: int  # the run that wrote the part
    seq: int  # order within the attempt

    @property
    def name(self) -> str:
        return f"part-{self.attempt:05d}-{self.seq:06d}.parquet"

    @classmethod
    def parse(cls, name: str) -> PartName | None:
        match = _PART_RE.match(name)
        return cls(int(match.group(1)), int(match.group(2))) if match else None


def list_parts(out: OutputDir) -> list[PartName]:
    return sorted(p for p in (PartName.parse(n) for n in out.names()) if p is not None)


def table_to_parquet(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def read_part(out: OutputDir, part: PartName, columns: list[str] | None = None) -> pa.Table:
    try:
        # Through a file handle, so only the requested columns' byte ranges are fetched.
        with out.fs.open(out.path(part.name), "rb") as fh:
            return pq.read_table(fh, columns=columns)
    except (pa.ArrowInvalid, OSError) as exc:
        raise RuntimeError(
            f"{out.uri}/{part.name}: committed part is unreadable ({exc}); delete it and rerun "
            "to regenerate its rows"
        ) from None


@dataclass
class CommitStats:
    """What one writer committed during this attempt."""

    parts: list[str] = field(default_factory=list)
    rows: int = 0
    error_rows: int = 0
    completion_tokens: int = 0
    duplicates_dropped: int = 0  # rows of an id already written by this attempt


class PartWriter:
    """Cuts a stream of output tables into parts of at most `rows_per_file` rows and commits
    each part atomically, in order."""

    def __init__(self, out: OutputDir, attempt: int, schema: pa.Schema, rows_per_file: int):
        self.out = out
        self.attempt = attempt
        self.schema = schema
        self.rows_per_file = rows_per_file
        self.stats = CommitStats()
        self._buffer: list[pa.Table] = []
        self._buffered = 0
        self._seq = 0
        # A safety net against a retried task re-emitting rows: ids of this attempt.
        self._seen: set[str] = set()

    def add(self, table: pa.Table) -> list[str]:
        """Buffer `table` (already in the output schema); returns names of parts committed."""
        ids = table.column("id").to_pylist()
        keep = [i for i, row_id in enumerate(ids) if row_id not in self._seen]
        if len(keep) != len(ids):
            self.stats.duplicates_dropped += len(ids) - len(keep)
            table = table.take(pa.array(keep, type=pa.int64()))
        self._seen.update(ids)
        if table.num_rows:
            self._buffer.append(table)
            self._buffered += table.num_rows
        committed = []
        while self._buffered >= self.rows_per_file:
            committed.append(self._commit(self.rows_per_file))
        return committed

    def close(self) -> list[str]:
        """Commit what is left (a short last part)."""
        return [self._commit(self._buffered)] if self._buffered else []

    def _commit(self, num_rows: int) -> str:
        table = pa.concat_tables(self._buffer)
        head, rest = table.slice(0, num_rows), table.slice(num_rows)
        self._buffer = [rest] if rest.num_rows else []
        self._buffered = rest.num_rows
        part = PartName(self.attempt, self._seq)
        self._seq += 1
        self.out.put_atomic(part.name, table_to_parquet(head.combine_chunks()))
        self.stats.parts.append(part.name)
        self.stats.rows += head.num_rows
        is_error = pc.equal(head.column("finish_reason"), "error")
        self.stats.error_rows += pc.sum(is_error).as_py() or 0
        self.stats.completion_tokens += pc.sum(head.column("completion_tokens")).as_py() or 0
        return part.name


# --- reading back the committed state --------------------------------------------------------


@dataclass
class CommittedState:
    """The committed rows' ids and which of them are (still) errors."""

    parts: list[PartName]
    ids: pa.Array  # string: every committed id, each once (latest attempt wins)
    error_ids: pa.Array  # string: ids whose latest row is an error
    superseded: dict[str, list[str]]  # part name -> ids in it that a later attempt replaced

    @property
    def next_attempt(self) -> int:
        return max((p.attempt for p in self.parts), default=0) + 1


def load_committed(out: OutputDir) -> CommittedState:
    """Read id and finish_reason of every committed part (protocol, step 3)."""
    parts = list_parts(out)
    empty = pa.array([], pa.string())
    if not parts:
        return CommittedState(parts=[], ids=empty, error_ids=empty, superseded={})
    tables = []
    for part in parts:
        t = read_part(out, part, columns=["id", "finish_reason"])
        tables.append(
            pa.table(
                {
                    "id": t.column("id").cast(pa.string()),
                    "is_error": pc.fill_null(pc.equal(t.column("finish_reason"), "error"), False),
                    "attempt": pa.repeat(pa.scalar(part.attempt, pa.int32()), t.num_rows),
                    "part": pa.repeat(pa.scalar(part.name), t.num_rows),
                }
            )
        )
    rows = pa.concat_tables(tables)
    superseded: dict[str, list[str]] = {}
    if pc.count_distinct(rows.column("id")).as_py() != rows.num_rows:
        # Some id was regenerated by a later attempt (--retry-errors): the latest row wins.
        latest = rows.group_by("id").aggregate([("attempt", "max")])
        rows = rows.join(latest, keys="id")
        is_current = pc.equal(rows.column("attempt"), rows.column("attempt_max"))
        older = rows.filter(pc.invert(is_current))
        for part_name, row_id in zip(
            older.column("part").to_pylist(), older.column("id").to_pylist(), strict=True
        ):
            superseded.setdefault(part_name, []).append(row_id)
        rows = rows.filter(is_current)
    errors = rows.filter(rows.column("is_error")).column("id")
    return CommittedState(
        parts=parts,
        ids=rows.column("id").combine_chunks(),
        error_ids=errors.combine_chunks() if errors.num_chunks else empty,
        superseded=superseded,
    )


def drop_superseded(out: OutputDir, state: CommittedState) -> list[str]:
    """Rewrite every part holding superseded rows without them (protocol, step 4)."""
    rewritten = []
    for name, ids in sorted(state.superseded.items()):
        part = PartName.parse(name)
        assert part is not None  # names come from list_parts
        table = read_part(out, part)
        keep = pc.invert(pc.is_in(table.column("id"), value_set=pa.array(ids, pa.string())))
        table = table.filter(keep)
        if table.num_rows:
            out.put_atomic(name, table_to_parquet(table))
        else:
            out.delete(name)
        rewritten.append(name)
    return rewritten


def iter_committed(out: OutputDir, columns: list[str] | None = None) -> Iterator[pa.Table]:
    """Committed parts, one table each, in part order."""
    for part in list_parts(out):
        yield read_part(out, part, columns=columns)
