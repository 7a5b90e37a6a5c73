"""Replica health: is this engine still making progress? Pure logic, testable without Ray.

Serve calls a replica's `check_health` every `health.check_period_s`; raising marks the
replica unhealthy, and after Serve's threshold of consecutive failures (3 in Ray 2.60) it is
stopped and replaced. Two things make an engine replica unhealthy:

- its engine is dead: a call raised EngineDeadError, or `stats()` itself fails;
- its step loop is stalled: work is waiting (running + waiting > 0) and the engine's step
  counter has not moved for `health.stall_timeout_s`. An idle engine never counts as stalled,
  since an idle step loop has nothing to step.

Once unhealthy, a replica stays unhealthy (`ReplicaHealth.failure` is sticky): its in-flight
requests have been failed with 503 already, and a step loop that hung once is not trusted to
serve the next request.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.api import EngineStats


class ReplicaUnhealthyError(RuntimeError):
    """This replica's engine is dead or stalled; Serve will replace the replica."""


@dataclass
class StallWatch:
    """Notices a step counter that stays put while requests wait for it."""

    stall_timeout_s: float
    _last_steps: int | None = None  # None: the last observation found no work
    _last_progress: float = 0.0  # monotonic time the counter last moved or work was first seen

    def observe(self, stats: EngineStats, now: float) -> str | None:
        """A reason the engine is stalled, or None while it progresses (or has no work)."""
        if stats.num_running + stats.num_waiting == 0:
            self._last_steps = None
            return None
        if stats.num_steps != self._last_steps:  # it stepped, or work just showed up
            self._last_steps = stats.num_steps
            self._last_progress = now
            return None
        stuck_for = now - self._last_progress
        if stuck_for < self.stall_timeout_s:
            return None
        return (
            f"step loop stalled: {stats.num_running} running and {stats.num_waiting} waiting "
            f"requests, no engine step for {stuck_for:.0f} s (stall_timeout_s "
            f"{self.stall_timeout_s:g})"
        )


@dataclass
class ReplicaHealth:
    """A replica's verdict on its engine: the first failure seen, kept for good."""

    watch: StallWatch
    failure: str | None = None

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason

    def check(self, stats: EngineStats | None, now: float, error: str | None = None) -> None:
        """Fold one health observation in: `stats` read now, or the `error` reading failed."""
        if error is not None:
            self.fail(f"engine stats failed: {error}")
            return
        assert stats is not None
        stalled = self.watch.observe(stats, now)
        if stalled is not None:
            self.fail(stalled)

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise ReplicaUnhealthyError(self.failure)
