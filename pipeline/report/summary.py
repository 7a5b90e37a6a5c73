"""The numbers of a run report, from `_manifest.json` alone (never the rows).

    load_report_inputs(out) → summarize(inputs) → ReportSummary

The manifest holds the merged row statistics of every committed part (sums, histograms,
errors by kind, the token timeline: pipeline.batch.commit.stats), each part's record, and
every run's actor accounts; the summary is computed from those.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.batch.interface.output import MANIFEST_NAME, PartRecord, RowStats, SpecCounts
from pipeline.cost import (
    ActorAccount,
    CostEstimate,
    CostTotals,
    RowSums,
    estimate_for_resources,
    job_totals,
)
from pipeline.spec import CostSpec, ResourcesSpec

if TYPE_CHECKING:
    from pipeline.storage import OutputDir


class ReportError(RuntimeError):
    """The output prefix has nothing to report on; the message says what is missing."""


@dataclass
class ReportInputs:
    """What the report is made from: the manifest and what it holds."""

    output_uri: str
    manifest: dict[str, Any]  # _manifest.json as written by pipeline.batch.commit.manifest
    stats: RowStats  # merged statistics of every committed row
    parts: list[PartRecord]  # every committed part
    accounts: list[ActorAccount]  # every actor incarnation of every run


def load_report_inputs(out: OutputDir) -> ReportInputs:
    """Read and parse the manifest (the parts themselves are not read)."""
    if not out.exists(MANIFEST_NAME):
        raise ReportError(
            f"{out.uri} has no {MANIFEST_NAME}: not a tokenmill output prefix, or its run never "
            "started; check the URI (and --endpoint-url for S3)"
        )
    try:
        manifest = json.loads(out.read(MANIFEST_NAME).decode())
    except ValueError as exc:
        raise ReportError(f"{out.uri}/{MANIFEST_NAME} is not valid JSON ({exc})") from None
    if int(manifest.get("protocol", 1)) < 2:
        raise ReportError(
            f"{out.uri}/{MANIFEST_NAME} was written by an older tokenmill (commit protocol 1); "
            "rerun the job with --fresh to rewrite it"
        )
    accounts = [
        ActorAccount.from_dict(a) for run in manifest.get("runs", []) for a in run.get("actors", [])
    ]
    return ReportInputs(
        output_uri=out.uri,
        manifest=manifest,
        stats=RowStats.from_json(manifest.get("stats")),
        parts=[PartRecord.from_json(p) for p in manifest.get("parts", [])],
        accounts=accounts,
    )


# --- the summary -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ActorLine:
    """One actor's books: its accounts (all incarnations) next to the rows it wrote."""

    actor_id: str
    incarnations: int
    devices: float
    lifetime_s: float  # wall seconds, summed over incarnations
    load_s: float  # device-seconds
    idle_s: float
    attributed_s: float
    pending_s: float
    row_gpu_seconds: float  # sum of gpu_seconds of this actor's rows in the parts
    num_rows: int  # rows in the parts served by this actor

    @property
    def paid_s(self) -> float:
        return self.devices * self.lifetime_s

    @property
    def balance_error_s(self) -> float:
        """rows + idle + load + pending − devices x lifetime: 0 when the books balance."""
        return self.row_gpu_seconds + self.idle_s + self.load_s + self.pending_s - self.paid_s

    @property
    def busy_fraction(self) -> float:
        return (self.attributed_s + self.pending_s) / self.paid_s if self.paid_s > 0 else 0.0


@dataclass(frozen=True)
class ReportSummary:
    job: str
    status: str
    output_uri: str
    updated_at: str
    num_runs: int
    missing_ids: int
    rows: int
    rows_ok: int
    rows_error: int
    wall_s: float  # driver wall time over all runs
    output_tokens_per_s: float | None  # completion tokens / wall_s
    latency_p50_s: float | None
    latency_p95_s: float | None
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    device_hour_usd: float
    cost: CostTotals
    actors: list[ActorLine]
    errors_by_kind: dict[str, int]
    estimate: CostEstimate | None
    estimate_source: str  # where the estimate came from (manifest, or recomputed: how)
    budget: dict[str, Any] | None = None  # the manifest's budget record, if any
    notes: list[str] = field(default_factory=list)  # caveats worth reading
    spec: SpecCounts | None = None  # speculative decoding, for jobs with engine.speculative
    # Jobs with model.adapters: each adapter's rows' sums ("" for the model itself).
    by_adapter: dict[str, RowSums] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        data = asdict(self)
        data["actors"] = [{**asdict(a), "balance_error_s": a.balance_error_s} for a in self.actors]
        return data


def _cost_spec(manifest: dict[str, Any]) -> CostSpec:
    try:
        return CostSpec.model_validate(manifest.get("spec", {}).get("cost", {}))
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise ReportError(
            f"the manifest's spec.cost section is not a valid cost spec ({exc}); rerun the job "
            "to rewrite _manifest.json"
        ) from None


def _resources(manifest: dict[str, Any]) -> ResourcesSpec:
    return ResourcesSpec.model_validate(manifest.get("spec", {}).get("resources", {}))


def _actor_lines(inputs: ReportInputs) -> list[ActorLine]:
    gpu_by_actor: dict[str, float] = defaultdict(float)
    rows_by_actor: Counter[str] = Counter()
    for part in inputs.parts:
        if part.actor_id is not None:
            gpu_by_actor[part.actor_id] += part.sums.gpu_seconds
            rows_by_actor[part.actor_id] += part.sums.rows
    grouped: dict[str, list[ActorAccount]] = defaultdict(list)
    for account in inputs.accounts:
        grouped[account.actor_id or "?"].append(account)
    lines = []
    for actor, accounts in sorted(grouped.items()):
        lines.append(
            ActorLine(
                actor_id=actor,
                incarnations=len(accounts),
                devices=accounts[0].devices,
                lifetime_s=math.fsum(a.lifetime_s for a in accounts),
                load_s=math.fsum(a.load_s for a in accounts),
                idle_s=math.fsum(a.idle_s for a in accounts),
                attributed_s=math.fsum(a.attributed_s for a in accounts),
                pending_s=math.fsum(a.pending_s for a in accounts),
                row_gpu_seconds=gpu_by_actor.get(actor, 0.0),
                num_rows=rows_by_actor.get(actor, 0),
            )
        )
    return lines


def _estimate(
    inputs: ReportInputs, cost_spec: CostSpec, totals: CostTotals
) -> tuple[CostEstimate | None, str]:
    """The plan's estimate stored in the manifest, or one recomputed as `tokenmill plan`
    would: rows x max_tokens output tokens at engine.expected_tokens_per_s, or, when that is
    not set, at the throughput the engines actually had while busy (so the comparison shows
    what load, idle time and shorter completions did to the cost)."""
    stored = inputs.manifest.get("estimate")
    if isinstance(stored, dict):
        try:
            return CostEstimate(**stored), "stored in the manifest by the run"
        except TypeError:
            pass
    spec = inputs.manifest.get("spec", {})
    try:
        resources = _resources(inputs.manifest)
    except ValueError:
        return None, "not available (the manifest's resources section is unreadable)"
    max_tokens = spec.get("sampling", {}).get("max_tokens")
    num_rows = totals.num_rows
    if isinstance(max_tokens, int) and max_tokens > 0:
        output_tokens, how = num_rows * max_tokens, f"{num_rows} rows x max_tokens {max_tokens}"
    else:
        output_tokens, how = totals.completion_tokens, "the actual completion tokens"
    expected = spec.get("engine", {}).get("expected_tokens_per_s")
    busy_actor_s = math.fsum(
        (a.attributed_s + a.pending_s) / a.devices for a in inputs.accounts if a.devices > 0
    )
    if isinstance(expected, (int, float)) and expected > 0:
        tokens_per_s, rate = float(expected), "engine.expected_tokens_per_s"
    elif busy_actor_s > 0 and totals.completion_tokens > 0:
        tokens_per_s = totals.completion_tokens / busy_actor_s
        rate = "the measured throughput of the engines while busy"
    else:
        return None, "not available (no completion tokens and no expected throughput)"
    if output_tokens <= 0:
        return None, "not available (no output tokens to estimate)"
    estimate = estimate_for_resources(
        resources, cost_spec, num_rows, totals.prompt_tokens, output_tokens, tokens_per_s
    )
    return estimate, (
        f"recomputed from the spec (none was stored with the run): output = {how}, at "
        f"{tokens_per_s:,.1f} output tok/s per actor ({rate})"
    )


def summarize(inputs: ReportInputs) -> ReportSummary:
    """Every number the report shows, from the manifest alone."""
    manifest, stats = inputs.manifest, inputs.stats
    cost_spec = _cost_spec(manifest)
    sums = stats.sums
    totals = job_totals(sums, inputs.accounts, cost_spec)
    runs = manifest.get("runs", [])
    wall_s = math.fsum(float(r.get("wall_s") or 0.0) for r in runs)
    estimate, source = _estimate(inputs, cost_spec, totals)
    notes = []
    if any(r.get("mode") == "retry-errors" for r in runs):
        notes.append(
            "A --retry-errors run replaced some rows; the replaced rows' device time stays in "
            "their actors' books, so those actors do not balance against the parts alone."
        )
    if totals.pending_usd > 0:
        notes.append(
            "Some actors stopped with rows in flight (pending time): those rows were not "
            "committed, and a rerun generates them again."
        )
    lost = [e for r in runs for e in r.get("events", []) if e.get("event") == "actor_lost"]
    for event in lost:
        recovered = event.get("recovered_after_s")
        notes.append(
            f"Engine actor {short_actor(str(event.get('actor')))} was lost; shard(s) "
            f"{event.get('shards_requeued')} were handed out again"
            + (f" and wrote again {recovered:.1f}s later." if recovered is not None else ".")
        )
    missing = manifest.get("missing_rows")
    speculative = (manifest.get("spec", {}).get("engine") or {}).get("speculative")
    return ReportSummary(
        job=str(manifest.get("job", "?")),
        status=str(manifest.get("status", "?")),
        output_uri=inputs.output_uri,
        updated_at=str(manifest.get("updated_at", "")),
        num_runs=len(runs),
        missing_ids=int(missing or 0),
        rows=sums.rows,
        rows_ok=sums.rows - sums.errors,
        rows_error=sums.errors,
        wall_s=wall_s,
        output_tokens_per_s=totals.completion_tokens / wall_s if wall_s > 0 else None,
        latency_p50_s=stats.latency_s.quantile(0.5),
        latency_p95_s=stats.latency_s.quantile(0.95),
        ttft_p50_s=stats.ttft_s.quantile(0.5),
        ttft_p95_s=stats.ttft_s.quantile(0.95),
        device_hour_usd=cost_spec.device_hour_usd,
        cost=totals,
        actors=_actor_lines(inputs),
        errors_by_kind=dict(stats.errors_by_kind.most_common()),
        estimate=estimate,
        estimate_source=source,
        budget=manifest.get("budget") if isinstance(manifest.get("budget"), dict) else None,
        notes=notes,
        spec=stats.spec if speculative else None,
        by_adapter=dict(stats.by_adapter),
    )


def short_actor(actor_id: str) -> str:
    """A Ray actor id's distinctive head (its tail is the job id, the same for every actor)."""
    return actor_id[:12]
