"""The `model` section: the checkpoint to run, its tokenizer and an optional quantized copy."""

from __future__ import annotations

from pydantic import Field

from engines.quantize.config import QuantizationSpec
from engines.strict import StrictModel


class ModelSpec(StrictModel):
    path: str = Field(
        description="Hugging Face model directory: a local path or an s3:// prefix (downloaded "
        "once per node into cache_dir)."
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer directory if not the model's own (local path or s3://)."
    )
    cache_dir: str = Field(
        "~/.cache/tokenmill/models",
        description="Node-local directory where s3:// models are downloaded and reused.",
    )
    name: str | None = Field(
        None,
        description="Name reported in output rows and manifests; default: the path's last part.",
    )
    quantization: QuantizationSpec | None = Field(
        None,
        description="Run a low-precision copy of the model: {format: fp8 | nvfp4, kv_cache, "
        "calibration, quality, cache_uri}. The artifact is reused from cache_uri when one was "
        "built from the same inputs, else built there first (see docs/quantization.md). Null: "
        "load the model as it is.",
    )

    @property
    def display_name(self) -> str:
        return self.name or self.path.rstrip("/").rsplit("/", 1)[-1]
