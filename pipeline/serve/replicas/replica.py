"""The engine replica: one Serve deployment replica owning one Engine, shared by many requests.

Built with `open_engine` from the model's ModelSpec / EngineSpec, the same call the batch
actors make, so a served model runs the engine, settings and code a nightly job does. The
replica adds what Serve needs around the engine: cancellation when the caller goes away, and a
per-request device-seconds figure (its share of engine time) for the response's cost, and
honest health (pipeline/serve/replicas/health.py): Serve's `check_health` fails once the engine
is dead or its step loop has stalled, requests in flight on such a replica fail at once with
ReplicaUnhealthyError (the ingress answers 503) instead of waiting for a step that never comes,
and the verdict goes to the app's board at once, where /ready reads it
(pipeline/serve/http/probes.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

import ray
from ray import serve

from engines.api import (
    EngineDeadError,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    StreamDelta,
)
from engines.health import StallWatch
from engines.samples import fan_out, merge
from pipeline.cost import CostMeter
from pipeline.engine_setup import open_engine
from pipeline.serve.replicas.board import POST_INTERVAL_S, open_board
from pipeline.serve.replicas.coalesce import coalesce
from pipeline.serve.replicas.cost import EqualShareMeter
from pipeline.serve.replicas.health import ReplicaHealth
from pipeline.serve.replicas.testhooks import BreakMode, break_engine
from pipeline.serve.spec import ServedModelSpec
from pipeline.spec import StorageSpec

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Idle stats do not change; posting them this often anyway keeps the board from dropping the
# replica as stopped (board.STALE_AFTER_S), and so /ready from counting it out.
HEARTBEAT_S = 10.0
# A request entering or leaving wakes the poster, which posts after this pause (the request
# has reached, or left, the engine by then). It also spaces posts out under load.
SETTLE_S = 0.05


@dataclass(frozen=True)
class ServedResult:
    """A finished request and the device time attributed to it."""

    result: GenerationResult
    gpu_seconds: float
    replica: str = ""  # id of the replica that served it


@dataclass(frozen=True)
class ServedDelta:
    """One item of a replica stream.

    The first item of every stream is an empty `admitted` marker, sent as soon as the replica
    accepted the request: the ingress awaits it before answering 200, so a full queue can still
    become a 429 instead of a broken stream. The last item has `delta.finished` and the cost.
    """

    delta: StreamDelta | None  # None only for the admitted marker
    gpu_seconds: float | None = None  # set on the finished item
    replica: str = ""  # set on the admitted marker: id of the replica serving the stream
    index: int = 0  # n > 1 (stream_n): which sample the delta belongs to


@serve.deployment
class EngineReplica:
    def __init__(self, served: ServedModelSpec, storage: StorageSpec) -> None:

        load_start = time.monotonic()
        self._engine = open_engine(
            served.model,
            served.engine,
            storage,
            own_process=served.replicas.runs_engine_process(served.engine.kind),
            interpreter=served.replicas.engine_python,
            devices=served.replicas.devices_per_replica,
        )
        info = self._engine.info
        devices = served.replicas.devices_per_replica
        self._step_meter: CostMeter | None = None
        self._equal_meter: EqualShareMeter | None = None
        if info.has_step_records:
            self._step_meter = CostMeter(
                devices,
                served.cost.prefill_weight,
                served.cost.decode_weight,
                start=load_start,
                has_step_records=True,
            )
            self._step_meter.record_load(load_start, time.monotonic())
        else:
            self._equal_meter = EqualShareMeter(devices)
        self._cancelled: list[GenerationRequest] = []  # cancelled since the last drain
        self._model = served.name
        self._stream_interval_s = served.replicas.stream_interval_s
        self._replica_id, self._app_name = _replica_identity()
        self._health = ReplicaHealth(StallWatch(served.health.stall_timeout_s))
        # Resolved when the replica turns unhealthy; every in-flight call races it. Created on
        # the replica's event loop on first use (Serve may build the replica on another one).
        self._failed: asyncio.Future[None] | None = None
        self._poster: asyncio.Task[None] | None = None
        self._posted_busy: bool | None = None  # busy state of the last stats posted
        self._stats_changed = asyncio.Event()
        self._board: ray.actor.ActorHandle | None = None  # found by the poster

    def info(self) -> EngineInfo:
        return self._engine.info

    def stats(self) -> EngineStats:
        return self._engine.stats()

    async def check_health(self) -> None:
        """Serve's periodic health check: raising marks the replica unhealthy, and Serve
        replaces it after 3 failures in a row. Reads engine stats only: no request slot, no
        engine step."""
        self._ensure_poster()
        try:
            stats = self._engine.stats()
        except Exception as exc:
            self._health.check(None, time.monotonic(), error=f"{type(exc).__name__}: {exc}")
        else:
            self._health.check(stats, time.monotonic())
        if self._health.failure is not None:
            self._mark_failed()
            logger.error("replica %s unhealthy: %s", self._replica_id, self._health.failure)
            self._health.raise_if_failed()

    def debug_break_engine(self, mode: BreakMode) -> str:
        """Test hook (TOKENMILL_TEST_HOOKS=1 only): break this replica's step loop."""
        break_engine(self._engine, mode)  # PermissionError when the hooks are off
        logger.warning("test hook: engine of replica %s broken (%s)", self._replica_id, mode)
        return self._replica_id

    # --- health --------------------------------------------------------------------------

    def _failure_future(self) -> asyncio.Future[None]:
        if self._failed is None:
            self._failed = asyncio.get_running_loop().create_future()
            if self._health.failure is not None:
                self._failed.set_result(None)
        return self._failed

    def _mark_failed(self, reason: str | None = None) -> None:
        if reason is not None:
            self._health.fail(reason)
        future = self._failure_future()
        if not future.done():
            future.set_result(None)
            # Posted at once: /ready turns 503 now, not after Serve's 3 failed health checks.
            self._ensure_poster()
            self._stats_changed.set()

    async def _unless_failed(self, awaitable: Awaitable[T]) -> T:
        """Await an engine call, unless the replica turns unhealthy first: a stalled step loop
        would never answer, so its callers get ReplicaUnhealthyError (503) instead."""
        task = asyncio.ensure_future(awaitable)
        try:
            await asyncio.wait((task, self._failure_future()), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await _cancel(task)  # the caller went away: the engine call's cleanup aborts it
            raise
        if task.done():
            try:
                return task.result()
            except EngineDeadError as exc:
                self._mark_failed(f"engine dead: {exc}")
                raise
        # Wait for the cancellation to land, so the engine stream is no longer running when
        # the caller closes it.
        await _cancel(task)
        self._health.raise_if_failed()
        raise AssertionError("unreachable: the failure future resolved without a failure")

    def _ensure_poster(self) -> None:
        if self._poster is None or self._poster.done():
            self._stats_changed.set()  # its first post goes at once
            self._poster = asyncio.get_running_loop().create_task(self._post_stats())

    def _post_now(self) -> None:
        """Post the engine's stats at once, without waiting, when the engine turned busy or
        idle since the last post: called where a request has just reached or left the engine,
        so a scrape made after the client saw its first token cannot read the idle stats of
        before it, nor one made after the reply the busy stats (the post leaves before the
        token does). Under steady load nothing flips and the poster's periodic posts suffice:
        an actor call per request here would cost more than the request's own Ray hops."""
        if self._board is None:
            return
        try:
            stats = self._engine.stats()
        except Exception:  # a dead engine: the health check and its post say so
            return
        busy = stats.num_running + stats.num_waiting > 0
        if busy == self._posted_busy:
            return
        try:
            self._board.post.remote(self._model, self._replica_id, stats, self._health.failure)
        except Exception:
            self._board = None
            return
        self._posted_busy = busy

    async def _post_stats(self) -> None:
        """Post the engine's stats and this replica's health verdict to the app's board
        (pipeline/serve/replicas/board.py), for /metrics and /ready: at once when the poster starts
        (the first health check, before Serve routes to the replica) and when the replica
        fails, soon after requests come and go, every POST_INTERVAL_S while steps run, and
        every HEARTBEAT_S when nothing changes."""
        last: tuple[EngineStats | None, str | None] | None = None
        last_post = 0.0
        while True:
            # asyncio.wait, not wait_for: wait_for (before 3.12) can swallow a cancellation
            # that lands as the event fires, and this loop would then outlive its replica.
            changed = asyncio.ensure_future(self._stats_changed.wait())
            try:
                await asyncio.wait((changed,), timeout=POST_INTERVAL_S)
            finally:
                changed.cancel()
            self._stats_changed.clear()
            await asyncio.sleep(SETTLE_S)
            try:
                stats: EngineStats | None = self._engine.stats()
            except Exception:
                stats = None  # the health check says why
            posted = (stats, self._health.failure)
            now = time.monotonic()
            if self._board is not None and posted == last and now - last_post < HEARTBEAT_S:
                continue
            if self._board is None:
                self._board = await asyncio.to_thread(_open_board, self._app_name)
                if self._board is None:
                    continue  # not in Ray, or the GCS did not answer: next round
            try:
                await _within(self._board.post.remote(self._model, self._replica_id, *posted), 5)
            except Exception:
                self._board = None  # killed (its app was deleted and redeployed): open again
                continue
            last, last_post = posted, now
            if stats is not None:
                self._posted_busy = stats.num_running + stats.num_waiting > 0

    def _enter(self, request: GenerationRequest) -> None:
        self._ensure_poster()
        self._stats_changed.set()
        now = time.monotonic()
        if self._step_meter is not None:
            self._step_meter.on_submit(request.request_id, now)
        elif self._equal_meter is not None:
            self._equal_meter.enter(request.request_id, now)

    def _leave(self, request: GenerationRequest, result: GenerationResult | None) -> float:
        """The request's device-seconds, once it has left the engine (result None: cancelled)."""
        rid = request.request_id
        self._post_now()
        self._stats_changed.set()  # and again once an abort has landed
        if self._equal_meter is not None:
            return self._equal_meter.leave(rid, time.monotonic())
        assert self._step_meter is not None  # one of the two meters is always set
        meter = self._step_meter
        # The engine records a request's steps before delivering its result, so after this
        # drain a finished request's share is final.
        meter.add_steps(self._engine.drain_step_records())
        # A cancelled request may still be in the step that was running when it was aborted;
        # that step reaches the meter with a later drain. Settle such leftovers once, here, so
        # the meter does not keep an entry per disconnected client.
        leftovers, self._cancelled = self._cancelled, []
        for stale in leftovers:
            meter.on_finish(_cancelled_result(stale))
            meter.pop_row_seconds(stale.request_id)
        if result is None:
            self._cancelled.append(request)
            result = _cancelled_result(request)
        meter.on_finish(result)
        return meter.pop_row_seconds(rid)

    async def generate(self, request: GenerationRequest) -> ServedResult:
        self._health.raise_if_failed()
        self._enter(request)
        try:
            result = await self._unless_failed(self._engine.generate(request))
        except BaseException:
            # The caller went away (client disconnect or a cancelled handle call) or the
            # engine failed: free the request's KV blocks now rather than finishing work
            # nobody will read.
            self._engine.abort(request.request_id)
            self._leave(request, None)
            raise
        return ServedResult(result, self._leave(request, result), self._replica_id)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[ServedDelta]:
        self._health.raise_if_failed()
        self._enter(request)
        engine_deltas = self._engine.stream(request)
        deltas = coalesce(engine_deltas, self._stream_interval_s)
        finished = False
        try:
            yield ServedDelta(None, replica=self._replica_id)
            first = True
            while True:
                try:
                    delta = await self._unless_failed(anext(deltas))
                except StopAsyncIteration:
                    return
                if first:
                    first = False
                    self._post_now()
                if delta.finished:
                    finished = True
                    yield ServedDelta(delta, self._leave(request, delta.result))
                    return
                yield ServedDelta(delta)
        finally:
            if not finished:
                # Cancelled mid-stream: closing the engine's iterator cancels the request
                # there; abort as well in case the engine's iterator is not a generator.
                await deltas.aclose()
                close = getattr(engine_deltas, "aclose", None)
                if close is not None:
                    await close()
                self._engine.abort(request.request_id)
                self._leave(request, None)

    async def generate_n(self, request: GenerationRequest, n: int) -> list[ServedResult]:
        """n samples of one prompt (OpenAI's `n`), in index order. They run here, on one
        engine, so the engine can compute the prompt once for all of them (engines.samples).
        Cancelling the call cancels every sample."""

        return list(await asyncio.gather(*(self.generate(r) for r in fan_out(request, n))))

    async def stream_n(self, request: GenerationRequest, n: int) -> AsyncIterator[ServedDelta]:
        """Like stream, for n samples at once: one admitted marker, then every sample's deltas
        as they come, each with its `index`; each sample ends with its finished delta."""

        streams = [self.stream(r) for r in fan_out(request, n)]
        merged = merge(streams)
        try:
            yield ServedDelta(None, replica=self._replica_id)
            async for index, item in merged:
                if item.delta is not None:
                    yield ServedDelta(item.delta, item.gpu_seconds, index=index)
        finally:
            await merged.aclose()

    def __del__(self) -> None:
        # Serve's documented replica teardown hook: stop the step loop, free memory. Not for
        # an unhealthy replica: joining a hung step loop would block until Serve's graceful
        # shutdown timeout, holding the devices the replacement needs; the actor process
        # exits right after this and frees them anyway.
        engine = getattr(self, "_engine", None)
        health = getattr(self, "_health", None)
        if engine is not None and (health is None or health.failure is None):
            engine.shutdown()


async def _within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """Await with a timeout (TimeoutError). Unlike wait_for before Python 3.12, it never
    swallows a cancellation that lands as the awaited call completes."""
    future = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait((future,), timeout=timeout_s)
    if not done:
        future.cancel()
        raise TimeoutError(f"no answer within {timeout_s} s")
    return future.result()


async def _cancel(task: asyncio.Future) -> None:
    task.cancel()
    # Bounded: the engine call's cancellation cleanup only enqueues an abort.
    await asyncio.wait((task,), timeout=5)


def _open_board(app_name: str) -> ray.actor.ActorHandle | None:
    """The app's board; None for a replica built outside Ray (unit tests) or when the GCS
    cannot be reached now."""
    if not ray.is_initialized():
        return None
    try:
        return open_board(app_name)
    except Exception:
        logger.warning("cannot open the board of app %s", app_name, exc_info=True)
        return None


def _replica_identity() -> tuple[str, str]:
    """(replica id, application name) from Serve's replica context."""
    try:
        replica_id = serve.get_replica_context().replica_id
    except Exception:  # built outside Serve (unit tests)
        return "local", "local"
    return replica_id.unique_id, replica_id.deployment_id.app_name


def _cancelled_result(request: GenerationRequest) -> GenerationResult:
    """What the cost meter needs to know of a request that left without a result."""
    return GenerationResult.without_output(request, "cancelled")
