"""`tokenmill validate` and `tokenmill plan`: check a job file and estimate a run before it starts.

Both exit 0 when the job is fine and 1 with the problem (file, field path, allowed values)
on stderr otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from pipeline.cli.app import app
from pipeline.openai.chat import PromptError
from pipeline.spec import SpecError, load_job_spec
from pipeline.storage import StorageError

_SET_HELP = "Override a field: --set sampling.max_tokens=64 (repeatable; YAML values)."
_DATE_HELP = "Run date for {{ date }} (YYYY-MM-DD); default: the file's date or today (UTC)."


def _fail(message: str) -> None:
    typer.echo(message, err=True)
    raise typer.Exit(1)


@app.command("validate")
def validate(
    job: Path = typer.Argument(..., help="Job YAML file."),
    set_: list[str] = typer.Option([], "--set", help=_SET_HELP),
    date: str | None = typer.Option(None, "--date", help=_DATE_HELP),
    check_storage: bool = typer.Option(
        False, "--check-storage", help="Also list the input files and check the model path."
    ),
) -> None:
    """Parse and check a job file (and with --check-storage, its inputs and model)."""

    try:
        spec = load_job_spec(job, overrides=set_, date=date)
        if check_storage:
            # lazy: the CLI starts without Ray, torch and pyarrow; only this command needs them
            from pipeline.batch.driver.plan import preflight

            files = preflight(spec)
            for file in files:
                typer.echo(f"  {file.uri} ({file.size:,} bytes)")
            typer.echo(f"ok: job {spec.name} ({len(files)} input file(s))")
            return
    except (SpecError, StorageError) as exc:
        _fail(str(exc))
    typer.echo(f"ok: job {spec.name} (date {spec.date})")


@app.command("plan")
def plan(
    job: Path = typer.Argument(..., help="Job YAML file."),
    set_: list[str] = typer.Option([], "--set", help=_SET_HELP),
    date: str | None = typer.Option(None, "--date", help=_DATE_HELP),
    sample_rows: int = typer.Option(200, min=1, help="Rows to read and tokenize as the sample."),
    tokens_per_s: float | None = typer.Option(
        None, "--tokens-per-s", min=0.001, help="Output tokens/s per actor to assume."
    ),
    measure: bool = typer.Option(
        False, "--measure", help="Measure tokens/s with the real engine on a few sample prompts."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
) -> None:
    """Count rows, tokenize a sample, find error rows, estimate time and cost."""
    # lazy: the CLI starts without Ray, torch and pyarrow; only this command needs them
    from pipeline.batch.driver.plan import build_plan, format_plan

    try:
        spec = load_job_spec(job, overrides=set_, date=date)
        report = build_plan(
            spec, sample_rows=sample_rows, tokens_per_s=tokens_per_s, measure=measure
        )
    except (SpecError, PromptError, StorageError) as exc:
        _fail(str(exc))
    typer.echo(json.dumps(report.to_dict(), indent=2) if as_json else format_plan(report))
