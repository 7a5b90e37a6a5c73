"""Cost accounting on a real pipeline run: a tiny job through run_job on local Ray, then the
books of every actor in `_manifest.json` are checked against the rows in the parts."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.spec import JobSpec, parse_job_spec

NUM_ROWS = 24


def write_prompts(path: Path, n: int) -> Path:
    lines = [
        json.dumps({"id": f"p{i:03d}", "prompt": f"Tell me about item {i}."}) for i in range(n)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_job(model_dir: Path, prompts: Path, out: Path, **overrides: Any) -> JobSpec:
    data: dict[str, Any] = {
        "name": "cost-test",
        "input": {
            "uri": str(prompts),
            "format": "jsonl",
            "id_column": "id",
            "prompt_column": "prompt",
        },
        "model": {"path": str(model_dir)},
        "engine": {
            "kind": "reference",
            "device": "cpu",
            "max_batch_size": 8,
            "kv_cache_tokens": 4096,
        },
        "sampling": {"max_tokens": 8, "temperature": 0.0},
        "resources": {"num_actors": 1, "cpus_per_actor": 0.5, "batch_size": 6, "max_in_flight": 8},
        "output": {"uri": str(out), "rows_per_file": 10},
        "cost": {
            "device_hour_usd": 3.5,
            "price_per_million": {"input": 0.5, "output": 2.0},
            "batch_discount": 0.5,
        },
    }
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value}
    return parse_job_spec(data)


def read_rows(out: Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("part-*.parquet")))


def check_books(out: Path) -> dict[str, Any]:
    """Per actor: sum of its rows' gpu_seconds + idle + load == devices x lifetime."""
    manifest = json.loads((out / "_manifest.json").read_text())
    rows = read_rows(out)
    gpu: dict[str, float] = defaultdict(float)
    for actor, seconds in zip(
        rows.column("actor_id").to_pylist(), rows.column("gpu_seconds").to_pylist(), strict=True
    ):
        assert seconds is not None and seconds >= 0 and math.isfinite(seconds)
        if actor is not None:
            gpu[actor] += seconds
    accounts: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in manifest["runs"]:
        for account in run["actors"]:
            accounts[account["actor_id"]].append(account)
    assert set(gpu) <= set(accounts), "rows name an actor with no account"
    for actor, accs in accounts.items():
        paid = math.fsum(a["devices"] * a["lifetime_s"] for a in accs)
        books = gpu[actor] + math.fsum(a["idle_s"] + a["load_s"] + a["pending_s"] for a in accs)
        assert books == pytest.approx(paid, rel=1e-6), (actor, accs)
        assert all(a["pending_s"] == pytest.approx(0.0, abs=1e-9) for a in accs)
        assert all(a["load_s"] > 0 for a in accs)
    return manifest


def test_books_balance_on_a_real_run(ray_local, tiny_model_dir, tmp_path):
    # The CLI's run: the job, then its report beside the output.
    from pipeline.cli.job_cmds import run_job_with_report as run_job

    prompts = write_prompts(tmp_path / "prompts.jsonl", NUM_ROWS)
    out = tmp_path / "out"
    result = run_job(tiny_job(tiny_model_dir, prompts, out))
    assert result.status == "complete", result.message
    manifest = check_books(out)
    rows = read_rows(out)
    assert rows.num_rows == NUM_ROWS
    ok = [r for r in rows.to_pylist() if r["finish_reason"] != "error"]
    assert ok, "no row was generated"
    # Every served row got engine time, priced at the device price.
    for r in ok:
        assert r["gpu_seconds"] > 0, r["id"]
        assert r["cost_usd"] == pytest.approx(r["gpu_seconds"] * 3.5 / 3600)
    totals = manifest["totals"]
    paid = sum(a["devices"] * a["lifetime_s"] for r in manifest["runs"] for a in r["actors"])
    assert totals["total_usd"] == pytest.approx(paid * 3.5 / 3600, rel=1e-9)
    assert totals["rows_usd"] + totals["idle_usd"] + totals["load_usd"] == pytest.approx(
        totals["total_usd"], rel=1e-6
    )
    # The run wrote the report beside the output.
    assert (out / "report.md").exists()
    assert "Books per actor" in (out / "report.md").read_text()
