"""The strict pydantic base of every settings and spec model (engines.quantize, the job and
serve specs, pipeline.data's config): a misspelled key fails, naming the field, instead of
being ignored; models are frozen; defaults are validated like given values. Here, below
pipeline, because engines import nothing of pipeline."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
