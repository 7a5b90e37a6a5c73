"""The low-precision example jobs parse: nightly-fp8 / nightly-nvfp4 as job specs, and the
quantize-* files as quantize specs."""

from __future__ import annotations

from pathlib import Path

import pytest

JOBS = Path(__file__).resolve().parents[2] / "jobs"


@pytest.mark.parametrize(
    ("name", "fmt", "price"), [("nightly-fp8", "fp8", 3.50), ("nightly-nvfp4", "nvfp4", 5.50)]
)
def test_nightly_low_precision_jobs_validate(name, fmt, price):
    from pipeline.engine_setup import engine_settings
    from pipeline.spec import load_job_spec

    spec = load_job_spec(JOBS / f"{name}.yaml", date="2026-01-31", env={})
    assert spec.engine.kind == "trtllm"
    assert spec.engine.kv_cache_dtype == "fp8"
    assert spec.model.quantization is not None
    assert spec.model.quantization.format == fmt and spec.model.quantization.kv_cache == "fp8"
    assert spec.cost.device_hour_usd == price
    assert spec.resources.devices_per_actor == 1
    assert "2026-01-31" in spec.input.uris[0]
    assert engine_settings(spec.engine)["kv_cache_dtype"] == "fp8"


@pytest.mark.parametrize("name", ["quantize-fp8", "quantize-nvfp4"])
def test_quantize_jobs_validate(name):
    from pipeline.cli.quantize_cmds import load_quantize_spec

    spec = load_quantize_spec(JOBS / f"{name}.yaml", ["model=/models/llama"])
    assert spec.model == "/models/llama"
    assert spec.quantization.format == name.split("-")[1]
    assert spec.quantization.kv_cache == "fp8"
    assert spec.output.startswith("s3://")


def test_quantize_spec_errors_name_the_field(tmp_path):
    from pipeline.cli.quantize_cmds import load_quantize_spec
    from pipeline.spec import SpecError

    bad = tmp_path / "q.yaml"
    bad.write_text("name: q\nmodel: m\noutput: o\nquantization: {format: int4, kv_cahce: fp8}\n")
    with pytest.raises(SpecError) as info:
        load_quantize_spec(bad, [])
    message = str(info.value)
    assert "quantization.format" in message and "quantization.kv_cahce" in message
