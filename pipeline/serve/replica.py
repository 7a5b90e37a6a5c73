"""The engine replica: one Serve deployment replica owning one Engine, shared by many requests.

Built with `open_engine` from the model's ModelSpec / EngineSpec, the same call the batch
actors make, so a served model runs the engine, settings and code a nightly job does. The
replica adds what Serve needs around the engine: cancellation when the caller goes away, and a
per-request device-seconds figure (its share of engine time) for the response's cost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ray import serve

from engines.api import (
    EngineDeadError,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    StreamDelta,
)
from pipeline.cost import CostMeter
from pipeline.serve.cost import EqualShareMeter
from pipeline.serve.spec import ServedModelSpec
from pipeline.spec import StorageSpec


@dataclass(frozen=True)
class ServedResult:
    """A finished request and the device time attributed to it."""

    result: GenerationResult
    gpu_seconds: float


@dataclass(frozen=True)
class ServedDelta:
    """One item of a replica stream.

    The first item of every stream is an empty `admitted` marker, sent as soon as the replica
    accepted the request: the ingress awaits it before answering 200, so a full queue can still
    become a 429 instead of a broken stream. The last item has `delta.finished` and the cost.
    """

    delta: StreamDelta | None  # None only for the admitted marker
    gpu_seconds: float | None = None  # set on the finished item


@serve.deployment
class EngineReplica:
    def __init__(self, served: ServedModelSpec, storage: StorageSpec) -> None:
        from pipeline.engine_setup import open_engine

        load_start = time.monotonic()
        self._engine = open_engine(served.model, served.engine, storage)
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

    def info(self) -> EngineInfo:
        return self._engine.info

    def stats(self) -> EngineStats:
        return self._engine.stats()

    def check_health(self) -> None:
        """Serve's periodic health check: a dead step loop makes Serve replace the replica."""
        try:
            self._engine.stats()
        except EngineDeadError as exc:
            raise RuntimeError(f"engine is dead: {exc}") from exc

    def _enter(self, request: GenerationRequest) -> None:
        now = time.monotonic()
        if self._step_meter is not None:
            self._step_meter.on_submit(request.request_id, now)
        elif self._equal_meter is not None:
            self._equal_meter.enter(request.request_id, now)

    def _leave(self, request: GenerationRequest, result: GenerationResult | None) -> float:
        """The request's device-seconds, once it has left the engine (result None: cancelled)."""
        rid = request.request_id
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
        self._enter(request)
        try:
            result = await self._engine.generate(request)
        except asyncio.CancelledError:
            # The caller went away (client disconnect or a cancelled handle call): free the
            # request's KV blocks now rather than finishing work nobody will read.
            self._engine.abort(request.request_id)
            self._leave(request, None)
            raise
        return ServedResult(result, self._leave(request, result))

    async def stream(self, request: GenerationRequest) -> AsyncIterator[ServedDelta]:
        self._enter(request)
        deltas = self._engine.stream(request)
        finished = False
        try:
            yield ServedDelta(None)
            async for delta in deltas:
                if delta.finished:
                    finished = True
                    yield ServedDelta(delta, self._leave(request, delta.result))
                    return
                yield ServedDelta(delta)
        finally:
            if not finished:
                # Cancelled mid-stream: closing the engine's iterator cancels the request
                # there; abort as well in case the engine's iterator is not a generator.
                close = getattr(deltas, "aclose", None)
                if close is not None:
                    await close()
                self._engine.abort(request.request_id)
                self._leave(request, None)

    def __del__(self) -> None:
        # Serve's documented replica teardown hook: stop the step loop, free memory.
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()


def _cancelled_result(request: GenerationRequest) -> GenerationResult:
    """What the cost meter needs to know of a request that left without a result."""
    return GenerationResult.without_output(request, "cancelled")
