"""report.md: the summary, cost books, estimate vs actual, actors and errors as Markdown."""

from __future__ import annotations

import math
from typing import Any

from pipeline.report.summary import ReportSummary, short_actor


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
    if s.spec is not None:
        rate, per = s.spec.acceptance_rate, s.spec.accepted_per_verification
        rows.append(
            (
                "speculative: acceptance, accepted per verification",
                f"{'-' if rate is None else f'{rate:.1%}'} of {s.spec.proposed:,} proposed, "
                + ("- (not counted by this engine)" if per is None else f"{per:.2f}"),
            )
        )
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
    if s.by_adapter:
        out += ["", "### By adapter", ""]
        out.append(
            "Rows by the LoRA adapter they ran with (model.adapters; `(model)`: the model "
            "itself). Device-seconds and dollars are the rows' own share (idle, load and "
            "pending time are the job's, above)."
        )
        out.append("")
        body = [
            [
                name or "(model)",
                fmt(a.rows),
                fmt(a.errors),
                fmt(a.prompt_tokens),
                fmt(a.completion_tokens),
                fmt(a.gpu_seconds),
                usd(a.cost_usd),
                usd(a.cost_usd / a.completion_tokens * 1e6) if a.completion_tokens else "-",
            ]
            for name, a in sorted(s.by_adapter.items())
        ]
        out += _table(
            [
                "adapter",
                "rows",
                "errors",
                "prompt tokens",
                "output tokens",
                "device-seconds",
                "USD",
                "USD per 1M output",
            ],
            body,
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


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole > 0 else "—"
