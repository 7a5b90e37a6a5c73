"""`tokenmill` command line. Each module below registers its commands on the shared app;
heavy imports (torch, ray, transformers) happen inside the commands, so `--help` is instant."""

from pipeline.cli import (  # noqa: F401  (imported for their command registrations)
    doctor_cmds,
    engine_cmds,
    job_cmds,
    plan_cmds,
    quantize_cmds,
    report_cmds,
    serve_cmds,
    submit_cmds,
)
from pipeline.cli.app import app

__all__ = ["app"]
