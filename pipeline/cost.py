"""Per-token cost accounting: engine time → per-row device-seconds, USD and list prices.

The model (docs/cost-accounting.md has the formulas and a worked example):

* An actor holds `devices` devices for its whole lifetime and pays for all of that time. A CPU
  actor (0 GPUs) counts as one device priced at `cost.device_hour_usd` (a CPU-hour price).
* Every second of that lifetime lands in exactly one bucket: `load` (model loading), a row's
  `gpu_seconds` (attributed), `pending` (engine work whose split is not known yet) or `idle`
  (nothing in the engine). Invariant: attributed + pending + idle + load == devices x lifetime.
* Engines with step records (reference engine): a step's duration is shared among the requests
  in it in proportion to `prefill_weight x prefill_tokens + decode_weight x decode_tokens`.
  The gap before a step (Python overhead between steps, a request waiting for the next step)
  is shared like that step, from the moment the earliest of its requests had arrived; the rest
  of the gap is idle. With all weights zero in a step, its requests share it equally.
* Engines with per-request intervals only (TensorRT-LLM): at every instant the engine's time is
  shared equally among the requests scheduled then (first_scheduled_time .. finish_time).
  A row's share is final once no request that arrived before its finish is still running.

`CostMeter` does this incrementally inside an engine actor (O(tokens listed) per step, O(log n)
per request for intervals); `split_steps` / `split_intervals` are the same rules as pure
functions, for tests and for re-deriving costs offline.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from engines.api import GenerationResult, StepRecord

if TYPE_CHECKING:
    import pyarrow as pa

    from pipeline.spec import CostSpec, JobSpec, ResourcesSpec

SECONDS_PER_HOUR = 3600.0
TOKENS_PER_MILLION = 1_000_000.0


def billed_devices(devices_per_actor: float) -> float:
    """Devices an actor pays for: its GPUs, or 1 (a CPU-actor-hour) when it holds none."""
    return float(devices_per_actor) if devices_per_actor > 0 else 1.0


# --- prices ----------------------------------------------------------------------------------


def cost_usd(gpu_seconds: float, cost_spec: CostSpec) -> float:
    """USD for `gpu_seconds` device-seconds at `cost_spec.device_hour_usd`."""
    return gpu_seconds * cost_spec.device_hour_usd / SECONDS_PER_HOUR


def list_price_usd(
    prompt_tokens: int, cached_prompt_tokens: int, completion_tokens: int, cost_spec: CostSpec
) -> float:
    """What a token-priced API would charge for one row (0.0 when no list prices are set).

    Cached prompt tokens are billed at `cached_input` (the input price when that is null); the
    batch discount applies to the whole row.
    """
    prices = cost_spec.price_per_million
    if prices is None:
        return 0.0
    cached = min(max(cached_prompt_tokens, 0), max(prompt_tokens, 0))
    uncached = max(prompt_tokens, 0) - cached
    cached_price = prices.input if prices.cached_input is None else prices.cached_input
    usd = (
        uncached * prices.input + cached * cached_price + max(completion_tokens, 0) * prices.output
    ) / TOKENS_PER_MILLION
    return usd * (1.0 - cost_spec.batch_discount)


@dataclass(frozen=True)
class RowCost:
    """The cost columns of one output row."""

    gpu_seconds: float  # device-seconds attributed to the row
    cost_usd: float  # gpu_seconds priced at cost.device_hour_usd
    list_price_usd: float  # the same tokens at the configured API list prices


def row_cost(
    gpu_seconds: float,
    prompt_tokens: int,
    cached_prompt_tokens: int,
    completion_tokens: int,
    cost_spec: CostSpec,
) -> RowCost:
    """All three cost columns for one row, from its device-seconds and token counts."""
    return RowCost(
        gpu_seconds=gpu_seconds,
        cost_usd=cost_usd(gpu_seconds, cost_spec),
        list_price_usd=list_price_usd(
            prompt_tokens, cached_prompt_tokens, completion_tokens, cost_spec
        ),
    )


# --- pure splits -----------------------------------------------------------------------------


def _step_weights(
    step: StepRecord, prefill_weight: float, decode_weight: float
) -> tuple[dict[str, float], float]:
    weights: dict[str, float] = {}
    for rid, n in step.prefill_tokens.items():
        weights[rid] = weights.get(rid, 0.0) + prefill_weight * max(n, 0)
    for rid, n in step.decode_tokens.items():
        weights[rid] = weights.get(rid, 0.0) + decode_weight * max(n, 0)
    total = math.fsum(weights.values())
    if total <= 0:
        # Nothing weighs anything (e.g. prefill weight 0 in a prefill-only step): share equally.
        weights = dict.fromkeys(weights, 1.0)
        total = float(len(weights))
    return weights, total


def split_steps(
    steps: Iterable[StepRecord],
    prefill_weight: float = 1.0,
    decode_weight: float = 1.0,
    arrivals: Mapping[str, float] | None = None,
    start: float | None = None,
) -> dict[str, float]:
    """Wall-seconds per request id from step records (multiply by devices for device-seconds).

    Each step's [start, end) is shared in proportion to weighted tokens. With `arrivals`
    (request id -> arrival time), the gap before each step — from the previous step's end (or
    `start` for the first step), but not before the earliest arrival among the step's requests
    — is shared like the step; without them gaps are not attributed. Steps are taken in the
    given order and clipped so that no instant counts twice.
    """
    seconds: dict[str, float] = {}
    cursor = -math.inf if start is None else start
    for step in steps:
        step_start = max(step.start, cursor)
        step_end = max(step.end, step_start)
        duration = step_end - step_start
        weights, total = _step_weights(step, prefill_weight, decode_weight)
        if weights and arrivals is not None and math.isfinite(cursor):
            earliest = min(arrivals.get(rid, step_start) for rid in weights)
            duration += max(0.0, step_start - max(cursor, earliest))
        cursor = step_end
        if not weights or duration <= 0:
            continue
        for rid, w in weights.items():
            seconds[rid] = seconds.get(rid, 0.0) + duration * (w / total)
    return seconds


def split_intervals(intervals: Mapping[str, tuple[float, float]]) -> dict[str, float]:
    """Wall-seconds per request id when at each instant the engine is shared equally among the
    requests whose [start, end) interval covers it (a sweep line over start/end events)."""
    events: list[tuple[float, int, str]] = []
    for rid, (s, e) in intervals.items():
        e = max(e, s)
        events.append((s, 0, rid))  # starts before ends at equal times: zero-length stays 0
        events.append((e, 1, rid))
    events.sort()
    seconds = dict.fromkeys(intervals, 0.0)
    active: set[str] = set()
    now = -math.inf
    for t, kind, rid in events:
        if active and t > now:
            share = (t - now) / len(active)
            for other in active:
                seconds[other] += share
        now = t
        if kind == 0:
            active.add(rid)
        else:
            active.discard(rid)
    return seconds


# --- the per-actor meter ---------------------------------------------------------------------


@dataclass
class ActorAccount:
    """Where one actor's device time went, in device-seconds (lifetime_s is wall seconds).

    attributed_s + pending_s + idle_s + load_s == devices x lifetime_s.
    """

    devices: float  # devices billed (1 for a CPU actor)
    lifetime_s: float  # wall seconds from actor start to the time of this account
    load_s: float  # device-seconds spent loading the model
    idle_s: float  # device-seconds with no request in the engine
    attributed_s: float  # device-seconds of rows whose share is final
    pending_s: float  # device-seconds of engine work not yet final (rows in flight)
    num_rows: int  # rows whose share is final
    actor_id: str = ""  # which actor (set by the caller; for reports)
    has_step_records: bool = True  # step-based split (True) or interval-based (False)

    @property
    def total_s(self) -> float:
        """Device-seconds paid for: devices x lifetime."""
        return self.devices * self.lifetime_s

    @property
    def busy_fraction(self) -> float:
        """Share of the paid time that went to rows (attributed + pending)."""
        total = self.total_s
        return (self.attributed_s + self.pending_s) / total if total > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ActorAccount:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class _IntervalSweep:
    """Incremental equal-share sweep line for interval-only engines.

    `share_clock` is the integral of 1/k(t) over busy time (k = requests scheduled): a request
    scheduled over [s, f] gets share_clock(f) - share_clock(s) wall-seconds, so each event costs
    O(log n) instead of touching every active request.
    """

    now: float  # the sweep has settled every instant before this
    share_clock: float = 0.0
    busy_s: float = 0.0  # wall-seconds settled with at least one request scheduled
    num_active: int = 0
    clock_at_start: dict[str, float] = field(default_factory=dict)
    events: list[tuple[float, int, str]] = field(default_factory=list)  # heap

    def push(self, rid: str, start: float, end: float) -> None:
        heapq.heappush(self.events, (start, 0, rid))
        heapq.heappush(self.events, (end, 1, rid))

    def advance(self, to: float, on_end: Callable[[str, float], None]) -> None:
        """Settle every instant before `to`; calls on_end(rid, wall_seconds) for ended ones."""
        while self.events and self.events[0][0] <= to:
            t, kind, rid = heapq.heappop(self.events)
            self._elapse(t)
            if kind == 0:
                self.num_active += 1
                self.clock_at_start[rid] = self.share_clock
            else:
                self.num_active -= 1
                on_end(rid, self.share_clock - self.clock_at_start.pop(rid))
        self._elapse(to)

    def _elapse(self, t: float) -> None:
        if t <= self.now:
            return
        if self.num_active:
            self.share_clock += (t - self.now) / self.num_active
            self.busy_s += t - self.now
        self.now = t


class CostMeter:
    """Attributes one actor's device time to the rows it serves, incrementally.

    Call order inside the actor:
      meter = CostMeter(devices, prefill_weight, decode_weight, start=time.monotonic(),
                        has_step_records=engine.info.has_step_records)
      meter.record_load(t0, t1)                  # once the engine is loaded, before any row
      meter.on_submit(request_id, t)             # just before engine.generate(request)
      meter.add_steps(engine.drain_step_records())  # often; and always before on_finish
      meter.on_finish(result)                    # when generate() returns
      if meter.is_final(rid): meter.pop_row_seconds(rid)  # -> the row's gpu_seconds
      meter.account(time.monotonic())            # for the manifest, at any time

    All times are the engine process's monotonic seconds. Shares are device-seconds (wall
    seconds x devices). Step-record engines record a request's steps before delivering its
    result, so a finished request is final once the caller has drained the step records.
    """

    def __init__(
        self,
        devices: float,
        prefill_weight: float = 1.0,
        decode_weight: float = 1.0,
        *,
        start: float,
        has_step_records: bool = True,
    ) -> None:
        if prefill_weight < 0 or decode_weight < 0:
            raise ValueError("cost weights must be >= 0 (cost.prefill_weight, cost.decode_weight)")
        self.devices = billed_devices(devices)
        self.prefill_weight = float(prefill_weight)
        self.decode_weight = float(decode_weight)
        self.start = start
        self.has_step_records = has_step_records
        self._load_s = 0.0  # wall seconds
        self._floor = start  # engine work is never counted before this (actor start, load end)
        self._accrued: dict[str, float] = {}  # wall seconds of rows not yet popped
        self._final: set[str] = set()  # rows whose share is final and not yet popped
        self._busy_s = 0.0  # wall seconds given to any row (step mode)
        self._final_s = 0.0  # wall seconds of rows that became final (popped or not)
        self._num_final = 0
        self._in_flight: dict[str, float] = {}  # request id -> arrival time
        # step mode
        self._cursor = start  # end of the last step taken into account
        # interval mode
        self._sweep = _IntervalSweep(now=start)
        self._arrival_heap: list[tuple[float, str]] = []  # lazy-deleted min-heap of arrivals
        self._max_finish = start

    # -- inputs --------------------------------------------------------------------------------

    def record_load(self, start: float, end: float) -> None:
        """Model loading took [start, end); call it before the first row is submitted."""
        begin = max(start, self._floor)
        if end > begin:
            self._load_s += end - begin
        self._floor = max(self._floor, end)
        self._cursor = max(self._cursor, self._floor)
        if not self.has_step_records and not self._in_flight:
            self._sweep.now = max(self._sweep.now, self._floor)

    def on_submit(self, request_id: str, t: float) -> None:
        """The request entered the engine at monotonic time t."""
        self._in_flight[request_id] = t
        if not self.has_step_records:
            heapq.heappush(self._arrival_heap, (t, request_id))

    def add_steps(self, steps: list[StepRecord]) -> None:
        """Share each step's time (and the busy gap before it) among its requests."""
        for step in steps:
            self._add_step(step)

    def _add_step(self, step: StepRecord) -> None:
        # The hot path (thousands of steps a minute): same rule as split_steps, with a fast
        # lane for pure decode steps and an early exit in the gap's arrival search.
        cursor = self._cursor
        step_start = max(step.start, cursor)
        step_end = max(step.end, step_start)
        self._cursor = step_end
        if not step.prefill_tokens and self.decode_weight > 0:
            weights: Mapping[str, float] = step.decode_tokens
            total = float(sum(weights.values()))
        else:
            weights, total = _step_weights(step, self.prefill_weight, self.decode_weight)
        if not weights:
            return
        if total <= 0:  # decode-only step listing zero tokens: share equally
            weights, total = dict.fromkeys(weights, 1.0), float(len(weights))
        duration = step_end - step_start
        if step_start > cursor:
            # The gap before the step counts from the earliest arrival among its requests.
            in_flight = self._in_flight
            earliest = step_start
            for rid in weights:
                arrival = in_flight.get(rid, step_start)
                if arrival <= cursor:
                    earliest = cursor
                    break
                earliest = min(earliest, arrival)
            duration += step_start - max(cursor, earliest)
        if duration <= 0:
            return
        accrued = self._accrued
        for rid, w in weights.items():
            # w / total first: stays finite for any weights, even denormal ones.
            accrued[rid] = accrued.get(rid, 0.0) + duration * (w / total)
        self._busy_s += duration

    def on_finish(self, result: GenerationResult) -> None:
        """The request left the engine; its timestamps are in result.metrics."""
        rid = result.request_id
        self._in_flight.pop(rid, None)
        if self.has_step_records:
            self._finalize(rid, self._accrued.pop(rid, 0.0))
            return
        metrics = result.metrics
        finish = None if metrics is None else metrics.finish_time
        scheduled = None if metrics is None else metrics.first_scheduled_time
        if finish is None or scheduled is None:
            # Never scheduled: it used no engine time, and it holds no one else's share back.
            self._finalize(rid, 0.0)
        else:
            # Clip to what is not yet settled (only matters if on_submit was skipped).
            begin = max(scheduled, self._floor, self._sweep.now)
            end = max(finish, begin)
            self._max_finish = max(self._max_finish, end)
            self._sweep.push(rid, begin, end)
        self._settle_intervals()

    # -- interval bookkeeping ------------------------------------------------------------------

    def _horizon(self) -> float:
        """Every request scheduled before this time has finished and been reported."""
        heap = self._arrival_heap
        while heap and heap[0][1] not in self._in_flight:
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def _settle_intervals(self, now: float | None = None) -> None:
        horizon = self._horizon()
        if math.isinf(horizon):
            horizon = self._max_finish if now is None else max(now, self._max_finish)
        self._sweep.advance(horizon, self._finalize)

    def _finalize(self, rid: str, wall_seconds: float) -> None:
        self._accrued[rid] = self._accrued.get(rid, 0.0) + wall_seconds
        self._final.add(rid)
        self._final_s += self._accrued[rid]
        self._num_final += 1

    # -- outputs -------------------------------------------------------------------------------

    def is_final(self, request_id: str) -> bool:
        """True once the row's share can no longer change (see the class docstring)."""
        return request_id in self._final

    def pop_row_seconds(self, request_id: str) -> float:
        """Device-seconds attributed to a final row; the meter forgets the row."""
        if request_id not in self._final:
            raise KeyError(
                f"request {request_id!r} has no final cost yet: call on_finish(result) first "
                "and check is_final(request_id) before popping"
            )
        self._final.discard(request_id)
        return self._accrued.pop(request_id, 0.0) * self.devices

    def account(self, now: float) -> ActorAccount:
        """Where the actor's time went from its start until `now` (monotonic)."""
        if self.has_step_records:
            end = max(now, self._cursor, self._floor)
            busy = self._busy_s
            unsplit = 0.0
            if self._in_flight:
                # Engine work since the last recorded step (or since the earliest arrival).
                earliest = min(self._in_flight.values())
                unsplit = max(0.0, end - max(self._cursor, earliest))
        else:
            self._settle_intervals(now)
            end = max(now, self._sweep.now, self._floor)
            busy = self._sweep.busy_s
            unsplit = end - max(self._sweep.now, self._floor) if self._in_flight else 0.0
        lifetime = end - self.start
        pending = busy - self._final_s + unsplit
        idle = lifetime - self._load_s - busy - unsplit
        d = self.devices
        return ActorAccount(
            devices=d,
            lifetime_s=lifetime,
            load_s=self._load_s * d,
            idle_s=max(idle, 0.0) * d,
            attributed_s=self._final_s * d,
            pending_s=max(pending, 0.0) * d,
            num_rows=self._num_final,
            has_step_records=self.has_step_records,
        )


# --- job totals and estimates ----------------------------------------------------------------


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
    """The sums of output rows (columns of pipeline.batch.schema.RESULT_FIELDS)."""
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


def _per_million(usd: float, tokens: float) -> float | None:
    return usd / tokens * TOKENS_PER_MILLION if tokens > 0 else None


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
        usd_per_million_input=_per_million(total_usd, prompt),
        usd_per_million_output=_per_million(total_usd, completion),
        usd_per_million_tokens=_per_million(total_usd, prompt + completion),
        output_tokens_per_s_per_device=completion / paid_s if paid_s > 0 else None,
        list_price_usd=list_usd,
        list_price_ratio=total_usd / list_usd if list_usd else None,
    )


@dataclass(frozen=True)
class CostEstimate:
    """A pre-flight estimate of a job's time and cost (`tokenmill plan`)."""

    num_rows: int
    prompt_tokens: int
    output_tokens: int  # expected completion tokens (e.g. rows x max_tokens: an upper bound)
    tokens_per_s: float  # output tokens per second per actor assumed
    num_actors: int
    devices_per_actor: float  # billed devices (1 for CPU actors)
    wall_s: float  # expected generation time with all actors busy (load time not included)
    device_hours: float
    usd: float  # device_hours x device_hour_usd
    usd_per_million_output: float | None  # usd per 1M output tokens
    list_price_usd: float | None  # the same tokens at the list prices (None: none set)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def estimate_cost(
    spec: JobSpec, num_rows: int, prompt_tokens: int, output_tokens: int, tokens_per_s: float
) -> CostEstimate:
    """Estimate time and cost from token counts and an assumed per-actor output throughput.

    wall = output_tokens / (tokens_per_s x actors); cost = devices x actors x wall x price.
    Autoscaling pools are estimated at max_actors (the fastest, same device-hours).
    """
    return estimate_for_resources(
        spec.resources, spec.cost, num_rows, prompt_tokens, output_tokens, tokens_per_s
    )


def estimate_for_resources(
    resources: ResourcesSpec,
    cost_spec: CostSpec,
    num_rows: int,
    prompt_tokens: int,
    output_tokens: int,
    tokens_per_s: float,
) -> CostEstimate:
    """`estimate_cost` from the two spec sections it reads (the report re-parses only these)."""
    if tokens_per_s <= 0:
        raise ValueError(
            f"tokens_per_s must be > 0 (output tokens per second per actor), got {tokens_per_s}"
        )
    num_actors = resources.num_actors or resources.max_actors or 1
    devices = billed_devices(resources.devices_per_actor)
    wall_s = output_tokens / (tokens_per_s * num_actors)
    device_hours = devices * num_actors * wall_s / SECONDS_PER_HOUR
    usd = device_hours * cost_spec.device_hour_usd
    has_list = cost_spec.price_per_million is not None
    return CostEstimate(
        num_rows=num_rows,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        tokens_per_s=tokens_per_s,
        num_actors=num_actors,
        devices_per_actor=devices,
        wall_s=wall_s,
        device_hours=device_hours,
        usd=usd,
        usd_per_million_output=_per_million(usd, output_tokens),
        list_price_usd=list_price_usd(prompt_tokens, 0, output_tokens, cost_spec)
        if has_list
        else None,
    )
