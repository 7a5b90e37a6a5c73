"""The `model` section: the checkpoint to run, its tokenizer and an optional quantized copy."""

from __future__ import annotations

from pydantic import Field, field_validator

from engines.quantize.config import QuantizationSpec
from engines.strict import StrictModel


class FrozenMap(dict[str, str]):
    """A dict that hashes by its items: a spec section is hashable (caches key on it), and a
    map of names is what a user writes. Never mutated after validation."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))


class ModelSpec(StrictModel):
    path: str = Field(
        description="Hugging Face model directory: a local path, an s3:// prefix or a Hugging "
        "Face Hub repository hf://ORG/NAME[@REVISION] (downloaded once per node into "
        "cache_dir; the hub's endpoint from HF_ENDPOINT, its token from HF_TOKEN)."
    )
    tokenizer: str | None = Field(
        None,
        description="Tokenizer directory if not the model's own (local path, s3:// or hf://).",
    )
    cache_dir: str = Field(
        "~/.cache/tokenmill/models",
        description="Node-local directory where s3:// and hf:// models and adapters are "
        "downloaded and reused.",
    )
    name: str | None = Field(
        None,
        description="Name reported in output rows and manifests; default: the path's last part.",
    )
    adapters: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters of this model by name: a PEFT adapter folder (local path, "
        "or an s3:// prefix or hf://ORG/NAME[@REVISION] downloaded once per node into "
        "cache_dir like the model). A row "
        "picks one by input.adapter_column (openai_batch: by its body.model); rows naming "
        "none run on the model itself. In a serve file a request's model field names the "
        "adapter. Every model-running engine kind (see docs/engine.md, LoRA adapters).",
    )
    adapter_prefix: str | None = Field(
        None,
        description="A folder (local path or s3:// prefix) holding one PEFT adapter folder "
        "per name: a row or request naming an adapter not in model.adapters is looked up "
        "as <adapter_prefix>/<name> on first use (an s3:// one downloaded once per node into "
        "cache_dir). A name with no adapter_config.json there is that row's error (404 in "
        "Serve).",
    )
    quantization: QuantizationSpec | None = Field(
        None,
        description="Run a low-precision copy of the model: {format: fp8 | nvfp4, kv_cache, "
        "calibration, quality, cache_uri}. The artifact is reused from cache_uri when one was "
        "built from the same inputs, else built there first (see docs/quantization.md). Null: "
        "load the model as it is.",
    )

    @field_validator("adapters")
    @classmethod
    def _adapter_names(cls, adapters: dict[str, str]) -> dict[str, str]:
        for name, source in adapters.items():
            if not name.strip() or name != name.strip():
                raise ValueError(f"model.adapters: {name!r} is not a usable adapter name")
            if not source:
                raise ValueError(f"model.adapters.{name}: give the adapter's folder")
        return FrozenMap(adapters)

    @property
    def has_adapters(self) -> bool:
        """Whether rows and requests may name LoRA adapters: listed ones, or a prefix."""
        return bool(self.adapters or self.adapter_prefix)

    @property
    def display_name(self) -> str:
        return self.name or self.path.rstrip("/").rsplit("/", 1)[-1]
