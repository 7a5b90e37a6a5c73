"""Replica health: is this engine still making progress? Pure logic, testable without Ray.

Serve calls a replica's `check_health` every `health.check_period_s`; raising marks the
replica unhealthy, and after Serve's threshold of consecutive failures (3 in Ray 2.60) it is
stopped and replaced. Two things make an engine replica unhealthy:

- its engine is dead: a call raised EngineDeadError, or `stats()` itself fails;
- its step loop is stalled: work is waiting (running + waiting > 0) and the engine has made
  no progress (no step, no finished request) for `health.stall_timeout_s`
  (engines.health.StallWatch, shared with the batch engine actors). An idle engine never
  counts as stalled, since an idle step loop has nothing to step.

Once unhealthy, a replica stays unhealthy (`ReplicaHealth.failure` is sticky): its in-flight
requests have been failed with 503 already, and a step loop that hung once is not trusted to
serve the next request.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.api import EngineStats
from engines.health import StallWatch


class ReplicaUnhealthyError(RuntimeError):
    """This replica's engine is dead or stalled; Serve will replace the replica."""


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
