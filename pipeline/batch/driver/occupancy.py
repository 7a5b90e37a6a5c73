"""How busy the engine actors were over a run, and how much of that was lost at the tail.

An engine actor is *idle* while it is up and has no unit at all: with one unit it still keeps
its engine full from that unit's rows (the scheduler hands out `UNITS_PER_ACTOR` only so one
shard's end overlaps the next one's start). The *tail* starts at the last hand-out of a whole
shard (not a tail-split piece, pipeline.batch.driver.scheduler): from then on no new work comes, and
an actor that runs dry waits for the others unless rows are split off to it.

The scheduler reports every change of an actor's state; each costs O(1), so the books stay
cheap with thousands of actors. The totals go into the run's events in the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# An engine actor's state as the books see it.
DOWN = None  # not (yet, or no longer) answering
IDLE = False  # up, no unit
BUSY = True  # up, at least one unit


@dataclass
class Occupancy:
    """Engine actor-seconds, idle actor-seconds, and the idle ones since the tail began."""

    started: float | None = None  # the first hand-out to an engine actor
    last: float = 0.0  # time of the last change
    up: int = 0  # actors answering now
    idle: int = 0  # of which without a unit
    actor_s: float = 0.0  # sum over actors of the time they were up (since `started`)
    idle_s: float = 0.0
    tail_from: float | None = None  # the last hand-out of a whole shard so far
    tail_idle_s: float = 0.0  # idle actor-seconds since `tail_from`

    def _advance(self, now: float) -> None:
        if self.started is not None and now > self.last:
            dt = now - self.last
            self.actor_s += self.up * dt
            self.idle_s += self.idle * dt
            if self.tail_from is not None:
                self.tail_idle_s += self.idle * dt
        self.last = now

    def changed(self, now: float, before: bool | None, after: bool | None) -> None:
        """One actor went from `before` to `after` (DOWN, IDLE or BUSY)."""
        self._advance(now)
        self.up += (after is not DOWN) - (before is not DOWN)
        self.idle += (after is IDLE) - (before is IDLE)

    def handed_out(self, now: float, whole_shard: bool) -> None:
        """A unit went to an engine actor (call before that actor's `changed`)."""
        self._advance(now)
        if self.started is None:
            self.started = self.last = now
        if whole_shard:  # the tail, if any, starts later
            self.tail_from = now
            self.tail_idle_s = 0.0

    def to_json(self, now: float) -> dict[str, Any]:
        self._advance(now)
        tail_s = 0.0 if self.tail_from is None else now - self.tail_from
        return {
            "event": "occupancy",
            "engine_actor_s": round(self.actor_s, 3),
            "idle_actor_s": round(self.idle_s, 3),
            "tail_s": round(tail_s, 3),
            "tail_idle_actor_s": round(self.tail_idle_s, 3),
            # The share of all engine actor-time that was spent idle at the tail.
            "tail_idle_fraction": round(self.tail_idle_s / self.actor_s, 4)
            if self.actor_s
            else 0.0,
        }
