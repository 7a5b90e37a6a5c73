"""A simulated Ray for the driver's scheduler: a fleet of thousands of actors in one process.

The scheduler (pipeline.batch.driver.scheduler) takes its `runtime` as a parameter; this module is a
stand-in for it and for the actor handles. Every call on a simulated handle returns a `SimRef`
(or, for `run_unit`, a `SimStream`) that completes at a simulated time; `wait` jumps the
simulated clock straight to the next completion among the refs it is given (an event heap, no
sleeping). So a night of a 5,000-actor fleet runs in seconds of CPU, and what the CPU and memory
measure is the scheduler's own work, the ledger's and this simulation's (which keeps its own
CPU time in `SimRuntime.cpu_s`, to be taken off).

The actors are models, not code:

- a prompt actor answers `prepare` with a `PreparedInfo` for the rows a unit selects, and
  passes those rows on as a `RowRanges` (the stand-in for the prepared table);
- an engine actor generates a unit's rows at a fixed rate per row, writes a part every
  `rows_per_part` rows, streams a `PartWritten` (a real `PartRecord`, with `RowStats` like a
  real part's when asked) per part and then a `UnitEnd`, each with a cost account;
- `release` cuts the second half of the rows a unit has not yet fed off its end, as
  pipeline.batch.stages.generate does (rows in the engine are fed `lookahead_rows` ahead);
- `SimEngine.kill(at)` makes an engine actor die at a simulated time: what its units streamed
  before stays, their next item raises `RayActorError`, and Ray "restarts" it `restart_s`
  later (calls made meanwhile wait for the new incarnation, as Ray queues them).

The simulation also checks what only it can see: that no rows are handed to two live units at
once (`overlaps`), and how many rows were generated in all (`rows_generated`).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pipeline.batch.commit.parts import PartName, PartRecord, PartWritten
from pipeline.batch.commit.stats import RowStats
from pipeline.batch.stages.generate import MIN_RELEASE_ROWS
from pipeline.batch.units import PreparedInfo, RowRanges, UnitEnd, WorkUnit
from pipeline.cost import ActorAccount, RowSums

EPOCH = 1_800_000_000.0  # wall time of simulated second 0 (part records carry epoch seconds)


class SimActorError(Exception):
    """ray.exceptions.RayActorError: the actor died; it may be restarting."""


class SimActorDiedError(SimActorError):
    """ray.exceptions.ActorDiedError: the actor is gone for good."""


class SimErrors:
    """The `exceptions` namespace of the simulated runtime (see scheduler.RuntimeErrors)."""

    RayActorError = SimActorError
    ActorDiedError = SimActorDiedError


# --- refs and the clock ------------------------------------------------------------------------


class _Waitable:
    """Something `wait` can return: ready once the clock reaches the time it was scheduled at."""

    __slots__ = ("is_ready", "version")

    def __init__(self) -> None:
        self.is_ready = False
        self.version = 0  # bumped on every (re)schedule: older heap entries are stale


class SimRef(_Waitable):
    """An ObjectRef: a value (or an error to raise) that exists from its completion time on."""

    __slots__ = ("error", "value")

    def __init__(self, value: Any = None, error: Exception | None = None):
        super().__init__()
        self.value = value
        self.error = error


class SimRuntime:
    """`wait` and `get` over simulated time (see the module docstring)."""

    exceptions = SimErrors

    def __init__(self) -> None:
        self.now = 0.0  # simulated seconds
        self._heap: list[tuple[float, int, _Waitable, int]] = []
        self._seq = itertools.count()
        # Completed while nobody waited for them (e.g. a stream the scheduler let go of).
        self._unclaimed: dict[_Waitable, None] = {}
        self.cpu_s = 0.0  # CPU seconds spent inside the simulation (not the scheduler's)

    def schedule(self, item: _Waitable, at: float) -> None:
        item.is_ready = False
        item.version += 1
        heapq.heappush(self._heap, (max(at, self.now), next(self._seq), item, item.version))

    def done(self, value: Any = None, at: float | None = None) -> SimRef:
        ref = SimRef(value)
        self.schedule(ref, self.now if at is None else at)
        return ref

    def failed(self, error: Exception, at: float | None = None) -> SimRef:
        ref = SimRef(error=error)
        self.schedule(ref, self.now if at is None else at)
        return ref

    def wait(
        self, object_refs: list[Any], /, *, num_returns: int = 1, timeout: float | None = None
    ) -> tuple[list[Any], list[Any]]:
        started = time.process_time()
        try:
            pending = set(object_refs)
            for item in self._unclaimed:
                if item in pending and item.is_ready:
                    del self._unclaimed[item]
                    return [item], _without(object_refs, item)
            while self._heap:
                at, _, item, version = heapq.heappop(self._heap)
                if version != item.version:
                    continue  # rescheduled since
                self.now = max(self.now, at)
                item.is_ready = True
                if item in pending:
                    return [item], _without(object_refs, item)
                self._unclaimed[item] = None
            return [], list(object_refs)  # nothing will ever complete: as a timeout
        finally:
            self.cpu_s += time.process_time() - started

    def get(self, object_refs: Any, /, *, timeout: float | None = None) -> Any:
        ref: SimRef = object_refs
        if ref.error is not None:
            raise ref.error
        return ref.value


# --- actors ------------------------------------------------------------------------------------


class _Method:
    """`handle.method.remote(...)` and `handle.method.options(...).remote(...)`."""

    __slots__ = ("_call",)

    def __init__(self, call: Any):
        self._call = call

    def options(self, **_: Any) -> _Method:
        return self

    def remote(self, *args: Any) -> Any:
        return self._call(*args)


class _Actor:
    """What both kinds of simulated actor share: the runtime, the call latency, and keeping
    the CPU their calls take out of the scheduler's."""

    def __init__(self, runtime: SimRuntime, name: str, latency_s: float):
        self.rt = runtime
        self.name = name
        self.latency_s = latency_s  # one call's round trip

    def _timed(self, call: Any) -> _Method:
        runtime = self.rt

        def timed(*args: Any) -> Any:
            started = time.process_time()
            try:
                return call(*args)
            finally:
                runtime.cpu_s += time.process_time() - started

        return _Method(timed)


class SimPrompter(_Actor):
    """A prompt actor: reads and renders a unit in `rows / rows_per_s` simulated seconds."""

    def __init__(self, runtime: SimRuntime, name: str, rows_per_s: float, latency_s: float):
        super().__init__(runtime, name, latency_s)
        self.rows_per_s = rows_per_s
        self.ready = self._timed(lambda: self.rt.done(True, self.rt.now + latency_s))
        self.prepare = self._timed(self._prepare)

    def _prepare(self, unit: WorkUnit) -> tuple[SimRef, SimRef]:
        num_rows = unit.shard.num_rows or 0
        base = unit.selection.only or RowRanges.full(num_rows)
        rows = base.difference(unit.selection.skip)
        info = PreparedInfo(unit.shard.index, num_rows, len(rows), 0)
        at = self.rt.now + self.latency_s + len(rows) / self.rows_per_s
        # The rows ref is only passed on to an engine actor, never waited for: it need not
        # be on the clock (the engine reads it when it starts, after `info` is ready).
        return self.rt.done(info, at), SimRef(rows)


@dataclass
class Fleet:
    """Settings shared by the simulated engine actors."""

    seconds_per_row: float = 0.002  # one unit's generation time per row (500 rows/s)
    rows_per_part: int = 10_000  # output.rows_per_file
    lookahead_rows: int = 64  # rows fed into the engine ahead of those finished
    batch_size: int = 16  # resources.batch_size: `release` keeps at least two batches
    load_s: float = 30.0  # model load, before the first `ready`
    restart_s: float = 20.0  # a lost actor's restart and reload
    latency_s: float = 0.002  # one call's round trip
    prompt_tokens: int = 120  # per row, for the sums
    completion_tokens: int = 16
    stats: RowStats | None = None  # each part gets its own copy of these (None: no stats)
    jitter: float = 0.2  # each unit's rate and each actor's load time vary by this fraction
    seed: int = 0


class SimStream(_Waitable):
    """The ObjectRefGenerator of one `run_unit`: its items become ready one after another.

    The next item is worked out ahead, with the time it is ready at; `release` and `stop`
    move the unit's end, and take that item back while the scheduler cannot have seen it."""

    def __init__(self, engine: SimEngine, unit: WorkUnit, rows: RowRanges, start: float):
        super().__init__()
        self.engine = engine
        self.unit = unit
        self.rows = rows  # the prepared rows, in feeding order (positions 0..)
        self.incarnation = engine.incarnation_at(start)
        self.start = start
        spread = engine.fleet.jitter
        self.seconds_per_row = engine.fleet.seconds_per_row * (
            1 + engine.rng.uniform(-spread, spread)
        )
        self.limit = len(rows)  # positions [0, limit) are this unit's (`release` lowers it)
        self.emitted = 0  # positions [0, emitted) are in parts streamed or worked out
        self.seq = 0
        self.refused = 0
        self.stopped = False
        self.ended = False  # the last item (UnitEnd or the actor's death) is worked out
        # The next item: ("part", first position, end position, ready at), ("end", ...) or
        # ("died", ...); built only when the driver takes it (`__next__`). None: the stream
        # ended, next() raises StopIteration.
        self._next: tuple[str, int, int, float] | None = None
        self._schedule_next()

    def done_at(self, position: int) -> float:
        return self.start + position * self.seconds_per_row

    def fed(self, at: float) -> int:
        """Positions taken into the engine by `at`: never released."""
        done = int((at - self.start) / self.seconds_per_row) if at > self.start else 0
        return min(self.limit, done + self.engine.fleet.lookahead_rows)

    @property
    def taken(self) -> int:
        """Positions in parts the driver took (so committed or refused by now)."""
        if self._next is not None and self._next[0] == "part":
            return self._next[1]
        return self.emitted

    def owed(self) -> RowRanges:
        """Rows this unit will still write (nothing once its actor died)."""
        death = self.engine.death_after(self.incarnation)
        if death is not None and death <= self.engine.rt.now:
            return RowRanges()
        return _slice(self.rows, self.taken, self.limit)

    def _schedule_next(self) -> None:
        """Work out the next item and the simulated time it is ready at."""
        runtime = self.engine.rt
        if self.ended:
            self._next = None  # the end of the stream
            runtime.schedule(self, runtime.now)
            return
        end = min(self.emitted + self.engine.fleet.rows_per_part, self.limit)
        at = self.done_at(end)
        death = self.engine.death_after(self.incarnation)
        if death is not None and at >= death:
            self._next, self.ended = ("died", self.emitted, self.emitted, death), True
        elif end > self.emitted:
            self._next, self.emitted = ("part", self.emitted, end, at), end
        else:
            self._next, self.ended = ("end", end, end, at), True
        runtime.schedule(self, self._next[3])

    def _event(self, kind: str, first: int, end: int, at: float) -> SimRef:
        engine = self.engine
        if kind == "died":
            return SimRef(error=SimActorError(f"{engine.name} died at {at:.3f}s"))
        if kind == "part":
            engine.rows_generated += end - first
            busy = engine.busy_s.get(self.incarnation, 0.0)
            engine.busy_s[self.incarnation] = busy + (end - first) * self.seconds_per_row
            return SimRef(PartWritten(self._part(first, end, at), engine.cost_account(at)))
        end_event = UnitEnd(
            self.unit.shard.index, end, self.refused, self.stopped, engine.cost_account(at)
        )
        return SimRef(end_event)

    def _part(self, first: int, end: int, at: float) -> PartRecord:
        engine, unit, fleet = self.engine, self.unit, self.engine.fleet
        rows = _slice(self.rows, first, end)
        n = len(rows)
        sums = RowSums(
            rows=n,
            prompt_tokens=n * fleet.prompt_tokens,
            completion_tokens=n * fleet.completion_tokens,
            gpu_seconds=n * self.seconds_per_row,
            cost_usd=n * self.seconds_per_row * 3.0 / 3600,  # $3 per device-hour
        )
        stats = None
        if engine.stats_json is not None:  # each record is unpickled on its own in a job
            stats = RowStats.from_json({**engine.stats_json, "sums": sums.to_json()})
        record = PartRecord(
            name=PartName(unit.shard.index, unit.run, unit.dispatch, self.seq).name,
            shard=unit.shard.index,
            run=unit.run,
            rows=rows,
            sums=sums,
            size_bytes=n * 180,
            version=f"{engine.name}-{unit.dispatch}-{self.seq}",
            actor_id=engine.name,
            written_at=EPOCH + at,
            stats=stats,
        )
        self.seq += 1
        return record

    def _take_back(self) -> bool:
        """Undo the item worked out ahead while it is not ready (the scheduler cannot have
        seen it); whether there was one."""
        if self.is_ready or self._next is None or self._next[0] == "died":
            return False
        self.emitted = self._next[1]
        self._next, self.ended = None, False
        return True

    def __iter__(self) -> Iterator[SimRef]:
        return self

    def __next__(self) -> SimRef:
        started = time.process_time()
        try:
            if self._next is None:
                self.engine.end(self)
                raise StopIteration
            item = self._event(*self._next)
            self._schedule_next()
            return item
        finally:
            self.engine.rt.cpu_s += time.process_time() - started

    def release(self) -> list[list[int]]:
        """The second half of the positions not yet fed, as row spans
        (pipeline.batch.stages.generate `release`: empty when too few are left)."""
        if (self.ended and self._next is None) or self.stopped:
            return []
        took_back = self._take_back()
        taken = max(self.fed(self.engine.rt.now), self.emitted)
        left = self.limit - taken
        released: list[list[int]] = []
        if not self.ended and left >= max(MIN_RELEASE_ROWS, 2 * self.engine.fleet.batch_size):
            cut = taken + (left + 1) // 2
            released = _slice(self.rows, cut, self.limit).to_json()
            self.limit = cut
        if took_back:
            self._schedule_next()
        return released

    def stop(self) -> None:
        """Write what is finished at once and end; rows not finished are refused."""
        if self.ended:
            return
        took_back = self._take_back()
        now = self.engine.rt.now
        finished = int(max(now - self.start, 0.0) / self.seconds_per_row)
        new_limit = min(self.limit, max(finished, self.emitted))
        self.refused += self.limit - new_limit
        self.limit, self.stopped = new_limit, True
        if took_back:
            self._schedule_next()


class SimEngine(_Actor):
    """An engine actor (see the module docstring); `kill` makes it die at a simulated time."""

    def __init__(self, runtime: SimRuntime, name: str, fleet: Fleet, rng: random.Random):
        super().__init__(runtime, name, fleet.latency_s)
        self.fleet = fleet
        self.rng = rng
        self.deaths: list[float] = []  # simulated times it dies, ascending
        self.streams: dict[tuple[int, int], SimStream] = {}  # (shard, dispatch) -> its stream
        self.rows_generated = 0  # rows of the parts it streamed
        self.busy_s: dict[int, float] = {}  # incarnation -> seconds of rows streamed
        self.stats_json = fleet.stats.to_json() if fleet.stats is not None else None
        self.on_end: Callable[[SimStream], None] = lambda stream: None
        self.load_s = fleet.load_s * (1 + rng.uniform(0, fleet.jitter))
        self.ready = self._timed(self._ready)
        self.run_unit = self._timed(self._run_unit)
        self.release = self._timed(self._release)
        self.stop = self._timed(self._stop)
        self.account = self._timed(lambda: self.rt.done(self.cost_account(self.rt.now)))

    def end(self, stream: SimStream) -> None:
        """A stream the driver read to its end."""
        self.streams.pop((stream.unit.shard.index, stream.unit.dispatch), None)
        self.on_end(stream)

    def kill(self, at: float) -> None:
        """Die at simulated time `at` (Ray restarts it `restart_s` later)."""
        bisect.insort(self.deaths, at)

    def incarnation_at(self, t: float) -> int:
        return bisect.bisect_right(self.deaths, t)

    def alive_from(self, incarnation: int) -> float:
        if incarnation == 0:
            return self.load_s
        return self.deaths[incarnation - 1] + self.fleet.restart_s

    def death_after(self, incarnation: int) -> float | None:
        return self.deaths[incarnation] if incarnation < len(self.deaths) else None

    def _start(self) -> float:
        """When a call made now runs: at once, or once the actor is (back) up."""
        at = self.rt.now + self.latency_s
        return max(at, self.alive_from(self.incarnation_at(at)))

    def _ready(self) -> SimRef:
        at = self._start()
        return self.rt.done({"actor_id": self.name, "incarnation": self.incarnation_at(at)}, at)

    def _run_unit(self, unit: WorkUnit, rows_ref: SimRef) -> SimStream:
        stream = SimStream(self, unit, rows_ref.value, self._start())
        self.streams[(unit.shard.index, unit.dispatch)] = stream
        return stream

    def _release(self, shard: int, dispatch: int) -> SimRef:
        at = self.rt.now + self.latency_s
        death = self.death_after(self.incarnation_at(self.rt.now))
        if death is not None and death <= at:
            return self.rt.failed(SimActorError(f"{self.name} died"), death)
        stream = self.streams.get((shard, dispatch))
        return self.rt.done([] if stream is None else stream.release(), at)

    def _stop(self) -> SimRef:
        for stream in self.streams.values():
            stream.stop()
        return self.rt.done(None, self.rt.now + self.latency_s)

    def cost_account(self, at: float) -> dict[str, Any]:
        """A plausible pipeline.cost account of the incarnation alive at `at`."""
        incarnation = self.incarnation_at(at)
        born = 0.0 if incarnation == 0 else self.deaths[incarnation - 1]
        lifetime = max(at - born, 0.0)
        load = min(lifetime, self.alive_from(incarnation) - born)
        busy = min(self.busy_s.get(incarnation, 0.0), lifetime - load)
        account = ActorAccount(
            devices=1.0,
            lifetime_s=lifetime,
            load_s=load,
            idle_s=lifetime - load - busy,
            attributed_s=busy,
            pending_s=0.0,
            num_rows=int(busy / self.fleet.seconds_per_row),
            actor_id=self.name,
        )
        return {**vars(account), "incarnation": incarnation}  # as to_dict(), without deepcopy


# --- the fleet ---------------------------------------------------------------------------------


@dataclass
class SimCluster:
    """A simulated fleet: the handles to give the scheduler, and the checks to make after."""

    runtime: SimRuntime
    engines: list[SimEngine]
    prompters: list[SimPrompter]
    overlaps: list[str] = field(default_factory=list)  # rows handed to two live units at once
    handed: int = 0  # run_unit calls
    _live: dict[int, list[SimStream]] = field(default_factory=dict)  # shard -> its streams

    @classmethod
    def start(
        cls,
        num_engines: int,
        num_prompters: int,
        fleet: Fleet | None = None,
        prompt_rows_per_s: float = 50_000.0,
    ) -> SimCluster:
        fleet = fleet or Fleet()
        runtime = SimRuntime()
        rng = random.Random(fleet.seed)
        engines = [SimEngine(runtime, f"engine-{i}", fleet, rng) for i in range(num_engines)]
        prompters = [
            SimPrompter(runtime, f"prompt-{i}", prompt_rows_per_s, fleet.latency_s)
            for i in range(num_prompters)
        ]
        cluster = cls(runtime, engines, prompters)
        for engine in engines:
            engine.run_unit = cluster._checked(engine.run_unit)
            engine.on_end = cluster._ended
        return cluster

    def _ended(self, stream: SimStream) -> None:
        others = self._live.get(stream.unit.shard.index, [])
        if stream in others:
            others.remove(stream)
        if not others:
            self._live.pop(stream.unit.shard.index, None)

    def _checked(self, run_unit: _Method) -> _Method:
        """run_unit that records it when a live unit of the shard still owes any of its rows:
        the scheduler handed those rows out twice without a loss."""
        runtime = self.runtime

        def call(unit: WorkUnit, rows_ref: SimRef) -> SimStream:
            stream: SimStream = run_unit.remote(unit, rows_ref)
            started = time.process_time()
            self.handed += 1
            others = self._live.setdefault(unit.shard.index, [])
            for other in others:
                owed = other.owed()
                if owed.overlaps(stream.rows):
                    self.overlaps.append(
                        f"{unit.key} on {stream.engine.name}: rows "
                        f"{owed.intersection(stream.rows).to_json()[:3]} still owed by "
                        f"dispatch {other.unit.dispatch} on {other.engine.name}"
                    )
            others[:] = [s for s in others if s.owed()]
            others.append(stream)
            runtime.cpu_s += time.process_time() - started
            return stream

        return _Method(call)

    @property
    def rows_generated(self) -> int:
        return sum(e.rows_generated for e in self.engines)


def _without(refs: list[Any], item: Any) -> list[Any]:
    rest = list(refs)
    rest.remove(item)  # refs compare by identity
    return rest


def _slice(ranges: RowRanges, start: int, end: int) -> RowRanges:
    """The rows at positions [start, end) of `ranges` (in ascending row order)."""
    out: list[tuple[int, int]] = []
    seen = 0
    for lo, hi in ranges.spans:
        size = hi - lo
        a, b = max(start - seen, 0), min(end - seen, size)
        if a < b:
            out.append((lo + a, lo + b))
        seen += size
        if seen >= end:
            break
    return RowRanges(tuple(out))
