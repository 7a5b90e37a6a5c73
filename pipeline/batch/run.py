"""run_job: the one place the stages are chained.

    preflight → fingerprint / resume decision → read → drop ids already committed → prompts
    → generate (engine actor pool) → write parts (driver) → completeness check → manifest
    → _SUCCESS → report

The commit protocol that makes the output exactly-once is described in pipeline.batch.commit.parts.

Ray: with RAY_ADDRESS set (as under `ray job submit -- tokenmill run job.yaml`) the job runs
on that cluster; otherwise it starts a private local one (`address="local"`, never attaching
to a cluster someone else started on this machine) sized to this machine.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.batch.commit.fingerprint import Fingerprint, input_listing, job_fingerprint
from pipeline.batch.commit.manifest import (
    Manifest,
    RunRecord,
    compute_totals,
    part_listing,
    read_manifest,
    spec_snapshot,
    utc_now,
    write_manifest,
)
from pipeline.batch.commit.parts import (
    SUCCESS_NAME,
    CommitStats,
    OutputDir,
    PartWriter,
    conform,
    drop_superseded,
    list_parts,
    load_committed,
    output_schema,
    read_part,
)
from pipeline.batch.progress import Progress, ProgressPrinter
from pipeline.spec import JobSpec, SpecError

logger = logging.getLogger(__name__)

# A pipeline that makes no progress for this long fails instead of hanging (an engine
# actor that cannot be scheduled, a deadlocked read). Generous: a model download counts.
NO_PROGRESS_TIMEOUT_S = 900.0
# Engine actors must be up within this (model download and load included).
ACTOR_START_TIMEOUT_S = 1200
# Object store cap for a local Ray: rows are small, and the rest of the memory is the engine's.
LOCAL_OBJECT_STORE_BYTES = 1 * 1024**3

# The id filter is a cheap set lookup; a whole CPU per task would starve the engine actors.
FILTER_TASK_CPUS = 0.25

RunStatus = Literal["complete", "already_complete", "incomplete", "stopped_at_budget"]


class ResourceError(RuntimeError):
    """The job's actors cannot fit beside the other stages on the cluster."""


class ResumeRefused(RuntimeError):
    """The output prefix holds rows made differently (or unknown rows); nothing was changed."""


@dataclass
class RunResult:
    """What a run did and what the output prefix now holds."""

    status: RunStatus
    output_uri: str
    message: str  # one line for the user
    attempt: int | None  # None: nothing was generated
    rows_written: int  # rows committed by this run
    parts_written: list[str]
    totals: dict[str, Any]  # the manifest totals over all committed rows
    max_error_fraction: float
    missing_ids: int = 0
    superseded_parts: list[str] = field(default_factory=list)

    @property
    def over_error_limit(self) -> bool:
        return float(self.totals.get("error_fraction") or 0.0) > self.max_error_fraction

    @property
    def exit_code(self) -> int:
        """0 success, 1 incomplete, 3 complete with too many error rows, 5 stopped at
        cost.budget_usd (committed rows are kept; rerun with a higher budget to resume).
        4 is left out: `tokenmill submit` uses it for an unreachable cluster."""
        if self.status == "incomplete":
            return 1
        if self.status == "stopped_at_budget":
            return 5
        return 3 if self.over_error_limit else 0


# --- Ray -------------------------------------------------------------------------------------


def ray_init_kwargs(env: Mapping[str, str], cpu_count: int | None = None) -> dict[str, Any]:
    """Arguments for ray.init: the cluster at RAY_ADDRESS, or a private local one."""
    address = env.get("RAY_ADDRESS", "").strip()
    if address:
        return {"address": address}
    return {
        "address": "local",
        "num_cpus": cpu_count or os.cpu_count() or 1,
        "object_store_memory": LOCAL_OBJECT_STORE_BYTES,
        "include_dashboard": False,
    }


@contextmanager
def ray_session() -> Iterator[None]:
    """Use the Ray already initialized in this process, or init one and shut it down after."""
    import ray

    if ray.is_initialized():
        yield
        return
    ray.init(**ray_init_kwargs(os.environ), log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def backpressure_ratio(spec: JobSpec) -> float:
    """How many times its consumer's in-flight bytes a stage's queued output may reach.

    Ray's default (2) counts the driver, which takes one block at a time, as the generate
    stage's consumer: when the batches of a few actors finish together the engines stop
    getting rows until the driver has taken them all. The ratio covers every batch that can
    finish at once; the read-ahead it allows upstream is that many blocks of a few rows.
    """
    from pipeline.batch.generate import concurrent_tasks_per_actor

    res = spec.resources
    finishing_together = (
        concurrent_tasks_per_actor(res.batch_size, res.max_in_flight) * res.peak_actors
    )
    return float(max(10, 2 * finishing_together))


def configure_data_context(spec: JobSpec) -> None:
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.max_errored_blocks = 0  # never drop a block silently: rows would be lost
    ctx.actor_task_retry_on_errors = False  # a Python error is a bug, not a flaky node
    # Keep a stricter guard someone set (tests); otherwise ours.
    if ctx.execution_no_progress_timeout_s > NO_PROGRESS_TIMEOUT_S:
        ctx.execution_no_progress_timeout_s = NO_PROGRESS_TIMEOUT_S
    # Dispatch only once the whole pool is up: otherwise the first engine to finish loading
    # takes every queued block and the others idle. Bounded, so a pool that cannot be
    # scheduled (too few CPUs/GPUs) is an error, not a hang.
    ctx.wait_for_min_actors_s = ACTOR_START_TIMEOUT_S
    # Ray Data's reservation allocator splits CPUs and object store memory among operators and
    # holds an operator's tasks back until its share covers them. With fractional CPUs and
    # kilobyte blocks it held the engine pool at one batch until that batch had finished:
    # each run started with 16 rows in an engine that could take 64. Off, the backpressure left
    # is the downstream-capacity policy: a stage stops taking input while its queued output is
    # over `ratio` times what its consumer has in flight.
    ctx.op_resource_reservation_enabled = False
    ctx.downstream_capacity_backpressure_ratio = backpressure_ratio(spec)
    ctx.enable_progress_bars = os.environ.get("RAY_DATA_DISABLE_PROGRESS_BARS") != "1"


def known_cluster_cpus() -> float | None:
    """CPUs of the cluster the job will run on, when known before it starts (None: unknown,
    e.g. an autoscaling cluster at RAY_ADDRESS)."""
    import ray

    if ray.is_initialized():
        return float(ray.cluster_resources().get("CPU", 0.0))
    kwargs = ray_init_kwargs(os.environ)
    return float(kwargs["num_cpus"]) if "num_cpus" in kwargs else None


def check_cpu_headroom(spec: JobSpec, cluster_cpus: float | None) -> None:
    """Refuse a pool whose CPUs leave too little for the read and prompt stages (a silent
    hang otherwise). Raises ResourceError naming the fields to change."""
    from pipeline.batch.prompts import PROMPT_STAGE_CPUS, prompt_pool_size
    from pipeline.batch.read import READ_TASK_CPUS

    if cluster_cpus is None:
        return
    res = spec.resources
    actors = res.num_actors or res.min_actors or 1
    others = READ_TASK_CPUS + PROMPT_STAGE_CPUS * prompt_pool_size(spec)
    if actors * res.cpus_per_actor + others > cluster_cpus + 1e-9:
        fit = max(cluster_cpus - others, 0.0) / actors
        raise ResourceError(
            f"resources: {actors} engine actor(s) x cpus_per_actor {res.cpus_per_actor} plus "
            f"{others:g} CPU for reading and tokenizing exceed the cluster's {cluster_cpus:g} "
            f"CPUs; set resources.cpus_per_actor <= {fit:.2f} (fractions are fine) or use "
            "fewer actors"
        )


# --- the front half (pipeline.batch.read / pipeline.batch.prompts) ---------------------------


def _preflight(spec: JobSpec) -> list[Any]:
    """Inputs listed, model and output checked (pipeline.batch.plan); SpecError names the field."""
    from pipeline.batch.plan import preflight

    return list(preflight(spec))


def _read(spec: JobSpec, files: list[Any]) -> Any:
    from pipeline.batch.read import read_dataset

    return read_dataset(spec, files)


def _add_prompt_stage(ds: Any, spec: JobSpec) -> Any:
    from pipeline.batch.prompts import tokenize_dataset

    return tokenize_dataset(ds, spec)


# --- steps -----------------------------------------------------------------------------------


def _select_ids(batch: pa.Table, ids: pa.Array, keep: bool) -> pa.Table:
    """Rows whose id is (keep=True) or is not (keep=False) in `ids`."""
    hit = pc.is_in(batch.column("id").cast(pa.string()), value_set=ids)
    return batch.filter(hit if keep else pc.invert(hit))


def read_input_ids(ds: Any) -> pa.Array:
    """Every input id, in input order; duplicate ids are a job error (they break resume)."""
    chunks = [
        b.column("id").cast(pa.string())
        for b in ds.select_columns(["id"]).iter_batches(batch_size=None, batch_format="pyarrow")
    ]
    ids = pa.chunked_array(chunks, type=pa.string()).combine_chunks()
    if pc.count_distinct(ids).as_py() != len(ids):
        counts = pc.value_counts(ids)
        dupes = [
            v["values"] for v in counts.filter(pc.greater(counts.field("counts"), 1)).to_pylist()
        ]
        raise SpecError(
            f"input has {len(dupes)} duplicate id(s), e.g. {dupes[:5]}; every row needs a "
            "unique id: fix input.id_column (or leave it null to derive ids from file and row)"
        )
    return ids


def check_resume(out: OutputDir, fingerprint: Fingerprint, has_parts: bool) -> Manifest | None:
    """The previous manifest if this run may add to the prefix; raises ResumeRefused if not."""
    previous = read_manifest(out)
    if previous is None:
        if has_parts:
            raise ResumeRefused(
                f"{out.uri} holds part files but no readable _manifest.json, so they cannot be "
                "checked against this job; rerun with --fresh to replace them, or use another "
                "output.uri"
            )
        return None
    before = Fingerprint.from_json(previous.fingerprint)
    if before.value != fingerprint.value:
        changed = fingerprint.changed_components(before)
        raise ResumeRefused(
            f"{out.uri} was written by a different job: {', '.join(changed)} changed since "
            f"(job {previous.job!r}, {len(previous.runs)} run(s)). Mixing the rows would make "
            "the output inconsistent; rerun with --fresh to start over (deletes its parts), or "
            "set output.uri to a new prefix"
        )
    return previous


def run_job(
    spec: JobSpec,
    *,
    fresh: bool = False,
    retry_errors: bool = False,
    emit: Callable[[str], None] | None = None,
    progress_interval_s: float = 10.0,
) -> RunResult:
    """Run (or resume) a job; see the module docstring for the order of the stages."""
    say = emit or (lambda line: logger.info(line))
    files = _preflight(spec)  # fails here, before any actor, on bad input or storage
    check_cpu_headroom(spec, known_cluster_cpus())
    fingerprint = job_fingerprint(spec, files)
    out = OutputDir(spec.output.uri, spec.storage)
    if fresh:
        out.clear()
    previous = check_resume(out, fingerprint, has_parts=bool(list_parts(out)))
    limit = spec.limits.max_error_fraction

    if previous is not None and out.exists(SUCCESS_NAME) and not retry_errors:
        return RunResult(
            status="already_complete",
            output_uri=out.uri,
            message=f"{out.uri} is already complete ({previous.totals.get('rows', 0)} rows); "
            "nothing to do (use --retry-errors to regenerate error rows, --fresh to redo all)",
            attempt=None,
            rows_written=0,
            parts_written=[],
            totals=previous.totals,
            max_error_fraction=limit,
        )

    out.remove_temp_files()
    state = load_committed(out)
    superseded = drop_superseded(out, state) if state.superseded else []
    if superseded:
        state = load_committed(out)
    nothing_to_retry = retry_errors and len(state.error_ids) == 0
    if nothing_to_retry and previous is not None and out.exists(SUCCESS_NAME):
        return RunResult(
            status="already_complete",
            output_uri=out.uri,
            message=f"{out.uri} has no error rows; nothing to retry",
            attempt=None,
            rows_written=0,
            parts_written=[],
            totals=previous.totals,
            max_error_fraction=limit,
        )
    out.delete(SUCCESS_NAME)  # the parts may change from here on

    # Never reuse an attempt number, even of a run that died before committing a part.
    earlier = [r.attempt for r in previous.runs] if previous else []
    attempt = max([state.next_attempt, *(a + 1 for a in earlier)])
    run = RunRecord(
        attempt=attempt, started_at=utc_now(), mode="retry-errors" if retry_errors else "run"
    )
    runs = [*(previous.runs if previous else []), run]
    manifest = Manifest(
        job=spec.name,
        status="running",
        fingerprint=fingerprint.to_json(),
        spec=spec_snapshot(spec),
        input_files=input_listing(files),
        runs=runs,
    )
    write_manifest(out, manifest)

    started = time.monotonic()
    with ray_session():
        configure_data_context(spec)
        input_ids = read_input_ids(_read(spec, files))
        if retry_errors:
            todo = pc.filter(input_ids, pc.is_in(input_ids, value_set=state.error_ids))
        else:
            todo = pc.filter(input_ids, pc.invert(pc.is_in(input_ids, value_set=state.ids)))
        say(
            f"{len(input_ids)} input rows, {len(state.ids)} already committed, "
            f"{len(todo)} to generate (attempt {attempt})"
        )
        stats = CommitStats()
        budget = _start_budget(spec, previous) if len(todo) else None
        if len(todo):
            stats, run.actors = _generate_and_write(
                spec, files, out, attempt, todo, say, progress_interval_s, budget
            )
        if budget is not None:
            import ray

            manifest.budget = ray.get(budget.state.remote()).to_dict()
        run.parts = list(stats.parts)
        run.rows = stats.rows
        run.error_rows = stats.error_rows
        run.completion_tokens = stats.completion_tokens
    run.wall_s = time.monotonic() - started
    run.finished_at = utc_now()

    state = load_committed(out)
    if state.superseded:  # this run regenerated error rows: older copies go now
        superseded += drop_superseded(out, state)
        state = load_committed(out)
    missing = int(pc.sum(pc.invert(pc.is_in(input_ids, value_set=state.ids))).as_py() or 0)
    manifest.status = "complete" if missing == 0 else "incomplete"
    stopped_at_budget = bool(missing and manifest.budget and manifest.budget["is_closed"])
    if stopped_at_budget:
        manifest.status = "stopped_at_budget"
    manifest.missing_ids = missing
    manifest.parts = part_listing(out)
    for earlier in runs[:-1]:
        if earlier.finished_at is None:  # its driver died: record what it had committed
            prefix = f"part-{earlier.attempt:05d}-"
            kept = [p for p in manifest.parts if p["name"].startswith(prefix)]
            earlier.parts = [p["name"] for p in kept]
            earlier.rows = sum(p["rows"] for p in kept)
            earlier.interrupted = True
    manifest.totals = compute_totals(out, spec, runs)
    write_manifest(out, manifest)
    if missing == 0:
        out.put_atomic(SUCCESS_NAME, b"")  # last: marks the output complete
    _write_report(spec, out, say)
    rows_written = stats.rows
    if stopped_at_budget:
        message = (
            f"{out.uri}: stopped at budget (cost.budget_usd {spec.cost.budget_usd}, spent "
            f"${manifest.totals.get('total_usd', 0):.4f}); {missing} input row(s) not generated; "
            "rerun with a higher budget (e.g. --set cost.budget_usd=...) to resume"
        )
    elif missing:
        message = (
            f"{out.uri}: {missing} input row(s) have no committed result; rerun the same "
            "command to generate them"
        )
    else:
        message = f"{out.uri}: complete, {manifest.totals['rows']} rows ({rows_written} new)"
    return RunResult(
        status=manifest.status if missing else "complete",  # type: ignore[arg-type]
        output_uri=out.uri,
        message=message,
        attempt=attempt,
        rows_written=rows_written,
        parts_written=list(stats.parts),
        totals=manifest.totals,
        max_error_fraction=limit,
        missing_ids=missing,
        superseded_parts=superseded,
    )


def _generate_and_write(
    spec: JobSpec,
    files: list[Any],
    out: OutputDir,
    attempt: int,
    todo: pa.Array,
    say: Callable[[str], None],
    progress_interval_s: float,
    budget: Any = None,
) -> tuple[CommitStats, list[dict[str, Any]]]:
    """Generate the `todo` ids and commit them as parts; returns the commit stats and the
    latest cost account of every actor incarnation."""
    from pipeline.batch.generate import ACCOUNT_COLUMN, add_generate_stage

    ds = _read(spec, files)
    # read_dataset already cuts blocks to resources.batch_size rows, so every actor gets work.
    ds = ds.map_batches(
        _select_ids,
        fn_kwargs={"ids": todo, "keep": True},
        batch_format="pyarrow",
        num_cpus=FILTER_TASK_CPUS,
    )
    ds = _add_prompt_stage(ds, spec)
    ds = add_generate_stage(ds, spec, budget=budget)

    parts = list_parts(out)
    # Resumed runs keep the schema of the parts already there (passthrough types included).
    schema = read_part(out, parts[0]).schema if parts else None
    writer: PartWriter | None = None
    accounts: dict[str, dict[str, Any]] = {}  # "<actor id>/<incarnation>" -> latest account
    progress = Progress(total=len(todo))
    with ProgressPrinter(progress, say, progress_interval_s):
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            if writer is None:
                if schema is None:
                    schema = output_schema(
                        _passthrough_fields(batch, spec.input.passthrough_columns),
                        spec.output.include_token_ids,
                    )
                writer = PartWriter(out, attempt, schema, spec.output.rows_per_file)
            for text in batch.column(ACCOUNT_COLUMN).drop_null().to_pylist():
                account = json.loads(text)
                key = f"{account['actor_id']}/{account['incarnation']}"
                if account["lifetime_s"] >= accounts.get(key, {}).get("lifetime_s", -1.0):
                    accounts[key] = account
            writer.add(conform(batch, writer.schema))
            progress.update(writer.stats)
        if writer is None:
            if budget is not None:  # the budget refused every row: nothing to commit
                return CommitStats(), list(accounts.values())
            raise RuntimeError("the generate stage returned no rows although rows were pending")
        writer.close()
        progress.update(writer.stats)
    return writer.stats, list(accounts.values())


def _start_budget(spec: JobSpec, previous: Manifest | None) -> Any:
    """The run's shared budget actor (pipeline.batch.budget), or None without cost.budget_usd.
    Spend of earlier runs on this output counts against the budget."""
    if spec.cost.budget_usd is None:
        return None
    from pipeline.batch.budget import gate_for_job, start_budget_actor

    return start_budget_actor(gate_for_job(spec, previous.totals if previous else None))


def _passthrough_fields(batch: pa.Table, names: list[str]) -> list[pa.Field]:
    fields = []
    for name in names:
        column_type = batch.schema.field(name).type
        # An all-null first batch says nothing about the type; strings hold anything.
        fields.append(pa.field(name, pa.string() if pa.types.is_null(column_type) else column_type))
    return fields


def _write_report(spec: JobSpec, out: OutputDir, say: Callable[[str], None]) -> None:
    if not spec.output.report:
        return
    from pipeline.report import write_report

    try:
        write_report(out.uri, spec.storage)
    except Exception as exc:  # the rows are committed; a failed report must not fail the job
        say(f"warning: could not write the run report: {type(exc).__name__}: {exc}")
