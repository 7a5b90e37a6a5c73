"""`tokenmill doctor`: what this environment can run; exit 1 naming every conflict and its fix."""

from __future__ import annotations

import json
from dataclasses import asdict

import typer

from engines.process import Side
from pipeline.cli.app import app
from pipeline.doctor import Status, run_checks
from pipeline.doctor.engine_side import check_engine_side
from pipeline.doctor.findings import unmet

CAPABILITIES = (
    "reference",
    "trtllm",
    "vllm",
    "serve",
    "quantize",
    "cpu",
    "cuda",
    "fp8",
    "nvfp4",
    "storage",
    "ray",
)


@app.command()
def doctor(
    require: list[str] = typer.Option(
        [],
        "--require",
        help=f"A capability this environment must have (repeatable): {', '.join(CAPABILITIES)}. "
        "One that is missing is a failure like a conflict.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the findings as JSON."),
    no_import: bool = typer.Option(
        False,
        "--no-import",
        help="Check TensorRT-LLM and vLLM by their installed versions only, without importing "
        "them (an import can take a minute on a GPU image).",
    ),
    ray_timeout_s: float = typer.Option(5.0, help="Seconds to wait for RAY_ADDRESS to answer."),
    engine_python: str | None = typer.Option(
        None,
        "--engine-python",
        help="The interpreter engine processes run under (a served model's "
        "replicas.engine_python): check its environment too, and that both sides run the "
        "same tokenmill. Its engines and devices count for --require.",
    ),
) -> None:
    """Check this environment: engine kinds, torch and its GPUs, versions against the supported
    ranges, storage credentials (never their values) and Ray. Exit 0 when nothing conflicts,
    1 naming every conflict (and every --require not met) with its fix."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    unknown = [r for r in require if r not in CAPABILITIES]
    if unknown:
        typer.echo(
            f"error: --require {', '.join(unknown)}: unknown; one of {', '.join(CAPABILITIES)}",
            err=True,
        )
        raise typer.Exit(2)
    findings = run_checks(probe_engines=not no_import, ray_timeout_s=ray_timeout_s)
    if engine_python is not None:
        findings += check_engine_side(engine_python, probe=not no_import)
    conflicts = [f for f in findings if f.status is Status.CONFLICT]
    missing = unmet(findings, require)
    if as_json:
        payload = {
            "ok": not conflicts and not missing,
            # What an engine process's parent checks (tokenmill doctor --engine-python).
            "side": asdict(Side.here()),
            "findings": [f.as_json() for f in findings],
            "unmet_requirements": missing,
        }
        typer.echo(json.dumps(payload, indent=2))
    else:
        table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
        for column in ("area", "check", "status", "found"):
            table.add_column(column, overflow="fold")
        style = {Status.OK: "green", Status.INFO: "yellow", Status.CONFLICT: "bold red"}
        for f in findings:
            status = f"[{style[f.status]}]{f.status.value}[/]"
            table.add_row(f.area, f.name, status, escape(f.detail))
        console = Console(soft_wrap=False, width=120)
        console.print(table)
    if conflicts or missing:
        lines = [
            f"{f.area} {f.name}: {f.detail}" + (f"; fix: {f.fix}" if f.fix else "")
            for f in conflicts
        ]
        lines += [
            f"required {name}: not available here" + _hint(findings, name) for name in missing
        ]
        typer.echo("doctor: " + str(len(lines)) + " problem(s):\n  " + "\n  ".join(lines), err=True)
        raise typer.Exit(1)
    typer.echo(
        "doctor: no conflicts" + (f"; has {', '.join(require)}" if require else ""), err=True
    )


def _hint(findings, name: str) -> str:
    """The fix of the finding that would have provided `name`, where one says."""
    for f in findings:
        if f.name == name and f.fix:
            return f" ({f.detail}; fix: {f.fix})"
    return ""
