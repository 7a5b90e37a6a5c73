"""`tokenmill quantize` as a user runs it: a spec file, a model and calibration data on S3
(the test S3 server over HTTP), the artifact published to S3 and reused by a second run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("modelopt.torch.quantization")

TOKENMILL = [sys.executable, "-c", "from pipeline.cli import app; app()"]
REPO = Path(__file__).resolve().parents[2]


def tokenmill(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*TOKENMILL, *args],
        cwd=REPO,
        env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.dev.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("cli-src") / "llama", arch="llama", seed=3)


def test_quantize_spec_to_s3_then_reuse(source, s3_server, bucket, aws_env, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from engines.quantize.calibration import sample_text

    s3_server.upload_dir(source, f"s3://{bucket}/models/llama")
    table = pa.table({"prompt": sample_text(60, seed=9)})
    local_parquet = tmp_path / "calib.parquet"
    pq.write_table(table, local_parquet)
    s3_server.put(f"s3://{bucket}/calib/prompts.parquet", local_parquet.read_bytes())
    spec = tmp_path / "quantize.yaml"
    spec.write_text(
        f"""
name: cli-test
model: s3://{bucket}/models/llama
model_cache_dir: {tmp_path / "models"}
quantization:
  format: nvfp4
  kv_cache: fp8
  device: cpu
  calibration: {{source: "s3://{bucket}/calib/prompts.parquet", column: prompt,
                num_samples: 16, max_length: 64}}
  quality: {{num_prompts: 3, greedy_tokens: 8, min_token_agreement: 0.0, max_mean_kl: 10.0,
            min_greedy_match: 0.0}}
output: s3://{bucket}/quantized/llama-nvfp4
storage: {{endpoint_url: "{s3_server.endpoint_url}"}}
"""
    )
    first = tokenmill("quantize", "--spec", str(spec), env=aws_env)
    assert first.returncode == 0, first.stderr
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert summary["reused"] is False and summary["calibration_batches"] == 2
    assert summary["artifact"] == f"s3://{bucket}/quantized/llama-nvfp4"
    names = {uri.rsplit("/", 1)[-1] for uri in s3_server.list_uris(summary["artifact"])}
    assert {"model.safetensors", "hf_quant_config.json", "quality_report.json"} <= names
    assert "tokenmill_artifact.json" in names and "tokenizer.json" in names
    report = json.loads(s3_server.get(f"{summary['artifact']}/quality_report.json"))
    assert report["calibration_source"] == f"s3://{bucket}/calib/prompts.parquet"
    assert report["kv_cache"] == "fp8" and report["num_calibration_texts"] == 16

    again = tokenmill("quantize", "--spec", str(spec), env=aws_env)
    assert again.returncode == 0, again.stderr
    summary2 = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary2["reused"] is True and summary2["calibration_batches"] == 0
    assert summary2["cache_key"] == summary["cache_key"]
    assert "no calibration" in again.stderr


def test_failed_gate_exits_3_and_publishes_nothing_usable(source, tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli import app

    out = tmp_path / "strict"
    args = [str(source), "--format", "fp8", "--out", str(out), "--device", "cpu"]
    gate = ["--num-prompts", "2", "--greedy-tokens", "4", "--min-token-agreement", "1.0"]
    result = CliRunner().invoke(app, ["quantize", *args, *gate, "--max-mean-kl", "0"])
    assert result.exit_code == 3, result.output
    assert "quality gate failed" in result.output and "--allow-quality-failure" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["quality_report.json"]


def test_bad_arguments_are_clear_errors(source, tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli import app

    runner = CliRunner()
    bad = runner.invoke(
        app, ["quantize", str(source), "--format", "int4", "--out", str(tmp_path / "o")]
    )
    assert bad.exit_code == 1
    assert "quantization.format" in bad.output and "'fp8' or 'nvfp4'" in bad.output
    missing = runner.invoke(app, ["quantize", str(source), "--format", "fp8"])
    assert missing.exit_code == 1 and "missing --out" in missing.output
