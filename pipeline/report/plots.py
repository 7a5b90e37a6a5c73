"""The report's PNG plots, drawn from the manifest's merged row statistics.

throughput.png     output tokens per second over time (tokens spread over each row's
                   decode interval, so the line shows when tokens were made)
latency.png        TTFT and end-to-end latency distributions (log buckets)
cost_per_row.png   cost_usd per row (device-seconds when no device price is set)
actors.png         per actor: when it had rows in its engine, and where its paid time went
errors.png         error rows by kind (only when there are errors)
"""

from __future__ import annotations

import io
from typing import Any

from pipeline.batch.interface.output import Histogram
from pipeline.report.summary import ReportInputs, ReportSummary, short_actor


def _figure_png(fig: Any) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def _histogram(ax: Any, histogram: Histogram, scale: float, label: str) -> None:
    """Bars of a log-bucket histogram, values multiplied by `scale`, on a log x axis."""
    items = [(low * scale, high * scale, n) for low, high, n in histogram.items() if high > 0]
    if not items:
        return
    ax.bar(
        [low for low, _, _ in items],
        [n for _, _, n in items],
        width=[high - low for low, high, _ in items],
        align="edge",
    )
    ax.set_xscale("log")
    ax.set_xlabel(label)
    ax.set_ylabel("rows")


def render_plots(inputs: ReportInputs, summary: ReportSummary) -> dict[str, bytes]:
    """PNG bytes by file name (under the report's plot folder). Plots without data are left
    out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots: dict[str, bytes] = {}
    stats = inputs.stats
    rates = stats.tokens.rates()
    origin = rates[0][0] if rates else 0.0
    busy_starts = [s for spans in stats.busy.values() for s, _ in spans]
    if busy_starts:
        origin = min(origin, min(busy_starts)) if rates else min(busy_starts)

    if rates:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        xs = [t - origin for t, _ in rates]
        ys = [r for _, r in rates]
        width = stats.tokens.width_s
        # where="post" draws each bin from its left edge: repeat the last rate to close it.
        ax.step([*xs, xs[-1] + width], [*ys, ys[-1]], where="post")
        ax.set_xlabel("seconds since the first row started")
        ax.set_ylabel("output tokens / s")
        ax.set_title(f"Throughput (tokens over each row's decode time, {width:g}s bins)")
        plots["throughput.png"] = _figure_png(fig)

    if stats.latency_s.total or stats.ttft_s.total:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for ax, histogram, name in (
            (axes[0], stats.ttft_s, "TTFT"),
            (axes[1], stats.latency_s, "latency"),
        ):
            _histogram(ax, histogram, 1.0, f"{name} (s)")
            ax.set_title(f"{name} distribution")
        plots["latency.png"] = _figure_png(fig)

    if stats.gpu_seconds.total:
        use_usd = summary.device_hour_usd > 0
        fig, ax = plt.subplots(figsize=(8, 3.5))
        scale = summary.device_hour_usd / 3600.0 if use_usd else 1.0
        label = "cost per row (USD)" if use_usd else "device-seconds per row"
        _histogram(ax, stats.gpu_seconds, scale, label)
        ax.set_title("Cost per row")
        plots["cost_per_row.png"] = _figure_png(fig)

    if summary.actors:
        fig, (ax_t, ax_b) = plt.subplots(
            2, 1, figsize=(9, 2.0 + 0.9 * len(summary.actors)), height_ratios=[1, 1]
        )
        names = [a.actor_id for a in summary.actors]
        for y, name in enumerate(names):
            spans = stats.busy.get(name, [])
            ax_t.broken_barh(
                [(s - origin, e - s) for s, e in spans], (y - 0.35, 0.7), color="tab:green"
            )
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
