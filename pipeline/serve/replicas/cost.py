"""Per-request device time for the Serve endpoint, from one replica's engine.

A response carries its cost when it is sent, so the replica needs each request's share of
engine time at the moment the request finishes:
- engines with step records (reference): `pipeline.cost.CostMeter`, the batch actors' own
  meter: a finished request's share is final once its step records are drained;
- engines with intervals only (TensorRT-LLM): CostMeter's share of a request can still change
  until every request that arrived before it has finished, which a response cannot wait for.
  `EqualShareMeter` settles at the request's departure instead: between consecutive
  enter/leave events, elapsed time is shared equally among the requests in the engine.
"""

from __future__ import annotations

from pipeline.cost import billed_devices


class EqualShareMeter:
    """Accrues device-seconds per request by sharing elapsed time equally among those in flight."""

    def __init__(self, devices: float) -> None:
        self._devices = billed_devices(devices)
        self._accrued: dict[str, float] = {}  # request_id -> wall seconds, for those in flight
        self._last_event: float | None = None  # monotonic time of the last enter/leave

    def _advance(self, now: float) -> None:
        if self._last_event is not None and self._accrued:
            share = max(now - self._last_event, 0.0) / len(self._accrued)
            for rid in self._accrued:
                self._accrued[rid] += share
        self._last_event = now

    def enter(self, request_id: str, now: float) -> None:
        self._advance(now)
        self._accrued[request_id] = 0.0

    def leave(self, request_id: str, now: float) -> float:
        """The request's device-seconds; it stops accruing and is forgotten."""
        self._advance(now)
        return self._accrued.pop(request_id, 0.0) * self._devices
