"""`tokenmill bench --modes reference,vllm`: both engines on one workload in one command, with
the ratio and both start-up times in the report."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


# A benchmark, in the slow set (two minutes here): `tokenmill bench` itself runs in the
# default suite on the reference engine (tests/integration/test_reference_bench.py).
@pytest.mark.slow
def test_bench_runs_the_reference_engine_and_vllm_side_by_side(tmp_path: Path) -> None:
    from engines.dev.tiny import make_tiny_model

    model = make_tiny_model(
        Path(tempfile.mkdtemp(prefix="tokenmill-bench-vllm-")) / "llama", size="tiny-hd32"
    )
    out = tmp_path / "bench.json"
    args = ["bench", "--model", str(model), "--num-prompts", "8", "--min-prompt-len", "4"]
    args += ["--max-prompt-len", "40", "--min-max-tokens", "2", "--max-max-tokens", "12"]
    args += ["--threads", "1", "--modes", "reference,vllm", "--vllm-eager", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    by_mode = {r["mode"]: r for r in data["results"]}
    assert set(by_mode) == {"reference", "vllm"}
    assert by_mode["vllm"]["error"] is None
    assert by_mode["vllm"]["useful_tokens"] == by_mode["reference"]["useful_tokens"] > 0
    assert by_mode["vllm"]["load_s"] > 0 and by_mode["vllm"]["tokens_per_s"] > 0
    assert data["speedup_vs_vllm"] > 0
    assert "reference vs vllm" in result.output
