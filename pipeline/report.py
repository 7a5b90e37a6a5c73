"""The run report beside a job's output: report.md plus PNG plots, from the committed parts
and `_manifest.json` alone (so `tokenmill report OUTPUT` can regenerate it at any time).

    load_report_inputs(out) → summarize(inputs) → render_markdown(summary) + render_plots(inputs)
                                                → write_report puts them beside the parts

Layout written under the output prefix:

    report.md                 summary, cost, estimate vs actual, per-actor books, errors
    report/throughput.png     output tokens per second over time (by row finish time)
    report/latency.png        TTFT and end-to-end latency distributions
    report/cost_per_row.png   cost_usd per row (gpu_seconds when no device price is set)
    report/actors.png         per actor: busy spans over time, and where its paid time went
    report/errors.png         error rows by kind (only when there are errors)
"""

from __future__ import annotations

import io
import json
import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.cost import (
    ActorAccount,
    CostEstimate,
    CostTotals,
    estimate_for_resources,
    job_totals,
)
from pipeline.spec import CostSpec, ResourcesSpec, StorageSpec

if TYPE_CHECKING:
    from pipeline.batch.commit.parts import OutputDir

REPORT_NAME = "report.md"
PLOTS_DIR = "report"
# Columns the report reads from the parts (never the text).
ROW_COLUMNS = [
    "id",
    "finish_reason",
    "error",
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
    "queue_s",
    "ttft_s",
    "latency_s",
    "gpu_seconds",
    "cost_usd",
    "list_price_usd",
    "actor_id",
    "finished_at",
]


class ReportError(RuntimeError):
    """The output prefix has nothing to report on; the message says what is missing."""


# --- inputs ----------------------------------------------------------------------------------


@dataclass
class ReportInputs:
    """What the report is made from."""

    output_uri: str
    manifest: dict[str, Any]  # _manifest.json as written by pipeline.batch.commit.manifest
    rows: pa.Table  # ROW_COLUMNS of every committed row (columns missing in old parts: null)
    accounts: list[ActorAccount]  # every actor incarnation of every run


def _accounts(manifest: dict[str, Any]) -> list[ActorAccount]:
    return [
        ActorAccount.from_dict(a) for run in manifest.get("runs", []) for a in run.get("actors", [])
    ]


def load_report_inputs(out: OutputDir) -> ReportInputs:
    """Read the manifest and the report columns of every committed part."""
    from pipeline.batch.commit.parts import MANIFEST_NAME, iter_committed

    if not out.exists(MANIFEST_NAME):
        raise ReportError(
            f"{out.uri} has no {MANIFEST_NAME}: not a tokenmill output prefix, or its run never "
            "started; check the URI (and --endpoint-url for S3)"
        )
    try:
        manifest = json.loads(out.read(MANIFEST_NAME).decode())
    except ValueError as exc:
        raise ReportError(f"{out.uri}/{MANIFEST_NAME} is not valid JSON ({exc})") from None
    tables = [_with_columns(t) for t in iter_committed(out)]
    rows = pa.concat_tables(tables, promote_options="default") if tables else _empty_rows()
    return ReportInputs(out.uri, manifest, rows, _accounts(manifest))


def _empty_rows() -> pa.Table:
    return _with_columns(pa.table({"id": pa.array([], pa.string())}))


_COLUMN_TYPES = {
    "id": pa.string(),
    "finish_reason": pa.string(),
    "error": pa.string(),
    "actor_id": pa.string(),
    "finished_at": pa.timestamp("ms", tz="UTC"),
    "prompt_tokens": pa.int64(),
    "cached_prompt_tokens": pa.int64(),
    "completion_tokens": pa.int64(),
}


def _with_columns(table: pa.Table) -> pa.Table:
    """The ROW_COLUMNS of a part, with common types (nulls for any column a part lacks)."""
    columns = {}
    for name in ROW_COLUMNS:
        target = _COLUMN_TYPES.get(name, pa.float64())
        if name in table.column_names:
            columns[name] = table.column(name).cast(target)
        else:
            columns[name] = pa.nulls(table.num_rows, target)
    return pa.table(columns)


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

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        data = asdict(self)
        data["actors"] = [{**asdict(a), "balance_error_s": a.balance_error_s} for a in self.actors]
        return data


def _quantile(column: pa.ChunkedArray, q: float) -> float | None:
    values = column.drop_null()
    if len(values) == 0:
        return None
    return float(pc.quantile(values, q=q, interpolation="linear")[0].as_py())


def error_kind(message: str | None) -> str:
    """A short, stable label for an error message: its exception type or leading phrase."""
    if not message:
        return "unknown"
    # "row 'x': ..." prefixes name the row, not the kind: drop them first.
    text = re.sub(r"^row\s+\S+?:\s*", "", message.strip())
    head = re.split(r"[:(\n]", text, maxsplit=1)[0].strip()
    return (head or text)[:48]


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
    rows = inputs.rows
    gpu_by_actor: dict[str, float] = defaultdict(float)
    rows_by_actor: Counter[str] = Counter()
    for actor, seconds in zip(
        rows.column("actor_id").to_pylist(), rows.column("gpu_seconds").to_pylist(), strict=True
    ):
        if actor is not None:
            gpu_by_actor[actor] += seconds or 0.0
            rows_by_actor[actor] += 1
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
    """Every number the report shows, computed from the parts and the manifest."""
    manifest, rows = inputs.manifest, inputs.rows
    cost_spec = _cost_spec(manifest)
    totals = job_totals(rows, inputs.accounts, cost_spec)
    is_error = pc.fill_null(pc.equal(rows.column("finish_reason"), "error"), False)
    errors = rows.filter(is_error).column("error").to_pylist()
    runs = manifest.get("runs", [])
    wall_s = math.fsum(float(r.get("wall_s") or 0.0) for r in runs)
    estimate, source = _estimate(inputs, cost_spec, totals)
    actors = _actor_lines(inputs)
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
    return ReportSummary(
        job=str(manifest.get("job", "?")),
        status=str(manifest.get("status", "?")),
        output_uri=inputs.output_uri,
        updated_at=str(manifest.get("updated_at", "")),
        num_runs=len(runs),
        missing_ids=int(manifest.get("missing_ids") or 0),
        rows=rows.num_rows,
        rows_ok=rows.num_rows - len(errors),
        rows_error=len(errors),
        wall_s=wall_s,
        output_tokens_per_s=totals.completion_tokens / wall_s if wall_s > 0 else None,
        latency_p50_s=_quantile(rows.column("latency_s"), 0.5),
        latency_p95_s=_quantile(rows.column("latency_s"), 0.95),
        ttft_p50_s=_quantile(rows.column("ttft_s"), 0.5),
        ttft_p95_s=_quantile(rows.column("ttft_s"), 0.95),
        device_hour_usd=cost_spec.device_hour_usd,
        cost=totals,
        actors=actors,
        errors_by_kind=dict(Counter(error_kind(e) for e in errors).most_common()),
        estimate=estimate,
        estimate_source=source,
        budget=manifest.get("budget") if isinstance(manifest.get("budget"), dict) else None,
        notes=notes,
    )


# --- markdown --------------------------------------------------------------------------------


def fmt(value: Any, digits: int = 4) -> str:
    """Numbers for humans: thousands separators, a few significant digits, '—' for none."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "—"
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def usd(value: float | None) -> str:
    if value is None:
        return "—"
    if value == 0:
        return "$0"
    if abs(value) >= 100:
        return f"${value:,.2f}"
    if abs(value) >= 0.01:
        return f"${value:.4g}"
    return f"${value:.8f}".rstrip("0")  # small amounts without scientific notation


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return lines


def summary_rows(s: ReportSummary) -> list[tuple[str, str]]:
    """The headline (name, value) pairs shared by report.md and the CLI."""
    c = s.cost
    rows = [
        ("status", s.status + (f" ({s.missing_ids} rows missing)" if s.missing_ids else "")),
        ("rows ok / error", f"{s.rows_ok:,} / {s.rows_error:,}"),
        (
            "prompt / cached / completion tokens",
            f"{c.prompt_tokens:,} / {c.cached_prompt_tokens:,} / {c.completion_tokens:,}",
        ),
        ("wall time (all runs)", f"{fmt(s.wall_s)} s"),
        ("output tokens/s", fmt(s.output_tokens_per_s)),
        ("latency p50 / p95 (s)", f"{fmt(s.latency_p50_s)} / {fmt(s.latency_p95_s)}"),
        ("TTFT p50 / p95 (s)", f"{fmt(s.ttft_p50_s)} / {fmt(s.ttft_p95_s)}"),
        ("device-hours", fmt(c.device_hours)),
        ("cost (all-in)", usd(c.total_usd)),
        (
            "  of which rows / idle / load",
            f"{usd(c.rows_usd)} / {usd(c.idle_usd)} / {usd(c.load_usd)}",
        ),
        ("busy fraction", f"{c.busy_fraction:.1%}"),
        ("USD per 1M output tokens", usd(c.usd_per_million_output)),
        ("USD per 1M input tokens", usd(c.usd_per_million_input)),
        ("list price of the same tokens", usd(c.list_price_usd)),
    ]
    if c.list_price_ratio is not None:
        rows.append(("cost / list price", f"{c.list_price_ratio:.3g}x"))
    if s.budget:
        b = s.budget
        stopped = " — stopped admitting rows" if b.get("is_closed") else ""
        rows.append(
            ("budget", f"{usd(b.get('budget_usd'))}, spent {usd(b.get('spent_usd'))}{stopped}")
        )
    return rows


def render_markdown(s: ReportSummary, plots: list[str]) -> str:
    """report.md; `plots` are the PNG paths (relative to report.md) that were written."""
    c = s.cost
    out = [f"# Run report: {s.job}", ""]
    out.append(f"Output `{s.output_uri}`, {s.num_runs} run(s), manifest updated {s.updated_at}.")
    out += ["", "## Summary", ""]
    out += _table(["", ""], [[k, v] for k, v in summary_rows(s)])

    out += ["", "## Cost", ""]
    out.append(
        f"Device price {usd(s.device_hour_usd)} per device-hour. Every paid device-second is a "
        "row's `gpu_seconds`, idle (no request in the engine), load (model loading) or pending "
        "(in flight when an actor stopped); docs/cost-accounting.md has the rules."
    )
    out.append("")
    paid_s = c.device_hours * 3600
    out += _table(
        ["bucket", "device-seconds", "share", "USD"],
        [
            ["rows", fmt(c.row_gpu_seconds), _share(c.row_gpu_seconds, paid_s), usd(c.rows_usd)],
            ["idle", fmt(c.idle_s), _share(c.idle_s, paid_s), usd(c.idle_usd)],
            ["load", fmt(c.load_s), _share(c.load_s, paid_s), usd(c.load_usd)],
            [
                "pending",
                fmt(c.pending_s),
                _share(c.pending_s, paid_s),
                usd(c.pending_usd),
            ],
            ["total paid", fmt(paid_s), "100%", usd(c.total_usd)],
        ],
    )
    out += ["", "### Estimate vs actual", ""]
    if s.estimate is None:
        out.append(f"Estimate {s.estimate_source}.")
    else:
        e = s.estimate
        out.append(f"Estimate {s.estimate_source}.")
        out.append("")
        out += _table(
            ["", "estimate", "actual"],
            [
                ["output tokens", fmt(e.output_tokens), fmt(c.completion_tokens)],
                ["wall time (s): generation / whole run", fmt(e.wall_s), fmt(s.wall_s)],
                ["device-hours", fmt(e.device_hours), fmt(c.device_hours)],
                ["cost", usd(e.usd), usd(c.total_usd)],
                [
                    "USD per 1M output tokens",
                    usd(e.usd_per_million_output),
                    usd(c.usd_per_million_output),
                ],
                ["list price", usd(e.list_price_usd), usd(c.list_price_usd)],
            ],
        )
        out.append("")
        out.append(
            "The estimate counts generation time only (the actual adds model load and idle "
            "time) and, when recomputed, assumes every row generates max_tokens."
        )

    out += ["", "## Actors", ""]
    if s.actors:
        out.append(
            "Books per actor: rows' gpu_seconds + idle + load + pending must equal devices x "
            "lifetime (balance ≈ 0)."
        )
        out.append("")
        out += _table(
            [
                "actor",
                "runs",
                "devices",
                "lifetime s",
                "rows",
                "row dev-s",
                "idle dev-s",
                "load dev-s",
                "busy",
                "balance dev-s",
            ],
            [
                [
                    short_actor(a.actor_id),
                    str(a.incarnations),
                    fmt(a.devices),
                    fmt(a.lifetime_s),
                    f"{a.num_rows:,}",
                    fmt(a.row_gpu_seconds),
                    fmt(a.idle_s),
                    fmt(a.load_s),
                    f"{a.busy_fraction:.0%}",
                    f"{a.balance_error_s:.2e}",
                ]
                for a in s.actors
            ],
        )
    else:
        out.append("No actor accounts in the manifest (no rows were generated by these runs).")

    out += ["", "## Errors", ""]
    if s.errors_by_kind:
        out += _table(["kind", "rows"], [[k, f"{n:,}"] for k, n in s.errors_by_kind.items()])
    else:
        out.append("No error rows.")

    if s.budget:
        out += ["", "## Budget", ""]
        out += _table(["", ""], [[k, fmt(v)] for k, v in s.budget.items()])
    if s.notes:
        out += ["", "## Notes", ""]
        out += [f"- {n}" for n in s.notes]
    if plots:
        out += ["", "## Plots", ""]
        out += [f"![{p.rsplit('/', 1)[-1][:-4]}]({p})" for p in plots]
    return "\n".join(out) + "\n"


def short_actor(actor_id: str) -> str:
    """A Ray actor id's distinctive head (its tail is the job id, the same for every actor)."""
    return actor_id[:12]


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole > 0 else "—"


# --- plots -----------------------------------------------------------------------------------


def _figure_png(fig: Any) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def _finish_seconds(rows: pa.Table) -> tuple[list[float], list[float], list[float], list[str]]:
    """Per row with a finish time: (start s, finish s, completion tokens, actor), relative to
    the first row's start, so plots share one time axis."""
    finished = rows.column("finished_at").cast(pa.int64()).to_pylist()  # ms since epoch
    latency = rows.column("latency_s").to_pylist()
    tokens = rows.column("completion_tokens").to_pylist()
    actors = rows.column("actor_id").to_pylist()
    keep = [i for i, f in enumerate(finished) if f is not None]
    ends = [finished[i] / 1000.0 for i in keep]
    starts = [e - (latency[i] or 0.0) for e, i in zip(ends, keep, strict=True)]
    t0 = min(starts, default=0.0)
    return (
        [s - t0 for s in starts],
        [e - t0 for e in ends],
        [float(tokens[i] or 0) for i in keep],
        [actors[i] or "-" for i in keep],
    )


def render_plots(inputs: ReportInputs, summary: ReportSummary) -> dict[str, bytes]:
    """PNG bytes by file name (under PLOTS_DIR). Plots without data are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots: dict[str, bytes] = {}
    rows = inputs.rows
    starts, ends, tokens, actors = _finish_seconds(rows)

    if ends:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        span = max(max(ends), 1e-9)
        bins = max(1, min(60, len(ends) // 5))
        width = span / bins
        totals = [0.0] * bins
        for e, n in zip(ends, tokens, strict=True):
            totals[min(int(e / width), bins - 1)] += n
        rates = [t / width for t in totals]
        # where="post" draws each bin from its left edge: repeat the last rate to close it.
        ax.step([i * width for i in range(bins + 1)], [*rates, rates[-1]], where="post")
        ax.set_xlabel("seconds since the first row started")
        ax.set_ylabel("output tokens / s")
        ax.set_title("Throughput (by row finish time)")
        plots["throughput.png"] = _figure_png(fig)

    latency = rows.column("latency_s").drop_null().to_pylist()
    ttft = rows.column("ttft_s").drop_null().to_pylist()
    if latency or ttft:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for ax, values, name in ((axes[0], ttft, "TTFT"), (axes[1], latency, "latency")):
            if values:
                ax.hist(values, bins=40)
            ax.set_xlabel(f"{name} (s)")
            ax.set_ylabel("rows")
            ax.set_title(f"{name} distribution")
        plots["latency.png"] = _figure_png(fig)

    use_usd = summary.device_hour_usd > 0
    column = "cost_usd" if use_usd else "gpu_seconds"
    per_row = rows.column(column).drop_null().to_pylist()
    if per_row:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.hist(per_row, bins=40)
        ax.set_xlabel("cost per row (USD)" if use_usd else "device-seconds per row")
        ax.set_ylabel("rows")
        ax.set_title("Cost per row")
        plots["cost_per_row.png"] = _figure_png(fig)

    if summary.actors:
        fig, (ax_t, ax_b) = plt.subplots(
            2, 1, figsize=(9, 2.0 + 0.9 * len(summary.actors)), height_ratios=[1, 1]
        )
        names = [a.actor_id for a in summary.actors]
        for y, name in enumerate(names):
            spans = _union(
                [(s, e) for s, e, a in zip(starts, ends, actors, strict=True) if a == name]
            )
            ax_t.broken_barh([(s, e - s) for s, e in spans], (y - 0.35, 0.7), color="tab:green")
        ax_t.set_yticks(range(len(names)), [short_actor(n) for n in names])
        ax_t.set_xlabel("seconds since the first row started (green: rows in the engine)")
        ax_t.set_title("Per-actor busy timeline")
        left = [0.0] * len(names)
        buckets = (
            ("rows", [a.row_gpu_seconds for a in summary.actors], "tab:green"),
            ("pending", [a.pending_s for a in summary.actors], "tab:olive"),
            ("idle", [a.idle_s for a in summary.actors], "tab:gray"),
            ("load", [a.load_s for a in summary.actors], "tab:blue"),
        )
        for label, values, color in buckets:
            ax_b.barh(range(len(names)), values, left=left, label=label, color=color)
            left = [x + v for x, v in zip(left, values, strict=True)]
        ax_b.set_yticks(range(len(names)), [short_actor(n) for n in names])
        ax_b.set_xlabel("device-seconds")
        ax_b.set_title("Where each actor's paid time went")
        ax_b.legend(loc="lower right", fontsize="small")
        plots["actors.png"] = _figure_png(fig)

    if summary.errors_by_kind:
        kinds = list(summary.errors_by_kind)[:15]
        fig, ax = plt.subplots(figsize=(8, 1.5 + 0.35 * len(kinds)))
        ax.barh(range(len(kinds)), [summary.errors_by_kind[k] for k in kinds], color="tab:red")
        ax.set_yticks(range(len(kinds)), kinds)
        ax.invert_yaxis()
        ax.set_xlabel("rows")
        ax.set_title("Error rows by kind")
        plots["errors.png"] = _figure_png(fig)
    return plots


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


# --- writing ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReportResult:
    summary: ReportSummary
    report_uri: str  # where report.md was written
    plot_names: list[str]  # paths relative to the output prefix


def build_report(out: OutputDir, plots: bool = True) -> tuple[ReportSummary, str, dict[str, bytes]]:
    """The summary, report.md text and plot PNGs of an output prefix (nothing written)."""
    inputs = load_report_inputs(out)
    summary = summarize(inputs)
    images = render_plots(inputs, summary) if plots else {}
    names = [f"{PLOTS_DIR}/{name}" for name in images]
    return summary, render_markdown(summary, names), images


def write_report(output_uri: str, storage: StorageSpec | None = None) -> ReportResult:
    """(Re)generate report.md and the plots beside the parts of `output_uri`."""
    from pipeline.batch.commit.parts import OutputDir

    out = OutputDir(output_uri, storage or StorageSpec())
    summary, markdown, images = build_report(out)
    for name, data in images.items():
        out.put_atomic(f"{PLOTS_DIR}/{name}", data)
    out.put_atomic(REPORT_NAME, markdown.encode())
    return ReportResult(
        summary=summary,
        report_uri=f"{out.uri}/{REPORT_NAME}",
        plot_names=[f"{PLOTS_DIR}/{n}" for n in images],
    )
