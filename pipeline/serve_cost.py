"""Per-request device time and USD for the Serve endpoint, from one replica's engine.

A replica serves many requests at once, so a request's device time is its share of the
engine's time, split the same way a batch job splits it (docs/architecture.md):
- engines with step records: each step's duration is shared by the requests in it in proportion
  to their weighted prefill and decode tokens;
- engines without (intervals only): between consecutive enter/leave events, elapsed time is
  shared equally by the requests in the engine.
Both are online: the meter accrues seconds per request id as steps or events arrive, and hands
a request its total when it leaves. Pure Python, no Ray, so tests can drive it directly.
"""

from __future__ import annotations

from collections.abc import Iterable

from engines.api import StepRecord
from pipeline.spec import CostSpec


class StepCostMeter:
    """Accrues device-seconds per request from step records."""

    def __init__(self, num_devices: float, prefill_weight: float, decode_weight: float) -> None:
        self._num_devices = max(num_devices, 1.0)  # a CPU engine is priced as one device
        self._prefill_weight = prefill_weight
        self._decode_weight = decode_weight
        self._accrued: dict[str, float] = {}  # request_id -> device-seconds so far

    def add_steps(self, steps: Iterable[StepRecord]) -> None:
        for step in steps:
            weights = {
                rid: self._prefill_weight * step.prefill_tokens.get(rid, 0)
                + self._decode_weight * step.decode_tokens.get(rid, 0)
                for rid in step.request_ids
            }
            total = sum(weights.values())
            if total <= 0:
                continue
            seconds = (step.end - step.start) * self._num_devices
            for rid, weight in weights.items():
                self._accrued[rid] = self._accrued.get(rid, 0.0) + seconds * weight / total

    def pop(self, request_id: str) -> float:
        """The request's device-seconds; forgets it (call once it has left the engine)."""
        return self._accrued.pop(request_id, 0.0)


class IntervalCostMeter:
    """Accrues device-seconds per request by sharing elapsed time equally among those in flight."""

    def __init__(self, num_devices: float) -> None:
        self._num_devices = max(num_devices, 1.0)
        self._accrued: dict[str, float] = {}  # request_id -> device-seconds, for those in flight
        self._last_event: float | None = None  # monotonic time of the last enter/leave

    def _advance(self, now: float) -> None:
        if self._last_event is not None and self._accrued:
            share = (now - self._last_event) * self._num_devices / len(self._accrued)
            for rid in self._accrued:
                self._accrued[rid] += share
        self._last_event = now

    def enter(self, request_id: str, now: float) -> None:
        self._advance(now)
        self._accrued[request_id] = 0.0

    def leave(self, request_id: str, now: float) -> float:
        self._advance(now)
        return self._accrued.pop(request_id, 0.0)


def cost_usd(gpu_seconds: float, cost: CostSpec) -> float:
    return gpu_seconds * cost.device_hour_usd / 3600.0


def list_price_usd(
    prompt_tokens: int, cached_tokens: int, completion_tokens: int, cost: CostSpec
) -> float | None:
    """What a token-priced online API would charge; None without prices. The batch discount is
    not applied: an interactive request is priced as an online one."""
    prices = cost.price_per_million
    if prices is None:
        return None
    cached_price = prices.input if prices.cached_input is None else prices.cached_input
    uncached = max(prompt_tokens - cached_tokens, 0)
    return (
        uncached * prices.input + cached_tokens * cached_price + completion_tokens * prices.output
    ) / 1e6
