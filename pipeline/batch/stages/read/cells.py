"""The columns every reader produces, per-row override values, and row → Arrow table building.

Columns of a table that `read_shard` returns (names are the constants below):

- `_row` (int64): the row's index within its shard (file order); what commits are tracked by.
- `id` (string): the id column's value as text; openai_batch: `custom_id`; without either,
  derived from the file URI and the row's place in the file (`derived_id`).
- `prompt` (string, null): prompt text (prompt column, or openai_batch `body.prompt`).
- `messages` (string, null): the chat as JSON text of a list of {role, content} (messages
  column, or openai_batch `body.messages`).
- `error` (string, null): read-level problem, naming the file and the line or row.
- passthrough columns (`input.passthrough_columns`) in the job's fixed output types (a cell
  that does not fit is null and makes its row an error row), then the columns
  `prompt.template` reads (nested JSON values as JSON text).
- override source columns (`sampling.overrides` values), int64 or float64 as the sampling
  field; a value that is not a number makes the row an error row naming column and value.
  Columns of the shared table's fields (stop, penalties, logit_bias, ...) are kept as text
  (lists and objects as JSON) and read into `body_sampling`.

openai_batch lines fill the fixed override columns `max_tokens` (body.max_completion_tokens
or body.max_tokens), `temperature`, `top_p`, `seed`, `response_format` (JSON text) and
`reasoning_effort` (see `override_columns`), and `body_sampling` (BODY_SAMPLING: the shared
table's parameters).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pipeline.batch.columns import (
    ADAPTER,
    BATCH_OVERRIDE_COLUMNS,
    BODY_SAMPLING,
    CORE_COLUMNS,
    ERROR,
    MESSAGES,
    OVERRIDE_TYPES,
    PROMPT,
    ROW,
)
from pipeline.batch.stages.schema import fit_column
from pipeline.openai import params
from pipeline.spec import JobSpec


def has_row_sampling(spec: JobSpec) -> bool:
    """Whether rows carry BODY_SAMPLING: openai_batch input, or an override of a table field."""
    return spec.input.format == "openai_batch" or any(
        field in params.BATCH_SAMPLING for field in spec.sampling.overrides
    )


def has_adapters(spec: JobSpec) -> bool:
    """Whether rows carry ADAPTER: the job has LoRA adapters (model.adapters, or a prefix to
    find them under)."""
    return spec.model.has_adapters


def adapter_cell(spec: JobSpec, row: dict[str, Any], value: Any, where: str) -> None:
    """A row's adapter from its input.adapter_column cell: null, empty or the model's own
    name run on the model itself; a name not among model.adapters is left for the engine to
    refuse (an error row naming it and the adapters there are)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        row[ADAPTER] = None
    elif isinstance(value, str):
        name = value.strip()
        row[ADAPTER] = None if name in ("", spec.model.display_name) else name
    else:
        row[ERROR] = (
            f"{where}: column {spec.input.adapter_column!r} (input.adapter_column) holds "
            f"{type(value).__name__}, expected an adapter's name"
        )


def model_adapter(spec: JobSpec, model: Any) -> tuple[str | None, str | None]:
    """(adapter, None) or (None, error) for an openai_batch line's body.model: the job's
    model (or none named) runs on it, an adapter's name on that adapter; with adapters listed,
    any other name is the line's error (as OpenAI answers a model it does not have)."""
    if not has_adapters(spec) or model in (None, "", "-", spec.model.display_name):
        return None, None
    if isinstance(model, str) and model in spec.model.adapters:
        return model, None
    if isinstance(model, str) and spec.model.adapter_prefix:
        return model, None  # looked up under the prefix when the line runs
    names = ", ".join(sorted(spec.model.adapters))
    return None, (
        f"body.model {model!r} is neither this job's model {spec.model.display_name!r} nor "
        f"one of its adapters ({names})"
    )


def override_columns(spec: JobSpec) -> dict[str, str]:
    """Sampling field -> input column holding its per-row value (openai_batch adds its own)."""
    columns = dict(BATCH_OVERRIDE_COLUMNS) if spec.input.format == "openai_batch" else {}
    columns.update(spec.sampling.overrides)
    return columns


def extra_columns(spec: JobSpec) -> list[str]:
    """Input columns read besides the prompt source: passthrough, template, override sources."""
    names = [
        *spec.input.passthrough_columns,
        *spec.prompt_columns(),
        *spec.sampling.overrides.values(),
    ]
    return list(dict.fromkeys(n for n in names if n not in CORE_COLUMNS))


def derived_id(uri: str, position: int) -> str:
    """The id of a row without an id column: stable while the file's URI and content are.

    `position` is the row number for Parquet and the line's byte offset for JSONL (a line's
    number is unknown to a reader that starts in the middle of a file)."""
    return f"{hashlib.sha256(uri.encode()).hexdigest()[:8]}-{position}"


def coerce_override(
    field: str, column: str, value: Any, label: str | None = None
) -> tuple[Any, str | None]:
    """(value as the field's type, None) or (None, error text naming the column and value).

    `label` replaces the default "column 'x' (sampling.overrides.field)" in the message.
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None, None
    where = label or f"column {column!r} (sampling.overrides.{field})"
    if field == "reasoning_effort":  # a word; the prompt stage checks which
        if isinstance(value, str):
            return value, None
        return None, f"{where}: {value!r} is not low, medium or high"
    if OVERRIDE_TYPES[field] is bool:
        if isinstance(value, bool):
            return value, None
        return None, f"{where}: {value!r} is not true or false"
    if OVERRIDE_TYPES[field] is str:
        if isinstance(value, (dict, list)):
            return json.dumps(value), None
        if isinstance(value, str):
            return value, None
        return None, f"{where}: {value!r} is not a JSON object or JSON text"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, f"{where}: {value!r} is not a number"
    if OVERRIDE_TYPES[field] is int:
        if isinstance(value, float) and not value.is_integer():
            return None, f"{where}: {value!r} is not an integer"
        if not -(2**63) <= value < 2**63:
            return None, f"{where}: {value!r} does not fit in a 64-bit integer"
        return int(value), None
    return float(value), None


def apply_overrides(
    spec: JobSpec, row: dict[str, Any], source: Mapping[str, Any], where: str
) -> None:
    """Coerce the override source columns of `row` (taken from `source`) in place; a shared
    table field's value (stop, penalties, ...) also joins the row's BODY_SAMPLING."""
    for field, column in override_columns(spec).items():
        if column not in source:
            continue
        if field in params.BATCH_SAMPLING:
            problem = _row_sampling_value(row, field, column, source[column])
            cell = source[column]
            row[column] = None if cell is None or isinstance(cell, str) else json.dumps(cell)
            if problem and row.get(ERROR) is None:
                row[ERROR] = f"{where}: {problem}"
            continue
        value, problem = coerce_override(field, column, source[column])
        row[column] = value
        if problem and row.get(ERROR) is None:
            row[ERROR] = f"{where}: {problem}"


def _row_sampling_value(row: dict[str, Any], field: str, column: str, value: Any) -> str | None:
    """Read one override cell of a shared-table field into the row's BODY_SAMPLING JSON (over
    what an openai_batch body set); the problem as text, or None."""
    if isinstance(value, str) and field not in ("stop", "bad_words"):
        # A list or an object kept as JSON text (a string column, a mixed JSON column).
        with contextlib.suppress(json.JSONDecodeError):
            value = json.loads(value)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if hasattr(value, "tolist"):  # Arrow / NumPy values of list columns
        value = value.tolist()
    try:
        read = params.BATCH_SAMPLING[field].read(field, value)
    except params.ParamError as exc:
        return f"column {column!r} (sampling.overrides.{field}): {exc}"
    values = json.loads(row[BODY_SAMPLING]) if row.get(BODY_SAMPLING) else {}
    values[params.BATCH_SAMPLING[field].field] = read
    row[BODY_SAMPLING] = json.dumps(values, sort_keys=True)
    return None


def json_cell(value: Any) -> Any:
    """Values from JSON: nested objects and lists are kept as JSON text."""
    return json.dumps(value) if isinstance(value, (dict, list)) else value


def text_prompt(row: dict[str, Any], column: str, value: Any, where: str) -> None:
    if value is None or isinstance(value, str):
        row[PROMPT] = value
    else:
        row[ERROR] = f"{where}: column {column!r} holds {type(value).__name__}, expected text"


def messages_value(row: dict[str, Any], column: str, value: Any, where: str) -> None:
    if value is None or isinstance(value, str):
        row[MESSAGES] = value
    elif isinstance(value, list):
        row[MESSAGES] = json.dumps(value)
    else:
        row[ERROR] = (
            f"{where}: column {column!r} holds {type(value).__name__}, expected a list of "
            "{role, content} messages"
        )


# --- the table of one shard ---------------------------------------------------------------------


def column_types(spec: JobSpec, passthrough: list[pa.Field]) -> dict[str, pa.DataType]:
    """The fixed type of every column a reader writes (other extras are inferred per chunk)."""
    types: dict[str, pa.DataType] = {name: pa.string() for name in CORE_COLUMNS}
    types[ROW] = pa.int64()
    for field in passthrough:
        types[field.name] = field.type
    for field, column in override_columns(spec).items():
        kind = OVERRIDE_TYPES.get(field, str)  # table fields: the cell as JSON text
        types[column] = {int: pa.int64(), str: pa.string(), bool: pa.bool_()}.get(
            kind, pa.float64()
        )
    if has_row_sampling(spec):
        types[BODY_SAMPLING] = pa.string()
    if has_adapters(spec):
        types[ADAPTER] = pa.string()
    return types


def output_names(spec: JobSpec) -> list[str]:
    """Columns of a read table, in order."""
    names = [ROW, *CORE_COLUMNS]
    for name in [*extra_columns(spec), *override_columns(spec).values()]:
        if name not in names:
            names.append(name)
    if has_row_sampling(spec):
        names.append(BODY_SAMPLING)
    if has_adapters(spec):
        names.append(ADAPTER)
    return names


@dataclass
class RowBuffer:
    """Column-wise rows of one shard (Python lists; turned into Arrow by `to_table`)."""

    columns: dict[str, list[Any]]

    @classmethod
    def empty(cls, names: list[str]) -> RowBuffer:
        return cls({name: [] for name in names})

    def append(self, row: dict[str, Any]) -> None:
        for name, values in self.columns.items():
            values.append(row.get(name))

    def __len__(self) -> int:
        return len(self.columns[ROW])


def to_table(
    spec: JobSpec, rows: RowBuffer, passthrough: list[pa.Field], where: list[str]
) -> pa.Table:
    """Arrow table of the buffered rows; passthrough cells are fitted to their fixed types
    (a cell that does not fit is null and its row becomes an error row; `where[i]` names the
    row in the message)."""

    types = column_types(spec, passthrough)
    fixed = {f.name for f in passthrough}
    errors = rows.columns[ERROR]
    arrays, names = [], []
    for name, values in rows.columns.items():
        if name in fixed:
            array, problems = fit_column(name, values, types[name])
            for i, problem in enumerate(problems):
                if problem is not None and errors[i] is None:
                    errors[i] = f"{where[i]}: {problem}"
            arrays.append(array)
        elif name in types:
            arrays.append(pa.array(values, type=types[name]) if name != ERROR else None)
        else:
            try:
                arrays.append(pa.array(values))
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
                # Mixed JSON types in one column (1 and "a"), or integers past int64: keep
                # every value, as JSON text.
                arrays.append(pa.array([None if v is None else json.dumps(v) for v in values]))
        names.append(name)
    # Errors last: fitting the passthrough columns may have added some.
    arrays[names.index(ERROR)] = pa.array(errors, type=pa.string())
    return pa.Table.from_arrays(arrays, names=names)
