"""Prices: device-seconds to USD, tokens to list-price USD, and the three cost columns of a row.

A CPU actor (0 GPUs) counts as one device priced at `cost.device_hour_usd` (a CPU-hour price).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.spec import CostSpec

SECONDS_PER_HOUR = 3600.0
TOKENS_PER_MILLION = 1_000_000.0


def billed_devices(devices_per_actor: float) -> float:
    """Devices an actor pays for: its GPUs, or 1 (a CPU-actor-hour) when it holds none."""
    return float(devices_per_actor) if devices_per_actor > 0 else 1.0


def cost_usd(gpu_seconds: float, cost_spec: CostSpec) -> float:
    """USD for `gpu_seconds` device-seconds at `cost_spec.device_hour_usd`."""
    return gpu_seconds * cost_spec.device_hour_usd / SECONDS_PER_HOUR


def list_price_usd(
    prompt_tokens: int, cached_prompt_tokens: int, completion_tokens: int, cost_spec: CostSpec
) -> float:
    """What a token-priced API would charge for one row (0.0 when no list prices are set).

    Cached prompt tokens are billed at `cached_input` (the input price when that is null); the
    batch discount applies to the whole row.
    """
    prices = cost_spec.price_per_million
    if prices is None:
        return 0.0
    cached = min(max(cached_prompt_tokens, 0), max(prompt_tokens, 0))
    uncached = max(prompt_tokens, 0) - cached
    cached_price = prices.input if prices.cached_input is None else prices.cached_input
    usd = (
        uncached * prices.input + cached * cached_price + max(completion_tokens, 0) * prices.output
    ) / TOKENS_PER_MILLION
    return usd * (1.0 - cost_spec.batch_discount)


@dataclass(frozen=True)
class RowCost:
    """The cost columns of one output row."""

    gpu_seconds: float  # device-seconds attributed to the row
    cost_usd: float  # gpu_seconds priced at cost.device_hour_usd
    list_price_usd: float  # the same tokens at the configured API list prices


def row_cost(
    gpu_seconds: float,
    prompt_tokens: int,
    cached_prompt_tokens: int,
    completion_tokens: int,
    cost_spec: CostSpec,
) -> RowCost:
    """All three cost columns for one row, from its device-seconds and token counts."""
    return RowCost(
        gpu_seconds=gpu_seconds,
        cost_usd=cost_usd(gpu_seconds, cost_spec),
        list_price_usd=list_price_usd(
            prompt_tokens, cached_prompt_tokens, completion_tokens, cost_spec
        ),
    )


def per_million(usd: float, tokens: float) -> float | None:
    """USD per million tokens (None when there are no tokens)."""
    return usd / tokens * TOKENS_PER_MILLION if tokens > 0 else None
