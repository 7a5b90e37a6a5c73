"""The driver's scheduler: hands shards to actors and collects what they commit-ready write.

There is no prefill or decode stage here, and no rows: the scheduler moves *shards*. Each is
prepared by a prompt actor (read + render; the rows stay in Ray's object store), then run by
an engine actor, which streams back one record per part it writes and one at the end. The
driver's work and memory grow with shards and parts, never with rows.

    queue ─▶ prepare (prompt actors, a few ahead) ─▶ prepared ─▶ run_unit (engine actors,
    `UNITS_PER_ACTOR` each, so one shard's tail overlaps the next one's start) ─▶ records

Failures:
- an engine actor dies (its process, or its node): every shard it was running goes back to
  the queue with the rows committed so far skipped; Ray restarts the actor where resources
  allow, and it gets work again once it answers `ready`; the others go on meanwhile;
- a prompt actor dies: the shard it was preparing (its one call, PREPARES_PER_PROMPTER)
  counts a failure and is prepared again after the others. A shard that killed a prompt
  actor more than `resources.max_task_retries` times is read once more without tokenizing,
  and its rows become error rows naming the cause, so a row that crashes the tokenizer costs
  its shard, not the job; if even that read kills the actor, the job fails naming the shard;
- a shard whose work fails otherwise (its input unreadable, a part write failing past the
  storage retries) counts towards the same cap, then the job fails naming the shard and the
  error;
- actors that never answer `ready`: the job fails after ACTOR_START_TIMEOUT_S without an
  engine actor, or PROMPT_START_TIMEOUT_S without a prompt actor while shards wait.

Stopping (SIGTERM, Ctrl-C, the budget, a lost lease): nothing new is handed out; engine
actors are asked to stop, write what is finished and end their shards; the scheduler
returns once they have.

The tail (`resources.tail_split`): once no shard waits and an engine actor has nothing to do,
the running unit with the most rows left (on another actor) is asked to release the second
half of the rows it has not yet fed (pipeline.batch.stages.generate `release`). Those rows become a
unit of their own, a new hand-out of the same shard (`only` those rows), prepared and run by
the free actor; the unit they came from keeps the rest. The ledger commits row ranges, so the
two commit side by side; a loss of either hands out again only that unit's own rows. Each
split is an event in the manifest.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeline.batch.commit.ledger import CommitLedger
from pipeline.batch.commit.parts import PartWritten
from pipeline.batch.driver.occupancy import BUSY, DOWN, IDLE, Occupancy
from pipeline.batch.stages.generate import MIN_RELEASE_ROWS, Fenced
from pipeline.batch.units import PreparedInfo, RowRanges, RowSelection, UnitEnd, WorkUnit

logger = logging.getLogger(__name__)

UNITS_PER_ACTOR = 2  # shards one engine actor works on at once
# One prepare call at a time per prompt actor: when one dies, the shard it was preparing is
# known for certain (an actor that dies right after a call may take that call's answer with
# it, so with two calls queued either could be the one that killed it). Tokenizing a shard
# takes far less than generating it; the round trip between calls costs the engines nothing.
PREPARES_PER_PROMPTER = 1
WAIT_S = 0.5  # longest the loop sleeps without an event
# Engine actors must answer `ready` within this (model download and load included).
ACTOR_START_TIMEOUT_S = 1200.0
# Without a prompt actor for this long while shards wait, the job fails (a tokenizer loads in
# seconds; a pool the cluster cannot place never comes).
PROMPT_START_TIMEOUT_S = 600.0
# After asking actors to stop, give their shards this long to end.
STOP_TIMEOUT_S = 60.0
# Shards go to engine actors once all are up, or this long after the first one is: otherwise
# the first engine to finish loading would take the first shards of a small job alone.
STARTUP_GRACE_S = 30.0


class RuntimeErrors(Protocol):
    """The actor errors the scheduler tells apart (those of `ray.exceptions`)."""

    ActorDiedError: type[Exception]  # the actor is gone for good (its restarts used up)
    RayActorError: type[Exception]  # the actor died; Ray may be restarting it


class Runtime(Protocol):
    """What the scheduler asks of Ray besides the actor handles: the `ray` module itself in a
    job. It is a parameter so the scheduler's own tests can drive it on a simulated fleet of
    thousands of actors, with no cluster (tests/unit/sim_runtime.py)."""

    exceptions: RuntimeErrors

    def wait(
        self, object_refs: list[Any], /, *, num_returns: int, timeout: float | None
    ) -> tuple[list[Any], list[Any]]: ...

    def get(self, object_refs: Any, /, *, timeout: float | None = None) -> Any: ...


class JobFailed(RuntimeError):
    """The run cannot go on; the message names the shard or actor and the cause."""


class JobFenced(RuntimeError):
    """An engine actor found the output's lease held by another run."""


@dataclass(eq=False)  # hashed by identity: _Pool keys its buckets by slot
class _Slot:
    """One actor of a pool, and what it is doing."""

    name: str
    handle: Any
    kind: str  # "engine" | "prompt"
    ready: bool = False
    dead: bool = False  # gone for good (its restarts are used up)
    ping: Any = None  # pending `ready` call (ObjectRef), None when answered
    busy: int = 0  # units running / prepares pending on it
    losses: int = 0
    answered: bool = False  # it answered `ready` at least once
    info: dict[str, Any] = field(default_factory=dict)


def _state(slot: _Slot) -> bool | None:
    """An engine actor's state for the occupancy books."""
    if not slot.ready:
        return DOWN
    return BUSY if slot.busy > 0 else IDLE


class _Pool:
    """A pool's actors by how many calls each holds, so picking the least busy one, counting
    the ready ones and listing the idle ones cost O(1) or O(answer), not O(actors): the loop
    runs once per event, and a fleet has thousands of actors. Every change of a slot's `ready`
    or `busy` goes through `set_ready` / `add_busy`."""

    def __init__(self, slots: list[_Slot], limit: int):
        self.limit = limit  # calls one actor takes at once
        self.ready = 0
        self.never_ready = len(slots)  # still starting (not yet answered `ready` once)
        # Ready slots by calls held (0..limit); dicts keep the order slots were added in.
        self._by_busy: list[dict[_Slot, None]] = [{} for _ in range(limit + 1)]

    def _bucket(self, slot: _Slot) -> dict[_Slot, None]:
        return self._by_busy[min(max(slot.busy, 0), self.limit)]

    def set_ready(self, slot: _Slot, ready: bool) -> None:
        if slot.ready == ready:
            return
        if ready:
            if not slot.answered:
                slot.answered = True
                self.never_ready -= 1
            slot.ready = True
            self.ready += 1
            self._bucket(slot)[slot] = None
        else:
            self._bucket(slot).pop(slot, None)
            slot.ready = False
            self.ready -= 1

    def add_busy(self, slot: _Slot, delta: int) -> None:
        if slot.ready:
            self._bucket(slot).pop(slot, None)
        slot.busy += delta
        if slot.ready:
            self._bucket(slot)[slot] = None

    def least_busy(self) -> _Slot | None:
        for bucket in self._by_busy[: self.limit]:
            if bucket:
                return next(iter(bucket))
        return None

    def idle(self) -> list[_Slot]:
        """Ready actors holding no call."""
        return list(self._by_busy[0])


@dataclass
class _Running:
    unit: WorkUnit  # its selection shrinks when part of it is released to another actor
    slot: _Slot
    generator: Any  # ObjectRefGenerator of run_unit
    selected: int = 0  # rows it was handed (less what it released)
    written: int = 0  # rows of the parts it wrote so far
    splittable: bool = True  # False once it had too few rows left to give any back
    # It ran to its end (its stream closed). A unit that failed or was lost instead is
    # requeued whole, released rows included (`_requeue` of its selection before the split).
    completed: bool = False


@dataclass
class TailSplit:
    """Rows of a running unit handed to an idle actor at the tail (for the manifest)."""

    shard: int
    from_actor: str
    rows: int
    dispatch: int  # the new hand-out's number (its parts' names carry it)
    at: float  # epoch seconds

    def to_json(self) -> dict[str, Any]:
        return {
            "event": "tail_split",
            "shard": self.shard,
            "from_actor": self.from_actor,
            "rows": self.rows,
            "dispatch": self.dispatch,
            "at": round(self.at, 3),
        }


@dataclass
class _Preparing:
    unit: WorkUnit
    slot: _Slot
    info_ref: Any
    rows_ref: Any


@dataclass
class ActorLoss:
    """An engine actor that died while it had work (for the manifest and the report)."""

    actor: str
    at: float  # epoch seconds
    shards: list[int]  # handed out again
    recovered_after_s: float | None = None  # until the first part of a re-dispatched shard

    def to_json(self) -> dict[str, Any]:
        return {
            "event": "actor_lost",
            "actor": self.actor,
            "at": round(self.at, 3),
            "shards_requeued": self.shards,
            "recovered_after_s": (
                None if self.recovered_after_s is None else round(self.recovered_after_s, 3)
            ),
        }


@dataclass
class SchedulerResult:
    accounts: dict[str, dict[str, Any]]  # "<actor id>/<incarnation>" -> latest cost account
    budget_closed: bool  # an engine actor left rows out because the budget refused them
    losses: list[ActorLoss]
    splits: list[TailSplit] = field(default_factory=list)
    occupancy: dict[str, Any] = field(default_factory=dict)  # Occupancy.to_json()


class Scheduler:
    """See the module docstring. `run()` returns when every unit is done or the run stopped."""

    def __init__(
        self,
        *,
        engines: list[Any],
        prompters: list[Any],
        units: list[WorkUnit],
        ledger: CommitLedger,
        on_part: Callable[[PartWritten], None],
        on_tick: Callable[[], None],
        stop: threading.Event,
        max_unit_retries: int,
        tail_split: bool = True,
        runtime: Runtime | None = None,  # None: Ray
    ):
        if runtime is None:
            import ray

            runtime = ray  # the module answers the protocol
        self._ray: Runtime = runtime
        self.engines = [_Slot(f"engine-{i}", h, "engine") for i, h in enumerate(engines)]
        self.prompters = [_Slot(f"prompt-{i}", h, "prompt") for i, h in enumerate(prompters)]
        self.engine_pool = _Pool(self.engines, UNITS_PER_ACTOR)
        self.prompt_pool = _Pool(self.prompters, PREPARES_PER_PROMPTER)
        self._pings: dict[Any, _Slot] = {}  # pending `ready` call -> its actor
        for slot in [*self.engines, *self.prompters]:
            self._ask_ready(slot)
        self.queue: deque[WorkUnit] = deque(units)
        self.ledger = ledger
        self.on_part = on_part
        self.on_tick = on_tick
        self.stop = stop
        self.max_unit_retries = max_unit_retries
        self.preparing: dict[Any, _Preparing] = {}  # info ref -> prepare call
        self.prepared: deque[tuple[WorkUnit, PreparedInfo, Any]] = deque()
        self.running: dict[Any, _Running] = {}  # generator -> unit
        self.dispatches: dict[int, int] = {u.shard.index: u.dispatch for u in units}
        self.failures: dict[int, int] = {}  # shard -> failed attempts
        self.accounts: dict[str, dict[str, Any]] = {}
        self.losses: list[ActorLoss] = []
        self._awaiting_recovery: dict[int, ActorLoss] = {}  # shard -> the loss it recovers
        self.budget_closed = False
        self._stop_sent = False
        self._no_engine_since: float | None = time.monotonic()  # None while one is ready
        self._no_prompter_since: float | None = time.monotonic()  # None: one is ready or idle
        self._first_ready: float | None = None  # when the first engine actor answered
        self._limitations_said: set[str] = set()  # engine limitations already logged
        self.tail_split = tail_split
        self.splits: list[TailSplit] = []
        self._releasing: dict[Any, _Running] = {}  # pending `release` call -> its unit
        self.occupancy = Occupancy()  # engine actors' busy and idle time, the tail's

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> SchedulerResult:
        stop_deadline: float | None = None
        while True:
            if self.stop.is_set() and stop_deadline is None:
                stop_deadline = time.monotonic() + STOP_TIMEOUT_S
                self._stop_all()
            if not self.stop.is_set() and not self.budget_closed:
                self._dispatch()
                self._split_tail()
            if self._finished():
                break
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                logger.warning("actors did not end their shards within %ss", STOP_TIMEOUT_S)
                break
            self._check_start_timeout()
            waiting = [
                *self.preparing,
                *self.running,
                *self._releasing,
                *self._pings,
            ]
            ready = self._ray.wait(waiting, num_returns=1, timeout=WAIT_S)[0] if waiting else []
            if not waiting:
                time.sleep(WAIT_S)
            for ref in ready:
                self._handle(ref)
            self.on_tick()
        for slot in self.engines:  # the last account of every actor still alive
            if slot.ready:
                try:
                    account = self._ray.get(slot.handle.account.remote(), timeout=30)
                    self._take_account(account)
                except Exception as exc:
                    logger.warning("no final account from %s: %s", slot.name, exc)
        return SchedulerResult(
            accounts=self.accounts,
            budget_closed=self.budget_closed,
            losses=self.losses,
            splits=self.splits,
            occupancy=self.occupancy.to_json(time.monotonic()),
        )

    def _finished(self) -> bool:
        work_left = bool(self.queue or self.prepared) and not (
            self.stop.is_set() or self.budget_closed
        )
        # A pending `release` may still hand back rows that no unit holds any more.
        return not (work_left or self.preparing or self.running or self._releasing)

    # --- handing out work ------------------------------------------------------------------------

    def _dispatch(self) -> None:
        ahead = max(self.engine_pool.ready, 1)
        while self.queue and len(self.preparing) + len(self.prepared) < ahead + 1:
            prompter = self.prompt_pool.least_busy()
            if prompter is None:
                break
            unit = self.queue.popleft()
            info_ref, rows_ref = prompter.handle.prepare.options(num_returns=2).remote(unit)
            self.prompt_pool.add_busy(prompter, +1)
            self.preparing[info_ref] = _Preparing(unit, prompter, info_ref, rows_ref)
        # An engine that never answered and is not dead is still starting (one that died
        # without ever answering fails the job in `_on_ready`).
        starting = self.engine_pool.never_ready > 0
        if starting and (
            self._first_ready is None or time.monotonic() - self._first_ready < STARTUP_GRACE_S
        ):
            return
        while self.prepared:
            engine = self.engine_pool.least_busy()
            if engine is None:
                break
            unit, info, rows_ref = self.prepared.popleft()
            generator = engine.handle.run_unit.options(num_returns="streaming").remote(
                unit, rows_ref
            )
            before = _state(engine)
            self.engine_pool.add_busy(engine, +1)
            now = time.monotonic()
            # Only split pieces select rows (`only`): any other unit is a whole shard's rows.
            self.occupancy.handed_out(now, whole_shard=unit.selection.only is None)
            self.occupancy.changed(now, before, _state(engine))
            self.running[generator] = _Running(unit, engine, generator, info.num_selected)

    # --- the tail ------------------------------------------------------------------------------

    def _split_tail(self) -> None:
        """With nothing left to hand out and an engine slot free, ask the running unit with the
        most rows left (on another actor) to give half of its unfed rows back."""
        if not self.tail_split or self._releasing or self.queue or self.prepared:
            return
        if self.preparing:
            return
        # Free: an actor with no unit at all. One with a unit still fills its engine from it.
        free = self.engine_pool.idle()
        if not free:
            return
        candidates = [
            r
            for r in self.running.values()
            if r.splittable
            and not r.unit.replace_parts
            and r.unit.failed is None
            and any(f is not r.slot for f in free)
            and r.selected - r.written >= MIN_RELEASE_ROWS
        ]
        if not candidates:
            return
        running = max(candidates, key=lambda r: r.selected - r.written)
        unit = running.unit
        ref = running.slot.handle.release.remote(unit.shard.index, unit.dispatch)
        self._releasing[ref] = running

    def _on_released(self, ref: Any, running: _Running) -> None:
        ray = self._ray
        try:
            spans = ray.get(ref)
        except Exception as exc:  # the actor died meanwhile: its loss requeues the unit
            logger.info("no rows released by %s: %s", running.slot.name, exc)
            return
        if running.generator not in self.running and not running.completed:
            # Failed or lost while it was asked: its requeue holds the released rows too.
            spans = []
        # A unit that completed meanwhile (it finished the rows it kept before this answer was
        # read) no longer has the released rows: they go out as a piece like any other.
        if not spans:
            running.splittable = False
            return
        released = RowRanges.of(spans)
        unit, shard = running.unit, running.unit.shard.index
        num_rows = self.ledger.shards[shard].num_rows or 0  # known: the shard was read
        kept = (unit.selection.only or RowRanges.full(num_rows)).difference(released)
        running.unit = dataclasses.replace(
            unit, selection=RowSelection(skip=unit.selection.skip, only=kept)
        )
        running.selected -= len(released)
        piece = WorkUnit(
            unit.shard,
            unit.run,
            self._next_dispatch(shard),
            RowSelection(skip=self.ledger.selection(shard).skip, only=released),
        )
        self.queue.appendleft(piece)
        split = TailSplit(
            shard,
            running.slot.info.get("actor_id", running.slot.name),
            len(released),
            piece.dispatch,
            time.time(),
        )
        self.splits.append(split)
        logger.info(
            "tail: %d row(s) of shard %d handed from %s to a free actor (dispatch %d)",
            split.rows,
            shard,
            running.slot.name,
            piece.dispatch,
        )

    def _pool(self, slot: _Slot) -> _Pool:
        return self.engine_pool if slot.kind == "engine" else self.prompt_pool

    def _ask_ready(self, slot: _Slot) -> None:
        slot.ping = slot.handle.ready.remote()
        self._pings[slot.ping] = slot

    def _requeue(self, unit: WorkUnit, front: bool = True) -> WorkUnit | None:
        """The unit's rows again, those committed so far skipped (None: nothing left). A unit
        that is a split piece of its shard, or gave rows to one, keeps to its own rows."""
        shard = unit.shard.index
        selection = RowSelection(self.ledger.selection(shard).skip, unit.selection.only)
        if unit.replace_parts:
            # Replacement work is all or nothing per part: redo the parts not yet replaced.
            left = tuple(p for p in unit.replace_parts if p in self.ledger.parts)
            if not left:
                return None
        else:
            state = self.ledger.shards[shard]
            if state.is_complete:
                return None
            left = ()
        again = dataclasses.replace(
            unit, dispatch=self._next_dispatch(shard), selection=selection, replace_parts=left
        )
        if front:
            self.queue.appendleft(again)
        else:
            self.queue.append(again)
        return again

    def _next_dispatch(self, shard: int) -> int:
        self.dispatches[shard] = self.dispatches.get(shard, 0) + 1
        if self.dispatches[shard] > 99:
            raise JobFailed(f"shard {shard} was handed out 99 times in one run; giving up")
        return self.dispatches[shard]

    def _stop_all(self) -> None:
        if self._stop_sent:
            return
        self._stop_sent = True
        self.queue.clear()
        self.prepared.clear()
        for slot in self.engines:
            if slot.ready:
                slot.handle.stop.remote()

    # --- events ----------------------------------------------------------------------------------

    def _handle(self, ref: Any) -> None:
        if ref in self.preparing:
            self._on_prepared(self.preparing.pop(ref))
        elif ref in self._releasing:
            self._on_released(ref, self._releasing.pop(ref))
        elif ref in self.running:
            self._on_unit_event(self.running[ref])
        elif ref in self._pings:
            self._on_ready(self._pings.pop(ref))

    def _on_ready(self, slot: _Slot) -> None:
        ray = self._ray
        ping, slot.ping = slot.ping, None
        try:
            answer = ray.get(ping)
        except ray.exceptions.ActorDiedError as exc:
            if slot.losses == 0 and not slot.ready:
                # The actor never came up: its constructor failed (bad model, out of memory).
                raise JobFailed(
                    f"the {slot.kind} actor {slot.name} could not start: {exc}"
                ) from exc
            logger.warning("%s is gone for good: %s", slot.name, exc)
            slot.dead = True
            return
        except ray.exceptions.RayActorError:
            self._ask_ready(slot)  # restarting: ask again
            return
        self._pool(slot).set_ready(slot, True)
        if slot.kind == "engine":
            self.occupancy.changed(time.monotonic(), DOWN, _state(slot))
            if self._first_ready is None:
                self._first_ready = time.monotonic()
        if isinstance(answer, dict):
            slot.info = answer
            for note in answer.get("limitations", ()):
                if note not in self._limitations_said:  # once per job, not once per actor
                    self._limitations_said.add(note)
                    logger.warning("engine limitation: %s", note)
        logger.info("%s ready %s", slot.name, slot.info or "")

    def _on_prepared(self, call: _Preparing) -> None:
        ray = self._ray
        self.prompt_pool.add_busy(call.slot, -1)
        try:
            info: PreparedInfo = ray.get(call.info_ref)
        except ray.exceptions.RayActorError as exc:
            self._lose_prompter(call, exc)
            return
        except Exception as exc:
            self._unit_failed(call.unit, exc)
            return
        self.ledger.set_num_rows(info.shard, info.num_rows)
        if info.num_selected == 0 and not call.unit.replace_parts:
            return  # nothing to generate in this shard (all committed, or empty)
        self.prepared.append((call.unit, info, call.rows_ref))

    def _lose_prompter(self, failed: _Preparing, exc: Exception) -> None:
        """A prompt actor died preparing `failed`'s shard (its only call: see
        PREPARES_PER_PROMPTER): a failure of that shard."""
        self._lose(failed.slot)
        for ref, call in list(self.preparing.items()):  # none while one call is the limit
            if call.slot is failed.slot:
                del self.preparing[ref]
                self.prompt_pool.add_busy(call.slot, -1)
                self.queue.appendleft(call.unit)
        self._prepare_died(failed.unit, exc)

    def _prepare_died(self, unit: WorkUnit, exc: Exception) -> None:
        """The shard a prompt actor died preparing: a failure of the shard (see the module
        docstring)."""
        shard = unit.shard.index
        self.failures[shard] = self.failures.get(shard, 0) + 1
        count = self.failures[shard]
        last = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
        if unit.failed is not None:
            raise JobFailed(
                f"{unit.shard.describe()} kills the prompt actor even when only read (no row "
                f"tokenized), {count} deaths in all; check the input file there. Last: {last}"
            ) from exc
        if count <= self.max_unit_retries:
            logger.warning(
                "a prompt actor died preparing %s (%d time(s)); trying it again", unit.key, count
            )
            self.queue.append(unit)  # after the others
            return
        times = f"{count} time{'s' if count != 1 else ''}"
        cause = (
            f"not generated: the prompt actor (read + tokenize) died {times} preparing "
            f"{unit.shard.describe()} (resources.max_task_retries {self.max_unit_retries}); a "
            "row of this shard may crash the tokenizer or need more memory than a prompt actor "
            f"has. Last: {last}"
        )
        logger.error("%s; its rows become error rows", cause)
        self.queue.append(dataclasses.replace(unit, failed=cause))

    def _on_unit_event(self, running: _Running) -> None:
        ray = self._ray
        try:
            ref = next(running.generator)
            event = ray.get(ref)
        except StopIteration:
            running.completed = True
            self._end_unit(running)
            return
        except ray.exceptions.RayActorError as exc:
            logger.warning("%s died with %s: %s", running.slot.name, running.unit.key, exc)
            self._lose(running.slot)
            return
        except Exception as exc:
            self._end_unit(running)
            if isinstance(exc, Fenced):  # another run holds the output: stop at once
                raise JobFenced(str(exc)) from exc
            self._unit_failed(running.unit, exc)
            return
        if isinstance(event, PartWritten):
            self._take_account(event.account)
            self.on_part(event)
            running.written += event.record.sums.rows
            loss = self._awaiting_recovery.pop(running.unit.shard.index, None)
            if loss is not None and loss.recovered_after_s is None:
                loss.recovered_after_s = time.time() - loss.at
        elif isinstance(event, UnitEnd):
            self._take_account(event.account)
            if event.rows_refused and not event.stopped:
                self.budget_closed = True

    def _end_unit(self, running: _Running) -> None:
        self.running.pop(running.generator, None)
        before = _state(running.slot)
        self._pool(running.slot).add_busy(running.slot, -1)
        if running.slot.kind == "engine":
            self.occupancy.changed(time.monotonic(), before, _state(running.slot))

    def _lose(self, slot: _Slot) -> None:
        """An actor died: wait for it to come back; an engine actor's shards are handed out
        again (a prompt actor's: `_lose_prompter`)."""
        if slot.ready:
            before = _state(slot)
            self._pool(slot).set_ready(slot, False)
            slot.losses += 1
            self._ask_ready(slot)
            if slot.kind == "engine":
                self.occupancy.changed(time.monotonic(), before, DOWN)
        if slot.kind != "engine":
            return
        lost_units = [r for r in self.running.values() if r.slot is slot]
        if not lost_units:
            return
        loss = ActorLoss(slot.info.get("actor_id", slot.name), time.time(), [])
        for running in lost_units:
            self._end_unit(running)
            again = self._requeue(running.unit)
            if again is not None:
                loss.shards.append(again.shard.index)
                self._awaiting_recovery[again.shard.index] = loss
        self.losses.append(loss)
        logger.warning(
            "%s was lost; shards %s handed out again (committed rows kept)", slot.name, loss.shards
        )

    def _unit_failed(self, unit: WorkUnit, exc: Exception) -> None:
        shard = unit.shard.index
        self.failures[shard] = self.failures.get(shard, 0) + 1
        if self.failures[shard] > self.max_unit_retries:
            raise JobFailed(
                f"{unit.shard.describe()} failed {self.failures[shard]} times; last error: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        logger.warning("%s failed (%s: %s); trying it again", unit.key, type(exc).__name__, exc)
        self._requeue(unit, front=False)

    def _take_account(self, account: dict[str, Any]) -> None:
        key = f"{account.get('actor_id')}/{account.get('incarnation')}"
        if account.get("lifetime_s", 0.0) >= self.accounts.get(key, {}).get("lifetime_s", -1.0):
            self.accounts[key] = account

    def _check_start_timeout(self) -> None:
        """Fail instead of waiting forever for actors that cannot come (back)."""
        self._check_prompters_start()
        if self.engine_pool.ready:
            self._no_engine_since = None
            return
        if all(s.dead for s in self.engines):
            raise JobFailed(
                "every engine actor died and used up its restarts (resources.max_restarts); "
                "see the actor logs for the cause"
            )
        now = time.monotonic()
        if self._no_engine_since is None:
            self._no_engine_since = now
        elif now - self._no_engine_since > ACTOR_START_TIMEOUT_S:
            raise JobFailed(
                f"no engine actor was running for {ACTOR_START_TIMEOUT_S:.0f}s: the cluster "
                "may lack the CPUs/GPUs/custom resources an actor asks for (resources.*)"
            )

    def _check_prompters_start(self) -> None:
        waiting = bool(self.queue) and not self.stop.is_set()
        if not waiting or self.prompt_pool.ready:
            self._no_prompter_since = None
            return
        now = time.monotonic()
        if self._no_prompter_since is None:
            self._no_prompter_since = now
        elif now - self._no_prompter_since > PROMPT_START_TIMEOUT_S:
            raise JobFailed(
                f"no prompt actor (read + tokenize) was running for "
                f"{PROMPT_START_TIMEOUT_S:.0f}s while shards waited: the cluster may lack the "
                "CPUs or custom resources they ask for (resources.prompt_actors sets how many), "
                "or their tokenizer does not load (model.tokenizer / model.path)"
            )
