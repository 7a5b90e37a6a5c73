"""Is an engine still making progress? Plain logic over EngineStats, shared by the Serve
replica's health check (pipeline/serve/replicas/health.py) and the batch engine actor's
watchdog (pipeline/batch/stages/generate.py): a dead engine raises from stats() itself; a hung one
shows work with no progress, which only a watch over time can see."""

from __future__ import annotations

from dataclasses import dataclass

from engines.api import EngineStats


@dataclass
class StallWatch:
    """Notices an engine that makes no progress while requests wait for it.

    Progress is a step or a finished request: engines whose API shows no step count
    (TensorRT-LLM's LLM API) progress by finishing requests, so on them the timeout must
    exceed the longest request."""

    stall_timeout_s: float
    # (steps, finished) at the last progress; None: the last observation found no work.
    _last: tuple[int, int] | None = None
    _last_progress: float = 0.0  # monotonic time of the last progress, or when work showed up

    def observe(self, stats: EngineStats, now: float) -> str | None:
        """A reason the engine is stalled, or None while it progresses (or has no work)."""
        if stats.num_running + stats.num_waiting == 0:
            self._last = None
            return None
        progress = (stats.num_steps, stats.num_finished)
        if progress != self._last:  # it stepped or finished something, or work showed up
            self._last = progress
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
