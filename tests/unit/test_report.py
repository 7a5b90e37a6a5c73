"""The run report from a synthetic output prefix: parts written in the output schema, actor
accounts from a real CostMeter, a manifest laid out like pipeline.batch.commit.manifest writes
it."""

from __future__ import annotations

import datetime as dt
import json
import math
from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from engines.api import GenerationResult, RequestMetrics, StepRecord
from pipeline.batch.commit.parts import PartName, write_part
from pipeline.batch.commit.stats import RowStats
from pipeline.batch.stages.schema import output_schema
from pipeline.cli import app
from pipeline.cost import CostMeter, row_cost
from pipeline.report import build_report, error_kind, write_report
from pipeline.spec import CostSpec, StorageSpec
from pipeline.storage import OutputDir

COST = {
    "device_hour_usd": 3.5,
    "price_per_million": {"input": 0.5, "output": 2.0},
    "batch_discount": 0.5,
}


def _actor_rows(actor: str, n: int, t0: float, errors: int = 0):
    """Rows served by one simulated actor (2 devices), and its final account."""
    spec = CostSpec(**COST)
    meter = CostMeter(2, start=0.0)
    meter.record_load(0.0, 5.0)
    rows = []
    t = 6.0
    for i in range(n):
        rid = f"{actor}-{i}"
        meter.on_submit(rid, t)
        meter.add_steps(
            [StepRecord(t, t + 0.5, {rid: 20}, {}), StepRecord(t + 0.6, t + 1.0, {}, {rid: 4})]
        )
        result = GenerationResult(
            rid,
            [1] * 4,
            "abcd",
            "stop",
            20,
            4,
            metrics=RequestMetrics(t, t, t + 0.5, t + 1.0),
        )
        meter.on_finish(result)
        gpu = meter.pop_row_seconds(rid)
        cost = row_cost(gpu, 20, 0, 4, spec)
        rows.append(
            {
                "id": rid,
                "text": "abcd",
                "finish_reason": "stop",
                "error": None,
                "prompt_tokens": 20,
                "cached_prompt_tokens": 0,
                "completion_tokens": 4,
                "queue_s": 0.0,
                "ttft_s": 0.5,
                "decode_s": 0.5,
                "latency_s": 1.0,
                "gpu_seconds": cost.gpu_seconds,
                "cost_usd": cost.cost_usd,
                "list_price_usd": cost.list_price_usd,
                "model": "tiny",
                "engine": "reference",
                "actor_id": actor,
                "finished_at": dt.datetime.fromtimestamp(t0 + t + 1.0, dt.timezone.utc),
            }
        )
        t += 1.5
    for i in range(errors):
        rows.append(
            {
                **rows[0],
                "id": f"{actor}-err{i}",
                "finish_reason": "error",
                "error": "ValueError: prompt too long (300 > 256)",
                "text": "",
                "gpu_seconds": 0.0,
                "cost_usd": 0.0,
                "list_price_usd": 0.0,
                "completion_tokens": 0,
                "actor_id": None,
                "latency_s": None,
                "ttft_s": None,
            }
        )
    account = meter.account(t + 2.0)
    account.actor_id = actor
    return rows, {**account.to_dict(), "incarnation": "x1"}


def make_output_dir(root: Path) -> Path:
    """An output prefix with two parts (two actors, 2 devices each) and its manifest."""
    root.mkdir(parents=True, exist_ok=True)
    rows_a, acc_a = _actor_rows("actor-aaaa", 6, 1e9, errors=2)
    rows_b, acc_b = _actor_rows("actor-bbbb", 4, 1e9 + 3)
    schema = output_schema()
    out = OutputDir(str(root), StorageSpec())
    records = []
    for shard, (rows, actor) in enumerate([(rows_a, "actor-aaaa"), (rows_b, "actor-bbbb")]):
        table = pa.Table.from_pylist(rows, schema=schema)
        table = table.append_column("_row", pa.array(range(len(rows)), pa.int64()))
        records.append(write_part(out, PartName(shard, 1, 1, 0), table, schema, actor))
    stats = RowStats()
    for record in records:
        assert record.stats is not None
        stats.merge(record.stats)
    manifest = {
        "protocol": 2,
        "job": "unit-report",
        "status": "complete",
        "fingerprint": {},
        "spec": {
            "name": "unit-report",
            "cost": COST,
            "resources": {"num_actors": 2, "devices_per_actor": 2},
            "sampling": {"max_tokens": 8},
        },
        "input_files": [],
        "runs": [
            {
                "attempt": 1,
                "started_at": "x",
                "mode": "run",
                "wall_s": 20.0,
                "actors": [acc_a, acc_b],
            }
        ],
        "parts": [r.to_json() for r in records],
        "stats": stats.to_json(),
        "missing_rows": 0,
        "updated_at": "2026-01-01T00:00:00+00:00",
    }
    (root / "_manifest.json").write_text(json.dumps(manifest))
    return root


@pytest.fixture(scope="module")
def output_dir(tmp_path_factory) -> Path:
    return make_output_dir(tmp_path_factory.mktemp("out"))


def test_summary_books_balance_and_costs(output_dir):
    summary, markdown, images = build_report(OutputDir(str(output_dir), StorageSpec()))
    assert summary.rows == 12 and summary.rows_error == 2 and summary.rows_ok == 10
    assert [a.actor_id for a in summary.actors] == ["actor-aaaa", "actor-bbbb"]
    for a in summary.actors:
        assert abs(a.balance_error_s) <= 1e-9 * a.paid_s
        assert a.load_s == pytest.approx(2 * 5.0)
    c = summary.cost
    paid = sum(a.paid_s for a in summary.actors)
    assert c.total_usd == pytest.approx(paid * 3.5 / 3600)
    assert c.rows_usd + c.idle_usd + c.load_usd == pytest.approx(c.total_usd)
    assert c.list_price_usd == pytest.approx(10 * (20 * 0.5 + 4 * 2.0) / 1e6 * 0.5)
    assert summary.errors_by_kind == {"ValueError": 2}
    # No estimate stored: recomputed with 12 rows x max_tokens 8 at the measured throughput.
    assert summary.estimate is not None and summary.estimate.output_tokens == 96
    assert "recomputed" in summary.estimate_source
    assert "| rows ok / error | 10 / 2 |" in markdown
    assert "Estimate vs actual" in markdown
    assert set(images) == {
        "throughput.png",
        "latency.png",
        "cost_per_row.png",
        "actors.png",
        "errors.png",
    }
    assert all(png.startswith(b"\x89PNG") for png in images.values())


def test_write_report_and_cli(output_dir):
    result = write_report(str(output_dir))
    text = (output_dir / "report.md").read_text()
    for name in result.plot_names:
        assert (output_dir / name).read_bytes().startswith(b"\x89PNG")
        assert f"]({name})" in text
    cli = CliRunner().invoke(app, ["report", str(output_dir), "--json", "--no-write"])
    assert cli.exit_code == 0, cli.output
    data = json.loads(cli.output)
    assert data["rows"] == 12
    assert all(math.isfinite(a["balance_error_s"]) for a in data["actors"])
    shown = CliRunner().invoke(app, ["report", str(output_dir)])
    assert shown.exit_code == 0, shown.output
    assert "USD per 1M output tokens" in shown.output and "report.md" in shown.output


def test_report_on_a_prefix_without_output(tmp_path):
    cli = CliRunner().invoke(app, ["report", str(tmp_path / "nothing")])
    assert cli.exit_code == 2
    assert "_manifest.json" in cli.output


def test_error_kinds():
    assert error_kind("ValueError: bad") == "ValueError"
    assert error_kind("row 'x1': max_tokens must be >= 1") == "max_tokens must be >= 1"
    assert error_kind("empty prompt (no tokens)") == "empty prompt"
    assert error_kind(None) == "unknown"


def test_estimate_is_recomputed_like_plan(output_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(output_dir, copy)
    manifest = json.loads((copy / "_manifest.json").read_text())
    manifest["spec"]["engine"] = {"expected_tokens_per_s": 100.0}
    manifest["spec"]["sampling"] = {"max_tokens": "***"}  # unreadable: actual tokens are used
    (copy / "_manifest.json").write_text(json.dumps(manifest))
    summary, _, _ = build_report(OutputDir(str(copy), StorageSpec()), plots=False)
    est = summary.estimate
    assert est is not None and est.tokens_per_s == 100.0
    assert est.output_tokens == summary.cost.completion_tokens == 40
    assert est.wall_s == pytest.approx(40 / (100.0 * 2))  # two actors
    assert "expected_tokens_per_s" in summary.estimate_source
    # Without an expected throughput: the engines' busy throughput (tokens per busy second).
    del manifest["spec"]["engine"]
    (copy / "_manifest.json").write_text(json.dumps(manifest))
    summary, _, _ = build_report(OutputDir(str(copy), StorageSpec()), plots=False)
    busy = sum(a.attributed_s / a.devices for a in summary.actors)
    assert summary.estimate.tokens_per_s == pytest.approx(40 / busy)


def test_speculative_jobs_report_acceptance(output_dir, tmp_path):
    """A job with engine.speculative shows its acceptance rate and accepted tokens per
    verification, from the manifest's merged stats; other jobs show no such line."""
    import shutil

    spec_dir = tmp_path / "spec"
    shutil.copytree(output_dir, spec_dir)
    manifest = json.loads((spec_dir / "_manifest.json").read_text())
    manifest["spec"]["engine"] = {"kind": "reference", "speculative": {"method": "ngram"}}
    manifest["stats"]["spec"] = {"proposed": 400, "accepted": 300, "verifications": 120}
    (spec_dir / "_manifest.json").write_text(json.dumps(manifest))
    summary, markdown, _ = build_report(OutputDir(str(spec_dir), StorageSpec()), plots=False)
    assert summary.spec is not None and summary.spec.acceptance_rate == pytest.approx(0.75)
    assert summary.spec.accepted_per_verification == pytest.approx(2.5)
    assert "75.0% of 400 proposed, 2.50" in markdown
    plain, plain_md, _ = build_report(OutputDir(str(output_dir), StorageSpec()), plots=False)
    assert plain.spec is None and "speculative" not in plain_md
