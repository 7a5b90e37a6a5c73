"""`python -m pipeline.cli`: the same as the `tokenmill` command."""

from pipeline.cli import app

app()
