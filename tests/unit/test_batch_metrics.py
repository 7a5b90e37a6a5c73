"""Batch metrics definitions, the busy-fraction window, and the Grafana dashboard: every metric
the dashboard queries is one pipeline.batch.metrics defines, under the name Prometheus has."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeline.batch.metrics import (
    BUSY_WINDOW_S,
    METRICS,
    PROMETHEUS_NAMES,
    BusyReporter,
    busy_fraction,
    prometheus_names,
)
from pipeline.cost import ActorAccount

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "infra" / "grafana" / "tokenmill-batch.json"
DOCS = ROOT / "docs" / "metrics.md"


def test_names_are_prefixed_and_tags_bounded() -> None:
    assert len({m.name for m in METRICS}) == len(METRICS)
    for metric in METRICS:
        assert metric.name.startswith("tokenmill_batch_")
        assert metric.tags[:2] == ("job", "run_id")
        # Bounded cardinality: never a per-row or per-shard tag.
        assert not {"row", "id", "shard", "part"} & set(metric.tags)
    counters = [m for m in METRICS if m.kind == "counter"]
    assert all(prometheus_names(m) == (f"ray_{m.name}_total",) for m in counters)


def test_every_metric_is_documented() -> None:
    text = DOCS.read_text()
    for metric in METRICS:
        row = next((line for line in text.splitlines() if f"`{metric.name}`" in line), None)
        assert row is not None, f"{metric.name} is not in {DOCS.name}"
        assert metric.kind in row
        for tag in metric.tags:
            assert tag in row
        for name in prometheus_names(metric):
            assert name in text


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in dashboard["panels"]:
        queries += [t["expr"] for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable.get("type") == "query":
            query = variable["query"]
            queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def test_dashboard_queries_only_defined_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    queried: set[str] = set()
    for query in _dashboard_queries():
        queried |= set(re.findall(r"\b(ray_tokenmill_\w+|tokenmill_\w+)", query))
    assert queried, "the dashboard queries no tokenmill metric"
    assert queried <= PROMETHEUS_NAMES, queried - PROMETHEUS_NAMES
    # Every metric has a panel.
    for metric in METRICS:
        assert set(prometheus_names(metric)) & queried, f"no panel shows {metric.name}"
    for panel in dashboard["panels"]:
        if panel.get("targets"):
            assert panel["datasource"]["uid"] == "${datasource}"


def _account(busy_s: float, lifetime_s: float, load_s: float = 2.0) -> ActorAccount:
    return ActorAccount(
        devices=1.0,
        lifetime_s=lifetime_s,
        load_s=load_s,
        idle_s=lifetime_s - load_s - busy_s,
        attributed_s=busy_s * 0.75,
        pending_s=busy_s * 0.25,
        num_rows=0,
    )


def test_busy_fraction_is_over_the_last_window() -> None:
    assert busy_fraction(None, 1.0, 2.0) is None
    assert busy_fraction((1.0, 2.0), 1.0, 2.0) is None  # no time passed
    assert busy_fraction((1.0, 2.0), 2.0, 4.0) == pytest.approx(0.5)
    assert busy_fraction((1.0, 2.0), 9.0, 4.0) == 1.0  # clamped

    reporter = BusyReporter("job", "run", "actor")
    assert reporter.update(_account(0.0, 2.0), now=0.0) is None  # the first reading
    # Within the window: nothing set yet.
    assert reporter.update(_account(1.0, 3.0), now=BUSY_WINDOW_S / 2) is None
    # Fully busy for 10 s after the model loaded.
    assert reporter.update(_account(10.0, 12.0), now=BUSY_WINDOW_S) == pytest.approx(1.0)
    # Then idle: the gauge drops to 0 instead of keeping the lifetime average.
    assert reporter.update(_account(10.0, 22.0), now=2 * BUSY_WINDOW_S) == pytest.approx(0.0)
    # Half busy.
    assert reporter.update(_account(15.0, 32.0), now=3 * BUSY_WINDOW_S) == pytest.approx(0.5)


def test_a_failing_metric_is_logged_once_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    from pipeline.batch.metrics import _Guard

    guard = _Guard("batch job")
    calls = []

    def broken() -> None:
        calls.append(1)
        # What Ray's Counter.inc raises for a zero increment.
        raise ValueError("value must be >0, got 0")

    with caplog.at_level("WARNING", logger="pipeline.batch.metrics"):
        for _ in range(3):
            guard(broken)  # never raises
    assert len(calls) == 3 and guard.failed
    assert [r.getMessage() for r in caplog.records].count(
        "batch job metrics: ValueError: value must be >0, got 0 (ignored: the job goes on; "
        "later metric errors are not logged)"
    ) == 1


def test_driver_metrics_never_raise_into_the_job() -> None:
    from pipeline.batch.metrics import JobMetrics, ShardCounts

    def scheduler_changed() -> ShardCounts:
        raise AttributeError("'Scheduler' object has no attribute 'prepared'")

    metrics = JobMetrics("job", "run", clock=lambda: 100.0)
    metrics.on_tick(scheduler_changed, saved=False)
    metrics.finish(scheduler_changed)
    assert metrics._guard.failed
