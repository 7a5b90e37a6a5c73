"""`tokenmill quantize`: build an FP8 / NVFP4 checkpoint with ModelOpt, gate it, publish it.

    tokenmill quantize MODEL --format fp8|nvfp4 [--kv-cache fp8] --out URI
    tokenmill quantize --spec jobs/quantize-fp8.yaml [--set quantization.format=nvfp4]

Exit codes: 0 built (or reused from the cache), 1 the build cannot run (bad model, bad
option, storage), 3 the quality gate failed (only quality_report.json was written).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import typer
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engines.quantize.artifacts import QualityGateFailed, build_or_reuse
from engines.quantize.config import QuantizationSpec, QuantizeError
from pipeline.cli.app import app
from pipeline.spec import (
    SpecError,
    StorageSpec,
    apply_overrides,
    format_validation_error,
    load_yaml,
)
from pipeline.storage import StorageError, filesystem_for, materialize_model

EXIT_QUALITY_FAILED = 3


class QuantizeJobSpec(BaseModel):
    """A quantize job file (jobs/quantize-*.yaml): what to quantize, how, and where to put it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Name of this build (logs only).")
    model: str = Field(
        description="Source Hugging Face checkpoint: a local directory or an s3:// prefix."
    )
    model_cache_dir: str = Field(
        "~/.cache/tokenmill/models", description="Where an s3:// source is downloaded to."
    )
    quantization: QuantizationSpec = Field(description="Format, calibration and quality gate.")
    output: str = Field(description="Where the artifact goes: a local directory or s3:// prefix.")
    storage: StorageSpec = Field(
        default_factory=StorageSpec, description="Object storage endpoint (no credentials)."
    )


def _fail(message: str, code: int = 1) -> None:
    typer.echo(message, err=True)
    raise typer.Exit(code)


def load_quantize_spec(path: Path, overrides: list[str]) -> QuantizeJobSpec:

    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror or exc}") from None
    data = load_yaml(text, source=str(path))
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a mapping at the top level")
    data = apply_overrides(data, overrides)
    try:
        return QuantizeJobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, str(path))) from None


def _spec_from_options(
    model: str, out: str, options: dict[str, Any], endpoint_url: str | None
) -> QuantizeJobSpec:

    calibration = {
        k: v
        for k, v in {
            "source": options["calibration"],
            "column": options["column"],
            "num_samples": options["num_samples"],
        }.items()
        if v is not None
    }
    data = {
        "name": Path(model.rstrip("/")).name or "model",
        "model": model,
        "output": out,
        "storage": {"endpoint_url": endpoint_url},
        "quantization": {
            "format": options["format"],
            "kv_cache": options["kv_cache"],
            "calibration": calibration,
            "allow_quality_failure": options["allow_quality_failure"],
            "device": options["device"],
            "quality": {k: v for k, v in options["quality"].items() if v is not None},
        },
    }
    try:
        return QuantizeJobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, "command line")) from None


def run_quantize_job(job: QuantizeJobSpec, overwrite: bool = False):
    """Fetch the source model if remote, then build or reuse the artifact at job.output."""

    model_dir = materialize_model(job.model, job.model_cache_dir, job.storage, field="model")
    out_fs, _ = filesystem_for(job.output, job.storage)
    source = job.quantization.calibration.source
    calibration_fs = filesystem_for(source, job.storage)[0] if source else None
    return build_or_reuse(
        model_dir,
        job.output,
        job.quantization,
        fs=out_fs,
        calibration_fs=calibration_fs,
        overwrite=overwrite,
    )


@app.command("quantize")
def quantize(
    model: str | None = typer.Argument(
        None, help="Hugging Face checkpoint to quantize: a local directory or s3:// prefix."
    ),
    format: str | None = typer.Option(None, "--format", help="fp8 | nvfp4."),
    kv_cache: str | None = typer.Option(None, "--kv-cache", help="fp8: also an FP8 KV cache."),
    out: str | None = typer.Option(None, "--out", help="Output directory or s3:// prefix."),
    spec: Path | None = typer.Option(
        None, "--spec", help="A quantize job file instead of MODEL/--format/--out."
    ),
    set_: list[str] = typer.Option([], "--set", help="Override a --spec field: a.b=c."),
    calibration: str | None = typer.Option(
        None, "--calibration", help="Parquet/JSONL file of calibration text (default: built-in)."
    ),
    column: str | None = typer.Option(None, "--column", help="Text column of --calibration."),
    num_samples: int | None = typer.Option(None, "--num-samples", help="Calibration texts."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda."),
    endpoint_url: str | None = typer.Option(
        None, "--endpoint-url", help="S3 endpoint for s3:// paths (credentials from the env)."
    ),
    allow_quality_failure: bool = typer.Option(
        False, "--allow-quality-failure", help="Publish even if the quality gate fails."
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace an artifact at --out built from other inputs."
    ),
    min_token_agreement: float | None = typer.Option(
        None, "--min-token-agreement", help="Gate: lowest teacher-forced argmax agreement."
    ),
    max_mean_kl: float | None = typer.Option(
        None, "--max-mean-kl", help="Gate: highest mean KL(original || quantized), nats."
    ),
    min_greedy_match: float | None = typer.Option(
        None, "--min-greedy-match", help="Gate: lowest mean greedy tokens before divergence."
    ),
    num_prompts: int | None = typer.Option(
        None, "--num-prompts", help="Gate: held-out texts to compare on."
    ),
    greedy_tokens: int | None = typer.Option(
        None, "--greedy-tokens", help="Gate: greedy tokens generated per held-out text."
    ),
) -> None:
    """Quantize a checkpoint to FP8 or NVFP4 with ModelOpt, check its quality, publish it."""

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if spec is not None:
            if model or format or out:
                _fail("give either --spec or MODEL --format --out, not both")
            job = load_quantize_spec(spec, set_)
            if allow_quality_failure:
                quant = job.quantization.model_copy(update={"allow_quality_failure": True})
                job = job.model_copy(update={"quantization": quant})
        else:
            missing = [
                n for n, v in (("MODEL", model), ("--format", format), ("--out", out)) if not v
            ]
            if missing:
                _fail(f"missing {', '.join(missing)} (or use --spec FILE)")
            options = {
                "format": format,
                "kv_cache": kv_cache,
                "calibration": calibration,
                "column": column,
                "num_samples": num_samples,
                "allow_quality_failure": allow_quality_failure,
                "device": device,
                "quality": {
                    "min_token_agreement": min_token_agreement,
                    "max_mean_kl": max_mean_kl,
                    "min_greedy_match": min_greedy_match,
                    "num_prompts": num_prompts,
                    "greedy_tokens": greedy_tokens,
                },
            }
            job = _spec_from_options(model, out, options, endpoint_url)
        result = run_quantize_job(job, overwrite=overwrite)
    except QualityGateFailed as exc:
        _fail(f"quality gate failed: {exc}", EXIT_QUALITY_FAILED)
    except (QuantizeError, SpecError, StorageError) as exc:
        _fail(f"error: {exc}")
    summary = {
        "artifact": result.uri,
        "cache_key": result.key,
        "reused": result.reused,
        "calibration_batches": result.calibration_batches,
        "quality_passed": result.report.get("passed"),
        "quality_failure_allowed": result.report.get("quality_failure_allowed"),
        "token_agreement": result.report.get("token_agreement"),
        "mean_kl": result.report.get("mean_kl"),
        "greedy_match_mean": result.report.get("greedy_match_mean"),
    }
    typer.echo(json.dumps(summary))
