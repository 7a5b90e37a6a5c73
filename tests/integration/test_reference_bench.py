"""`tokenmill bench` end to end on a tiny model and a small workload: every mode runs in its
own subprocess and the JSON report holds consistent numbers."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from tests.engine_fixtures import tiny_model

pytestmark = pytest.mark.timeout(600)


ALL_MODES = ("reference", "hf-static", "hf-continuous")


@pytest.mark.parametrize(
    ("modes", "rounds"),
    [
        # Default suite: the reference mode alone keeps it quick (two rounds: two
        # subprocesses); the slow run covers every mode.
        pytest.param(("reference",), 2, id="reference"),
        pytest.param(ALL_MODES, 1, id="all-modes", marks=pytest.mark.slow),
    ],
)
def test_bench_command_runs_modes_and_writes_json(tmp_path, modes, rounds) -> None:
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--model",
            str(tiny_model("llama")),
            "--num-prompts",
            "6",
            "--min-prompt-len",
            "4",
            "--max-prompt-len",
            "24",
            "--min-max-tokens",
            "2",
            "--max-max-tokens",
            "10",
            "--threads",
            "1",
            "--static-batch-size",
            "4",
            "--modes",
            ",".join(modes),
            "--rounds",
            str(rounds),
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [(r["round"], r["mode"]) for r in data["results"]] == [
        (i, mode) for i in range(rounds) for mode in modes
    ]
    by_mode = {r["mode"]: r for r in data["results"]}
    useful = {r["useful_tokens"] for r in by_mode.values()}
    assert len(useful) == 1 and useful.pop() > 0  # every mode produced exactly max_tokens
    for r in by_mode.values():
        assert r["error"] is None
        assert r["tokens_per_s"] > 0 and r["peak_rss_mb"] > 0
        assert 0 <= r["ttft_p50_s"] <= r["ttft_p95_s"] <= r["seconds"]
    assert data["matmul_flops_per_s"] > 1e8
    assert data["onednn_flops_per_s"] is None or data["onednn_flops_per_s"] > 1e8
    assert "tok/s" in result.output
    if len(modes) > 1:
        assert data["speedup_vs_best_hf"] > 0
        assert "reference vs best transformers" in result.output


def test_bench_rejects_unknown_modes() -> None:
    result = CliRunner().invoke(app, ["bench", "--modes", "reference,sglang"])
    assert result.exit_code != 0
    assert "sglang" in result.output


def test_bench_reports_the_expert_load_on_a_moe_model(tmp_path) -> None:
    """Qwen3-MoE: the reference rounds carry tokens per expert per step (max and mean) in the
    JSON and the printed line."""
    out = tmp_path / "bench.json"
    args = ["bench", "--model", str(tiny_model("qwen3_moe")), "--num-prompts", "4"]
    args += ["--min-prompt-len", "4", "--max-prompt-len", "16", "--min-max-tokens", "2"]
    args += ["--max-max-tokens", "6", "--threads", "1", "--modes", "reference"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    load = data["results"][0]["expert_load"]
    assert load["num_steps"] > 0
    assert 0 < load["tokens_mean"] <= load["tokens_max"] <= load["tokens_peak"]
    assert load["max_over_mean"] >= 1.0
    assert "tokens per expert per step: max" in result.output


def test_bench_rejects_an_unknown_arch() -> None:
    result = CliRunner().invoke(app, ["bench", "--arch", "mixtral", "--modes", "reference"])
    assert result.exit_code != 0
    assert "mixtral" in result.output
