"""run_job: the one place the stages of a batch job are chained.

    [format ray_data: staged once as Parquet] ─▶ preflight ─▶ shard plan + output schema ─▶
    fingerprint ─▶ lease ─▶ resume state (manifest, adopted parts) ─▶ Ray: prompt actors (read
    + render) ─▶ engine actors (generate + write parts) ─▶ commits into the manifest ─▶ finish:
    status, totals, `_SUCCESS` (the CLI writes the run report from the manifest:
    pipeline.cli.job_cmds)

The driver moves shards and part records, never rows (pipeline.batch.driver.scheduler); the commit
protocol that makes the output exactly-once is in pipeline.batch.commit.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa

from pipeline.batch.commit.committer import Committer, ResumeRefused
from pipeline.batch.commit.duplicates import find_duplicate_ids, mark_duplicates
from pipeline.batch.commit.fingerprint import input_listing, job_fingerprint
from pipeline.batch.commit.lease import Lease, LeaseHeld, LeaseKeeper, LeaseLost
from pipeline.batch.commit.manifest import Manifest, ManifestConflict, ManifestStore, Status
from pipeline.batch.commit.parts import PartName, PartRecord, PartWritten
from pipeline.batch.driver.budget import gate_for_job, start_budget_actor
from pipeline.batch.driver.cluster import (
    ResourceError,
    check_cpu_headroom,
    known_cluster_cpus,
    start_engines,
    start_prompters,
)
from pipeline.batch.driver.openai_output import LineContext, prune_exports, write_exports
from pipeline.batch.driver.plan import preflight
from pipeline.batch.driver.progress import (
    Progress,
    ProgressPrinter,
    RowTotal,
    estimate_total,
    sample_bytes_per_line,
)
from pipeline.batch.driver.scheduler import UNITS_PER_ACTOR, JobFailed, JobFenced, Scheduler
from pipeline.batch.driver.shards import plan_shards
from pipeline.batch.metrics import JobMetrics, shard_counts
from pipeline.batch.session import ray_session
from pipeline.batch.stages.read import sample_values
from pipeline.batch.stages.read.staging import stage_input
from pipeline.batch.stages.schema import (
    INFER_SAMPLE_ROWS,
    job_output_schema,
    passthrough_fields,
    schema_to_json,
)
from pipeline.batch.units import ShardPlan, WorkUnit
from pipeline.spec import JobSpec
from pipeline.storage import InputFile, OutputDir, RetryPolicy

__all__ = [
    "JobFailed",
    "LeaseHeld",
    "LeaseLost",
    "ResourceError",
    "ResumeRefused",
    "RunResult",
    "run_job",
]

logger = logging.getLogger(__name__)

RunStatus = Literal["complete", "already_complete", "incomplete", "stopped_at_budget"]


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
    missing_rows: int = 0
    superseded_parts: list[str] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # e.g. lost actors

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


# --- planning ----------------------------------------------------------------------------------


def plan_input(
    spec: JobSpec, files: list[InputFile], slots: int | None = None
) -> tuple[ShardPlan, list[pa.Field]]:
    """The job's shards (sized for `slots` engine slots) and the passthrough columns' fixed
    types."""
    plan = plan_shards(spec, files, slots)
    samples = None
    if spec.input.format != "parquet" and spec.input.passthrough_columns:
        samples = sample_values(spec, plan, spec.input.passthrough_columns, INFER_SAMPLE_ROWS)
    return plan, passthrough_fields(spec, plan.parquet_schemas, samples)


def _shard_slots(spec: JobSpec, out: OutputDir, fresh: bool) -> int | None:
    """The engine slots to size the shard plan for: this job's pool, or for a resume, what the
    first run planned for (its manifest says; a different pool must not cut other shards).
    A manifest from before plans recorded it: None, the plan it made then."""
    if not fresh:
        previous = ManifestStore(out).read()
        if previous is not None:
            return previous.shard_slots
    return spec.resources.peak_actors * UNITS_PER_ACTOR


def _units(committer: Committer, run: int, retry_errors: bool) -> list[WorkUnit]:
    ledger = committer.ledger
    if not retry_errors:
        return [
            WorkUnit(ledger.shards[i].shard, run, 1, ledger.selection(i))
            for i in ledger.incomplete()
        ]
    by_shard: dict[int, list[str]] = {}
    for record in ledger.records():
        if record.sums.errors:
            by_shard.setdefault(record.shard, []).append(record.name)
    return [
        WorkUnit(ledger.shards[i].shard, run, 1, ledger.selection(i), tuple(names))
        for i, names in sorted(by_shard.items())
    ]


# --- signals -----------------------------------------------------------------------------------


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event, say: Callable[[str], None]) -> Iterator[None]:
    """SIGTERM and Ctrl-C set `stop` (the run then writes what is finished and ends) instead of
    killing the driver; a second Ctrl-C kills it. Only in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: Any) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        say(f"{signal.Signals(signum).name}: stopping; writing what is finished")
        stop.set()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# --- the run -----------------------------------------------------------------------------------


def _preflight(spec: JobSpec) -> list[InputFile]:
    """Inputs listed, model and output checked (pipeline.batch.driver.plan); SpecError names the
    field."""

    return list(preflight(spec))


def run_job(
    spec: JobSpec,
    *,
    fresh: bool = False,
    retry_errors: bool = False,
    emit: Callable[[str], None] | None = None,
    progress_interval_s: float = 10.0,
    stop: threading.Event | None = None,
) -> RunResult:
    """Run (or resume) a job; see the module docstring for the order of the stages."""
    say = emit or (lambda line: logger.info(line))
    stop = stop or threading.Event()
    spec = stage_input(spec, fresh=fresh, emit=say)  # ray_data: a Parquet snapshot, as parquet
    files = _preflight(spec)  # fails here, before any actor, on bad input or storage
    check_cpu_headroom(spec, known_cluster_cpus())
    out = OutputDir(spec.output.uri, spec.storage, RetryPolicy(spec.storage.retry_s))
    plan, passthrough = plan_input(spec, files, _shard_slots(spec, out, fresh))
    schema = job_output_schema(spec, passthrough)
    fingerprint = job_fingerprint(
        spec, files, shard_plan=plan.digest, schema=schema_to_json(schema)
    )
    lease = Lease.acquire(out, spec.output.lease_timeout_s)  # LeaseHeld: another run writes
    committer = Committer(
        out, spec, plan, fingerprint, schema_to_json(schema), input_listing(files), lease
    )
    deadline = _deadline(spec.limits.stop_at, stop, say)
    try:
        with LeaseKeeper(lease, stop) as keeper:
            return _run(
                spec,
                committer,
                lease,
                keeper,
                stop,
                schema,
                passthrough,
                say,
                fresh=fresh,
                retry_errors=retry_errors,
                progress_interval_s=progress_interval_s,
            )
    finally:
        if deadline is not None:
            deadline.cancel()
        lease.release()


def _deadline(
    stop_at: float | None, stop: threading.Event, say: Callable[[str], None]
) -> threading.Timer | None:
    """limits.stop_at: a timer that stops the run at that wall time, as SIGTERM would."""
    if stop_at is None:
        return None

    def fire() -> None:
        say(f"limits.stop_at ({stop_at:.0f}) reached: stopping; writing what is finished")
        stop.set()

    timer = threading.Timer(max(0.0, stop_at - time.time()), fire)
    timer.daemon = True
    timer.start()
    return timer


def _run(
    spec: JobSpec,
    committer: Committer,
    lease: Lease,
    keeper: LeaseKeeper,
    stop: threading.Event,
    schema: pa.Schema,
    passthrough: list[pa.Field],
    say: Callable[[str], None],
    *,
    fresh: bool,
    retry_errors: bool,
    progress_interval_s: float,
) -> RunResult:
    out, limit = committer.out, spec.limits.max_error_fraction
    if fresh:
        committer.clear()
    out.remove_temp_files()
    opened = committer.open()  # ResumeRefused: another job's output
    previous = opened.previous
    if opened.already_complete and not retry_errors and previous is not None:
        if _export_openai_batch(spec, committer):  # when output.format changed since
            newest = max((r.attempt for r in previous.runs), default=0)
            _prune_openai_batch(spec, committer, newest)
        return _nothing_to_do(
            out,
            previous,
            limit,
            "is already complete",
            "nothing to do (use --retry-errors to regenerate error rows, --fresh to redo all)",
        )
    adopted = committer.adopt_orphans()
    if adopted:
        say(f"adopted {len(adopted)} part(s) an interrupted run had written: {adopted[:5]}")
    has_errors = any(r.sums.errors for r in committer.ledger.parts.values())
    if retry_errors and not has_errors and opened.already_complete and previous is not None:
        return _nothing_to_do(out, previous, limit, "has no error rows", "nothing to retry")

    holder = lease.holder
    run = committer.begin(
        "retry-errors" if retry_errors else "run", holder.run_id, holder.host, holder.pid
    )
    lease.set_attempt(run.attempt)
    units = _units(committer, run.attempt, retry_errors)
    missing = committer.ledger.missing_rows()
    say(
        f"{len(committer.plan)} shard(s), {len(units)} to run (attempt {run.attempt}); "
        f"{sum(r.sums.rows for r in committer.ledger.parts.values())} row(s) committed before"
        + (f", {missing} missing" if missing is not None else "")
    )
    started = time.monotonic()
    events: list[dict[str, Any]] = [{"event": "adopted_parts", "parts": adopted}] if adopted else []
    accounts: dict[str, dict[str, Any]] = {}
    budget_state: dict[str, Any] | None = None
    budget_closed = False
    if units:
        # Signals are taken over after Ray starts: ray.init installs its own SIGTERM handler.
        with ray_session(), stop_on_signals(stop, say):
            budget = _start_budget(spec, previous)
            engines = start_engines(spec, schema, budget, lease.run_id)
            prompters = start_prompters(spec, passthrough)
            progress = Progress(total=_row_total(spec, committer, units))
            metrics = JobMetrics(spec.name, lease.run_id)

            def on_part(event: PartWritten) -> None:
                before = committer.parts_committed
                committer.on_part(event)
                progress.add(event.record)
                if committer.parts_committed > before:  # not a refused part
                    metrics.on_part(event.record)

            def on_tick() -> None:
                committer.save()
                saved = committer.ledger.changes == 0
                metrics.on_tick(lambda: shard_counts(scheduler), saved=saved)

            scheduler = Scheduler(
                engines=engines.handles,
                prompters=prompters.handles,
                units=units,
                ledger=committer.ledger,
                on_part=on_part,
                on_tick=on_tick,
                stop=stop,
                max_unit_retries=spec.resources.max_task_retries,
                tail_split=spec.resources.tail_split,
            )
            try:
                with ProgressPrinter(progress, say, progress_interval_s):
                    outcome = scheduler.run()
                # The final manifest follows at once; Ray (and so the metrics) may not outlast it.
                metrics.finish(lambda: shard_counts(scheduler))
            except (ManifestConflict, JobFenced) as exc:  # another run took the output
                raise LeaseLost(str(exc)) from exc
            finally:
                engines.stop()  # free the devices now, not when the handles are collected
                prompters.stop()
            if keeper.failure and lease.lost:
                raise LeaseLost(lease.lost)
            accounts = outcome.accounts
            events += [loss.to_json() for loss in outcome.losses]
            events += [split.to_json() for split in outcome.splits]
            if outcome.occupancy:  # engine actors' idle time, at the tail and in all
                events.append(outcome.occupancy)
            budget_closed = outcome.budget_closed
            if budget is not None:
                import ray

                budget_state = ray.get(budget.state.remote()).to_dict()
                budget_closed = budget_closed or bool(budget_state["is_closed"])
            # In the job's own Ray session: a second ray.init costs a small job seconds.
            _check_duplicate_ids_if_due(spec, committer, schema, say)
    if keeper.failure and lease.lost:
        raise LeaseLost(lease.lost)
    missing = committer.ledger.missing_rows()
    status: Status = "complete" if missing == 0 else "incomplete"
    if missing and budget_closed:
        status = "stopped_at_budget"
    _check_duplicate_ids_if_due(spec, committer, schema, say)  # a resume with nothing to run
    _export_openai_batch(spec, committer)  # before finish writes `_SUCCESS`
    manifest = committer.finish(
        status,
        time.monotonic() - started,
        list(accounts.values()),
        events,
        budget_state,
        prune=lambda: _prune_openai_batch(spec, committer, run.attempt),
    )
    return _result(spec, committer, manifest, status, limit, events)


def _export_openai_batch(spec: JobSpec, committer: Committer) -> bool:
    """output.format openai_batch: OpenAI-format lines of exactly the committed parts
    (pipeline.batch.driver.openai_output); a stopped or incomplete run exports what it committed.
    Files of parts no longer committed go later (`_prune_openai_batch`), once the manifest
    that drops those parts is written. Returns whether the job exports."""
    if spec.output.format != "openai_batch":
        return False

    committer.lease.verify()  # LeaseLost if another run took the output over meanwhile
    context = LineContext(committer.fingerprint.value, spec.cost.price_per_million is not None)
    write_exports(committer.out, committer.ledger.records(), context)
    return True


def _prune_openai_batch(spec: JobSpec, committer: Committer, newest_run: int) -> None:
    """Delete export files of parts no longer committed, up to this run's number."""
    if spec.output.format != "openai_batch":
        return

    prune_exports(committer.out, committer.ledger.records(), newest_run)


def _ids_from_data(spec: JobSpec) -> bool:
    """Ids taken from the input can repeat; derived ids (file and position) cannot."""
    return spec.input.id_column is not None or spec.input.format == "openai_batch"


def _check_duplicate_ids_if_due(
    spec: JobSpec, committer: Committer, schema: pa.Schema, say: Callable[[str], None]
) -> None:
    """The cross-shard duplicate-id pass (pipeline.batch.commit.duplicates), once every row is
    committed and only where it can find something: ids from the data, parts changed since the
    last check, and rows of more than one shard (within a shard, the prompt actor marks repeats
    while it reads). Repeats become error rows naming the first occurrence."""
    if committer.duplicate_ids is not None:  # done earlier in this run
        return
    if not _ids_from_data(spec) or committer.ledger.missing_rows() != 0:
        return
    if not committer.needs_duplicate_check():
        return
    records = committer.ledger.records()
    if _read_in_one_go(records):
        committer.duplicate_ids = {"num_duplicates": 0, "examples": [], "skipped": "one shard"}
        return

    assert committer.run is not None
    committer.lease.verify()  # LeaseLost before writing marks if another run took over
    with ray_session():  # the job's, when it still runs; its own for a resume with no units
        report = find_duplicate_ids(spec.output.uri, spec.storage, records)
        if report.marks:
            by_name = {r.name: r for r in records}
            for record in mark_duplicates(
                spec.output.uri, spec.storage, report, by_name, committer.run.attempt, schema
            ):
                committer.on_part(PartWritten(record, {}))
    committer.duplicate_ids = report.to_json()
    if report.num_duplicates:
        examples = ", ".join(repr(e["id"]) for e in report.examples[:5])
        say(
            f"{report.num_duplicates} row(s) repeat an id of an earlier row in another shard "
            f"(e.g. {examples}); they are error rows now: fix input.id_column's values"
        )


def _read_in_one_go(records: list[PartRecord]) -> bool:
    """Whether every committed row came from one hand-out of one shard: the prompt actor that
    read it marked each repeated id then. Rows of one shard read in several hand-outs (a
    resume, a lost actor's shard handed out again, a split tail, --retry-errors) were not
    compared with each other."""
    names = [PartName.parse(r.name) for r in records]
    reads = {(n.shard, n.run, n.dispatch) if n else None for n in names}
    return len(reads) <= 1 and None not in reads


def _row_total(
    spec: JobSpec, committer: Committer, units: list[WorkUnit]
) -> Callable[[], RowTotal]:
    """The progress line's total: asked anew per line, so JSONL estimates become exact as
    shards are read (pipeline.batch.driver.progress)."""
    shards = committer.ledger.shards

    def known_rows(index: int) -> int | None:
        return shards[index].num_rows

    per_line = sample_bytes_per_line(spec, units, known_rows)
    return lambda: estimate_total(units, known_rows, per_line)


def _nothing_to_do(
    out: OutputDir, previous: Manifest, limit: float, what: str, hint: str
) -> RunResult:
    return RunResult(
        status="already_complete",
        output_uri=out.uri,
        message=f"{out.uri} {what} ({previous.totals.get('rows', 0)} rows); {hint}",
        attempt=None,
        rows_written=0,
        parts_written=[],
        totals=previous.totals,
        max_error_fraction=limit,
    )


def _result(
    spec: JobSpec,
    committer: Committer,
    manifest: Manifest,
    status: Status,
    limit: float,
    events: list[dict[str, Any]],
) -> RunResult:
    assert committer.run is not None
    missing = manifest.missing_rows or 0
    attempt = committer.run.attempt
    written = [r for r in committer.ledger.records() if r.run == attempt]
    superseded = [r.replaces for r in written if r.replaces]
    totals = manifest.totals
    if status == "stopped_at_budget":
        message = (
            f"{committer.out.uri}: stopped at budget (cost.budget_usd {spec.cost.budget_usd}, "
            f"spent ${totals.get('total_usd', 0):.4f}); {missing} input row(s) not generated; "
            "rerun with a higher budget (e.g. --set cost.budget_usd=...) to resume"
        )
    elif status == "incomplete":
        # Unknown when the run stopped before reading every shard (JSONL rows are counted
        # as they are read).
        count = "some" if manifest.missing_rows is None else str(missing)
        message = (
            f"{committer.out.uri}: {count} input row(s) have no committed result; rerun the "
            "same command to generate them"
        )
    else:
        message = (
            f"{committer.out.uri}: complete, {totals['rows']} rows ({committer.rows_committed} new)"
        )
    return RunResult(
        status="complete" if status == "complete" else status,  # type: ignore[arg-type]
        output_uri=committer.out.uri,
        message=message,
        attempt=attempt,
        rows_written=committer.rows_committed,
        parts_written=[r.name for r in written],
        totals=totals,
        max_error_fraction=limit,
        missing_rows=missing,
        superseded_parts=[s for s in superseded if s],
        events=events,
    )


def _start_budget(spec: JobSpec, previous: Manifest | None) -> Any:
    """The run's shared budget actor (pipeline.batch.driver.budget), or None without
    cost.budget_usd. Spend of earlier runs on this output counts against the budget."""
    if spec.cost.budget_usd is None:
        return None

    return start_budget_actor(gate_for_job(spec, previous.totals if previous else None))
