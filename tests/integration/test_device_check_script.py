"""The GPU device check (tests/gpu/device_check.py) kept working without a GPU: its smoke
shape on CPU, through the real `tokenmill doctor` and `tokenmill run` on a local Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.device_check import main

pytestmark = pytest.mark.timeout(600)

SMOKE = "--device cpu --size tiny --rows 8 --max-tokens 4 --engines reference"


def test_smoke_shape_reports_throughput_and_cost(tmp_path: Path, capsys) -> None:
    report = main([*SMOKE.split(), "--checkpoints", "bf16", "--out", str(tmp_path)])
    (run,) = report["runs"].values()
    assert run["rows"] == 8 and run["completion_tokens"] == 8 * 4  # EOS ignored: fixed length
    assert run["output_tokens_per_s"] > 0 and run["usd_per_million_output"] > 0
    assert any(f["name"] == "reference" and f["status"] == "ok" for f in report["doctor"])
    assert (tmp_path / "report.json").is_file()
    assert "reference-bf16" in capsys.readouterr().out


@pytest.mark.slow
def test_prepared_fp8_checkpoints_are_used_as_they_are(tmp_path: Path) -> None:
    main([*SMOKE.split(), "--prepare-only", "--out", str(tmp_path)])
    marker = tmp_path / "models" / "fp8" / "tokenmill_artifact.json"
    built = marker.stat().st_mtime_ns
    report = main([*SMOKE.split(), "--out", str(tmp_path)])
    assert marker.stat().st_mtime_ns == built  # not rebuilt
    assert set(report["runs"]) == {"reference-bf16", "reference-fp8"}
    agreement = report["agreement_fp8_vs_bf16_reference"]
    assert 0.0 <= agreement["same_text"] <= 1.0 and agreement["shared_prefix"] > 0


OTHER_PYTHON = Path(__file__).resolve().parents[2] / ".venv-trtllm" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not OTHER_PYTHON.is_file(), reason="needs .venv-trtllm (make setup-trtllm)")
def test_the_serve_step_serves_through_serves_environment(tmp_path: Path) -> None:
    """As in the TensorRT-LLM image: the check runs under the engine's environment (here
    .venv-trtllm, TensorRT-LLM 1.2's pins), `tokenmill serve` from Serve's (this one), the
    replica's engine process back under the engine's interpreter. Greedy texts through HTTP
    equal the batch run's for the same prompts."""
    import json
    import subprocess
    import sys

    serve_bin = str(Path(sys.executable).parent)  # Serve's environment: this one
    args = [*SMOKE.split(), "--checkpoints", "bf16", "--out", str(tmp_path)]
    proc = subprocess.run(
        [str(OTHER_PYTHON), "-m", "tests.gpu.device_check", *args, "--serve-env", serve_bin],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    serve = json.loads((tmp_path / "report.json").read_text())["serve"]
    assert serve["engine_python"] == str(OTHER_PYTHON)
    assert serve["models"] == ["check"] and serve["requests"] == 8
    assert serve["same_text_as_batch"] == 1.0
    assert serve["requests_per_s"] > 0 and serve["ttft_p50_ms"] > 0
