"""What engine replicas and Serve say about an app, for readers that must not wait on either.

Every call through a Serve handle counts against the replica's `max_ongoing_requests`, so a
scrape or a probe that asked each replica would compete with requests (and queue behind a
full replica). Instead each engine replica posts, to one small actor per application (the
board), its engine's stats (for /metrics) and its health verdict (for /ready): when it starts,
when they change (a failure at once), and at least every `replica.HEARTBEAT_S`. Readers (the
ingress at scrape time, the ready probe in the background) make one plain Ray actor call.

Once a ready probe has asked, the board also keeps Serve's count of RUNNING replicas per
deployment, read by a thread of its own every STATUS_REFRESH_S: `serve.status()` is a
controller round trip plus tens of milliseconds of parsing, which would hold up the probe's own
HTTP answers if the probe's process made it.

The board is detached and found by name, like the limits coordinator: whoever needs it first
creates it (`get_if_exists`), and it outlives every replica, so a replica that dies, or the
replacement of a one-hop app's only replica, loses nothing already posted. Ray restarts it if
its process dies (the replicas post again within a heartbeat). `tokenmill serve` kills it when
it deletes its app on a shared cluster; a RayService cluster keeps it (num_cpus=0).

The name carries BOARD_VERSION: a rollout that changes what is posted gets a new actor rather
than talking to one running the old code.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass

import ray

from engines.api import EngineStats
from pipeline.serve.access.limit_coordinator import NAMESPACE
from pipeline.serve.replicas.readiness import ReplicaReport, running_by_deployment

logger = logging.getLogger(__name__)

BOARD_VERSION = 1
POST_INTERVAL_S = 1.0  # freshness of the engine gauges while steps run
STALE_AFTER_S = 30.0  # a replica that stopped posting (stopped, replaced) drops out
# How soon /ready sees a replica Serve added or removed (a replica's own failure is posted).
STATUS_REFRESH_S = 1.0


def board_name(app_name: str) -> str:
    return f"tokenmill-board-v{BOARD_VERSION}-{app_name}"


@dataclass(frozen=True)
class Snapshot:
    """What the ready probe reads, in one call."""

    running: dict[str, int] | None  # RUNNING replicas per deployment; None: not read yet
    running_age_s: float  # seconds since Serve's status was read
    reports: list[ReplicaReport]  # every replica still posting


@dataclass(frozen=True)
class _Post:
    at: float  # monotonic time of arrival
    stats: EngineStats | None  # None: the replica could not read them
    failure: str | None


@ray.remote(num_cpus=0, max_restarts=-1)
class ReplicaBoard:
    """The latest post per (model, replica), stamped on arrival. A failure is kept: a replica
    whose engine failed is not trusted again, whatever it posts later."""

    def __init__(self, app_name: str) -> None:
        self._app_name = app_name
        self._posts: dict[tuple[str, str], _Post] = {}
        self._running: tuple[float, dict[str, int]] | None = None  # (read at, per deployment)
        self._watcher: threading.Thread | None = None

    def post(
        self, model: str, replica: str, stats: EngineStats | None, failure: str | None = None
    ) -> None:
        previous = self._posts.get((model, replica))
        if previous is not None and previous.failure is not None:
            failure = previous.failure
        self._posts[(model, replica)] = _Post(time.monotonic(), stats, failure)

    def latest(self) -> dict[str, EngineStats]:
        """Per model, the most recently posted stats of a replica still posting."""
        latest: dict[str, tuple[float, EngineStats]] = {}
        for (model, _), post in self._live().items():
            if post.stats is not None and (model not in latest or post.at > latest[model][0]):
                latest[model] = (post.at, post.stats)
        return {model: stats for model, (_, stats) in latest.items()}

    def reports(self) -> list[ReplicaReport]:
        """Every replica still posting: its verdict and how old it is."""
        now = time.monotonic()
        return [
            ReplicaReport(model, replica, now - post.at, post.failure)
            for (model, replica), post in self._live().items()
        ]

    def snapshot(self) -> Snapshot:
        """Serve's running replicas and the replicas' reports. The first call starts watching
        Serve's status: only a ready probe needs it."""
        if self._watcher is None or not self._watcher.is_alive():  # a watcher that died is
            self._watcher = threading.Thread(  # started again, not trusted to be watching
                target=self._watch_serve, name="serve-status", daemon=True
            )
            self._watcher.start()
        running = self._running
        if running is None:
            return Snapshot(None, 0.0, self.reports())
        return Snapshot(running[1], time.monotonic() - running[0], self.reports())

    def _watch_serve(self) -> None:
        from ray import serve

        failing = False
        while True:
            try:
                status = serve.status()  # a controller round trip, however long it takes
                running = running_by_deployment(status, self._app_name)
            except Exception:
                if not failing:
                    logger.warning("reading Serve's status failed; retrying", exc_info=True)
                failing = True
            else:
                # One tuple, replaced whole: snapshot() never sees half of it.
                self._running = (time.monotonic(), running)
                failing = False
            time.sleep(STATUS_REFRESH_S)

    def _live(self) -> dict[tuple[str, str], _Post]:
        now = time.monotonic()
        self._posts = {k: p for k, p in self._posts.items() if now - p.at < STALE_AFTER_S}
        return self._posts


def open_board(app_name: str) -> ray.actor.ActorHandle:
    """The application's board, created if missing. A GCS round trip: off any event loop."""
    return ReplicaBoard.options(  # type: ignore[attr-defined]
        name=board_name(app_name), namespace=NAMESPACE, lifetime="detached", get_if_exists=True
    ).remote(app_name)


def kill_board(app_name: str) -> None:
    """Remove the app's board (its app was deleted); nothing if there is none."""
    with contextlib.suppress(ValueError):  # never created
        ray.kill(ray.get_actor(board_name(app_name), namespace=NAMESPACE))
