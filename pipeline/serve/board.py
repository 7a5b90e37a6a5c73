"""Engine stats for /metrics without taking an engine request slot.

Every call through a Serve handle counts against the replica's `max_ongoing_requests`, so a
scrape that asked each replica for its stats would compete with requests (and queue behind a
full replica). Instead each engine replica posts its stats, when they change and at most
every `POST_INTERVAL_S`, to one small actor per application (the board), and the ingress
reads the board at scrape time: one plain Ray actor call, no engine involved.

The board is created by the ingress (`get_if_exists`, so several ingress replicas share one)
and lives as long as the ingress replica that created it; replicas look it up by name and
look again after a failed post, so a board re-created by another ingress is found.
"""

from __future__ import annotations

import time

import ray

from engines.api import EngineStats

POST_INTERVAL_S = 1.0  # freshness of the engine gauges
STALE_AFTER_S = 30.0  # a replica that stopped posting (stopped, replaced) drops out


def board_name(app_name: str) -> str:
    return f"tokenmill-engine-stats-{app_name}"


@ray.remote(num_cpus=0)
class StatsBoard:
    """Latest EngineStats per model and replica, stamped on arrival."""

    def __init__(self) -> None:
        self._posts: dict[str, dict[str, tuple[float, EngineStats]]] = {}

    def post(self, model: str, replica: str, stats: EngineStats) -> None:
        self._posts.setdefault(model, {})[replica] = (time.monotonic(), stats)

    def latest(self) -> dict[str, EngineStats]:
        """Per model, the most recently posted stats of a replica still posting."""
        now = time.monotonic()
        latest: dict[str, EngineStats] = {}
        for model, replicas in self._posts.items():
            live = {r: p for r, p in replicas.items() if now - p[0] < STALE_AFTER_S}
            self._posts[model] = live
            if live:
                latest[model] = max(live.values(), key=lambda p: p[0])[1]
        return latest


def open_board(app_name: str) -> ray.actor.ActorHandle:
    """The application's board, created if missing (the ingress calls this)."""
    return StatsBoard.options(name=board_name(app_name), get_if_exists=True).remote()


def find_board(app_name: str) -> ray.actor.ActorHandle | None:
    """The application's board if it exists (replicas call this; they never create it)."""
    if not ray.is_initialized():
        return None  # a replica built outside Ray (unit tests): nothing to post to
    try:
        return ray.get_actor(board_name(app_name))
    except Exception:  # ValueError: not created yet; anything else: try again next post
        return None
