"""The `cost` and `limits` sections: prices, budget and cost split; failure thresholds and
deadline."""

from __future__ import annotations

from pydantic import Field, model_validator

from engines.strict import StrictModel


class LimitsSpec(StrictModel):
    max_error_fraction: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Error rows above this fraction of all rows make the run exit 3 (partial).",
    )
    stop_at: float | None = Field(
        None,
        description="Unix time (seconds) at which a run stops taking rows, commits what has "
        "finished and ends incomplete (exit 1; a rerun resumes), as on SIGTERM: a deadline "
        "such as a Batch API completion window. Null: none.",
    )


class PricePerMillion(StrictModel):
    input: float = Field(0.0, ge=0, description="USD per 1M uncached input tokens.")
    cached_input: float | None = Field(
        None, ge=0, description="USD per 1M cached input tokens; null: the input price."
    )
    output: float = Field(0.0, ge=0, description="USD per 1M output tokens.")


class CostSpec(StrictModel):
    device_hour_usd: float = Field(
        0.0,
        ge=0,
        description="Price of one device-hour: a GPU-hour for GPU actors, a CPU-actor-hour "
        "for CPU actors (e.g. 3.50 for a Nebius H200).",
    )
    price_per_million: PricePerMillion | None = Field(
        None, description="List prices of a token-priced API, for comparison (list_price_usd)."
    )
    batch_discount: float = Field(
        0.0, ge=0, lt=1, description="Discount on list prices for batch APIs (0.5 = half price)."
    )
    prefill_weight: float = Field(
        1.0, ge=0, description="Weight of a prefill token when sharing a step's time."
    )
    decode_weight: float = Field(
        1.0, ge=0, description="Weight of a decode token when sharing a step's time."
    )
    budget_usd: float | None = Field(
        None,
        gt=0,
        description="Stop admitting rows once spend plus the projected cost of rows in flight "
        "would pass this; a rerun with a higher budget resumes.",
    )

    @model_validator(mode="after")
    def _weights(self) -> CostSpec:
        if self.prefill_weight == 0 and self.decode_weight == 0:
            raise ValueError("cost.prefill_weight and cost.decode_weight cannot both be 0")
        return self
