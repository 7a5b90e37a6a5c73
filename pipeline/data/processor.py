"""`build_processor`: tokenmill's engines as a step of a Ray Data pipeline.

    processor = build_processor(config, preprocess=..., postprocess=...)
    ds = processor(ds)            # lazy, like any Ray Data transform
    ds.write_parquet(...)         # or take, iter_batches, ...
    processor.accounts()          # per engine actor: where its device time went

`processor(ds)` is `ds.map(preprocess)` → `ds.map_batches(EngineStage, compute=ActorPoolStrategy
(min_actors..max_actors))` → `ds.map(postprocess)`. Each `EngineStage` actor loads one engine
(`open_engine`, as the batch path's engine actors do) and the tokenizer, and per batch:

- reads the id and prompt columns (`ProcessorConfig.input`) into the batch path's read
  columns (a column it needs but the batch lacks makes the row an error row naming it);
- renders and tokenizes each row with the batch path's prompt stage (`PromptStage`);
- serves every row at once through `RowServer`, at most `resources.max_in_flight` requests
  in the engine across the batches the actor works on (Ray Data runs a few batches of each
  of two blocks at once on the actor's event loop, so the next rows enter the engine while
  the last rows of earlier batches decode);
- returns the batch's columns with `id` and the result columns of `tokenmill run`'s output
  (pipeline.batch.stages.schema) added; a result column replaces an input column of the same name.

A bad row is an error row (`finish_reason` error, `error` says why), never a failed Dataset.

Cost: each actor keeps the batch path's books (pipeline.cost.CostMeter: rows + idle + load =
devices x lifetime) and reports its account, after loading and after every batch, to one
small actor per processor (`AccountBook`), which `Processor.accounts()` reads. An account is
as of the actor's last report: the idle time between its last batch and its exit is not in it.

Semantics are Ray Data's: a batch whose actor dies is run again on another actor (up to
resources.max_task_retries), so a row can be generated, and paid for, more than once, and
what a write of the Dataset leaves behind after a failure is Ray Data's business. For
exactly-once output, write the rows as Parquet and run `tokenmill run` on them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines import faults
from pipeline.cost import ActorAccount, CostMeter
from pipeline.data.config import ProcessorConfig, processor_config
from pipeline.engine_setup import open_engine

if TYPE_CHECKING:
    import pyarrow as pa
    from ray.data import Dataset

    from pipeline.cost import ActorAccount
    from pipeline.spec import JobSpec

RowFn = Callable[[dict[str, Any]], dict[str, Any]]


def build_processor(
    config: ProcessorConfig | dict[str, Any] | str | Path,
    *,
    preprocess: RowFn | None = None,
    postprocess: RowFn | None = None,
) -> Processor:
    """A `Dataset -> Dataset` step that generates with tokenmill's engines (module docstring).

    `config`: a ProcessorConfig, a dict of its sections (prompt, model, engine, sampling,
    resources, cost, storage, input columns), or a job YAML path (its input columns and
    those sections). `preprocess` / `postprocess`: row functions run before and after
    generation (Ray Data `map`). Raises SpecError for an invalid config, before any actor
    starts."""
    # lazy: importing pipeline.data loads no pyarrow or Ray (a Ray Data driver imports it at start)
    from pipeline.batch.interface.dataset import check_job_tools, check_reasoning

    checked = processor_config(config)
    job = checked.job_spec()
    check_reasoning(job)  # prompt.reasoning's tokens, before any actor
    check_job_tools(job)  # prompt.tools' schemas and choice
    return Processor(checked, preprocess, postprocess)


class Processor:
    """The callable `build_processor` returns; see the module docstring."""

    def __init__(
        self, config: ProcessorConfig, preprocess: RowFn | None, postprocess: RowFn | None
    ) -> None:
        self.config = config
        self.preprocess = preprocess
        self.postprocess = postprocess
        self._book: Any = None  # the AccountBook actor, made on the first call

    def __call__(self, ds: Dataset) -> Dataset:
        import ray
        from ray.data import ActorPoolStrategy

        if self._book is None:
            self._book = ray.remote(AccountBook).options(num_cpus=0).remote()
        res = self.config.resources
        if self.preprocess is not None:
            ds = ds.map(self.preprocess)
        hooks = faults.forwarded_env()  # empty outside tests
        with warnings.catch_warnings():
            # Ray Data's actor defaults restart a dead actor and retry its batch forever: a
            # batch that kills its engine would never end. Ray 2.60 takes the limits only as
            # extra remote arguments, which it marks deprecated without a replacement yet.
            warnings.filterwarnings(
                "ignore", message="`ray_remote_args` is deprecated", category=DeprecationWarning
            )
            ds = ds.map_batches(
                EngineStage,
                fn_constructor_kwargs={"config": self.config, "book": self._book},
                batch_format="pyarrow",
                batch_size=res.batch_size,
                compute=ActorPoolStrategy(
                    min_size=res.num_actors or res.min_actors,
                    max_size=res.num_actors or res.max_actors,
                    # Two Ray Data tasks (blocks) at once per actor, as the batch path's actors
                    # run two shards: the next block's rows enter the engine while the last
                    # rows of the previous one decode. Both run on the actor's one event loop.
                    max_concurrent_calls_per_actor=2,
                ),
                num_cpus=res.cpus_per_actor,
                num_gpus=res.devices_per_actor or None,
                resources=dict(res.actor_resources) or None,
                runtime_env={"env_vars": hooks} if hooks else None,
                max_restarts=res.max_restarts,
                max_task_retries=res.max_task_retries,
            )
        if self.postprocess is not None:
            ds = ds.map(self.postprocess)
        return ds

    def accounts(self) -> list[ActorAccount]:
        """Per engine actor this processor started (on every Dataset it made, each time one
        was executed): its device time as of its last batch. attributed_s + pending_s +
        idle_s + load_s == devices x lifetime_s for each. [] before any actor started."""
        import ray

        if self._book is None:
            return []
        return [ActorAccount.from_dict(a) for a in ray.get(self._book.accounts.remote())]

    def arrivals(self) -> dict[str, tuple[float, float]]:
        """Test hook data (TOKENMILL_TEST_PROCESSOR_BARRIER): per engine actor that reached
        the barrier, (monotonic time its constructor started, time of its first batch)."""
        import ray

        return {} if self._book is None else ray.get(self._book.arrivals.remote())


class AccountBook:
    """Ray actor: the latest account of each engine actor of one processor."""

    def __init__(self) -> None:
        self._accounts: dict[str, dict[str, Any]] = {}  # actor id/incarnation -> account
        # actor id -> (constructor start, first batch), monotonic; test hook only
        self._arrivals: dict[str, tuple[float, float]] = {}

    def report(self, key: str, account: dict[str, Any]) -> None:
        self._accounts[key] = account

    def accounts(self) -> list[dict[str, Any]]:
        return [self._accounts[key] for key in sorted(self._accounts)]

    def arrive(self, actor_id: str, started: float, now: float) -> int:
        """Test hook (TOKENMILL_TEST_PROCESSOR_BARRIER): `actor_id` has a batch; returns how
        many engine actors have had one."""
        self._arrivals.setdefault(actor_id, (started, now))
        return len(self._arrivals)

    def arrivals(self) -> dict[str, tuple[float, float]]:
        return dict(self._arrivals)


class EngineStage:
    """Ray Data actor (map_batches): one engine, many requests in flight; see the module
    docstring."""

    def __init__(self, config: ProcessorConfig, book: Any) -> None:
        import ray

        # lazy: importing pipeline.data loads no pyarrow or Ray (a Ray Data driver imports it at...
        from pipeline.batch.interface.dataset import (
            GenerateConfig,
            PromptStage,
            RowServer,
            current_actor_id,
            job_output_schema,
            reasoning_parser,
        )

        started = time.monotonic()
        spec = config.job_spec()
        self.spec = spec
        self.prompts = PromptStage(spec)
        self.engine = open_engine(
            spec.model, spec.engine, spec.storage, devices=spec.resources.devices_per_actor
        )
        self.meter = CostMeter(
            spec.resources.devices_per_actor,
            spec.cost.prefill_weight,
            spec.cost.decode_weight,
            start=started,
            has_step_records=self.engine.info.has_step_records,
        )
        self.meter.record_load(started, time.monotonic())
        # The prompt stage's tokenizer is the model's: it also splits reasoning outputs.
        parser = reasoning_parser(spec.prompt.reasoning, spec.model, spec.storage)
        self.rows = RowServer(
            self.engine, self.meter, spec.sampling, reasoning=parser, embed=spec.embed_params
        )
        self.output = GenerateConfig.from_spec(spec, job_output_schema(spec))
        self.actor_id = current_actor_id()
        self.key = f"{self.actor_id}/{uuid.uuid4().hex[:12]}"  # a restart keeps the actor id
        self.book = book
        self.started = started
        self._barrier = faults.processor_barrier()  # 0 outside tests
        self._slots: asyncio.Semaphore | None = None  # made on the event loop that uses it
        ray.get(self._report())  # a loaded actor is paid for even if it never gets a batch

    async def __call__(self, batch: pa.Table) -> AsyncIterator[pa.Table]:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.spec.resources.max_in_flight)
        slots = self._slots
        if self._barrier:
            await self._wait_for_peers()
        prepared = prepare_rows(batch, self.spec, self.prompts)

        async def serve(row: dict[str, Any]) -> Any:
            async with slots:
                return await self.rows.serve(row)

        outcomes = await asyncio.gather(*(serve(row) for row in prepared))
        table = output_table(batch, prepared, outcomes, self)
        # Landed before the batch is returned: once a Dataset is consumed, the book holds
        # every batch's account.
        await self._report()
        yield table

    def account(self) -> dict[str, Any]:
        account = self.meter.account(time.monotonic())
        account.actor_id = self.actor_id
        return account.to_dict()

    async def _wait_for_peers(self) -> None:
        """Test hook: hold this batch until `_barrier` engine actors have had a batch."""
        book = self.book
        while await book.arrive.remote(self.actor_id, self.started, time.monotonic()) < (
            self._barrier
        ):
            await asyncio.sleep(0.05)

    def _report(self) -> Any:
        return self.book.report.remote(self.key, self.account())


# --- rows in, rows out -------------------------------------------------------------------------


def derived_id(row: dict[str, Any], sources: list[str]) -> str:
    """An id from the values of the prompt's columns: the same prompt, the same id."""
    text = json.dumps([row.get(c) for c in sources], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prepare_rows(batch: pa.Table, spec: JobSpec, prompts: Any) -> list[dict[str, Any]]:
    """The batch's rows as the row server takes them: the batch's columns (template
    variables), the read columns (`_row`, id, prompt, messages, error, coerced override
    sources) and the prompt stage's (token ids, sampling values, error)."""
    # lazy: importing pipeline.data loads no pyarrow or Ray (a Ray Data driver imports it at start)
    from pipeline.batch.interface.dataset import (
        ADAPTER,
        ERROR,
        ID,
        MESSAGES,
        PROMPT,
        ROW,
        adapter_cell,
        apply_overrides,
        columns_needed,
        messages_value,
        text_prompt,
    )

    inp = spec.input
    needed = columns_needed(spec)
    missing = [c for c in needed if c not in batch.column_names]
    problem = None
    if missing:
        fields = ", ".join(f"{c!r} ({needed[c]})" for c in missing)
        problem = f"column(s) {fields} not found; the Dataset has {batch.column_names[:20]}"
    sources = [c for c in (inp.prompt_column, inp.messages_column) if c]
    sources += spec.prompt_columns()
    prepared = []
    for position, values in enumerate(batch.to_pylist()):
        row: dict[str, Any] = {**values, ROW: position, PROMPT: None, MESSAGES: None}
        row[ERROR] = problem
        row_id = values.get(inp.id_column) if inp.id_column else derived_id(values, sources)
        if row_id is None:
            row[ID] = derived_id(values, sources)
            if problem is None and inp.id_column in batch.column_names:
                row[ERROR] = f"id column {inp.id_column!r} is null"
        else:
            row[ID] = str(row_id)
        where = f"row {row[ID]!r}"
        if inp.prompt_column and inp.prompt_column in values:
            text_prompt(row, inp.prompt_column, values[inp.prompt_column], where)
        if inp.messages_column and inp.messages_column in values:
            messages_value(row, inp.messages_column, values[inp.messages_column], where)
        if spec.model.has_adapters:
            row[ADAPTER] = None
            if inp.adapter_column and inp.adapter_column in values:
                adapter_cell(spec, row, values[inp.adapter_column], where)
        apply_overrides(spec, row, values, where)
        prepared.append(row)
    # The batch's prompts rendered and tokenized together, as a `tokenmill run` shard's are.
    for row, stage in zip(prepared, prompts.process_rows(prepared), strict=True):
        row.update(stage)
    return prepared


def output_table(
    batch: pa.Table, prepared: list[dict[str, Any]], outcomes: list[Any], stage: EngineStage
) -> pa.Table:
    """The batch's own columns, then `id` and the result columns (which win a name clash)."""
    import pyarrow as pa

    # lazy: importing pipeline.data loads no pyarrow or Ray (a Ray Data driver imports it at start)
    from pipeline.batch.interface.dataset import ADAPTER, ID, ROW, outcomes_to_table

    columns = {
        ROW: pa.array([row[ROW] for row in prepared], pa.int64()),
        ID: pa.array([row[ID] for row in prepared], pa.string()),
    }
    if stage.output.adapters:  # each row's adapter, for the `adapter` result column
        columns[ADAPTER] = pa.array([row.get(ADAPTER) for row in prepared], pa.string())
    keys = pa.table(columns)
    results = outcomes_to_table(
        keys, outcomes, stage.output, stage.actor_id, stage.engine.info.kind
    )
    results = results.drop_columns([ROW])
    kept = [name for name in batch.column_names if name not in results.column_names]
    table = batch.select(kept)
    for name in results.column_names:
        table = table.append_column(results.schema.field(name), results.column(name))
    return table
