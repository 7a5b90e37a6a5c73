"""Batch job metrics on Ray's metrics system (`ray.util.metrics`), for Prometheus and Grafana.

Each process records into its Ray node's metrics agent, which Prometheus scrapes (KubeRay's
Grafana dashboards read the same Prometheus). Two recorders:

- `JobMetrics`, in the driver: rows, error rows, tokens and USD of every committed part, the
  shards by state, and each part's commit latency (written by the actor -> in the manifest);
- `BusyReporter`, in each engine actor: the share of recent wall time the engine had at least
  one request in flight.

Every metric is named `tokenmill_batch_*` and tagged with the job name and run id (plus the
actor id for per-actor ones): never per row or per shard, so the series stay few. Prometheus
sees them with Ray's `ray_` prefix, counters with a `_total` suffix (`PROMETHEUS_NAMES`;
docs/metrics.md lists them all).

Metrics must never fail a job: every recording goes through `_Guard`, which logs the first
error and drops the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.batch.commit.parts import PartRecord

logger = logging.getLogger(__name__)

PREFIX = "tokenmill_batch_"
# Prometheus names as Ray 2.60 exports them (its OpenTelemetry exporter): `ray_` + the name,
# counters with `_total`, histograms as `_bucket`/`_sum`/`_count` series.
RAY_PREFIX = "ray_"

MetricKind = Literal["counter", "gauge", "histogram"]
JOB_TAGS = ("job", "run_id")
ACTOR_TAGS = ("job", "run_id", "actor_id")
SHARD_STATES = ("queued", "running", "committed")
# Commit latency buckets (seconds): parts are committed within output.commit_interval_s
# (default seconds) of being written; minutes mean the driver is stuck.
COMMIT_LATENCY_BOUNDARIES = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]
# Shard counts are set at most this often (the scheduler ticks many times a second).
SHARDS_EVERY_S = 1.0
# The busy gauge covers the wall time since its last update; shorter windows are noise.
BUSY_WINDOW_S = 5.0


@dataclass(frozen=True)
class MetricDef:
    """One exported metric: its name (without Ray's prefix), type, tags and meaning."""

    name: str
    kind: MetricKind
    tags: tuple[str, ...]
    description: str


METRICS: tuple[MetricDef, ...] = (
    MetricDef(
        "tokenmill_batch_rows",
        "counter",
        JOB_TAGS,
        "Rows committed (results in parts recorded in the manifest), error rows included.",
    ),
    MetricDef(
        "tokenmill_batch_error_rows",
        "counter",
        JOB_TAGS,
        "Committed rows whose result is an error (the `error` column is set).",
    ),
    MetricDef(
        "tokenmill_batch_prompt_tokens",
        "counter",
        JOB_TAGS,
        "Prompt (input) tokens of the committed rows.",
    ),
    MetricDef(
        "tokenmill_batch_completion_tokens",
        "counter",
        JOB_TAGS,
        "Completion (output) tokens of the committed rows.",
    ),
    MetricDef(
        "tokenmill_batch_cost_usd",
        "counter",
        JOB_TAGS,
        "Cost in USD attributed to the committed rows (the parts' cost_usd sums).",
    ),
    MetricDef(
        "tokenmill_batch_shards",
        "gauge",
        (*JOB_TAGS, "state"),
        "Shards of this run by state: queued (waiting or being read), running (on an engine "
        "actor), committed (every row committed, earlier runs' included).",
    ),
    MetricDef(
        "tokenmill_batch_commit_latency_seconds",
        "histogram",
        JOB_TAGS,
        "Per part: from the engine actor writing it to the manifest that commits it being saved.",
    ),
    MetricDef(
        "tokenmill_batch_engine_busy_fraction",
        "gauge",
        ACTOR_TAGS,
        "Share (0..1) of the last few seconds of wall time an engine actor had at least one "
        "request in flight.",
    ),
)
BY_NAME = {m.name: m for m in METRICS}


def prometheus_names(metric: MetricDef) -> tuple[str, ...]:
    """The series names Prometheus holds for a metric (see RAY_PREFIX)."""
    base = RAY_PREFIX + metric.name
    if metric.kind == "counter":
        return (base + "_total",)
    if metric.kind == "histogram":
        return (base + "_bucket", base + "_sum", base + "_count")
    return (base,)


PROMETHEUS_NAMES = frozenset(n for m in METRICS for n in prometheus_names(m))


class _Guard:
    """Runs metric calls; the first failure is logged, every failure is swallowed."""

    def __init__(self, where: str):
        self.where = where
        self.failed = False

    def __call__(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:
            if not self.failed:
                logger.warning(
                    "%s metrics: %s: %s (ignored: the job goes on; later metric errors are "
                    "not logged)",
                    self.where,
                    type(exc).__name__,
                    exc,
                )
            self.failed = True


def _make(metric: MetricDef) -> Any:
    from ray.util import metrics

    if metric.kind == "counter":
        return metrics.Counter(metric.name, description=metric.description, tag_keys=metric.tags)
    if metric.kind == "gauge":
        return metrics.Gauge(metric.name, description=metric.description, tag_keys=metric.tags)
    return metrics.Histogram(
        metric.name,
        description=metric.description,
        boundaries=COMMIT_LATENCY_BOUNDARIES,
        tag_keys=metric.tags,
    )


# --- the driver ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardCounts:
    queued: int
    running: int
    committed: int


def shard_counts(scheduler: Any) -> ShardCounts:
    """Shards by state, from the scheduler's queues (pipeline.batch.driver.scheduler.Scheduler) and
    its ledger. A shard being read by a prompt actor or waiting for an engine counts as queued."""
    queued = len(scheduler.queue) + len(scheduler.preparing) + len(scheduler.prepared)
    committed = sum(1 for state in scheduler.ledger.shards if state.is_complete)
    return ShardCounts(queued, len(scheduler.running), committed)


class JobMetrics:
    """The driver's metrics of one run. Call `on_part` for each committed part, `on_tick`
    after each manifest save check, and `finish` when the scheduler is done."""

    def __init__(self, job: str, run_id: str, clock: Callable[[], float] = time.time):
        self.tags = {"job": job, "run_id": run_id}
        self.clock = clock
        self._guard = _Guard("batch job")
        self._metrics: dict[str, Any] = {}
        self._unsaved: list[float] = []  # written_at of committed parts not yet in a manifest
        self._shards_set_at = -float("inf")
        self._guard(self._create)

    def _create(self) -> None:
        self._metrics = {m.name: _make(m) for m in METRICS if m.tags == JOB_TAGS}
        self._metrics["tokenmill_batch_shards"] = _make(BY_NAME["tokenmill_batch_shards"])

    def on_part(self, record: PartRecord) -> None:
        """A part the committer accepted (it is in the next manifest save)."""
        sums = record.sums

        def record_sums() -> None:
            values = {
                # A replacement part (--retry-errors) counts only the rows it regenerated.
                "tokenmill_batch_rows": record.generated_rows,
                "tokenmill_batch_error_rows": sums.errors,
                "tokenmill_batch_prompt_tokens": sums.prompt_tokens,
                "tokenmill_batch_completion_tokens": sums.completion_tokens,
                "tokenmill_batch_cost_usd": sums.cost_usd,
            }
            for name, value in values.items():
                if value > 0:  # Ray's Counter.inc refuses 0 (a part without errors)
                    self._metrics[name].inc(value, tags=self.tags)

        self._guard(record_sums)
        self._unsaved.append(record.written_at)

    def on_tick(self, counts: Callable[[], ShardCounts], saved: bool) -> None:
        """`counts`: asked only when due. `saved`: no committed part is waiting for a manifest
        write any more."""
        now = self.clock()
        # The scheduler ticks on every event; Ray exports every few seconds anyway.
        if now - self._shards_set_at >= SHARDS_EVERY_S:
            self._shards_set_at = now
            self._guard(lambda: self._set_shards(counts()))
        if saved:
            self._saved()

    def finish(self, counts: Callable[[], ShardCounts]) -> None:
        """The scheduler is done; the final manifest follows at once: the last shard counts,
        and whatever waited for a manifest counts as committed now."""
        self._guard(lambda: self._set_shards(counts()))
        self._saved()

    def _set_shards(self, counts: ShardCounts) -> None:
        """Called through the guard (reading the counts may fail too)."""
        gauge = self._metrics["tokenmill_batch_shards"]
        for state in SHARD_STATES:
            gauge.set(getattr(counts, state), tags={**self.tags, "state": state})

    def _saved(self) -> None:
        if not self._unsaved:
            return
        now, written = self.clock(), self._unsaved
        self._unsaved = []

        def record() -> None:
            histogram = self._metrics["tokenmill_batch_commit_latency_seconds"]
            for at in written:
                # Actor and driver clocks may differ a little: never a negative latency.
                histogram.observe(max(now - at, 0.0), tags=self.tags)

        self._guard(record)


# --- engine actors ------------------------------------------------------------------------------


def busy_fraction(
    previous: tuple[float, float] | None, busy_s: float, total_s: float
) -> float | None:
    """Busy share between two readings of an actor account ((busy, total) device-seconds):
    None when too little time passed to tell."""
    if previous is None:
        return None
    d_total = total_s - previous[1]
    if d_total <= 0:
        return None
    return min(max((busy_s - previous[0]) / d_total, 0.0), 1.0)


class BusyReporter:
    """In an engine actor: sets its busy-fraction gauge from the cost meter's account (busy =
    attributed + pending device time, i.e. time with requests in the engine), over the time
    since the last update. Call `update` every second or so while the actor lives: an idle
    actor must show 0, not its last busy value."""

    def __init__(self, job: str, run_id: str, actor_id: str):
        self.tags = {"job": job, "run_id": run_id, "actor_id": actor_id}
        self._guard = _Guard("engine actor")
        self._gauge: Any = None
        self._last: tuple[float, float] | None = None
        self._last_at = 0.0

        def create() -> None:
            self._gauge = _make(BY_NAME["tokenmill_batch_engine_busy_fraction"])

        self._guard(create)

    def update(self, account: Any, now: float | None = None) -> float | None:
        """`account`: a pipeline.cost.ActorAccount. Returns the fraction set, if any."""
        now = time.monotonic() if now is None else now
        if self._last is not None and now - self._last_at < BUSY_WINDOW_S:
            return None
        busy = account.attributed_s + account.pending_s
        total = account.total_s - account.load_s  # loading the model is not idleness
        fraction = busy_fraction(self._last, busy, total)
        self._last, self._last_at = (busy, total), now
        if fraction is not None:
            self._guard(lambda: self._gauge.set(fraction, tags=self.tags))
        return fraction
