"""Pre-flight checks and the job plan: what a run would read, tokenize, generate and cost.

`preflight(spec)` is the gate every run passes first (`tokenmill run` calls it before any actor
starts): the inputs are listed (a missing file or an unreachable bucket fails here, naming the
URI and endpoint), the model and tokenizer directories are checked, the output URI is parsed.

`build_plan(spec)` reads no more than a sample: rows are counted from Parquet footers or JSONL
line counts (estimated from bytes per line past EXACT_COUNT_BYTES), the first `sample_rows`
rows are read and tokenized in this process (no Ray), and token totals and error rates are
extrapolated from them. Output tokens are an upper bound (rows x max_tokens). Time comes from
an assumed per-actor output throughput (`--tokens-per-s`, `engine.expected_tokens_per_s`) or
a short measurement on the real engine (`--measure`); cost from `pipeline.cost.estimate_cost`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from engines import GenerationRequest, SamplingParams
from pipeline.batch.columns import (
    ERROR,
    ID,
    MAX_TOKENS,
    PROMPT_TOKEN_IDS,
    PROMPT_TOKENS,
    SAMPLES,
    TOO_LONG,
)
from pipeline.batch.driver.shards import bytes_per_line, count_lines, parquet_footer, plan_shards
from pipeline.batch.stages.prompts import PromptStage, context_length
from pipeline.batch.stages.read import sample_rows
from pipeline.batch.stages.tools import check_job_tools
from pipeline.engine_setup import open_engine
from pipeline.openai.chat import PromptError, load_tokenizer
from pipeline.openai.reasoning import ReasoningError, make_parser
from pipeline.spec import JobSpec, SpecError
from pipeline.storage import (
    InputFile,
    exists,
    filesystem_for,
    hub,
    is_s3,
    join_uri,
    list_input_files,
    materialize_model,
)
from pipeline.storage.hub import is_hub

DEFAULT_SAMPLE_ROWS = 200
# JSONL bytes read to count rows exactly; larger inputs are estimated from bytes per line.
EXACT_COUNT_BYTES = 256 * 1024**2
# --measure: a few prompts, short outputs; enough for a steady-state rate on a small model.
MEASURE_PROMPTS = 8
MEASURE_MAX_TOKENS = 32
MAX_ERROR_EXAMPLES = 5


def _check_model_dir(path: str, required: str, field_name: str, spec: JobSpec) -> None:
    if is_hub(path):
        hub.content(path, field_name, required)  # the API's listing: nothing downloaded
    elif is_s3(path):
        marker = join_uri(path, required)
        try:
            found = exists(marker, spec.storage)
        except Exception as exc:
            raise SpecError(f"{field_name}: cannot reach {path}: {exc}") from None
        if not found:
            raise SpecError(
                f"{field_name}: {marker} not found; upload the Hugging Face model directory "
                "under that prefix"
            )
    else:
        materialize_model(
            path, spec.model.cache_dir, spec.storage, required_file=required, field=field_name
        )


def preflight(spec: JobSpec) -> list[InputFile]:
    """Check everything a run needs before it starts; return the input files (sorted listing).

    Raises SpecError naming the field, the URI and what to do.
    """
    files = list_input_files(spec)
    _check_model_dir(spec.model.path, "config.json", "model.path", spec)
    if spec.model.tokenizer:
        _check_model_dir(spec.model.tokenizer, "tokenizer_config.json", "model.tokenizer", spec)
    try:
        filesystem_for(spec.output.uri, spec.storage)
    except SpecError as exc:
        raise SpecError(f"output.uri: {exc}") from None
    check_reasoning(spec)
    check_job_tools(spec)
    return files


def check_reasoning(spec: JobSpec) -> None:
    """prompt.reasoning's tokens are in the model's tokenizer (SpecError naming the field)."""
    if spec.prompt.reasoning == "none":
        return

    try:
        make_parser(spec.prompt.reasoning, load_tokenizer(spec.model, spec.storage))
    except (PromptError, ReasoningError) as exc:
        raise SpecError(f"prompt.reasoning: {exc}") from None


@dataclass(frozen=True)
class PlanReport:
    """What `tokenmill plan` found; `est_*` values are extrapolated from the sample."""

    job: str
    num_files: int
    input_bytes: int
    num_rows: int  # rows the run would read (after input.limit)
    num_rows_exact: bool  # False: some JSONL rows estimated from bytes per line
    sample_rows: int  # rows read and tokenized here
    sample_errors: int  # of which error rows (any cause)
    sample_too_long: int  # of which over the context length
    sample_duplicate_ids: int  # rows whose id repeats an earlier one (resume needs unique ids)
    error_examples: list[tuple[str, str]]  # (row id, error) from the sample
    context_length: int | None
    sample_prompt_tokens: int  # prompt tokens of the sample's ok rows
    est_ok_rows: int
    est_error_rows: int
    est_prompt_tokens: int
    est_output_tokens_max: int  # sum of max_tokens over ok rows: an upper bound
    tokens_per_s: float | None  # output tokens/s per actor assumed or measured
    tokens_per_s_source: (
        str  # "--tokens-per-s" | "engine.expected_tokens_per_s" | "measured" | "none"
    )
    est_wall_s: float | None  # generation time with all actors busy (model load excluded)
    cost: dict[str, Any] | None = field(default=None)  # pipeline.cost.CostEstimate as a dict

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def count_job_rows(spec: JobSpec, files: list[InputFile]) -> tuple[int, bool]:
    """(rows the run would read, whether the count is exact).

    Parquet rows come from the footers (exact, cheap). JSONL rows are counted by reading the
    files in order until EXACT_COUNT_BYTES have been read; beyond that, rows are estimated
    from file sizes and the bytes per line seen so far, so planning a 100 GB input does not
    download it.
    """
    limit = spec.input.limit
    if spec.input.format == "parquet":
        total = sum(sum(parquet_footer(spec, f)[0]) for f in files)
        return (total if limit is None else min(total, limit)), True
    counted_rows, counted_bytes = 0, 0
    rest: list[InputFile] = []
    for file in files:
        if limit is not None and counted_rows >= limit:
            return limit, True
        if counted_bytes + file.size <= EXACT_COUNT_BYTES:
            counted_rows += count_lines(spec, file)
            counted_bytes += file.size
        else:
            rest.append(file)
    if not rest:
        return (counted_rows if limit is None else min(counted_rows, limit)), True
    per_row = counted_bytes / counted_rows if counted_rows else bytes_per_line(spec, rest[0])
    estimated = counted_rows + round(sum(f.size for f in rest) / per_row) if per_row else 0
    return (estimated if limit is None else min(estimated, limit)), False


def read_sample(spec: JobSpec, files: list[InputFile], num_rows: int) -> Any:
    """The first `num_rows` rows of the job (input order) through read and prompts, in process."""
    if num_rows <= 0:
        return None
    sample = sample_rows(spec, plan_shards(spec, files), num_rows)
    return PromptStage(spec)(sample) if sample.num_rows else None


def measure_tokens_per_s(spec: JobSpec, prompts: list[list[int]], max_tokens: int) -> float:
    """Output tokens/s of one engine on these prompts, all in flight at once (load excluded)."""
    import asyncio

    if not prompts:
        raise SpecError("--measure: no valid prompt in the sample to measure with")
    engine = open_engine(spec.model, spec.engine, spec.storage)
    sampling = SamplingParams(
        max_tokens=max_tokens, temperature=spec.sampling.temperature, top_p=spec.sampling.top_p
    )

    async def run_all() -> int:
        requests = [GenerationRequest(prompt_token_ids=p, sampling=sampling) for p in prompts]
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
        return sum(r.completion_tokens for r in results)

    try:
        asyncio.run(run_all())  # warm-up: first-call compilation and allocation
        start = time.monotonic()
        tokens = asyncio.run(run_all())
        elapsed = time.monotonic() - start
    finally:
        engine.shutdown()
    return tokens / elapsed if elapsed > 0 else 0.0


def _cost_estimate(
    spec: JobSpec, num_rows: int, prompt_tokens: int, output_tokens: int, tokens_per_s: float
) -> dict[str, Any] | None:
    try:
        # optional: the cost estimate's prices may be absent (ImportError: no estimate)
        from pipeline.cost import estimate_cost
    except ImportError:
        return None
    estimate = estimate_cost(spec, num_rows, prompt_tokens, output_tokens, tokens_per_s)
    return estimate.to_dict()


def build_plan(
    spec: JobSpec,
    *,
    files: list[InputFile] | None = None,
    sample_rows: int = DEFAULT_SAMPLE_ROWS,
    tokens_per_s: float | None = None,
    measure: bool = False,
) -> PlanReport:
    """Count, sample, tokenize and estimate (see the module docstring)."""
    files = preflight(spec) if files is None else files
    total, rows_exact = count_job_rows(spec, files)
    sample = read_sample(spec, files, min(sample_rows, total))
    rows = sample.to_pylist() if sample is not None else []
    ok = [r for r in rows if r[ERROR] is None]
    errors = [r for r in rows if r[ERROR] is not None]
    too_long = sum(1 for r in errors if r[ERROR].startswith(TOO_LONG))
    scale = total / len(rows) if rows else 0.0
    sample_prompt_tokens = sum(r[PROMPT_TOKENS] for r in ok)
    est_prompt = round(sample_prompt_tokens * scale)
    # n samples of a row may each run to max_tokens.
    est_output = round(sum(r[MAX_TOKENS] * (r.get(SAMPLES) or 1) for r in ok) * scale)

    source = "none"
    if tokens_per_s is not None:
        source = "--tokens-per-s"
    elif measure:
        prompts = [r[PROMPT_TOKEN_IDS] for r in ok[:MEASURE_PROMPTS]]
        tokens_per_s = measure_tokens_per_s(spec, prompts, MEASURE_MAX_TOKENS)
        source = "measured"
    elif spec.engine.expected_tokens_per_s is not None:
        tokens_per_s = spec.engine.expected_tokens_per_s
        source = "engine.expected_tokens_per_s"

    cost = None
    wall_s = None
    if tokens_per_s:
        cost = _cost_estimate(spec, total, est_prompt, est_output, tokens_per_s)
        num_actors = spec.resources.peak_actors
        wall_s = est_output / (tokens_per_s * num_actors)
    return PlanReport(
        job=spec.name,
        num_files=len(files),
        input_bytes=sum(f.size for f in files),
        num_rows=total,
        num_rows_exact=rows_exact,
        sample_rows=len(rows),
        sample_errors=len(errors),
        sample_too_long=too_long,
        sample_duplicate_ids=len(rows) - len({r[ID] for r in rows}),
        error_examples=[(r[ID], r[ERROR]) for r in errors[:MAX_ERROR_EXAMPLES]],
        context_length=context_length(spec),
        sample_prompt_tokens=sample_prompt_tokens,
        est_ok_rows=round(len(ok) * scale),
        est_error_rows=round(len(errors) * scale),
        est_prompt_tokens=est_prompt,
        est_output_tokens_max=est_output,
        tokens_per_s=tokens_per_s,
        tokens_per_s_source=source,
        est_wall_s=wall_s,
        cost=cost,
    )


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def format_plan(plan: PlanReport) -> str:
    """The plan as text for the terminal."""
    pct = 100.0 * plan.sample_errors / plan.sample_rows if plan.sample_rows else 0.0
    lines = [
        f"job {plan.job}",
        f"  input       {plan.num_files} file(s), {plan.input_bytes:,} bytes, "
        f"{'' if plan.num_rows_exact else '~'}{plan.num_rows:,} rows",
        f"  sample      {plan.sample_rows:,} rows: {plan.sample_errors} error row(s) ({pct:.1f}%), "
        f"{plan.sample_too_long} over the context length ({plan.context_length or 'unknown'})",
    ]
    for row_id, error in plan.error_examples:
        lines.append(f"                {row_id}: {error}")
    if plan.sample_duplicate_ids:
        lines.append(
            f"  WARNING     {plan.sample_duplicate_ids} duplicate id(s) in the sample: ids must be "
            "unique for resume to be exact (check input.id_column)"
        )
    lines += [
        f"  rows        ~{plan.est_ok_rows:,} ok, ~{plan.est_error_rows:,} error (extrapolated)",
        f"  tokens      ~{plan.est_prompt_tokens:,} prompt, <= {plan.est_output_tokens_max:,} "
        "output (max_tokens per row)",
    ]
    if plan.tokens_per_s:
        lines.append(
            f"  time        ~{_duration(plan.est_wall_s or 0.0)} at "
            f"{plan.tokens_per_s:,.0f} output tokens/s per actor "
            f"({plan.tokens_per_s_source}); model load not included"
        )
    else:
        lines.append(
            "  time        unknown: pass --tokens-per-s N, set engine.expected_tokens_per_s, "
            "or use --measure"
        )
    if plan.cost:
        cost = plan.cost
        line = f"  cost        ~${cost['usd']:,.2f} ({cost['device_hours']:.3f} device-hours)"
        if cost.get("list_price_usd") is not None:
            line += f"; list price ${cost['list_price_usd']:,.2f}"
        lines.append(line)
    return "\n".join(lines)
