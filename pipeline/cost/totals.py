"""Job totals: the additive sums of rows (per part, per job) and a job's cost figures from
those sums and its actors' accounts. USD figures are all-in: idle and load time are paid too."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pipeline.cost.meter import ActorAccount
from pipeline.cost.prices import SECONDS_PER_HOUR, per_million

if TYPE_CHECKING:
    import pyarrow as pa

    from pipeline.spec import CostSpec

# Sums kept per part (the manifest's part records) and per job.
SUM_FIELDS = (
    "rows",
    "errors",
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
    "gpu_seconds",
    "cost_usd",
    "list_price_usd",
)


@dataclass
class RowSums:
    """Additive counts of a set of rows (one part, or the whole job)."""

    rows: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    gpu_seconds: float = 0.0
    cost_usd: float = 0.0
    list_price_usd: float = 0.0

    def add(self, other: RowSums, sign: int = 1) -> None:
        for name in SUM_FIELDS:
            setattr(self, name, getattr(self, name) + sign * getattr(other, name))

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in SUM_FIELDS}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RowSums:
        return cls(**{name: data.get(name, 0) for name in SUM_FIELDS})


def row_sums(rows: pa.Table) -> RowSums:
    """The sums of output rows (columns of pipeline.batch.stages.schema.RESULT_FIELDS)."""
    import pyarrow.compute as pc

    if rows.num_rows == 0:
        return RowSums()
    errors = 0
    if "finish_reason" in rows.column_names:
        errors = int(pc.sum(pc.equal(rows.column("finish_reason"), "error")).as_py() or 0)
    return RowSums(
        rows=rows.num_rows,
        errors=errors,
        prompt_tokens=int(_column_sum(rows, "prompt_tokens")),
        cached_prompt_tokens=int(_column_sum(rows, "cached_prompt_tokens")),
        completion_tokens=int(_column_sum(rows, "completion_tokens")),
        gpu_seconds=_column_sum(rows, "gpu_seconds"),
        cost_usd=_column_sum(rows, "cost_usd"),
        list_price_usd=_column_sum(rows, "list_price_usd"),
    )


@dataclass(frozen=True)
class CostTotals:
    """Job-level cost figures for the manifest and the report. USD figures are all-in: they
    include idle and load time, because that time is paid for too."""

    num_rows: int  # rows in the output (ok and error)
    num_actors: int
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    device_hours: float  # sum over actors of devices x lifetime, in hours
    total_usd: float  # device_hours x device_hour_usd: what the job cost
    rows_usd: float  # sum of the rows' cost_usd
    idle_usd: float
    load_usd: float
    pending_usd: float  # nonzero only if an actor stopped with rows in flight
    row_gpu_seconds: float  # sum of the rows' gpu_seconds
    idle_s: float  # device-seconds
    load_s: float  # device-seconds
    pending_s: float  # device-seconds in flight when an actor's last account was taken
    busy_fraction: float  # (attributed + pending) / paid device time
    usd_per_million_input: float | None  # total_usd per 1M prompt tokens (None: no tokens)
    usd_per_million_output: float | None  # total_usd per 1M completion tokens
    usd_per_million_tokens: float | None  # total_usd per 1M prompt + completion tokens
    output_tokens_per_s_per_device: float | None  # completion tokens / paid device-seconds
    list_price_usd: float | None  # sum of rows' list_price_usd (None: no list prices set)
    list_price_ratio: float | None  # total_usd / list_price_usd: < 1 means cheaper than the API

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _column_sum(rows: pa.Table, name: str) -> float:
    import pyarrow.compute as pc

    if name not in rows.column_names or rows.num_rows == 0:
        return 0.0
    value = pc.sum(rows.column(name)).as_py()
    return float(value or 0.0)


def job_totals(rows: RowSums, accounts: list[ActorAccount], cost_spec: CostSpec) -> CostTotals:
    """A job's cost figures from the sums of its rows and its actors' accounts."""
    price = cost_spec.device_hour_usd / SECONDS_PER_HOUR  # USD per device-second
    paid_s = math.fsum(a.total_s for a in accounts)
    idle_s = math.fsum(a.idle_s for a in accounts)
    load_s = math.fsum(a.load_s for a in accounts)
    pending_s = math.fsum(a.pending_s for a in accounts)
    busy_s = math.fsum(a.attributed_s + a.pending_s for a in accounts)
    prompt, completion = rows.prompt_tokens, rows.completion_tokens
    total_usd = paid_s * price
    list_usd = rows.list_price_usd if cost_spec.price_per_million is not None else None
    return CostTotals(
        num_rows=rows.rows,
        num_actors=len(accounts),
        prompt_tokens=prompt,
        cached_prompt_tokens=rows.cached_prompt_tokens,
        completion_tokens=completion,
        device_hours=paid_s / SECONDS_PER_HOUR,
        total_usd=total_usd,
        rows_usd=rows.cost_usd,
        idle_usd=idle_s * price,
        load_usd=load_s * price,
        pending_usd=pending_s * price,
        row_gpu_seconds=rows.gpu_seconds,
        idle_s=idle_s,
        load_s=load_s,
        pending_s=pending_s,
        busy_fraction=busy_s / paid_s if paid_s > 0 else 0.0,
        usd_per_million_input=per_million(total_usd, prompt),
        usd_per_million_output=per_million(total_usd, completion),
        usd_per_million_tokens=per_million(total_usd, prompt + completion),
        output_tokens_per_s_per_device=completion / paid_s if paid_s > 0 else None,
        list_price_usd=list_usd,
        list_price_ratio=total_usd / list_usd if list_usd else None,
    )
