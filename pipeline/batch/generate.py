"""The generate stage: a pool of engine actors behind Ray Data's `map_batches`.

Each actor loads one engine once (`open_engine`; an s3:// model is downloaded once per node)
and keeps it full: `__call__` is a coroutine, Ray Data runs it on the actor's event loop, and
several batches are in flight per actor at once (`max_concurrent_calls_per_actor` tasks, each
with a few batches), so the next batch's rows enter the engine while the last rows of the
previous one are still decoding. A semaphore caps the requests in the engine at
`resources.max_in_flight` across all of them.

Per row: SamplingParams from the row's columns (set by the prompt stage) and the job's stop
settings; a row that already carries an `error` (bad input, too long) skips the engine; an
exception while serving one row becomes that row's error, never a failed batch. Only a dead
engine (EngineDeadError) ends the actor process, so that Ray restarts it
(`resources.max_restarts`) and retries its unfinished batches (`resources.max_task_retries`).

Output rows are in the schema of pipeline.batch.commit.parts (input order within each batch), plus
one `actor_account` column: the actor's cost account as JSON on the batch's last row (null on the
others), which the driver collects for idle/load totals and strips before writing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import logging
import math
import os
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from engines.api import EngineDeadError, GenerationRequest, GenerationResult, SamplingParams
from pipeline.spec import CostSpec, EngineSpec, JobSpec, ModelSpec, SamplingSpec, StorageSpec

logger = logging.getLogger(__name__)

ACCOUNT_COLUMN = "actor_account"  # JSON of the actor's cost account; not an output column


@dataclass(frozen=True)
class GenerateConfig:
    """What an engine actor needs from the job spec (small, picklable)."""

    model: ModelSpec
    engine: EngineSpec
    storage: StorageSpec
    sampling: SamplingSpec
    cost: CostSpec
    passthrough: tuple[str, ...]  # input columns copied to the output
    include_token_ids: bool  # also emit completion_token_ids
    max_in_flight: int  # requests in the engine at once, across batches
    devices: float  # devices per actor (0: a CPU actor)
    budget: Any = None  # pipeline.batch.budget actor shared by the run's actors; None: no budget

    @classmethod
    def from_spec(cls, spec: JobSpec) -> GenerateConfig:
        return cls(
            model=spec.model,
            engine=spec.engine,
            storage=spec.storage,
            sampling=spec.sampling,
            cost=spec.cost,
            passthrough=tuple(spec.input.passthrough_columns),
            include_token_ids=spec.output.include_token_ids,
            max_in_flight=spec.resources.max_in_flight,
            devices=spec.resources.devices_per_actor,
        )


# --- per-row sampling ------------------------------------------------------------------------


def row_sampling(row: dict[str, Any], sampling: SamplingSpec) -> SamplingParams:
    """SamplingParams for one row: its own columns (prompt stage) over the job's defaults.

    Raises ValueError naming the field when a row's value is invalid.
    """

    def pick(name: str, default: Any) -> Any:
        value = row.get(name)
        return default if value is None else value

    # The prompt stage fills `seed`: the row's override, or one derived from (sampling.seed, id).
    seed = row.get("seed")
    if seed is None and sampling.seed is not None and "seed" not in row:
        from pipeline.batch.prompts import derive_seed

        seed = derive_seed(sampling.seed, str(row["id"]))
    return SamplingParams(
        max_tokens=int(pick("max_tokens", sampling.max_tokens)),
        temperature=float(pick("temperature", sampling.temperature)),
        top_p=float(pick("top_p", sampling.top_p)),
        top_k=int(pick("top_k", sampling.top_k)),
        seed=None if seed is None else int(seed),
        stop=tuple(sampling.stop),
        stop_token_ids=tuple(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
    )


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
    def from_result(cls, result: GenerationResult, gpu_seconds: float) -> RowOutcome:
        m = result.metrics
        return cls(
            text=result.text,
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


def _prompt_tokens_of(row: dict[str, Any]) -> int:
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
    account_json: str | None,
) -> pa.Table:
    """The output table of one batch: id, passthrough columns, result columns, account."""
    from pipeline.batch.commit.parts import RESULT_FIELDS, TOKEN_IDS_FIELD
    from pipeline.cost import row_cost

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
    columns: dict[str, pa.Array | pa.ChunkedArray] = {"id": batch.column("id").cast(pa.string())}
    for name in config.passthrough:
        columns[name] = batch.column(name)
    for f in RESULT_FIELDS:
        columns[f.name] = pa.array(values[f.name], type=f.type)
    if config.include_token_ids:
        columns[TOKEN_IDS_FIELD.name] = pa.array(
            [o.completion_token_ids for o in outcomes], type=TOKEN_IDS_FIELD.type
        )
    accounts = [None] * n
    if n:
        accounts[-1] = account_json
    columns[ACCOUNT_COLUMN] = pa.array(accounts, type=pa.string())
    return pa.table(columns)


# --- the actor -------------------------------------------------------------------------------


class GenerateStage:
    """Ray Data callable class: one engine per actor, many requests in flight."""

    def __init__(self, config: GenerateConfig):
        from pipeline.cost import CostMeter
        from pipeline.engine_setup import open_engine

        started = time.monotonic()
        self.config = config
        self.engine = open_engine(config.model, config.engine, config.storage)
        self.meter = CostMeter(
            config.devices,
            config.cost.prefill_weight,
            config.cost.decode_weight,
            start=started,
            has_step_records=self.engine.info.has_step_records,
        )
        self.meter.record_load(started, time.monotonic())
        self.actor_id = _actor_id()
        self.incarnation = uuid.uuid4().hex[:12]  # a restarted actor keeps its actor id
        # asyncio primitives bind to the loop that first uses them: made lazily in __call__,
        # which Ray Data runs on the actor's one UDF event loop.
        self._slots: asyncio.Semaphore | None = None
        self._finished: asyncio.Condition | None = None

    async def __call__(self, batch: pa.Table) -> pa.Table:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.max_in_flight)
            self._finished = asyncio.Condition()
        rows = batch.to_pylist()
        if self.config.budget is not None:
            # Rows refused by the budget are left out of the output, so a rerun generates them.
            admitted = await self._admit(rows)
            if not all(admitted):
                batch = batch.filter(pa.array(admitted, pa.bool_()))
                rows = [row for row, ok in zip(rows, admitted, strict=True) if ok]
        results = await asyncio.gather(*(self._serve(row) for row in rows), return_exceptions=True)
        outcomes = [self._as_outcome(row, r) for row, r in zip(rows, results, strict=True)]
        account = self._account()
        table = outcomes_to_table(
            batch,
            outcomes,
            self.config,
            self.actor_id,
            self.engine.info.kind,
            json.dumps(account),
        )
        if self.config.budget is not None:
            self._report_spend(table, account)
        return table

    async def _admit(self, rows: list[dict[str, Any]]) -> list[bool]:
        from pipeline.batch.budget import RowAdmission

        asks = [
            RowAdmission(
                row_id=str(row["id"]),
                prompt_tokens=_prompt_tokens_of(row),
                max_tokens=int(row.get("max_tokens") or self.config.sampling.max_tokens),
            )
            for row in rows
        ]
        return await self.config.budget.admit.remote(asks)

    def _report_spend(self, table: pa.Table, account: dict[str, Any]) -> None:
        """Tell the budget what this batch's rows cost and what this actor has cost so far
        (fire and forget: the budget actor applies calls in order)."""
        from pipeline.batch.budget import RowSpend

        spends = [
            RowSpend(row_id=str(rid), cost_usd=cost or 0.0, tokens=(p or 0) + (c or 0))
            for rid, cost, p, c in zip(
                table.column("id").to_pylist(),
                table.column("cost_usd").to_pylist(),
                table.column("prompt_tokens").to_pylist(),
                table.column("completion_tokens").to_pylist(),
                strict=True,
            )
        ]
        paid_usd = account["devices"] * account["lifetime_s"] * self.config.cost.device_hour_usd
        self.config.budget.finish.remote(spends)
        self.config.budget.report_spend.remote(
            f"{self.actor_id}/{self.incarnation}", paid_usd / 3600.0
        )

    @staticmethod
    def _as_outcome(row: dict[str, Any], result: RowOutcome | BaseException) -> RowOutcome:
        """A row whose serving raised is that row's error; the rest of the batch stands."""
        if isinstance(result, RowOutcome):
            return result
        if not isinstance(result, Exception):  # cancellation, interpreter exit: not a row's
            raise result
        logger.exception("row %r failed", row.get("id"), exc_info=result)
        message = f"internal error serving the row: {type(result).__name__}: {result}"
        return RowOutcome.failed(message, _prompt_tokens_of(row), served=True)

    def _account(self) -> dict[str, Any]:
        account = self.meter.account(time.monotonic())
        account.actor_id = self.actor_id
        return {**account.to_dict(), "incarnation": self.incarnation}

    async def _serve(self, row: dict[str, Any]) -> RowOutcome:
        prompt_tokens = _prompt_tokens_of(row)
        if row.get("error"):
            return RowOutcome.failed(str(row["error"]), prompt_tokens, served=False)
        try:
            sampling = row_sampling(row, self.config.sampling)
        except (ValueError, TypeError) as exc:
            return RowOutcome.failed(f"row {row['id']!r}: {exc}", prompt_tokens, served=False)
        token_ids = row.get("prompt_token_ids")
        if not token_ids:
            return RowOutcome.failed("empty prompt (no tokens)", prompt_tokens, served=False)
        request = GenerationRequest(
            prompt_token_ids=[int(t) for t in token_ids],
            sampling=sampling,
            # Unique even if an input repeats an id: the engine keys requests by this.
            request_id=f"{row['id']}#{uuid.uuid4().hex[:8]}",
        )
        assert self._slots is not None and self._finished is not None
        async with self._slots:
            self.meter.on_submit(request.request_id, time.monotonic())
            result = await self._generate(request)
        self.meter.add_steps(self.engine.drain_step_records())
        self.meter.on_finish(result)
        async with self._finished:
            self._finished.notify_all()
            # Interval-only engines: a row's share is final once every earlier-arrived request
            # has finished too.
            await self._finished.wait_for(lambda: self.meter.is_final(request.request_id))
        gpu_seconds = self.meter.pop_row_seconds(request.request_id)
        return RowOutcome.from_result(result, gpu_seconds)

    async def _generate(self, request: GenerationRequest) -> GenerationResult:
        try:
            return await self.engine.generate(request)
        except EngineDeadError as exc:
            # Nothing more can be served here. Ending the process (not raising) makes Ray
            # restart the actor and retry this batch; a raised error would fail the job.
            logger.error("engine died (%s); exiting so the actor is restarted", exc)
            os._exit(70)
        except Exception as exc:
            return GenerationResult.without_output(
                request, "error", error=f"{type(exc).__name__}: {exc}"
            )


def _actor_id() -> str:
    import ray

    # get_runtime_context() would start a Ray instance when used outside one (tests, tools).
    if ray.is_initialized():
        actor_id = ray.get_runtime_context().get_actor_id()
        if actor_id:
            return actor_id
    return f"pid-{os.getpid()}"


# --- wiring into a dataset -------------------------------------------------------------------


def concurrent_tasks_per_actor(batch_size: int, max_in_flight: int) -> int:
    """Blocks handed to one actor at once: enough batches to fill max_in_flight, plus one so
    the next block is already waiting when one ends."""
    return max(2, math.ceil(max_in_flight / batch_size) + 1)


def add_generate_stage(ds: Any, spec: JobSpec, budget: Any = None) -> Any:
    """`ds.map_batches(GenerateStage, ...)` with the pool, resources and retry limits."""
    import ray.data

    res = spec.resources
    tasks = concurrent_tasks_per_actor(res.batch_size, res.max_in_flight)
    if res.num_actors is not None:
        pool: dict[str, int] = {"size": res.num_actors}
    else:
        pool = {"min_size": res.min_actors or 1, "max_size": res.max_actors or 1}
    compute = ray.data.ActorPoolStrategy(
        **pool, max_tasks_in_flight_per_actor=tasks, max_concurrent_calls_per_actor=tasks
    )
    remote_args: dict[str, Any] = {
        # Ray's defaults are infinite: a batch that kills its actor would loop forever.
        "max_restarts": res.max_restarts,
        "max_task_retries": res.max_task_retries,
    }
    with warnings.catch_warnings():
        # Ray 2.60 deprecates **ray_remote_args but offers no named max_restarts yet.
        warnings.simplefilter("ignore", DeprecationWarning)
        return ds.map_batches(
            GenerateStage,
            fn_constructor_kwargs={
                "config": dataclasses.replace(GenerateConfig.from_spec(spec), budget=budget)
            },
            batch_size=res.batch_size,
            batch_format="pyarrow",
            zero_copy_batch=True,
            compute=compute,
            num_cpus=res.cpus_per_actor,
            num_gpus=res.devices_per_actor or None,
            **remote_args,
        )
