"""The `storage` section: the object storage endpoint (credentials come from the environment)."""

from __future__ import annotations

from pydantic import Field

from engines.strict import StrictModel


class StorageSpec(StrictModel):
    endpoint_url: str | None = Field(
        None,
        description="S3 endpoint, e.g. https://storage.eu-north1.nebius.cloud. Credentials come "
        "only from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...).",
    )
    region: str | None = Field(None, description="S3 region (e.g. eu-north1).")
    anonymous: bool = Field(False, description="Access public buckets without credentials.")
    retry_s: float = Field(
        600.0,
        ge=0,
        description="While a job runs, how long a failing write of a part, the manifest or the "
        "lease is retried (exponential backoff with jitter) before the job fails. Pre-flight "
        "checks fail fast instead.",
    )
