"""The output schema of a job: fixed before the first row is generated, and part of the
fingerprint.

    id, <passthrough columns>, text, finish_reason, error, token counts, timings, cost, ...

Every part of a job (ok and error rows, every run) has exactly this schema. The passthrough
columns' types come from, in order: `input.passthrough_types`; the Parquet files' own schemas
(unified across files); for JSONL, the values in the first lines of the input (a column whose
sampled values mix types, or hold objects or lists, is a string of JSON text). A cell that does
not fit its column's type later in the input makes its row an error row naming the column and
the value; the job goes on.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import pyarrow as pa

from pipeline.batch.columns import CORE_COLUMNS, ROW, STAGE_COLUMNS
from pipeline.spec import JobSpec

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
# Jobs that can constrain output (sampling.response_format, its override, openai_batch): is
# the text whole and valid in its format? Null on unconstrained rows.
PARSED_FIELD = pa.field("parsed", pa.bool_())
# Jobs that ask for logprobs (sampling.logprobs, its override, openai_batch): per output token
# its id, logprob and top alternatives. Null on rows without logprobs.
_ALTERNATIVE = pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])
LOGPROBS_FIELD = pa.field(
    "logprobs",
    pa.list_(
        pa.struct(
            [
                ("token_id", pa.int32()),
                ("logprob", pa.float32()),
                ("top", pa.list_(_ALTERNATIVE)),
            ]
        )
    ),
)

# Jobs with sampling.prompt_logprobs: per prompt token (the first, which nothing predicts, is
# null) its id, logprob and top alternatives.
PROMPT_LOGPROBS_FIELD = pa.field("prompt_logprobs", LOGPROBS_FIELD.type)

# Jobs whose rows may ask for n > 1 samples (sampling.n, its override): every sample's answer,
# in index order. The row's own text / finish_reason / parsed / logprobs are sample 0's.
SAMPLES_FIELD = pa.field(
    "samples",
    pa.list_(
        pa.struct(
            [
                ("index", pa.int32()),
                ("text", pa.string()),
                ("finish_reason", pa.string()),
                ("error", pa.string()),
                ("completion_tokens", pa.int32()),
                ("parsed", pa.bool_()),
                ("logprobs", LOGPROBS_FIELD.type),
                ("completion_token_ids", pa.list_(pa.int32())),
            ]
        )
    ),
)

# Jobs with prompt.reasoning: the reasoning the model wrote before its answer (`text` holds
# the answer alone), null on rows whose output has none, and its output tokens (markers not
# counted; summed over the samples of n > 1 rows, as completion_tokens is).
REASONING_FIELDS: tuple[pa.Field, ...] = (
    pa.field("reasoning", pa.string()),
    pa.field("reasoning_tokens", pa.int32()),
)


# Jobs with model.adapters: the LoRA adapter the row ran with (null: the model itself).
ADAPTER_FIELD = pa.field("adapter", pa.string())

# Jobs whose rows may carry tools (prompt.tools, sampling.overrides.tools, openai_batch): the
# calls the answer made, as JSON text of OpenAI's tool_calls (null: none); `text` then holds
# what the answer said besides.
TOOL_CALLS_FIELD = pa.field("tool_calls", pa.string())

# Jobs with task embed: the prompt's pooled embedding (null on error rows).
EMBEDDING_FIELD = pa.field("embedding", pa.list_(pa.float32()))


def samples_field(reasoning: bool = False) -> pa.Field:
    """The `samples` column; with reasoning, each sample has its own `reasoning` too."""
    if not reasoning:
        return SAMPLES_FIELD
    return pa.field(
        SAMPLES_FIELD.name,
        pa.list_(pa.struct([*SAMPLES_FIELD.type.value_type, pa.field("reasoning", pa.string())])),
    )


# `input.passthrough_types` names → Arrow types. "json" keeps any value as JSON text.
PASSTHROUGH_TYPES: dict[str, pa.DataType] = {
    "string": pa.string(),
    "json": pa.string(),
    "int64": pa.int64(),
    "float64": pa.float64(),
    "bool": pa.bool_(),
    "timestamp": pa.timestamp("us", tz="UTC"),
    "date": pa.date32(),
}
# JSONL lines read to infer passthrough types when none are declared.
INFER_SAMPLE_ROWS = 1000


# Jobs with engine.speculative: tokens proposed for the row, how many the model accepted, and
# in how many engine steps they were verified (0 where the engine does not count them).
SPEC_FIELDS: tuple[pa.Field, ...] = (
    pa.field("spec_proposed_tokens", pa.int32()),
    pa.field("spec_accepted_tokens", pa.int32()),
    pa.field("spec_verifications", pa.int32()),
)


def output_schema(
    passthrough: Iterable[pa.Field] = (),
    include_token_ids: bool = False,
    structured: bool = False,
    logprobs: bool = False,
    speculative: bool = False,
    samples: bool = False,
    prompt_logprobs: bool = False,
    reasoning: bool = False,
    embedding: bool = False,
    adapters: bool = False,
    tools: bool = False,
) -> pa.Schema:
    """The one schema of every part of a job: id, passthrough columns, results."""
    fields = [pa.field("id", pa.string()), *passthrough, *RESULT_FIELDS]
    if include_token_ids:
        fields.append(TOKEN_IDS_FIELD)
    if structured:
        fields.append(PARSED_FIELD)
    if logprobs:
        fields.append(LOGPROBS_FIELD)
    if speculative:
        fields.extend(SPEC_FIELDS)
    if samples:
        fields.append(samples_field(reasoning))
    if prompt_logprobs:
        fields.append(PROMPT_LOGPROBS_FIELD)
    if reasoning:
        fields.extend(REASONING_FIELDS)
    if embedding:
        fields.append(EMBEDDING_FIELD)
    if adapters:
        fields.append(ADAPTER_FIELD)
    if tools:
        fields.append(TOOL_CALLS_FIELD)
    return pa.schema(fields)


# Every column name the pipeline writes itself: the read stage's, the prompt stage's, and every
# column an output part can have. An input column by one of these names can be neither passed
# through nor a template variable (JobSpec refuses it, naming it): it would overwrite the
# pipeline's value or be overwritten by it.
RESERVED_COLUMNS: frozenset[str] = frozenset(
    {
        ROW,
        *CORE_COLUMNS,
        *STAGE_COLUMNS,
        *output_schema(
            include_token_ids=True,
            structured=True,
            logprobs=True,
            speculative=True,
            samples=True,
            prompt_logprobs=True,
            reasoning=True,
            embedding=True,
            adapters=True,
            tools=True,
        ).names,
    }
)


def job_output_schema(spec: JobSpec, passthrough: Iterable[pa.Field] = ()) -> pa.Schema:
    """`output_schema` with the optional columns a job's spec asks for."""
    return output_schema(
        passthrough,
        spec.output.include_token_ids,
        structured=is_structured(spec),
        logprobs=wants_logprobs(spec),
        speculative=spec.engine.speculative is not None,
        samples=has_samples(spec),
        prompt_logprobs=spec.sampling.prompt_logprobs is not None,
        reasoning=spec.prompt.reasoning != "none",
        embedding=spec.task == "embed",
        adapters=spec.model.has_adapters,
        tools=has_tools(spec),
    )


def has_tools(spec: JobSpec) -> bool:
    """Whether a job's rows can carry tools (and its output has a `tool_calls` column)."""
    if spec.task == "embed":
        return False
    return (
        spec.prompt.tools is not None
        or "tools" in spec.sampling.overrides
        or spec.input.format == "openai_batch"
    )


def wants_logprobs(spec: JobSpec) -> bool:
    """Whether a job's rows can ask for logprobs (and its output has a `logprobs` column)."""
    return (
        spec.sampling.logprobs is not None
        or "logprobs" in spec.sampling.overrides
        or spec.input.format == "openai_batch"
    )


def has_samples(spec: JobSpec) -> bool:
    """Whether a job's rows can ask for n > 1 (and its output has a `samples` column)."""
    return (
        spec.sampling.n > 1 or "n" in spec.sampling.overrides or spec.input.format == "openai_batch"
    )


def is_structured(spec: JobSpec) -> bool:
    """Whether a job's rows can carry a response format (and its output a `parsed` column)."""
    return (
        spec.sampling.response_format is not None
        or "response_format" in spec.sampling.overrides
        or spec.input.format == "openai_batch"
    )


def schema_to_json(schema: pa.Schema) -> list[list[str]]:
    """[[name, type], ...]: the schema as the fingerprint and the manifest record it."""
    return [[f.name, str(f.type)] for f in schema]


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fit_column(name: str, values: list[Any], target: pa.DataType) -> tuple[pa.Array, list[Any]]:
    """`values` as an Arrow array of `target`, and per value None or why it did not fit.

    String columns take anything (non-strings as JSON text). For other types a value that
    does not convert becomes null, with a message naming the column, the value and the fix.
    """
    if pa.types.is_string(target) or pa.types.is_large_string(target):
        texts = [
            v if v is None or isinstance(v, str) else json.dumps(v, default=str) for v in values
        ]
        return pa.array(texts, type=target), [None] * len(values)
    if all(_plainly_fits(v, target) for v in values):
        try:
            return pa.array(values, type=target), [None] * len(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
            pass
    kept: list[Any] = []
    problems: list[str | None] = []
    for value in values:
        try:
            if not _plainly_fits(value, target):
                raise ValueError(value)
            pa.array([value], type=target)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
            kept.append(None)
            problems.append(
                f"column {name!r}: {_short(value)} does not fit the column's type {target} "
                f"(fixed when the job started); declare input.passthrough_types.{name}: json "
                "to keep any value"
            )
        else:
            kept.append(value)
            problems.append(None)
    return pa.array(kept, type=target), problems


def _plainly_fits(value: Any, target: pa.DataType) -> bool:
    """Whether a JSON value belongs in a column of `target` without losing anything. Arrow
    itself would turn 7.5 into 7 in an int64 column and True into 1 in a float column."""
    if value is None:
        return True
    if pa.types.is_integer(target):
        if isinstance(value, float):
            return value.is_integer()
        return isinstance(value, int) and not isinstance(value, bool)
    if pa.types.is_floating(target):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if pa.types.is_boolean(target):
        return isinstance(value, bool)
    return True


def infer_type(values: list[Any]) -> pa.DataType:
    """The Arrow type of sampled JSON values: their common type, else a string (JSON text)."""
    present = [v for v in values if v is not None]
    if not present or any(isinstance(v, (dict, list)) for v in present):
        return pa.string()
    try:
        inferred = pa.array(present).type
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):  # 2**63 and up too
        return pa.string()
    if pa.types.is_integer(inferred):
        return pa.int64()
    if pa.types.is_floating(inferred):
        return pa.float64()
    if pa.types.is_boolean(inferred) or pa.types.is_string(inferred):
        return inferred
    return pa.string()


def passthrough_fields(
    spec: JobSpec,
    parquet_schemas: list[pa.Schema] | None = None,
    samples: dict[str, list[Any]] | None = None,
) -> list[pa.Field]:
    """The fixed fields of the passthrough columns (see the module docstring).

    `parquet_schemas`: the Arrow schema of every Parquet input file; `samples`: JSONL values
    per column from the first lines of the input.
    """
    declared = spec.input.passthrough_types
    fields = []
    for name in spec.input.passthrough_columns:
        if name in declared:
            fields.append(pa.field(name, PASSTHROUGH_TYPES[declared[name]]))
        elif parquet_schemas is not None:
            types = [s.field(name).type for s in parquet_schemas if name in s.names]
            fields.append(pa.field(name, _unified(name, types)))
        else:
            fields.append(pa.field(name, infer_type((samples or {}).get(name, []))))
    return fields


def _unified(name: str, types: list[pa.DataType]) -> pa.DataType:
    """One type for a column across Parquet files: their common supertype, else string."""
    if not types:
        return pa.string()
    if all(t == types[0] for t in types):
        return pa.string() if pa.types.is_null(types[0]) else types[0]
    try:
        schema = pa.unify_schemas(
            [pa.schema([pa.field(name, t)]) for t in types], promote_options="permissive"
        )
        return schema.field(name).type
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.string()
