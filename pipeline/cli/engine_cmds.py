"""Engine-level commands: build a tiny model, benchmark an engine."""

from __future__ import annotations

from pathlib import Path

import typer

from pipeline.cli.app import app


@app.command("make-tiny-model")
def make_tiny_model(
    out_dir: Path = typer.Argument(..., help="Directory to write the Hugging Face model to."),
    arch: str = typer.Option("llama", help="Architecture: llama, qwen2 or qwen3."),
    size: str = typer.Option("tiny", help="Preset: tiny (~0.3M params) or small (~35M)."),
    tied: bool = typer.Option(False, help="Tie the input embedding and the LM head."),
    seed: int = typer.Option(0, help="Seed for the tokenizer corpus and the weights."),
) -> None:
    """Train a byte-level BPE tokenizer locally and save a random model with it."""
    from engines.tiny import make_tiny_model as build

    try:
        path = build(out_dir, arch=arch, size=size, tie_word_embeddings=tied, seed=seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(f"wrote {arch} ({size}) model to {path}")
