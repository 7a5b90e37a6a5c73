"""Pre-flight estimates of a job's time and cost from token counts and an assumed throughput."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pipeline.cost.prices import SECONDS_PER_HOUR, billed_devices, list_price_usd, per_million

if TYPE_CHECKING:
    from pipeline.spec import CostSpec, JobSpec, ResourcesSpec


@dataclass(frozen=True)
class CostEstimate:
    """A pre-flight estimate of a job's time and cost (`tokenmill plan`)."""

    num_rows: int
    prompt_tokens: int
    output_tokens: int  # expected completion tokens (e.g. rows x max_tokens: an upper bound)
    tokens_per_s: float  # output tokens per second per actor assumed
    num_actors: int
    devices_per_actor: float  # billed devices (1 for CPU actors)
    wall_s: float  # expected generation time with all actors busy (load time not included)
    device_hours: float
    usd: float  # device_hours x device_hour_usd
    usd_per_million_output: float | None  # usd per 1M output tokens
    list_price_usd: float | None  # the same tokens at the list prices (None: none set)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def estimate_cost(
    spec: JobSpec, num_rows: int, prompt_tokens: int, output_tokens: int, tokens_per_s: float
) -> CostEstimate:
    """Estimate time and cost from token counts and an assumed per-actor output throughput.

    wall = output_tokens / (tokens_per_s x actors); cost = devices x actors x wall x price.
    Autoscaling pools are estimated at max_actors (the fastest, same device-hours).
    """
    return estimate_for_resources(
        spec.resources, spec.cost, num_rows, prompt_tokens, output_tokens, tokens_per_s
    )


def estimate_for_resources(
    resources: ResourcesSpec,
    cost_spec: CostSpec,
    num_rows: int,
    prompt_tokens: int,
    output_tokens: int,
    tokens_per_s: float,
) -> CostEstimate:
    """`estimate_cost` from the two spec sections it reads (the report re-parses only these)."""
    if tokens_per_s <= 0:
        raise ValueError(
            f"tokens_per_s must be > 0 (output tokens per second per actor), got {tokens_per_s}"
        )
    num_actors = resources.num_actors or resources.max_actors or 1
    devices = billed_devices(resources.devices_per_actor)
    wall_s = output_tokens / (tokens_per_s * num_actors)
    device_hours = devices * num_actors * wall_s / SECONDS_PER_HOUR
    usd = device_hours * cost_spec.device_hour_usd
    has_list = cost_spec.price_per_million is not None
    return CostEstimate(
        num_rows=num_rows,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        tokens_per_s=tokens_per_s,
        num_actors=num_actors,
        devices_per_actor=devices,
        wall_s=wall_s,
        device_hours=device_hours,
        usd=usd,
        usd_per_million_output=per_million(usd, output_tokens),
        list_price_usd=list_price_usd(prompt_tokens, 0, output_tokens, cost_spec)
        if has_list
        else None,
    )
