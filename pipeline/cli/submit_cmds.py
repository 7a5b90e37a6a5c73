"""`tokenmill submit`: run a job file on a remote Ray cluster through the Ray Jobs API."""

from __future__ import annotations

from pathlib import Path

import typer

from pipeline.cli.app import app
from pipeline.submit import SubmitError, SubmitRequest, range_exit_code, submit, submit_range


@app.command("submit")
def submit_cmd(
    job_file: Path = typer.Argument(..., help="Job YAML on this machine; validated before upload."),
    address: str = typer.Option(
        ...,
        "--address",
        envvar="RAY_API_SERVER_ADDRESS",
        help="Ray Jobs API (dashboard) URL, e.g. http://ray-head:8265.",
    ),
    date: str | None = typer.Option(
        None, "--date", help="Run date YYYY-MM-DD for {{ date }}; default: the file's or today UTC."
    ),
    since: str | None = typer.Option(
        None,
        "--since",
        help="Catch up: submit every night from this date to --date (default today UTC); "
        "nights that already succeeded are skipped.",
    ),
    wait: bool = typer.Option(
        False, "--wait", help="Follow the logs and exit with the job's status (0 = succeeded)."
    ),
    set_: list[str] = typer.Option(
        [], "--set", help="Override a field, e.g. --set sampling.max_tokens=64 (repeatable)."
    ),
    env_from: list[str] = typer.Option(
        [],
        "--env-from",
        help="Forward this environment variable to the job by name (repeatable). Default: the "
        "standard AWS_* variables that are set.",
    ),
    no_env: bool = typer.Option(
        False,
        "--no-env",
        help="Forward none of the AWS_* defaults (the cluster has its own credentials); "
        "${VAR}s the job file uses are still forwarded.",
    ),
    ship_code: bool = typer.Option(
        False,
        "--ship-code",
        help="Upload this checkout's `pipeline` and `engines` packages with the job, for "
        "clusters whose image lacks (this version of) tokenmill.",
    ),
    token_file: Path | None = typer.Option(
        None,
        "--token-file",
        help="Ray auth token file. Default: $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH, "
        "~/.ray/auth_token.",
    ),
) -> None:
    """Submit JOB_FILE to a Ray cluster: at most one run per job, date and settings.

    Submitting the same night again attaches to (with --wait) or reports the first submission;
    a failed one is retried under `<id>-rN` and resumes from its committed parts.
    Exit codes: 0 submitted / succeeded, 1 job failed, 2 invalid job or arguments,
    3 job finished with too many error rows, 4 cluster unreachable or refused,
    5 job stopped at its cost budget.
    """

    if no_env and env_from:
        typer.echo("--no-env and --env-from contradict each other; pass one", err=True)
        raise typer.Exit(2)
    request = SubmitRequest(
        job_file=job_file,
        address=address,
        date=date,
        overrides=tuple(set_),
        wait=wait,
        ship_code=ship_code,
        env_from=() if no_env else (tuple(env_from) if env_from else None),
        token_file=token_file,
    )
    try:
        if since is None:
            code = submit(request).exit_code
        else:
            outcomes = submit_range(request, since)
            for day, outcome in outcomes:
                typer.echo(
                    f"{day}  {outcome.action:<6}  {outcome.submission_id}  exit {outcome.exit_code}"
                )
            code = range_exit_code(outcomes)
    except SubmitError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(exc.exit_code) from None
    raise typer.Exit(code)
