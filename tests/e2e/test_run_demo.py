"""`tokenmill demo` end to end (what `make demo` runs on a fresh machine), on fewer rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.e2e.test_run import cli_env

pytestmark = pytest.mark.timeout(400)


def test_demo_builds_model_runs_job_and_prints_summary(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pipeline.cli import app; app()",
            "demo",
            "--dir",
            str(tmp_path),
            "--rows",
            "40",
        ],
        capture_output=True,
        text=True,
        timeout=380,
        env=cli_env(),
        cwd=tmp_path,  # the demo must not depend on the working directory
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = tmp_path / "results"
    assert f"demo output: {results}" in proc.stdout
    assert "output tokens/s" in proc.stdout  # the summary table
    assert (results / "_SUCCESS").exists()
    assert "Books per actor" in (results / "report.md").read_text()  # the CLI wrote the report
    table = pq.read_table(sorted(results.glob("part-*.parquet")))
    ids = table.column("id").to_pylist()
    assert sorted(ids) == [f"demo-{i:05d}" for i in range(40)]
    prompts = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    budget = {p["id"]: p["max_tokens"] for p in prompts}
    for row in table.select(["id", "completion_tokens", "topic"]).to_pylist():
        assert 1 <= row["completion_tokens"] <= budget[row["id"]]  # per-row max_tokens
        assert row["topic"]  # passthrough column
