"""`tokenmill run` and `tokenmill demo`: run a batch job on Ray and print its summary.

Exit codes: 0 the output is complete; 1 the job failed or is incomplete (rerun to resume);
3 the output is complete but error rows exceed `limits.max_error_fraction`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from pipeline.batch.driver.demo import prepare_demo
from pipeline.cli.app import app
from pipeline.spec import SpecError, load_job_spec
from pipeline.storage import StorageError

if TYPE_CHECKING:
    from pipeline.batch.driver.run import RunResult

EXIT_FAILED = 1


def _err(line: str) -> None:
    typer.echo(line, err=True)


def _fmt(value: Any, unit: str = "", digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}{unit}"
    return f"{value}{unit}"


def print_summary(result: RunResult) -> None:
    """A table of the run's totals (all committed rows) on stdout."""
    from rich.console import Console
    from rich.table import Table

    t = result.totals
    table = Table(title=f"tokenmill: {result.status}", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    rows = [
        ("output", result.output_uri),
        ("rows", f"{t.get('rows', 0)} ({result.rows_written} written by this run)"),
        ("ok / error", f"{t.get('rows_ok', 0)} / {t.get('rows_error', 0)}"),
        (
            "error fraction",
            f"{_fmt(t.get('error_fraction'))} (limit {result.max_error_fraction})",
        ),
        (
            "prompt / output tokens",
            f"{t.get('prompt_tokens', 0)} / {t.get('completion_tokens', 0)}",
        ),
        ("output tokens/s", _fmt(t.get("output_tokens_per_s"))),
        ("prompt tokens/s", _fmt(t.get("prompt_tokens_per_s"))),
        (
            "latency p50 / p95",
            f"{_fmt(t.get('latency_p50_s'), 's')} / {_fmt(t.get('latency_p95_s'), 's')}",
        ),
        (
            "device-seconds rows/idle/load",
            f"{_fmt(t.get('row_gpu_seconds'))} / {_fmt(t.get('idle_s'))} / {_fmt(t.get('load_s'))}",
        ),
        ("cost USD (all-in)", _fmt(t.get("total_usd"))),
        ("USD per 1M output tokens", _fmt(t.get("usd_per_million_output"))),
        ("list price USD", _fmt(t.get("list_price_usd"))),
    ]
    if result.missing_rows:
        rows.append(("missing rows", f"{result.missing_rows} (rerun to resume)"))
    for name, value in rows:
        table.add_row(name, value)
    Console(soft_wrap=True).print(table)
    typer.echo(result.message)


def write_run_report(spec: Any, say: Callable[[str], None] = _err) -> None:
    """report.md and its plots beside the output (`output.report`), from the manifest alone.

    The CLI writes it, not the batch run: the report only reads what the run committed, and
    keeping it out of pipeline.batch keeps batch and report from importing each other.
    """
    if not spec.output.report:
        return
    # lazy: the CLI starts without Ray, torch and pyarrow; only this command needs them
    from pipeline.report import write_report

    try:
        write_report(spec.output.uri, spec.storage)
    except Exception as exc:  # the rows are committed; a failed report must not fail the job
        say(f"warning: could not write the run report: {type(exc).__name__}: {exc}")


def run_job_with_report(
    spec: Any,
    *,
    fresh: bool = False,
    retry_errors: bool = False,
    emit: Callable[[str], None] = _err,
) -> RunResult:
    """`run_job`, then the run report of whatever the run committed."""
    # lazy: the CLI starts without Ray, torch and pyarrow; only this command needs them
    from pipeline.batch.driver.run import run_job

    result = run_job(spec, fresh=fresh, retry_errors=retry_errors, emit=emit)
    write_run_report(spec, emit)
    return result


def run_and_report(spec: Any, *, fresh: bool, retry_errors: bool) -> int:
    """Run the job, print progress and the summary; returns the exit code."""
    # lazy: the CLI starts without Ray, torch and pyarrow; only this command needs them
    from pipeline.batch.driver.run import (
        JobFailed,
        LeaseHeld,
        LeaseLost,
        ResourceError,
        ResumeRefused,
    )

    try:
        result = run_job_with_report(spec, fresh=fresh, retry_errors=retry_errors, emit=_err)
    except (SpecError, ResumeRefused, ResourceError, StorageError, LeaseHeld) as exc:
        _err(f"error: {exc}")
        return EXIT_FAILED
    except JobFailed as exc:
        _err(f"error: {exc}; committed rows are kept, rerun the same command to resume")
        return EXIT_FAILED
    except LeaseLost as exc:
        _err(f"error: another run took this output over; this run stopped ({exc})")
        return EXIT_FAILED
    print_summary(result)
    if result.exit_code == 3:
        _err(
            f"error rows are {result.totals.get('error_fraction', 0):.1%} of the output, over "
            f"limits.max_error_fraction {result.max_error_fraction}; see the `error` column"
        )
    return result.exit_code


@app.command("run")
def run_cmd(
    job: Path = typer.Argument(..., help="Job YAML file."),
    set_: list[str] = typer.Option(
        [], "--set", help="Override a field: --set sampling.max_tokens=64 (repeatable)."
    ),
    date: str | None = typer.Option(None, "--date", help="Run date for {{ date }} (YYYY-MM-DD)."),
    fresh: bool = typer.Option(
        False, "--fresh", help="Delete this job's parts and manifest under output.uri first."
    ),
    retry_errors: bool = typer.Option(
        False, "--retry-errors", help="Regenerate only the rows whose result is an error."
    ),
) -> None:
    """Run (or resume) a batch job on the Ray cluster at RAY_ADDRESS, or on a local one."""

    try:
        spec = load_job_spec(job, overrides=set_, date=date)
    except SpecError as exc:
        _err(f"error: {exc}")
        raise typer.Exit(EXIT_FAILED) from None
    code = run_and_report(spec, fresh=fresh, retry_errors=retry_errors)
    sys.stdout.flush()
    raise typer.Exit(code)


@app.command("demo")
def demo_cmd(
    workdir: Path = typer.Option(
        Path("demo-output"), "--dir", help="Where the tiny model, prompts and results go."
    ),
    rows: int = typer.Option(300, "--rows", min=1, help="Prompts in the sample dataset."),
    set_: list[str] = typer.Option([], "--set", help="Extra overrides for jobs/demo.yaml."),
) -> None:
    """Build a tiny model and a sample dataset, run jobs/demo.yaml, print the summary."""

    try:
        spec = prepare_demo(workdir, num_rows=rows, overrides=set_, emit=_err)
    except (SpecError, FileNotFoundError) as exc:
        _err(f"error: {exc}")
        raise typer.Exit(EXIT_FAILED) from None
    code = run_and_report(spec, fresh=True, retry_errors=False)
    typer.echo(f"demo output: {spec.output.uri} (parts, _manifest.json, _SUCCESS)")
    raise typer.Exit(code)
