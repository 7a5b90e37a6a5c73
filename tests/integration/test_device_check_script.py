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
