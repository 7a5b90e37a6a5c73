"""The GPU example jobs parse: nightly (TensorRT-LLM FP8, the scheduled job) and nightly-nvfp4
load what the quantize-* files publish, nightly-reference runs the reference engine, and the
quantize-* files parse as quantize specs."""

from __future__ import annotations

from pathlib import Path

import pytest

JOBS = Path(__file__).resolve().parents[2] / "jobs"


@pytest.mark.parametrize(
    ("name", "fmt", "price"), [("nightly", "fp8", 3.50), ("nightly-nvfp4", "nvfp4", 5.50)]
)
def test_nightly_low_precision_jobs_load_the_published_checkpoint(name, fmt, price):
    from pipeline.cli.quantize_cmds import load_quantize_spec
    from pipeline.engine_setup import engine_settings
    from pipeline.spec import load_job_spec

    spec = load_job_spec(JOBS / f"{name}.yaml", date="2026-01-31", env={})
    assert spec.engine.kind == "trtllm"
    assert spec.engine.kv_cache_dtype == "fp8"
    # Built beforehand where the quantize extra is (not in TensorRT-LLM's container): the job
    # loads exactly what `tokenmill quantize --spec jobs/quantize-<fmt>.yaml` publishes.
    assert spec.model.quantization is None
    built = load_quantize_spec(JOBS / f"quantize-{fmt}.yaml", [])
    assert spec.model.path == built.output
    assert built.quantization.format == fmt and built.quantization.kv_cache == "fp8"
    assert spec.cost.device_hour_usd == price
    assert spec.resources.devices_per_actor == 1
    assert "2026-01-31" in spec.input.uris[0]
    assert engine_settings(spec.engine)["kv_cache_dtype"] == "fp8"


def test_the_reference_variant_reads_the_same_night():
    from pipeline.spec import load_job_spec

    reference = load_job_spec(JOBS / "nightly-reference.yaml", date="2026-01-31", env={})
    trtllm = load_job_spec(JOBS / "nightly.yaml", date="2026-01-31", env={})
    assert reference.engine.kind == "reference"
    assert reference.input.uris == trtllm.input.uris
    assert reference.output.uri != trtllm.output.uri  # never two engines into one output


def test_the_gpu_serve_file_runs_vllm_on_gpus():
    from pipeline.serve.spec import load_serve_spec

    spec = load_serve_spec(JOBS / "serve-gpu.yaml", env={})
    (model,) = spec.models
    assert model.engine.kind == "vllm"
    assert model.replicas.devices_per_replica == 1
    assert model.model.path.startswith("s3://")
    assert spec.http.host == "0.0.0.0" and not spec.one_hop


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


def test_the_trtllm_serve_file_serves_the_nightlys_fp8_checkpoint_from_the_containers_python():
    from pipeline.cli.quantize_cmds import load_quantize_spec
    from pipeline.serve.spec import load_serve_spec
    from pipeline.spec import load_job_spec

    spec = load_serve_spec(JOBS / "serve-gpu-trtllm.yaml", env={})
    (model,) = spec.models
    assert model.engine.kind == "trtllm"
    nightly = load_job_spec(JOBS / "nightly.yaml", date="2026-01-31", env={})
    built = load_quantize_spec(JOBS / "quantize-fp8.yaml", [])
    assert model.model.path == nightly.model.path == built.output
    assert model.name == nightly.model.name  # one name for the model in batch and Serve
    # The engine in a process under the TensorRT-LLM container's Python, overridable.
    assert model.replicas.engine_python == "/usr/bin/python3"
    assert model.replicas.runs_engine_process("trtllm")
    other = load_serve_spec(JOBS / "serve-gpu-trtllm.yaml", env={"TOKENMILL_ENGINE_PYTHON": "/x"})
    assert other.models[0].replicas.engine_python == "/x"
    assert model.replicas.devices_per_replica == 1 and not spec.one_hop
