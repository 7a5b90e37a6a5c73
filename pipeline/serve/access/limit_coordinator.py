"""The Serve app's limits coordinator: one small named Ray actor holding the ledger.

Several ingress replicas share a key's limits through one pipeline.serve.access.limit_ledger.Ledger
in this actor. It is detached and found by name (per app, in its own namespace): the first
ingress replica that needs it creates it (`get_if_exists`), so there is no creation race and
`tokenmill serve` / the RayService need no extra step; being detached, it outlives any one
ingress replica, so a rolling update keeps every key's budget used so far. Ray restarts it if
its process dies (`max_restarts`), with a fresh ledger. `tokenmill serve` kills it when it
deletes its app on a shared cluster; a RayService cluster keeps it (it holds no resources:
num_cpus=0), and a later deployment of the same app finds it again.

The name carries LEDGER_VERSION: a rollout that changes the exchange's types gets a new actor
rather than talking to one running the old code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import ray

from pipeline.serve.access.limit_ledger import Ask, Grant, Ledger

logger = logging.getLogger(__name__)

NAMESPACE = "tokenmill"
LEDGER_VERSION = 1
EXCHANGE_TIMEOUT_S = 2.0  # beyond this the replica serves from its own share (fallback)


def coordinator_name(app_name: str) -> str:
    return f"tokenmill-limits-v{LEDGER_VERSION}-{app_name}"


@ray.remote(num_cpus=0, max_restarts=-1)
class LimitCoordinator:
    """The ledger behind a Ray actor: calls run one at a time, so no lock is needed."""

    def __init__(self) -> None:
        self._ledger = Ledger()

    def exchange(self, replica: str, asks: Sequence[Ask]) -> list[Grant]:
        return self._ledger.exchange(replica, asks)


class CoordinatorUnavailable(Exception):
    """The coordinator could not be reached or did not answer in time."""


class Coordinator(Protocol):
    """Where a replica's exchanges go: the actor, or a Ledger in tests."""

    async def exchange(self, replica: str, asks: Sequence[Ask]) -> list[Grant]: ...


class RemoteCoordinator:
    """The app's coordinator actor, created on first use and looked up again after a failure
    (Ray may have restarted it, or it was killed and another replica re-created it)."""

    def __init__(self, app_name: str, timeout_s: float = EXCHANGE_TIMEOUT_S) -> None:
        self._name = coordinator_name(app_name)
        self._timeout_s = timeout_s
        self._handle: Any = None

    def _open(self) -> Any:
        return LimitCoordinator.options(  # type: ignore[attr-defined]
            name=self._name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True
        ).remote()

    async def exchange(self, replica: str, asks: Sequence[Ask]) -> list[Grant]:
        try:
            if self._handle is None:
                # A GCS round trip: off the event loop, which keeps serving meanwhile.
                self._handle = await asyncio.wait_for(
                    asyncio.to_thread(self._open), self._timeout_s
                )
            ref = self._handle.exchange.remote(replica, list(asks))
            return await asyncio.wait_for(_awaitable(ref), self._timeout_s)
        except Exception as exc:  # dead, restarting, unreachable, slow: all the same here
            self._handle = None
            raise CoordinatorUnavailable(f"limits coordinator {self._name}: {exc!r}") from exc


async def _awaitable(ref: Any) -> Any:
    return await ref


def kill_coordinator(app_name: str) -> None:
    """Remove the app's coordinator (its app was deleted); nothing if there is none."""
    # ValueError: never created (one ingress replica, or no request came).
    with contextlib.suppress(ValueError):
        ray.kill(ray.get_actor(coordinator_name(app_name), namespace=NAMESPACE))
