"""The run report beside a job's output: report.md plus PNG plots, from `_manifest.json`
alone (so `tokenmill report OUTPUT` can regenerate it at any time without reading a row).

    load_report_inputs(out) → summarize(inputs) → render_markdown(summary) + render_plots(...)
                                                → write_report puts them beside the parts

Layout written under the output prefix:

    report.md                 summary, cost, estimate vs actual, per-actor books, errors
    report/throughput.png     output tokens per second over time
    report/latency.png        TTFT and end-to-end latency distributions
    report/cost_per_row.png   cost_usd per row (gpu_seconds when no device price is set)
    report/actors.png         per actor: busy spans over time, and where its paid time went
    report/errors.png         error rows by kind (only when there are errors)
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.batch.interface.output import error_kind
from pipeline.report.markdown import fmt, render_markdown, summary_rows, usd
from pipeline.report.plots import render_plots
from pipeline.report.summary import (
    ReportError,
    ReportInputs,
    ReportSummary,
    load_report_inputs,
    short_actor,
    summarize,
)
from pipeline.spec import StorageSpec
from pipeline.storage import OutputDir

__all__ = [
    "ReportError",
    "ReportInputs",
    "ReportResult",
    "ReportSummary",
    "build_report",
    "error_kind",
    "fmt",
    "load_report_inputs",
    "render_markdown",
    "render_plots",
    "short_actor",
    "summarize",
    "summary_rows",
    "usd",
    "write_report",
]

REPORT_NAME = "report.md"
PLOTS_DIR = "report"


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
    out = OutputDir(output_uri, storage or StorageSpec())
    summary, markdown, images = build_report(out)
    for name, data in images.items():
        out.put(f"{PLOTS_DIR}/{name}", data)
    out.put(REPORT_NAME, markdown.encode())
    return ReportResult(
        summary=summary,
        report_uri=f"{out.uri}/{REPORT_NAME}",
        plot_names=[f"{PLOTS_DIR}/{n}" for n in images],
    )
