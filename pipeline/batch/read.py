"""Input files → rows with a stable id: the first stage of a job.

Every input row becomes exactly one output row; nothing is dropped. A row that cannot be read
(a malformed JSON line, an OpenAI batch request we cannot serve, a missing column) becomes an
*error row*: its `error` is set and later stages pass it through untouched.

Columns of the dataset `read_dataset` returns (names are the constants below):

- `id` (string): the id column's value as text; openai_batch: `custom_id`; without either,
  derived from (file URI, row index) as `<8 hex of sha256(uri)>-<row index>`.
- `prompt` (string, null): prompt text (prompt column, or openai_batch `body.prompt`).
- `messages` (string, null): the chat as JSON text of a list of {role, content} (messages
  column, or openai_batch `body.messages`).
- `error` (string, null): read-level problem, naming the file and the line or row.
- passthrough columns (`input.passthrough_columns`) and the columns `prompt.template` reads,
  typed as in the input (nested JSON values as JSON text).
- override source columns (`sampling.overrides` values), int64 or float64 as the sampling
  field; a value that is not a number makes the row an error row naming column and value.

openai_batch lines fill the fixed override columns `max_tokens` (body.max_completion_tokens
or body.max_tokens), `temperature`, `top_p` and `seed` (see `override_columns`).

The row index is the 0-based line number for JSONL (blank lines are skipped but keep their
number, so ids do not shift when one is added) and the 0-based row number for Parquet.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.spec import JobSpec, SpecError
from pipeline.storage import InputFile, StorageError, filesystem_for

if TYPE_CHECKING:
    import pyarrow as pa
    import ray.data

ID = "id"
PROMPT = "prompt"
MESSAGES = "messages"
ERROR = "error"
CORE_COLUMNS = (ID, PROMPT, MESSAGES, ERROR)

SUPPORTED_BATCH_URLS = ("/v1/chat/completions", "/v1/completions")
# openai_batch: sampling field -> the column its per-request value lands in.
BATCH_OVERRIDE_COLUMNS: dict[str, str] = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
}
# The Python type each overridable sampling field is coerced to.
OVERRIDE_TYPES: dict[str, type] = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "seed": int,
}
# Request body parameters that would change results and that the pipeline does not implement:
# name -> predicate on the value saying "this value needs the feature".
_UNSUPPORTED_BODY: dict[str, Any] = {
    "n": lambda v: v not in (None, 1),
    "best_of": lambda v: v not in (None, 1),
    "logprobs": lambda v: bool(v),
    "top_logprobs": lambda v: v is not None,
    "echo": lambda v: bool(v),
    "suffix": lambda v: bool(v),
    "stream": lambda v: bool(v),
    "tools": lambda v: bool(v),
    "tool_choice": lambda v: v not in (None, "none"),
    "functions": lambda v: bool(v),
    "function_call": lambda v: v not in (None, "none"),
    "response_format": lambda v: v not in (None, {"type": "text"}),
    "logit_bias": lambda v: bool(v),
    "presence_penalty": lambda v: v not in (None, 0, 0.0),
    "frequency_penalty": lambda v: v not in (None, 0, 0.0),
    "stop": lambda v: bool(v),
}


def override_columns(spec: JobSpec) -> dict[str, str]:
    """Sampling field -> input column holding its per-row value (openai_batch adds its own)."""
    columns = dict(BATCH_OVERRIDE_COLUMNS) if spec.input.format == "openai_batch" else {}
    columns.update(spec.sampling.overrides)
    return columns


def extra_columns(spec: JobSpec) -> list[str]:
    """Input columns read besides the prompt source: passthrough, template, override sources."""
    names = [
        *spec.input.passthrough_columns,
        *spec.template_columns(),
        *spec.sampling.overrides.values(),
    ]
    return list(dict.fromkeys(n for n in names if n not in CORE_COLUMNS))


def derived_id(uri: str, row_index: int) -> str:
    """The id of a row without an id column: stable while the file's URI and order are."""
    return f"{hashlib.sha256(uri.encode()).hexdigest()[:8]}-{row_index}"


def coerce_override(
    field: str, column: str, value: Any, label: str | None = None
) -> tuple[Any, str | None]:
    """(value as the field's type, None) or (None, error text naming the column and value).

    `label` replaces the default "column 'x' (sampling.overrides.field)" in the message.
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None, None
    where = label or f"column {column!r} (sampling.overrides.{field})"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, f"{where}: {value!r} is not a number"
    if OVERRIDE_TYPES[field] is int:
        if isinstance(value, float) and not value.is_integer():
            return None, f"{where}: {value!r} is not an integer"
        if not -(2**63) <= value < 2**63:
            return None, f"{where}: {value!r} does not fit in a 64-bit integer"
        return int(value), None
    return float(value), None


# --- one file -> one Arrow table ---------------------------------------------------------------


@dataclass
class _Rows:
    """Column-wise row buffer for one file (Python lists; turned into Arrow at the end)."""

    columns: dict[str, list[Any]]

    @classmethod
    def empty(cls, names: list[str]) -> _Rows:
        return cls({name: [] for name in names})

    def append(self, row: dict[str, Any]) -> None:
        for name, values in self.columns.items():
            values.append(row.get(name))


def _column_types(spec: JobSpec) -> dict[str, Any]:
    import pyarrow as pa

    types: dict[str, Any] = {name: pa.string() for name in CORE_COLUMNS}
    for field, column in override_columns(spec).items():
        types[column] = pa.int64() if OVERRIDE_TYPES[field] is int else pa.float64()
    return types


def _to_table(spec: JobSpec, rows: _Rows) -> pa.Table:
    import pyarrow as pa

    types = _column_types(spec)
    arrays, names = [], []
    for name, values in rows.columns.items():
        if name in types:
            arrays.append(pa.array(values, type=types[name]))
        else:
            try:
                arrays.append(pa.array(values))
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
                # Mixed JSON types in one column (1 and "a"): keep every value, as JSON text.
                arrays.append(pa.array([None if v is None else json.dumps(v) for v in values]))
        names.append(name)
    return pa.Table.from_arrays(arrays, names=names)


def _output_names(spec: JobSpec) -> list[str]:
    names = list(CORE_COLUMNS)
    for name in [*extra_columns(spec), *override_columns(spec).values()]:
        if name not in names:
            names.append(name)
    return names


def _json_cell(value: Any) -> Any:
    """Passthrough/template values from JSON: nested objects are kept as JSON text."""
    return json.dumps(value) if isinstance(value, (dict, list)) else value


def _apply_overrides(
    spec: JobSpec, row: dict[str, Any], source: dict[str, Any], where: str
) -> None:
    """Coerce the override source columns of `row` (taken from `source`) in place."""
    for field, column in override_columns(spec).items():
        if column not in source:
            continue
        value, problem = coerce_override(field, column, source[column])
        row[column] = value
        if problem and row.get(ERROR) is None:
            row[ERROR] = f"{where}: {problem}"


def _text_prompt(row: dict[str, Any], column: str, value: Any, where: str) -> None:
    if value is None or isinstance(value, str):
        row[PROMPT] = value
    else:
        row[ERROR] = f"{where}: column {column!r} holds {type(value).__name__}, expected text"


def _messages_value(row: dict[str, Any], column: str, value: Any, where: str) -> None:
    if value is None or isinstance(value, str):
        row[MESSAGES] = value
    elif isinstance(value, list):
        row[MESSAGES] = json.dumps(value)
    else:
        row[ERROR] = (
            f"{where}: column {column!r} holds {type(value).__name__}, expected a list of "
            "{role, content} messages"
        )


def _jsonl_row(spec: JobSpec, obj: dict[str, Any], row: dict[str, Any], where: str) -> None:
    inp = spec.input
    # Passthrough and override keys may be absent from a line (null); the prompt source may not.
    required = [c for c in (inp.id_column, inp.prompt_column, inp.messages_column) if c]
    required += spec.template_columns()
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
        _text_prompt(row, inp.prompt_column, obj[inp.prompt_column], where)
    if inp.messages_column:
        _messages_value(row, inp.messages_column, obj[inp.messages_column], where)
    for name in extra_columns(spec):
        row[name] = _json_cell(obj.get(name))
    _apply_overrides(spec, row, obj, where)


def parse_batch_request(obj: dict[str, Any]) -> dict[str, Any]:
    """One OpenAI Batch API line → custom_id, prompt/messages, override values, or an error.

    Returns a dict with keys `custom_id` (may be None), `prompt`, `messages` (JSON text),
    the BATCH_OVERRIDE_COLUMNS and `error`.
    """
    out: dict[str, Any] = {"custom_id": None, PROMPT: None, MESSAGES: None, ERROR: None}
    custom_id = obj.get("custom_id")
    if custom_id is None or custom_id == "":
        out[ERROR] = "missing custom_id"
        return out
    out["custom_id"] = str(custom_id)
    url = obj.get("url")
    if url not in SUPPORTED_BATCH_URLS:
        out[ERROR] = f"unsupported url {url!r}; supported: {', '.join(SUPPORTED_BATCH_URLS)}"
        return out
    method = obj.get("method", "POST")
    if str(method).upper() != "POST":
        out[ERROR] = f"unsupported method {method!r}; batch requests are POST"
        return out
    body = obj.get("body")
    if not isinstance(body, dict):
        out[ERROR] = "missing body (an object with messages or prompt)"
        return out
    for name, needs_feature in _UNSUPPORTED_BODY.items():
        if name in body and needs_feature(body[name]):
            out[ERROR] = f"unsupported body parameter {name}={body[name]!r}"
            return out
    if url == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            out[ERROR] = "body.messages must be a non-empty list for /v1/chat/completions"
            return out
        out[MESSAGES] = json.dumps(messages)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            out[ERROR] = "body.prompt must be one string for /v1/completions"
            return out
        out[PROMPT] = prompt
    values = {
        "max_tokens": body.get("max_completion_tokens", body.get("max_tokens")),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "seed": body.get("seed"),
    }
    for field, value in values.items():
        column = BATCH_OVERRIDE_COLUMNS[field]
        coerced, problem = coerce_override(field, column, value, label=f"body.{field}")
        out[column] = coerced
        if problem:
            out[ERROR] = problem
            return out
    return out


def _batch_row(spec: JobSpec, obj: dict[str, Any], row: dict[str, Any], where: str) -> None:
    parsed = parse_batch_request(obj)
    if parsed["custom_id"] is not None:
        row[ID] = parsed["custom_id"]
    for name in (PROMPT, MESSAGES, *BATCH_OVERRIDE_COLUMNS.values()):
        row[name] = parsed.get(name)
    for name in spec.input.passthrough_columns:
        row[name] = _json_cell(obj.get(name))
    # User overrides may point at top-level keys of the line (rare, but allowed).
    _apply_overrides(
        spec, row, {k: v for k, v in obj.items() if k in spec.sampling.overrides.values()}, where
    )
    if parsed[ERROR]:
        row[ERROR] = f"{where}: {parsed[ERROR]}"


def iter_lines(spec: JobSpec, file: InputFile) -> Iterator[tuple[int, bytes]]:
    """(0-based line number, line) for the non-blank lines of a JSONL file."""
    fs, path = filesystem_for(file.uri, spec.storage)
    # compression="infer": .jsonl.gz / .jsonl.zst inputs are read transparently.
    with fs.open(path, "rb", compression="infer") as handle:
        for index, line in enumerate(handle):
            if line.strip():
                yield index, line


def _iter_jsonl(
    spec: JobSpec, file: InputFile, max_rows: int | None, chunk_rows: int
) -> Iterator[pa.Table]:
    names = _output_names(spec)
    rows = _Rows.empty(names)
    count = 0
    for index, line in iter_lines(spec, file):
        if max_rows is not None and count >= max_rows:
            break
        count += 1
        where = f"{file.uri} line {index + 1}"
        row: dict[str, Any] = {ID: derived_id(file.uri, index), ERROR: None}
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            row[ERROR] = f"{where}: not valid JSON ({exc})"
            obj = None
        if obj is None:
            pass
        elif not isinstance(obj, dict):
            row[ERROR] = f"{where}: expected a JSON object, got {type(obj).__name__}"
        elif spec.input.format == "openai_batch":
            _batch_row(spec, obj, row, where)
        else:
            _jsonl_row(spec, obj, row, where)
        rows.append(row)
        if len(rows.columns[ID]) >= chunk_rows:
            yield _to_table(spec, rows)
            rows = _Rows.empty(names)
    if rows.columns[ID] or count == 0:
        yield _to_table(spec, rows)


def _parquet_needs(spec: JobSpec) -> dict[str, str]:
    """Input column -> the spec field that asks for it (for "column not found" errors)."""
    inp = spec.input
    needed = {c: "input.id_column" for c in [inp.id_column] if c}
    needed.update({c: "input.prompt_column" for c in [inp.prompt_column] if c})
    needed.update({c: "input.messages_column" for c in [inp.messages_column] if c})
    for c in inp.passthrough_columns:
        needed.setdefault(c, "input.passthrough_columns")
    for c in spec.template_columns():
        needed.setdefault(c, "prompt.template")
    for field, c in spec.sampling.overrides.items():
        needed.setdefault(c, f"sampling.overrides.{field}")
    return needed


def _parquet_chunk(
    spec: JobSpec,
    file: InputFile,
    table: pa.Table,
    first_row: int,
    present: list[str],
    file_error: str | None,
) -> pa.Table:
    """Read columns for rows [first_row, first_row + table.num_rows) of one Parquet file."""
    import pyarrow as pa

    inp = spec.input

    def values(name: str | None) -> list[Any] | None:
        return table.column(name).to_pylist() if name and name in present else None

    ids, prompts, chats = (
        values(inp.id_column),
        values(inp.prompt_column),
        values(inp.messages_column),
    )
    override_values = {
        c: table.column(c).to_pylist() for c in spec.sampling.overrides.values() if c in present
    }
    core: dict[str, list[Any]] = {ID: [], PROMPT: [], MESSAGES: [], ERROR: []}
    coerced: dict[str, list[Any]] = {c: [] for c in override_values}
    for i in range(table.num_rows):
        index = first_row + i
        where = f"{file.uri} row {index}"
        row: dict[str, Any] = {ID: derived_id(file.uri, index), ERROR: file_error}
        if ids is not None:
            if ids[i] is None:
                row[ERROR] = row[ERROR] or f"{where}: id column {inp.id_column!r} is null"
            else:
                row[ID] = str(ids[i])
        if prompts is not None:
            _text_prompt(row, inp.prompt_column or "", prompts[i], where)
        if chats is not None:
            _messages_value(row, inp.messages_column or "", chats[i], where)
        _apply_overrides(spec, row, {c: v[i] for c, v in override_values.items()}, where)
        for name in core:
            core[name].append(row.get(name))
        for name in coerced:
            coerced[name].append(row.get(name))

    types = _column_types(spec)
    arrays: dict[str, Any] = {name: pa.array(core[name], type=pa.string()) for name in core}
    for name in _output_names(spec):
        if name in arrays:
            continue
        if name in coerced:
            arrays[name] = pa.array(coerced[name], type=types[name])
        elif name in present:
            arrays[name] = table.column(name).combine_chunks()
        else:
            arrays[name] = pa.nulls(table.num_rows, type=types.get(name, pa.null()))
    return pa.Table.from_arrays(list(arrays.values()), names=list(arrays))


def _iter_parquet(
    spec: JobSpec, file: InputFile, max_rows: int | None, chunk_rows: int
) -> Iterator[pa.Table]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    needed = _parquet_needs(spec)
    fs, path = filesystem_for(file.uri, spec.storage)
    with fs.open(path, "rb") as handle:
        parquet = pq.ParquetFile(handle)
        available = parquet.schema_arrow.names
        present = [c for c in needed if c in available]
        missing = [c for c in needed if c not in available]
        file_error = None
        if missing:
            fields = ", ".join(f"{c!r} ({needed[c]})" for c in missing)
            file_error = f"{file.uri}: column(s) {fields} not found; the file has {available[:20]}"
        total = parquet.metadata.num_rows
        if max_rows is not None:
            total = min(total, max_rows)
        if not present:
            # Nothing to read (every needed column is missing): error rows by count alone.
            for start in range(0, max(total, 1), chunk_rows):
                empty = pa.table({"_": pa.nulls(min(chunk_rows, total - start))})
                yield _parquet_chunk(spec, file, empty, start, present, file_error)
            return
        first_row = 0
        for batch in parquet.iter_batches(batch_size=chunk_rows, columns=present):
            if first_row >= total:
                break
            table = pa.Table.from_batches([batch]).slice(0, total - first_row)
            yield _parquet_chunk(spec, file, table, first_row, present, file_error)
            first_row += table.num_rows
        if first_row == 0:
            yield _parquet_chunk(
                spec, file, parquet.schema_arrow.empty_table().select(present), 0, present, None
            )


# Rows per table a reader yields: bounds a read task's memory on big files.
READ_CHUNK_ROWS = 8192


def iter_file(
    spec: JobSpec, file: InputFile, max_rows: int | None = None, chunk_rows: int = READ_CHUNK_ROWS
) -> Iterator[pa.Table]:
    """The rows of one input file (at most `max_rows`) as Arrow tables of <= chunk_rows rows.

    Yields at least one table (possibly empty), so the schema is always known.
    """
    reader = _iter_parquet if spec.input.format == "parquet" else _iter_jsonl
    try:
        yield from reader(spec, file, max_rows, chunk_rows)
    except (SpecError, StorageError):
        raise
    except Exception as exc:
        # A corrupt file or a dropped connection: no row count to make error rows from, so the
        # read fails, naming the file.
        raise StorageError(
            f"cannot read {file.uri} as input.format {spec.input.format}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def read_file(spec: JobSpec, file: InputFile, max_rows: int | None = None) -> pa.Table:
    """All rows of one input file (at most `max_rows`), as one Arrow table. No Ray needed."""
    import pyarrow as pa

    tables = list(iter_file(spec, file, max_rows))
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="default")


def count_rows(spec: JobSpec, file: InputFile) -> int:
    """Rows in one file: Parquet from its footer, JSONL by counting non-blank lines."""
    if spec.input.format == "parquet":
        import pyarrow.parquet as pq

        fs, path = filesystem_for(file.uri, spec.storage)
        with fs.open(path, "rb") as handle:
            return pq.ParquetFile(handle).metadata.num_rows
    return sum(1 for _ in iter_lines(spec, file))


def row_budget(spec: JobSpec, files: list[InputFile]) -> list[tuple[InputFile, int | None]]:
    """Files to read with their row cap, honouring `input.limit` in input order.

    Without a limit every file is read whole (None). With one, files are counted in order
    until the limit is reached; later files are not read at all.
    """
    limit = spec.input.limit
    if limit is None:
        return [(f, None) for f in files]
    plan: list[tuple[InputFile, int | None]] = []
    left = limit
    for file in files:
        if left <= 0:
            break
        rows = count_rows(spec, file)
        plan.append((file, min(rows, left)))
        left -= rows
    return plan


# --- Ray Data ----------------------------------------------------------------------------------

# Read tasks are I/O and JSON parsing; a fraction of a CPU leaves room for the other stages.
READ_TASK_CPUS = 0.25


def _read_units(batch: pa.Table, spec: JobSpec) -> Iterator[pa.Table]:
    # A generator: Ray Data cuts what it yields into blocks, so a large file never has to fit
    # in one task's memory at once.
    for unit in batch.to_pylist():
        file = InputFile(uri=unit["uri"], size=unit["size"], version=unit["version"])
        yield from iter_file(spec, file, unit["max_rows"])


def read_dataset(spec: JobSpec, files: list[InputFile]) -> ray.data.Dataset:
    """The job's rows as a Ray Dataset (columns in the module docstring).

    Each file is read by one task with the reader above (JSON lines are parsed one by one, so a
    bad line is an error row instead of a failed file), and that same task cuts its rows into
    blocks of `resources.batch_size` (`cut_blocks`), so every engine actor gets work even from
    one small file. Row order across files is not guaranteed; ids are.
    """
    import ray.data

    units = [
        {"uri": f.uri, "size": f.size, "version": f.version, "max_rows": cap}
        for f, cap in row_budget(spec, files)
    ]
    if not units:
        raise ValueError("read_dataset: no input files (call preflight(spec) first)")
    ds = ray.data.from_items(units, override_num_blocks=len(units))
    ds = ds.map_batches(
        _read_units,
        fn_kwargs={"spec": spec},
        batch_size=1,
        batch_format="pyarrow",
        num_cpus=READ_TASK_CPUS,
    )
    return cut_blocks(ds, spec.resources.batch_size, READ_TASK_CPUS)


def cut_blocks(ds: ray.data.Dataset, rows: int, num_cpus: float) -> ray.data.Dataset:
    """`ds` with blocks of at most `rows` rows, cut inside the tasks that made them.

    Ray Data's `repartition(target_num_rows_per_block=...)` runs as its own operator with one
    whole CPU and no argument to ask for less. Where a job gives its engine actors most of the
    CPUs (a 2-CPU machine, or a GPU node whose CPUs are spoken for), that task cannot be
    scheduled and the job hangs. Given the same remote arguments as the map before it, Ray
    fuses the two, so the cutting runs in the read task at `num_cpus` (the operator's remote
    arguments are the one thing set here that the public call does not expose).
    """
    cut = ds.repartition(target_num_rows_per_block=rows)
    cut._logical_plan.dag.ray_remote_args["num_cpus"] = num_cpus
    return cut
