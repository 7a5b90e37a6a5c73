"""One row through the engine: its sampling parameters, its outcome, and output rows.

Pure functions and small types shared by the engine actor (pipeline.batch.stages.generate) and the
tests: no Ray, no storage.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from engines.api import (
    EmbedParams,
    GenerationResult,
    ResponseFormat,
    SamplingParams,
)
from pipeline.batch.columns import ADAPTER, BODY_SAMPLING, ROW
from pipeline.batch.stages.prompts import derive_seed
from pipeline.batch.stages.schema import (
    ADAPTER_FIELD,
    EMBEDDING_FIELD,
    LOGPROBS_FIELD,
    PARSED_FIELD,
    PROMPT_LOGPROBS_FIELD,
    REASONING_FIELDS,
    RESULT_FIELDS,
    SPEC_FIELDS,
    TOKEN_IDS_FIELD,
    TOOL_CALLS_FIELD,
    has_samples,
    has_tools,
    is_structured,
    samples_field,
    wants_logprobs,
)
from pipeline.cost import row_cost
from pipeline.openai.reasoning import Split
from pipeline.openai.response_format import conforms, from_column
from pipeline.openai.sampling import configured, resolve
from pipeline.spec import CostSpec, EngineSpec, JobSpec, ModelSpec, SamplingSpec, StorageSpec


@dataclass(frozen=True)
class GenerateConfig:
    """What an engine actor needs from the job spec (small, picklable)."""

    model: ModelSpec
    engine: EngineSpec
    storage: StorageSpec
    sampling: SamplingSpec
    cost: CostSpec
    output_uri: str  # where parts are written
    schema: pa.Schema  # the job's output schema (pipeline.batch.stages.schema)
    passthrough: tuple[str, ...]  # input columns copied to the output
    include_token_ids: bool  # also emit completion_token_ids
    structured: bool  # rows may carry a response format: emit `parsed`
    logprobs: bool  # rows may ask for logprobs: emit `logprobs`
    speculative: bool  # engine.speculative is set: emit spec_proposed/accepted_tokens
    samples: bool  # rows may ask for n > 1: emit `samples`
    prompt_logprobs: bool  # sampling.prompt_logprobs is set: emit `prompt_logprobs`
    reasoning: str  # prompt.reasoning: none, or the format to split outputs by (emit both)
    embed: EmbedParams | None  # task embed: how rows are embedded (emit `embedding`)
    adapters: bool  # model.adapters: rows carry their LoRA adapter (emit `adapter`)
    tools: bool  # rows may carry tools (emit `tool_calls`)
    max_in_flight: int  # requests in the engine at once, across shards
    batch_size: int  # rows taken from a shard at a time
    rows_per_file: int  # a part holds at most this many rows
    flush_interval_s: float  # finished rows wait at most this long for their part
    devices: float  # devices per actor (0: a CPU actor)
    stall_timeout_s: float | None = None  # resources.engine_stall_timeout_s (None: no watch)
    budget: Any = (
        None  # pipeline.batch.driver.budget actor shared by the run's actors; None: no budget
    )
    run_id: str | None = None  # the lease this run holds; None: not a fenced run (tools, tests)
    job_name: str = ""  # spec.name: the `job` tag of the actor's metrics (pipeline.batch.metrics)

    @classmethod
    def from_spec(cls, spec: JobSpec, schema: pa.Schema) -> GenerateConfig:

        return cls(
            model=spec.model,
            engine=spec.engine,
            storage=spec.storage,
            sampling=spec.sampling,
            cost=spec.cost,
            output_uri=spec.output.uri,
            schema=schema,
            passthrough=tuple(spec.input.passthrough_columns),
            include_token_ids=spec.output.include_token_ids,
            structured=is_structured(spec),
            logprobs=wants_logprobs(spec),
            speculative=spec.engine.speculative is not None,
            samples=has_samples(spec),
            prompt_logprobs=spec.sampling.prompt_logprobs is not None,
            reasoning=spec.prompt.reasoning,
            embed=spec.embed_params,
            adapters=spec.model.has_adapters,
            tools=has_tools(spec),
            max_in_flight=spec.resources.max_in_flight,
            batch_size=spec.resources.batch_size,
            rows_per_file=spec.output.rows_per_file,
            flush_interval_s=spec.output.flush_interval_s,
            devices=spec.resources.devices_per_actor,
            stall_timeout_s=spec.resources.engine_stall_timeout_s,
            job_name=spec.name,
        )


# --- per-row sampling ------------------------------------------------------------------------


# Distinct sampling tuples a cache keeps (row_sampling) before it starts over: rows of a job
# mostly share a handful; per-row seeds make each row distinct, and the cache then stays small.
SAMPLING_CACHE_SIZE = 4096


def row_sampling(
    row: dict[str, Any],
    sampling: SamplingSpec,
    cache: dict[tuple[Any, ...], SamplingParams] | None = None,
) -> SamplingParams:
    """SamplingParams for one row: its own values (the prompt stage's columns, an openai_batch
    body's) over the job's sampling section, by the one resolver (pipeline.openai.sampling).

    Raises ValueError (SamplingError) naming the field when a row's value is invalid. `cache`,
    one per caller and `sampling`, maps a row's values to the params already built for them:
    most rows of a job share their values, and building SamplingParams (its validation) per
    row was a noticeable part of an engine actor's work per row. The params are frozen, so
    rows can share one.
    """
    # The prompt stage fills `seed`: the row's override, or one derived from (sampling.seed, id).
    seed = row.get("seed")
    if seed is None and sampling.seed is not None and "seed" not in row:
        seed = derive_seed(sampling.seed, str(row["id"]))
    key = (
        row.get("max_tokens"),
        row.get("temperature"),
        row.get("top_p"),
        row.get("top_k"),
        seed,
        row.get("response_format"),
        row.get("logprobs"),
        row.get(BODY_SAMPLING),
    )
    params = None if cache is None else cache.get(key)
    if params is None:
        values = {
            "max_tokens": key[0],
            "temperature": key[1],
            "top_p": key[2],
            "top_k": key[3],
            "seed": seed,
            "response_format": row_format(row),
            "logprobs": key[6],
            **(_body_values(key[7]) if key[7] else {}),
        }
        params = resolve(values, configured(sampling))
        if cache is not None:
            if len(cache) >= SAMPLING_CACHE_SIZE:
                cache.clear()
            cache[key] = params
    return params


def _body_values(text: str) -> dict[str, Any]:
    """An openai_batch line's shared-table sampling values (the reader's BODY_SAMPLING JSON,
    already checked there), over the job's."""
    values = json.loads(text)
    if "logit_bias" in values:  # JSON keys are text
        values["logit_bias"] = {int(k): v for k, v in values["logit_bias"].items()}
    return values


def row_samples(row: dict[str, Any], sampling: SamplingSpec) -> int:
    """Samples to draw for the row: the prompt stage's `num_samples` cell, else the job's."""
    value = row.get("num_samples")
    return sampling.n if value is None else int(value)


def row_format(row: dict[str, Any]) -> ResponseFormat | None:
    """The row's response format from the prompt stage's canonical `response_format` cell."""

    text = row.get("response_format")
    return from_column(text) if text else None


# --- one row's outcome -----------------------------------------------------------------------


@dataclass
class RowOutcome:
    """The result columns of one row (see pipeline.batch.commit.parts.RESULT_FIELDS)."""

    text: str
    finish_reason: str
    error: str | None
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    completion_token_ids: list[int]
    queue_s: float | None
    ttft_s: float | None
    decode_s: float | None
    latency_s: float | None
    gpu_seconds: float
    finished_at: dt.datetime
    served: bool  # reached this actor's engine (actor_id is set only then)
    parsed: bool | None = None  # constrained rows: whole and valid in their format
    logprobs: list[dict[str, Any]] | None = None  # rows that asked: the nested column's value
    spec_proposed_tokens: int = 0  # speculative decoding: tokens proposed for this row
    spec_accepted_tokens: int = 0  # and accepted by the model
    spec_verifications: int = 0  # engine steps that verified proposals for this row
    samples: list[dict[str, Any]] | None = None  # n > 1: the `samples` column's value
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # the nested column's value
    reasoning: str | None = None  # reasoning jobs: the reasoning part (`text` is the answer)
    reasoning_tokens: int = 0  # its output tokens
    embedding: list[float] | None = None  # task embed: the prompt's embedding
    tool_calls: str | None = None  # rows with tools: JSON text of the calls the answer made

    @classmethod
    def failed(cls, error: str, prompt_tokens: int, served: bool) -> RowOutcome:
        return cls(
            text="",
            finish_reason="error",
            error=error,
            prompt_tokens=prompt_tokens,
            cached_prompt_tokens=0,
            completion_tokens=0,
            completion_token_ids=[],
            queue_s=None,
            ttft_s=None,
            decode_s=None,
            latency_s=None,
            gpu_seconds=0.0,
            finished_at=dt.datetime.now(dt.timezone.utc),
            served=served,
        )

    @classmethod
    def from_result(
        cls,
        result: GenerationResult,
        gpu_seconds: float,
        fmt: ResponseFormat | None = None,
        split: Split | None = None,
    ) -> RowOutcome:
        """`split`: reasoning jobs, the result's output split (pipeline.openai.reasoning)."""

        m = result.metrics
        text = result.text if split is None else split.text
        parsed = None
        if fmt is not None:
            # A cut text (finish "length") or an error row is not a usable answer.
            parsed = result.finish_reason == "stop" and conforms(fmt, text)
        return cls(
            reasoning=None if split is None else split.reasoning,
            reasoning_tokens=0 if split is None else split.reasoning_tokens,
            embedding=result.embedding,
            parsed=parsed,
            logprobs=_logprob_rows(result),
            prompt_logprobs=_prompt_logprob_rows(result),
            spec_proposed_tokens=result.spec_proposed_tokens,
            spec_accepted_tokens=result.spec_accepted_tokens,
            spec_verifications=result.spec_verifications,
            text=text,
            finish_reason=result.finish_reason,
            error=result.error if result.finish_reason == "error" else None,
            prompt_tokens=result.prompt_tokens,
            cached_prompt_tokens=result.cached_prompt_tokens,
            completion_tokens=result.completion_tokens,
            completion_token_ids=list(result.output_token_ids),
            queue_s=None if m is None else m.queue_s,
            ttft_s=None if m is None else m.ttft_s,
            decode_s=None if m is None else m.decode_s,
            latency_s=None if m is None else m.latency_s,
            gpu_seconds=gpu_seconds,
            finished_at=dt.datetime.now(dt.timezone.utc),
            served=True,
        )

    @classmethod
    def from_results(
        cls,
        results: list[GenerationResult],
        gpu_seconds: float,
        fmt: ResponseFormat | None = None,
        splits: list[Split | None] | None = None,
    ) -> RowOutcome:
        """One row's outcome from its n samples (in index order): sample 0 speaks for the
        row's text, finish reason, format check and logprobs; completion tokens, device time
        and speculation counts add up over all samples; the timings span them all. A failed
        sample makes the row an error row naming it (retry-errors then redoes the row)."""
        splits = splits or [None] * len(results)
        if len(results) == 1:
            return cls.from_result(results[0], gpu_seconds, fmt, splits[0])
        each = [cls.from_result(r, 0.0, fmt, sp) for r, sp in zip(results, splits, strict=True)]
        row = each[0]
        row.samples = [
            {
                "index": i,
                "text": o.text,
                "finish_reason": o.finish_reason,
                "error": o.error,
                "completion_tokens": o.completion_tokens,
                "parsed": o.parsed,
                "logprobs": o.logprobs,
                "completion_token_ids": o.completion_token_ids,
                "reasoning": o.reasoning,
            }
            for i, o in enumerate(each)
        ]
        row.gpu_seconds = gpu_seconds
        row.completion_tokens = sum(o.completion_tokens for o in each)
        row.reasoning_tokens = sum(o.reasoning_tokens for o in each)
        row.spec_proposed_tokens = sum(o.spec_proposed_tokens for o in each)
        row.spec_accepted_tokens = sum(o.spec_accepted_tokens for o in each)
        row.spec_verifications = sum(o.spec_verifications for o in each)
        row.ttft_s = _least([o.ttft_s for o in each])
        row.queue_s = _least([o.queue_s for o in each])
        row.latency_s = _most([o.latency_s for o in each])
        if row.ttft_s is not None and row.latency_s is not None:
            row.decode_s = row.latency_s - row.ttft_s
        failed = [(i, o) for i, o in enumerate(each) if o.finish_reason == "error"]
        if failed and row.finish_reason != "error":
            i, o = failed[0]
            row.text, row.finish_reason, row.parsed = "", "error", None
            row.reasoning = None
            row.error = f"sample {i} of {len(each)} failed: {o.error}"
        return row


def _least(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def _most(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _logprob_rows(result: GenerationResult) -> list[dict[str, Any]] | None:
    """A result's logprobs as the `logprobs` column's nested value."""
    if result.logprobs is None:
        return None
    return [_logprob_cell(lp) for lp in result.logprobs]


def _prompt_logprob_rows(result: GenerationResult) -> list[dict[str, Any] | None] | None:
    """A result's prompt logprobs as the `prompt_logprobs` column's value (first entry null)."""
    if result.prompt_logprobs is None:
        return None
    return [None if lp is None else _logprob_cell(lp) for lp in result.prompt_logprobs]


def _logprob_cell(lp: Any) -> dict[str, Any]:
    return {
        "token_id": lp.token_id,
        "logprob": lp.logprob,
        "top": [{"token_id": t, "logprob": v} for t, v in lp.top],
    }


def prompt_tokens_of(row: dict[str, Any]) -> int:
    value = row.get("prompt_tokens")
    if value is None:
        ids = row.get("prompt_token_ids")
        return len(ids) if ids is not None else 0
    return int(value)


def outcomes_to_table(
    batch: pa.Table,
    outcomes: list[RowOutcome],
    config: GenerateConfig,
    actor_id: str,
    engine_kind: str,
) -> pa.Table:
    """Output rows for `batch` (prepared rows) and their outcomes: `_row`, id, passthrough
    columns and the result columns of pipeline.batch.stages.schema."""

    costs = [
        row_cost(
            o.gpu_seconds,
            o.prompt_tokens,
            o.cached_prompt_tokens,
            o.completion_tokens,
            config.cost,
        )
        for o in outcomes
    ]
    n = len(outcomes)
    values: dict[str, list[Any]] = {
        "text": [o.text for o in outcomes],
        "finish_reason": [o.finish_reason for o in outcomes],
        "error": [o.error for o in outcomes],
        "prompt_tokens": [o.prompt_tokens for o in outcomes],
        "cached_prompt_tokens": [o.cached_prompt_tokens for o in outcomes],
        "completion_tokens": [o.completion_tokens for o in outcomes],
        "queue_s": [o.queue_s for o in outcomes],
        "ttft_s": [o.ttft_s for o in outcomes],
        "decode_s": [o.decode_s for o in outcomes],
        "latency_s": [o.latency_s for o in outcomes],
        "gpu_seconds": [c.gpu_seconds for c in costs],
        "cost_usd": [c.cost_usd for c in costs],
        "list_price_usd": [c.list_price_usd for c in costs],
        "model": [config.model.display_name] * n,
        "engine": [engine_kind] * n,
        "actor_id": [actor_id if o.served else None for o in outcomes],
        "finished_at": [o.finished_at for o in outcomes],
    }
    columns: dict[str, pa.Array | pa.ChunkedArray] = {
        ROW: batch.column(ROW),
        "id": batch.column("id").cast(pa.string()),
    }
    for name in config.passthrough:
        columns[name] = batch.column(name)
    for f in RESULT_FIELDS:
        columns[f.name] = pa.array(values[f.name], type=f.type)
    if config.include_token_ids:
        columns[TOKEN_IDS_FIELD.name] = pa.array(
            [o.completion_token_ids for o in outcomes], type=TOKEN_IDS_FIELD.type
        )
    if config.structured:
        columns[PARSED_FIELD.name] = pa.array([o.parsed for o in outcomes], type=pa.bool_())
    if config.logprobs:
        columns[LOGPROBS_FIELD.name] = pa.array(
            [o.logprobs for o in outcomes], type=LOGPROBS_FIELD.type
        )
    if config.speculative:
        for f in SPEC_FIELDS:
            columns[f.name] = pa.array([getattr(o, f.name) for o in outcomes], type=f.type)
    if config.prompt_logprobs:
        columns[PROMPT_LOGPROBS_FIELD.name] = pa.array(
            [o.prompt_logprobs for o in outcomes], type=PROMPT_LOGPROBS_FIELD.type
        )
    reasoning = config.reasoning != "none"
    if config.samples:
        field = samples_field(reasoning)
        columns[field.name] = pa.array(
            [_samples_cell(o, config.include_token_ids, reasoning) for o in outcomes],
            type=field.type,
        )
    if reasoning:
        for f in REASONING_FIELDS:
            columns[f.name] = pa.array([getattr(o, f.name) for o in outcomes], type=f.type)
    if config.embed is not None:
        columns[EMBEDDING_FIELD.name] = pa.array(
            [o.embedding for o in outcomes], type=EMBEDDING_FIELD.type
        )
    if config.adapters:
        columns[ADAPTER_FIELD.name] = batch.column(ADAPTER).cast(ADAPTER_FIELD.type)
    if config.tools:
        columns[TOOL_CALLS_FIELD.name] = pa.array(
            [o.tool_calls for o in outcomes], type=TOOL_CALLS_FIELD.type
        )
    return pa.table(columns)


def _samples_cell(
    outcome: RowOutcome, include_token_ids: bool, reasoning: bool = False
) -> list[dict[str, Any]] | None:
    """The `samples` value of a row: its n samples; null for a row of one sample (its answer
    is the row itself) and for a row that never reached the engine."""
    if outcome.samples is None:
        return None
    samples = outcome.samples
    if not reasoning:  # the column's struct has no `reasoning` field
        samples = [{k: v for k, v in s.items() if k != "reasoning"} for s in samples]
    if include_token_ids:
        return samples
    return [{**s, "completion_token_ids": None} for s in samples]
