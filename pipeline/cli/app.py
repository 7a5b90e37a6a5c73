"""The `tokenmill` Typer application; commands live in sibling modules, one per area."""

import typer

app = typer.Typer(
    name="tokenmill",
    help="Batch token generation on Ray: YAML jobs, in-flight batching engines, per-token cost.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def main() -> None:
    """Batch token generation on Ray: YAML jobs, in-flight batching engines, per-token cost."""
