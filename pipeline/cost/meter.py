"""The cost split: one actor's engine time → per-row device-seconds (wall seconds x devices).

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
from typing import Any

from engines.api import GenerationResult, StepRecord
from pipeline.cost.prices import billed_devices

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
