"""Readiness: can every served model take a request now? Pure logic, testable without Ray.

The ready probe (pipeline/serve/http/probes.py) keeps a view built from two sources, both read
in the background by the app's board (pipeline/serve/replicas/board.py) and from it by the probe,
never on a probe's request path:

- Serve's status (the controller): how many replicas of each model's engine deployment are
  RUNNING. It sees a replica whose process died, and says when a new one can be routed to.
- the replicas' own reports on the app's board (pipeline/serve/replicas/board.py): each engine
  replica posts its verdict (healthy, or why its engine cannot serve) when it starts, every few
  seconds, and at once when its engine dies or stalls. That is seconds before Serve's controller
  acts (after 3 failed health checks in a row), which counts the replica RUNNING until then.

A model is served while Serve counts a RUNNING replica of it and some replica of it reported a
healthy engine within `stale_after_s`. Until both sources have been read once, nothing is; and
a count of Serve's older than `stale_after_s` (its reader stuck or gone) counts for nothing
either: a signal nobody refreshes must not keep saying ready.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReplicaReport:
    """One engine replica's latest post, as the board hands it out."""

    model: str
    replica: str  # Serve's replica id
    age_s: float  # seconds since the replica posted it, when the board was read
    failure: str | None  # why its engine cannot serve; None: healthy


@dataclass(frozen=True)
class Readiness:
    """What /ready answers. Its body holds counts only: the probe needs no key, and model
    names would undo the per-key hiding of models (the names of the unserved go to the log)."""

    models: int  # models served by the app
    models_serving: int  # of them, those with a replica that can take a request now
    age_s: float | None  # age of the older source; None: a source was never read
    unserved: tuple[str, ...]  # names of the models not serving: for the log, not the body

    @property
    def ready(self) -> bool:
        return self.age_s is not None and self.models_serving == self.models

    def body(self) -> dict[str, Any]:
        return {
            "status": "ready" if self.ready else "unavailable",
            "models": self.models,
            "models_serving": self.models_serving,
            "age_s": None if self.age_s is None else round(self.age_s, 3),
        }


def running_by_deployment(status: Any, app_name: str) -> dict[str, int]:
    """Per deployment of the app, the replicas Serve's status (`serve.status()`) lists as
    RUNNING; empty when it does not list the app."""
    app = status.applications.get(app_name)
    if app is None:
        return {}
    return {name: d.replica_states.get("RUNNING", 0) for name, d in app.deployments.items()}


class ReadinessView:
    """The latest read of each source, stamped with the (monotonic) time it was read.

    Written by a refresh thread, read by the request path: every update replaces one tuple
    whole, so a reader never sees half of one."""

    def __init__(self, deployments: Mapping[str, str], stale_after_s: float) -> None:
        self._deployments = dict(sorted(deployments.items()))  # model -> its engine deployment
        self._models = tuple(self._deployments)
        self._stale_after_s = stale_after_s
        self._running: tuple[float, Mapping[str, int]] | None = None
        self._reports: tuple[float, Sequence[ReplicaReport]] | None = None

    def set_running(self, running: Mapping[str, int], at: float) -> None:
        """RUNNING replicas per deployment (running_by_deployment), as Serve said at `at`."""
        self._running = (at, dict(running))

    def set_reports(self, reports: Sequence[ReplicaReport], at: float) -> None:
        self._reports = (at, tuple(reports))

    def current(self, now: float) -> Readiness:
        running, reports = self._running, self._reports
        if running is None or reports is None:
            return Readiness(len(self._models), 0, None, self._models)
        (running_at, counts), (reports_at, posted) = running, reports
        if now - running_at >= self._stale_after_s:
            counts = {}  # Serve's count went stale: no replica is known to run
        since_read = now - reports_at  # reports age on after they were read
        healthy = {
            r.model
            for r in posted
            if r.failure is None and r.age_s + since_read < self._stale_after_s
        }
        unserved = tuple(
            m for m, d in self._deployments.items() if counts.get(d, 0) < 1 or m not in healthy
        )
        return Readiness(
            models=len(self._models),
            models_serving=len(self._models) - len(unserved),
            age_s=max(0.0, now - min(running_at, reports_at)),
            unserved=unserved,
        )
