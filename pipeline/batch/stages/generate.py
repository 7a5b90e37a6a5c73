"""The generate stage: engine actors that turn a shard's prepared rows into parts.

Each `EngineWorker` actor loads one engine once (`open_engine`; an s3:// model is downloaded
once per node) and works on the shards the driver hands it (`run_unit`, a few at a time so the
next shard's rows enter the engine while the last rows of the previous one still decode). A
semaphore caps the requests in the engine at `resources.max_in_flight` across all of them.

Per shard, rows are taken `resources.batch_size` at a time (asked of the budget together when
`cost.budget_usd` is set), generated with in-flight batching, and the finished ones are
written as a part (pipeline.batch.commit.parts) every `output.rows_per_file` rows, every
`output.flush_interval_s` seconds, at the end of the shard, and at once when the driver asks
the actor to stop. Each part's record streams back to the driver, which commits it.

At the tail of a job the driver may ask for part of a unit back (`release`): the rows not yet
taken into the engine (nor asked of the budget) are cut off the unit's end and handed to an
idle actor as a unit of their own; this one finishes the rest. The cut and the feeding of rows
both run on the actor's event loop, so a row is either fed here or released, never both.

Per row: SamplingParams from the row's columns (set by the prompt stage) and the job's stop
settings; a row that already carries an `error` (bad input, too long) skips the engine; an
exception while serving one row becomes that row's error, never a failed shard. Only a dead
engine (EngineDeadError) ends the actor process, so that Ray restarts it and the driver hands
its unfinished shards out again (their written parts are kept). That per-row path is
`RowServer`, shared with the Ray Data processor (pipeline.data), so a row is served, costed
and turned into an outcome the same way in both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import pyarrow as pa

from engines.api import (
    EmbedParams,
    Engine,
    EngineDeadError,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)
from engines.health import StallWatch
from engines.samples import fan_out
from pipeline.batch.columns import ADAPTER, ROW, TOOL_PLAN
from pipeline.batch.commit.lease import LeaseHolder
from pipeline.batch.commit.parts import (
    LEASE_NAME,
    REPLACEMENT_DISPATCH,
    PartName,
    PartRecord,
    PartWritten,
    conform,
    read_part,
    read_part_record,
    write_part,
)
from pipeline.batch.commit.stats import RowStats
from pipeline.batch.metrics import BusyReporter
from pipeline.batch.stages.devices import claim_devices
from pipeline.batch.stages.heap import settle_after_load
from pipeline.batch.stages.images import row_images
from pipeline.batch.stages.rows import (
    GenerateConfig,
    RowOutcome,
    outcomes_to_table,
    prompt_tokens_of,
    row_samples,
    row_sampling,
)
from pipeline.batch.stages.tools import FINISH_TOOL_CALLS, read_calls
from pipeline.batch.units import RowAdmission, RowRanges, RowSpend, UnitEnd, WorkUnit
from pipeline.cost import CostMeter, row_cost
from pipeline.engine_setup import open_engine
from pipeline.openai.chat import load_tokenizer
from pipeline.openai.reasoning import ReasoningParser, make_parser, split_output
from pipeline.spec import SamplingSpec
from pipeline.storage import OutputDir, RetryPolicy

logger = logging.getLogger(__name__)

# After the driver asks an actor to stop, rows already in its engine get this long to finish.
STOP_GRACE_S = 10.0
WAKE_S = 1.0  # longest a unit's loop waits for a finished row before it looks around again
# A unit gives rows back (`release`) only when at least this many are still to be fed, and
# at least two batches: fewer finish sooner here than a new hand-out could start elsewhere.
MIN_RELEASE_ROWS = 32


@dataclass
class _Feed:
    """How far one running unit has fed its prepared rows into the engine."""

    limit: int  # positions [0, limit) of the prepared table are this unit's to generate
    taken: int = 0  # positions [0, taken) were fed or asked of the budget: never released


# --- one row through the engine ----------------------------------------------------------------


class RowServer:
    """Serves prepared rows (prompt stage columns) on one engine and attributes its time.

    `serve(row)` never raises for a row's own problem: a row that carries an `error`, has no
    tokens or an invalid sampling value, or whose generation raised, becomes an error outcome.
    Only a dead engine ends the process (see `_generate`).
    """

    def __init__(
        self,
        engine: Engine,
        meter: Any,
        sampling: SamplingSpec,
        request_prefix: str | None = None,
        reasoning: ReasoningParser | None = None,
        embed: EmbedParams | None = None,
    ):
        self.engine = engine
        self.embed = embed  # task embed: every row is embedded, not generated
        self.meter = meter  # pipeline.cost.CostMeter of the actor
        self.sampling = sampling
        self.reasoning = reasoning  # prompt.reasoning's parser: outputs are split by it
        # Request ids: the row id, then a prefix of this server's own and a counter. The engine
        # keys its requests by them, so they must be unique even where an input repeats an id;
        # the prefix (the actor's incarnation) keeps them apart across actors and restarts
        # (logs, traces), and a counter costs less per row than a uuid4.
        self._request_prefix = request_prefix or uuid.uuid4().hex[:8]
        self._request_seq = itertools.count()
        self._sampling_cache: dict[tuple[Any, ...], SamplingParams] = {}  # see row_sampling
        # Bound to the event loop that first uses it: made on first use, on that loop.
        self._finished: asyncio.Condition | None = None

    async def serve(self, row: dict[str, Any]) -> RowOutcome:
        """The row's outcome; an exception while serving it is that row's error."""
        try:
            return await self._serve(row)
        except Exception as exc:
            return self.failure(row, exc)

    @staticmethod
    def failure(row: dict[str, Any], exc: BaseException) -> RowOutcome:
        """A row whose serving raised is that row's error; the rest of the rows stand."""
        if not isinstance(exc, Exception):  # cancellation, interpreter exit: not a row's
            raise exc
        logger.exception("row %r failed", row.get("id"), exc_info=exc)
        message = f"internal error serving the row: {type(exc).__name__}: {exc}"
        return RowOutcome.failed(message, prompt_tokens_of(row), served=True)

    async def _serve(self, row: dict[str, Any]) -> RowOutcome:
        prompt_tokens = prompt_tokens_of(row)
        if row.get("error"):
            return RowOutcome.failed(str(row["error"]), prompt_tokens, served=False)
        try:
            sampling = row_sampling(row, self.sampling, self._sampling_cache)
        except (ValueError, TypeError) as exc:
            return RowOutcome.failed(f"row {row['id']!r}: {exc}", prompt_tokens, served=False)
        token_ids = row.get("prompt_token_ids")
        if not token_ids:
            return RowOutcome.failed("empty prompt (no tokens)", prompt_tokens, served=False)
        request = GenerationRequest(
            prompt_token_ids=list(map(int, token_ids)),
            sampling=sampling,
            request_id=f"{row['id']}#{self._request_prefix}.{next(self._request_seq)}",
            embed=self.embed,
            adapter=row.get(ADAPTER) or None,
            images=row_images(row),
        )
        # n > 1: n requests of one group (the engine computes the prompt once for them).
        requests = fan_out(request, row_samples(row, self.sampling))
        if self._finished is None:
            self._finished = asyncio.Condition()
        finished = self._finished
        now = time.monotonic()
        for r in requests:
            self.meter.on_submit(r.request_id, now)
        if len(requests) == 1:  # the common case: no task per row
            results = [await self._generate(request)]
        else:
            results = list(await asyncio.gather(*(self._generate(r) for r in requests)))
        self.meter.add_steps(self.engine.drain_step_records())
        for result in results:
            self.meter.on_finish(result)
        async with finished:
            finished.notify_all()
            # Interval-only engines: a row's share is final once every earlier-arrived request
            # has finished too.
            await finished.wait_for(
                lambda: all(self.meter.is_final(r.request_id) for r in requests)
            )
        gpu_seconds = sum(self.meter.pop_row_seconds(r.request_id) for r in requests)
        splits = None
        if self.reasoning is not None:
            splits = [
                None
                if r.finish_reason == "error"
                else split_output(
                    self.reasoning, request.prompt_token_ids, r.output_token_ids, r.text
                )
                for r in results
            ]
        outcome = RowOutcome.from_results(results, gpu_seconds, sampling.response_format, splits)
        plan = row.get(TOOL_PLAN)
        if plan and outcome.finish_reason != "error":
            # The answer's calls (pipeline.batch.stages.tools): `text` keeps what it said besides.
            found = splits[0].calls if splits and splits[0] is not None else ()  # harmony's
            outcome.text, outcome.tool_calls = read_calls(plan, str(row["id"]), outcome.text, found)
            if outcome.tool_calls is not None:
                outcome.finish_reason = FINISH_TOOL_CALLS
        return outcome

    async def _generate(self, request: GenerationRequest) -> GenerationResult:
        try:
            return await self.engine.generate(request)
        except asyncio.CancelledError:
            self.engine.abort(request.request_id)
            raise
        except EngineDeadError as exc:
            _exit_for_restart(f"engine died ({exc})")
        except Exception as exc:
            return GenerationResult.without_output(
                request, "error", error=f"{type(exc).__name__}: {exc}"
            )


def _exit_for_restart(why: str) -> NoReturn:
    """Nothing more can be served here. Ending the process (not raising) makes Ray restart
    the actor, and its work is handed out again."""
    logger.error("%s; exiting so the actor is restarted", why)
    os._exit(70)


class EngineWatchdog:
    """Watches an engine actor's engine from a thread of its own: the driver sees an actor
    whose process is alive as alive, so a hung engine (work, no progress for
    `stall_timeout_s`: engines.health.StallWatch) or one that died while idle would hold its
    shards until the job's deadline. Either calls `on_failure` with why."""

    def __init__(
        self,
        engine: Any,
        stall_timeout_s: float,
        on_failure: Callable[[str], None],
        period_s: float | None = None,
    ) -> None:
        self.engine = engine
        self.watch = StallWatch(stall_timeout_s)
        self.on_failure = on_failure
        self.period_s = period_s if period_s is not None else min(10.0, stall_timeout_s / 4)

    def start(self) -> None:
        threading.Thread(target=self._run, name="engine-watchdog", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(self.period_s)
            try:
                stats = self.engine.stats()
            except EngineDeadError as exc:
                self.on_failure(f"engine died ({exc})")
                return
            except Exception:  # a stats read that failed once says nothing yet
                logger.warning("reading engine stats failed", exc_info=True)
                continue
            stalled = self.watch.observe(stats, time.monotonic())
            if stalled is not None:
                self.on_failure(f"engine hung: {stalled}")
                return


# --- the actor -------------------------------------------------------------------------------


class Fenced(RuntimeError):
    """Another run holds the output's lease: this actor's run must not write to it."""


@dataclass
class _Finished:
    """A row that left the engine, waiting for its part."""

    position: int  # the row's position in the unit's prepared table
    outcome: RowOutcome


class EngineWorker:
    """Ray actor: one engine, many requests in flight across the shards it works on."""

    def __init__(self, config: GenerateConfig):

        started = time.monotonic()
        self.config = config
        # A multi-device actor: its group's GPUs on this node become visible before the engine
        # starts its workers (pipeline.batch.driver.placement).
        self.devices = claim_devices() if config.devices > 1 else []
        self.engine = open_engine(
            config.model, config.engine, config.storage, devices=config.devices
        )
        self.meter = CostMeter(
            config.devices,
            config.cost.prefill_weight,
            config.cost.decode_weight,
            start=started,
            has_step_records=self.engine.info.has_step_records,
        )
        self.meter.record_load(started, time.monotonic())
        self.actor_id = current_actor_id()
        self.incarnation = uuid.uuid4().hex[:12]  # a restarted actor keeps its actor id
        self.rows = RowServer(
            self.engine,
            self.meter,
            config.sampling,
            self.incarnation[:8],
            reasoning_parser(config.reasoning, config.model, config.storage),
            config.embed,
        )
        self.out = OutputDir(config.output_uri, config.storage, RetryPolicy(config.storage.retry_s))
        self.busy = BusyReporter(config.job_name, config.run_id or "", self.actor_id)
        self._busy_task: asyncio.Task[None] | None = None
        # asyncio primitives bind to the loop that first uses them: made on first use, on the
        # actor's event loop.
        self._slots: asyncio.Semaphore | None = None
        self._stopping: asyncio.Event | None = None
        self._feeds: dict[tuple[int, int], tuple[_Feed, pa.Table]] = {}  # (shard, dispatch)
        if config.stall_timeout_s is not None and not self.actor_id.startswith("pid-"):
            # In an actor only: exiting is how a failed engine gets restarted, and outside
            # one (tools, tests) nothing would restart it.
            EngineWatchdog(self.engine, config.stall_timeout_s, _exit_for_restart).start()
        settle_after_load()  # see pipeline.batch.stages.heap

    def _loop_state(self) -> tuple[asyncio.Semaphore, asyncio.Event]:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.max_in_flight)
            self._stopping = asyncio.Event()
        assert self._stopping is not None
        return self._slots, self._stopping

    # --- calls from the driver ---------------------------------------------------------------

    def ready(self) -> dict[str, Any]:
        """Answers once the engine is loaded: who and where this actor is."""
        import ray

        return {
            "actor_id": self.actor_id,
            "incarnation": self.incarnation,
            "node_id": ray.get_runtime_context().get_node_id() if ray.is_initialized() else "",
            "pid": os.getpid(),
            "limitations": list(self.engine.info.limitations),
            # The GPUs this actor reserved: per placement-group bundle, or its own.
            "devices": self.devices
            or (
                [{"bundle": None, "gpu_ids": [str(i) for i in ray.get_gpu_ids()]}]
                if ray.is_initialized()
                else []
            ),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def stop(self) -> None:
        """Stop taking rows; write what is finished; end every unit soon (see run_unit)."""
        self._loop_state()[1].set()

    async def release(self, shard: int, dispatch: int) -> list[list[int]]:
        """Give back the second half of a running unit's rows not yet fed: their shard row
        indexes as [start, end) spans (empty when the unit is not here, is stopping, or has
        fewer than MIN_RELEASE_ROWS left). Async, so it runs between two steps of `feed`."""
        entry = self._feeds.get((shard, dispatch))
        if entry is None or self._loop_state()[1].is_set():
            return []
        feed, rows = entry
        left = feed.limit - feed.taken
        if left < max(MIN_RELEASE_ROWS, 2 * self.config.batch_size):
            return []
        cut = feed.taken + (left + 1) // 2  # this actor keeps the first half
        released = rows.column(ROW).slice(cut, feed.limit - cut).to_pylist()
        feed.limit = cut

        return [list(span) for span in RowRanges.from_indexes(released).spans]

    def account(self) -> dict[str, Any]:
        account = self.meter.account(time.monotonic())
        account.actor_id = self.actor_id
        return {**account.to_dict(), "incarnation": self.incarnation}

    async def _report_busy(self) -> None:
        """The busy-fraction gauge, refreshed while the actor lives (idle time included)."""
        while True:
            try:
                self.busy.update(self.meter.account(time.monotonic()))
            except Exception as exc:  # metrics never stop the actor's work
                logger.debug("busy fraction not reported: %s", exc)
            await asyncio.sleep(1.0)

    async def run_unit(self, unit: WorkUnit, rows: pa.Table) -> AsyncIterator[Any]:
        """Generate the prepared rows of one shard; yields PartWritten per part, then UnitEnd.

        Call with `.options(num_returns="streaming")`."""
        slots, stopping = self._loop_state()
        if self._busy_task is None:  # on the actor's event loop, which outlives this call
            self._busy_task = asyncio.ensure_future(self._report_busy())
        finished: asyncio.Queue[_Finished] = asyncio.Queue()
        in_flight: set[asyncio.Task[None]] = set()
        records = rows.to_pylist()
        feed_state = _Feed(limit=len(records))
        key = (unit.shard.index, unit.dispatch)
        if not unit.replace_parts:  # replacement work is all or nothing per part
            self._feeds[key] = (feed_state, rows)
        refused = 0
        flushed: list[PartRecord] = []
        buffer: list[_Finished] = []  # finished rows waiting for their part
        buffered_since = 0.0  # when the oldest of them finished
        seq = 0

        async def serve(position: int, row: dict[str, Any]) -> None:
            try:
                outcome = await self.rows.serve(row)
            finally:
                slots.release()
            finished.put_nowait(_Finished(position, outcome))

        async def feed() -> None:
            nonlocal refused
            size = self.config.batch_size
            start = 0
            while start < feed_state.limit:  # `release` may lower the limit meanwhile
                chunk = list(range(start, min(start + size, feed_state.limit)))
                if stopping.is_set():
                    refused += feed_state.limit - start
                    return
                feed_state.taken = chunk[-1] + 1  # from here on these rows stay here
                admitted = await self._admit([records[i] for i in chunk])
                for position, ok in zip(chunk, admitted, strict=True):
                    if not ok:
                        refused += 1
                        continue
                    await slots.acquire()
                    if stopping.is_set():  # asked to stop while waiting for a slot
                        slots.release()
                        refused += feed_state.limit - position
                        return
                    task = asyncio.ensure_future(serve(position, records[position]))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                if not all(admitted):  # the budget closed: nothing more from this shard
                    refused += feed_state.limit - chunk[-1] - 1
                    return
                start = chunk[-1] + 1

        feeder = asyncio.ensure_future(feed())

        def settled() -> bool:
            # A row's task is done once its outcome is queued; `in_flight.discard` runs later,
            # as a done callback. Counting a done task as still in flight kept the last part of
            # a shard waiting up to flush_interval_s for a row that would never come.
            return feeder.done() and finished.empty() and all(t.done() for t in in_flight)

        stop_deadline: float | None = None  # when rows still in the engine are left
        flushed_on_stop = False  # what was finished when the stop came is written at once
        try:
            while True:
                done = settled()
                # Finished rows wait at most flush_interval_s for their part. The loop wakes at
                # least every WAKE_S all the same: to notice a stop, or the feeder ending (a
                # release can end it) with rows waiting, which no queued outcome announces.
                if buffer:
                    age = time.monotonic() - buffered_since
                    wait_s = min(max(self.config.flush_interval_s - age, 0.0), WAKE_S)
                else:
                    wait_s = WAKE_S
                if stopping.is_set():
                    stop_deadline = stop_deadline or time.monotonic() + STOP_GRACE_S
                    wait_s = min(wait_s, 0.2)
                if not done:
                    try:
                        item = await asyncio.wait_for(finished.get(), timeout=max(wait_s, 0.01))
                        arrived = [item]
                        room = self.config.rows_per_file - len(buffer)
                        while not finished.empty() and len(arrived) < room:
                            arrived.append(finished.get_nowait())
                        if not buffer:
                            buffered_since = time.monotonic()
                        buffer += arrived
                        # The budget learns of every finished row at once, not per part.
                        self._report_spend(records, arrived)
                    except asyncio.TimeoutError:
                        pass
                if stop_deadline is not None and time.monotonic() > stop_deadline and in_flight:
                    # Past the grace: leave the rows still in the engine for a rerun (a done
                    # task's outcome is queued already and goes into this part).
                    pending = [task for task in in_flight if not task.done()]
                    for task in pending:
                        task.cancel()
                    refused += len(pending)
                    in_flight.clear()
                due = bool(buffer) and (
                    time.monotonic() - buffered_since >= self.config.flush_interval_s
                )
                full = len(buffer) >= self.config.rows_per_file
                done = settled()
                stop_now = stopping.is_set() and not flushed_on_stop
                if buffer and (full or due or done or stop_now) and not unit.replace_parts:
                    flushed_on_stop = flushed_on_stop or stopping.is_set()
                    record = await self._write(unit, rows, buffer, seq)
                    seq += 1
                    flushed.append(record)
                    buffer = []
                    yield PartWritten(record, self.account())
                if done:
                    break
            feeder.result()  # surface an admission failure
            if unit.replace_parts:
                async for event in self._replace(unit, rows, buffer):
                    flushed.append(event.record)
                    yield event
            yield UnitEnd(
                shard=unit.shard.index,
                rows_written=sum(r.sums.rows for r in flushed),
                rows_refused=refused,
                stopped=stopping.is_set(),
                account=self.account(),
            )
        finally:
            self._feeds.pop(key, None)
            feeder.cancel()
            for task in in_flight:
                task.cancel()

    # --- rows --------------------------------------------------------------------------------

    async def _admit(self, rows: list[dict[str, Any]]) -> list[bool]:
        if self.config.budget is None:
            return [True] * len(rows)

        asks = [
            RowAdmission(
                row_id=str(row["id"]),
                prompt_tokens=prompt_tokens_of(row),
                # n samples may each run to max_tokens; the prompt is computed once.
                max_tokens=int(row.get("max_tokens") or self.config.sampling.max_tokens)
                * row_samples(row, self.config.sampling),
            )
            for row in rows
        ]
        return await self.config.budget.admit.remote(asks)

    def _report_spend(self, records: list[dict[str, Any]], items: list[_Finished]) -> None:
        """Tell the budget what these finished rows cost and what this actor has cost so far
        (fire and forget: the budget actor applies calls in order)."""
        if self.config.budget is None or not items:
            return

        spends = []
        for item in items:
            o = item.outcome
            cost = row_cost(
                o.gpu_seconds,
                o.prompt_tokens,
                o.cached_prompt_tokens,
                o.completion_tokens,
                self.config.cost,
            )
            row_id = str(records[item.position]["id"])
            spends.append(RowSpend(row_id, cost.cost_usd, o.prompt_tokens + o.completion_tokens))
        account = self.account()
        paid_usd = account["devices"] * account["lifetime_s"] * self.config.cost.device_hour_usd
        self.config.budget.finish.remote(spends)
        self.config.budget.report_spend.remote(
            f"{self.actor_id}/{self.incarnation}", paid_usd / 3600.0
        )

    def _output(self, rows: pa.Table, items: list[_Finished]) -> pa.Table:
        positions = pa.array([item.position for item in items], type=pa.int64())
        return outcomes_to_table(
            rows.take(positions),
            [item.outcome for item in items],
            self.config,
            self.actor_id,
            self.engine.info.kind,
        )

    def _check_lease(self) -> None:
        """Refuse to write once another run holds the output (this actor's driver hangs or
        lost its lease): a fenced-off run's late parts are not even written."""
        if self.config.run_id is None:
            return

        current = self.out.read_versioned(LEASE_NAME)
        holder = LeaseHolder.parse(current.data) if current else None
        if holder is None or holder.run_id != self.config.run_id or holder.released:
            who = holder.describe() if holder else "no run"
            raise Fenced(
                f"{self.out.uri}: the lease is held by {who}, not by this actor's run; not writing"
            )

    async def _write(
        self, unit: WorkUnit, rows: pa.Table, items: list[_Finished], seq: int
    ) -> PartRecord:
        await asyncio.to_thread(self._check_lease)
        table = self._output(rows, items)
        part = PartName(unit.shard.index, unit.run, unit.dispatch, seq)
        return await asyncio.to_thread(
            write_part, self.out, part, table, self.config.schema, self.actor_id
        )

    async def _replace(
        self, unit: WorkUnit, rows: pa.Table, items: list[_Finished]
    ) -> AsyncIterator[PartWritten]:
        """--retry-errors: write each listed part again with its regenerated rows in place."""

        await asyncio.to_thread(self._check_lease)
        new = self._output(rows, items)
        by_row = {r: i for i, r in enumerate(new.column(ROW).to_pylist())}
        for seq, name in enumerate(unit.replace_parts):
            old_record = await asyncio.to_thread(read_part_record, self.out, name)
            old = await asyncio.to_thread(read_part, self.out, name)
            if old_record is None:
                raise RuntimeError(f"{self.out.uri}/{name} has no tokenmill record in its footer")
            shard_rows = list(old_record.rows)
            old = old.append_column(ROW, pa.array(shard_rows, type=pa.int64()))
            take_new = [by_row.get(r) for r in shard_rows]
            keep_old = pa.array([i for i, n in enumerate(take_new) if n is None], pa.int64())
            fresh = pa.array([n for n in take_new if n is not None], pa.int64())
            merged = pa.concat_tables(
                [
                    conform(old.take(keep_old), _with_row(self.config.schema)),
                    conform(new.take(fresh), _with_row(self.config.schema)),
                ]
            )
            part = PartName(
                unit.shard.index, unit.run, REPLACEMENT_DISPATCH, _replacement_seq(unit, seq)
            )
            record = await asyncio.to_thread(
                write_part, self.out, part, merged, self.config.schema, self.actor_id, name
            )
            replaced = old_record.stats or RowStats.of_table(conform(old, self.config.schema))
            record = dataclasses.replace(record, replaced_stats=replaced, new_rows=len(fresh))
            yield PartWritten(record, self.account())


def _with_row(schema: pa.Schema) -> pa.Schema:
    return schema.insert(0, pa.field(ROW, pa.int64()))


def _replacement_seq(unit: WorkUnit, index: int) -> int:
    # Replacement parts of one shard and run must not collide across dispatches of that shard.
    return unit.dispatch * 100 + index


def reasoning_parser(fmt: str, model: Any, storage: Any) -> ReasoningParser | None:
    """The parser of prompt.reasoning over the model's tokenizer (None for none)."""
    if fmt == "none":
        return None

    return make_parser(fmt, load_tokenizer(model, storage))


def current_actor_id() -> str:
    import ray

    # get_runtime_context() would start a Ray instance when used outside one (tests, tools).
    if ray.is_initialized():
        actor_id = ray.get_runtime_context().get_actor_id()
        if actor_id:
            return actor_id
    return f"pid-{os.getpid()}"
