"""Turn a job's model and engine sections into a loaded Engine.

Shared by the batch actors and the Serve replicas so both run the same engine the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines import Engine, load_engine
from engines.factory import accepted_settings
from engines.process import ProcessEngine
from engines.quantize.artifacts import MARKER, build_in_cache
from pipeline.spec import EngineSpec, ModelSpec, StorageSpec
from pipeline.storage import filesystem_for, is_s3, join_uri, materialize_model
from pipeline.storage.hub import is_hub


def engine_settings(engine: EngineSpec) -> dict[str, Any]:
    """The keyword arguments `load_engine(engine.kind, ...)` takes for this spec: the
    EngineSpec fields the engine accepts (the others belong to other kinds). Null fields are
    left out, so the engine's own default applies (each kind documents its defaults)."""
    accepted = accepted_settings(engine.kind)
    settings = {
        name: getattr(engine, name)
        for name in EngineSpec.model_fields
        if name in accepted and getattr(engine, name) is not None
    }
    if "speculative" in settings:
        # Engines take plain data (they never import the pipeline); unset fields get the
        # engine's own defaults.
        settings["speculative"] = engine.speculative.model_dump(exclude_none=True)
    settings.update(engine.extra)
    return settings


def open_engine(
    model: ModelSpec,
    engine: EngineSpec,
    storage: StorageSpec,
    *,
    own_process: bool = False,
    interpreter: str | None = None,
    devices: float = 0,
) -> Engine:
    """Fetch the model to local disk if it is remote (once per node), then load the engine:
    here, or with `own_process` in a child process of its own (engines/process.py), under
    `interpreter` when given (another environment's Python).
    `devices` is the GPUs the actor or replica holds: below 1, engines share a GPU, which an
    engine that sizes GPU memory per engine is told (`placement_settings`)."""

    local_path = materialize_model(model.path, model.cache_dir, storage)
    if model.quantization is not None:
        local_path = quantized_model(local_path, model, storage)
    settings = {**placement_settings(engine, devices), **engine_settings(engine)}
    if model.adapters:
        settings["lora_adapters"] = adapter_folders(model, storage)
    if model.adapter_prefix:
        settings["lora_prefix"] = adapter_prefix(model, storage)
    if own_process:
        return ProcessEngine(
            engine.kind, model=str(local_path), interpreter=interpreter, **settings
        )
    return load_engine(engine.kind, model=str(local_path), **settings)


def adapter_folders(model: ModelSpec, storage: StorageSpec) -> dict[str, str]:
    """model.adapters as local folders: an s3:// prefix downloaded once per node into the
    model's cache_dir (a prefix that cannot be read fails the engine's load, naming
    model.adapters.<name>, as a bad model path does); a local folder as it is, checked by the
    engine when a row first asks for it (a bad one fails that adapter's rows only)."""
    return {
        name: str(
            materialize_model(
                source,
                model.cache_dir,
                storage,
                required_file="adapter_config.json",
                field=f"model.adapters.{name}",
            )
        )
        if is_s3(source) or is_hub(source)
        else source
        for name, source in model.adapters.items()
    }


def adapter_prefix(model: ModelSpec, storage: StorageSpec) -> dict[str, Any]:
    """model.adapter_prefix as the engines' `lora_prefix` setting (engines/lora/prefix.py):
    where to look and where S3 is, never a credential (those stay in the environment)."""
    return {
        "uri": model.adapter_prefix,
        "cache_dir": join_uri(model.cache_dir, "adapters"),
        "endpoint_url": storage.endpoint_url,
        "region": storage.region,
        "anonymous": storage.anonymous,
    }


def placement_settings(engine: EngineSpec, devices: float) -> dict[str, Any]:
    """Settings that follow from where the engine runs rather than from the job's engine
    section: `actors_per_device` (how many engines Ray packs on one GPU) for the kinds that
    take it. A job's own engine.extra value wins."""
    if not 0 < devices < 1 or "actors_per_device" not in accepted_settings(engine.kind):
        return {}
    return {"actors_per_device": max(1, int(1 / devices + 1e-9))}


def quantized_model(local_path: Path, model: ModelSpec, storage: StorageSpec) -> Path:
    """The local directory of `model.quantization`'s artifact: reused from its cache when one
    was built from the same inputs, built (calibrated, gated, published) there first if not."""

    spec = model.quantization
    cache_uri = spec.cache_uri or join_uri(model.cache_dir, "quantized")
    source = spec.calibration.source
    result = build_in_cache(
        local_path,
        cache_uri,
        model.display_name,
        spec,
        fs=filesystem_for(cache_uri, storage)[0],
        calibration_fs=filesystem_for(source, storage)[0] if source else None,
    )
    return materialize_model(
        result.uri,
        model.cache_dir,
        storage,
        required_file=MARKER,
        field="model.quantization.cache_uri",
    )
