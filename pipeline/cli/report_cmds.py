"""`tokenmill report OUTPUT_URI`: print a job's summary and regenerate its run report."""

from __future__ import annotations

import json

import typer

from pipeline.cli.app import app
from pipeline.spec import StorageSpec
from pipeline.storage import OutputDir, StorageError

EXIT_NO_OUTPUT = 2  # the URI holds no tokenmill output (or cannot be read)


@app.command("report")
def report_cmd(
    output_uri: str = typer.Argument(..., help="A job's output.uri (local path or s3:// prefix)."),
    endpoint_url: str | None = typer.Option(
        None, "--endpoint-url", help="S3 endpoint (credentials come from the environment)."
    ),
    region: str | None = typer.Option(None, "--region", help="S3 region."),
    anonymous: bool = typer.Option(False, "--anonymous", help="Read a public bucket."),
    write: bool = typer.Option(
        True, "--write/--no-write", help="Regenerate report.md and plots beside the output."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON instead."),
) -> None:
    """Summarize an output prefix (rows, tokens, latency, cost, per-actor books) and write
    report.md with plots beside it. Exit code 2 if the prefix holds no tokenmill output."""
    from rich.console import Console
    from rich.table import Table

    # lazy: the report's plotting (matplotlib) loads only for this command
    from pipeline.report import (
        ReportError,
        build_report,
        short_actor,
        summary_rows,
        write_report,
    )

    storage = StorageSpec(endpoint_url=endpoint_url, region=region, anonymous=anonymous)
    err = Console(stderr=True)
    try:
        if write:
            result = write_report(output_uri, storage)
            summary, written = result.summary, result.report_uri
        else:
            summary, _, _ = build_report(OutputDir(output_uri, storage), plots=False)
            written = None
    except (ReportError, StorageError, FileNotFoundError) as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        raise typer.Exit(EXIT_NO_OUTPUT) from None

    if as_json:
        typer.echo(json.dumps(summary.to_dict(), indent=2, default=str))
        return
    console = Console(soft_wrap=True)
    table = Table(title=f"{summary.job}: {summary.output_uri}", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    for name, value in summary_rows(summary):
        table.add_row(name, value)
    console.print(table)
    if summary.actors:
        actors = Table(title="actors (device-seconds)")
        for col in ("actor", "rows", "rows dev-s", "idle", "load", "busy", "balance"):
            actors.add_column(col, justify="left" if col == "actor" else "right")
        for a in summary.actors:
            actors.add_row(
                short_actor(a.actor_id),
                f"{a.num_rows:,}",
                f"{a.row_gpu_seconds:.3f}",
                f"{a.idle_s:.3f}",
                f"{a.load_s:.3f}",
                f"{a.busy_fraction:.0%}",
                f"{a.balance_error_s:.1e}",
            )
        console.print(actors)
    for kind, count in summary.errors_by_kind.items():
        console.print(f"errors: {count} x {kind}", markup=False, highlight=False)
    if written:
        console.print(f"report: {written}", markup=False, highlight=False)
