"""cost.budget_usd end to end: a tiny job stops at its budget with the finished rows
committed, then a rerun with a higher budget resumes and every id ends up exactly once."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tests.integration.test_cost_pipeline import check_books, read_rows, tiny_job, write_prompts

NUM_ROWS = 24


# Slow (50 s): by default the gate's projection and stop are tests/unit/test_cost_budget.py's.
@pytest.mark.slow
def test_budget_stops_the_run_and_a_higher_budget_resumes(ray_local, tiny_model_dir, tmp_path):
    # The CLI's run: the job, then its report beside the output.
    from pipeline.cli.job_cmds import run_job_with_report as run_job

    prompts = write_prompts(tmp_path / "prompts.jsonl", NUM_ROWS)
    out = tmp_path / "out"
    # $1 per device-second: model load alone passes a $0.001 budget, so once the first batch
    # reports its actor's spend no further row is admitted. The first wave (no cost per token
    # known yet, nothing spent) gets in: that is the documented overshoot.
    pricey = {"device_hour_usd": 3600.0, "budget_usd": 0.001}
    small = {"batch_size": 4, "max_in_flight": 4}
    stopped = run_job(tiny_job(tiny_model_dir, prompts, out, cost=pricey, resources=small))
    assert stopped.status == "stopped_at_budget", stopped.message
    assert stopped.exit_code == 5
    assert "budget" in stopped.message
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["status"] == "stopped_at_budget"
    assert manifest["budget"]["is_closed"] and manifest["budget"]["num_refused"] > 0
    assert manifest["budget"]["spent_usd"] > 0.001
    assert not (out / "_SUCCESS").exists()
    first = read_rows(out).column("id").to_pylist()
    assert 0 < len(first) < NUM_ROWS
    assert manifest["missing_rows"] == NUM_ROWS - len(first)
    check_books(out)
    report = (out / "report.md").read_text()
    assert "stopped_at_budget" in report and "stopped admitting rows" in report

    raised = {**pricey, "budget_usd": 1e6}
    resumed = run_job(tiny_job(tiny_model_dir, prompts, out, cost=raised, resources=small))
    assert resumed.status == "complete", resumed.message
    assert resumed.exit_code in (0, 3)  # 3 only if error rows passed limits.max_error_fraction
    ids = read_rows(out).column("id").to_pylist()
    assert Counter(ids) == Counter(f"p{i:03d}" for i in range(NUM_ROWS))
    assert resumed.rows_written == NUM_ROWS - len(first)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["status"] == "complete" and not manifest["budget"]["is_closed"]
    # Earlier spend counts: the second run started from the first run's total.
    assert manifest["budget"]["spent_usd"] > manifest["runs"][0]["actors"][0]["load_s"] * 1.0
    assert (out / "_SUCCESS").exists()
    check_books(out)
