"""`tokenmill serve`: the OpenAI-compatible endpoint over the batch jobs' models and engines."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from engines.dev.tiny import make_tiny_model
from pipeline.cli.app import app
from pipeline.serve.access.auth import AuthConfigError, digest, load_key_digests
from pipeline.serve.access.keys import KeyFileError, entry_snippet, load_key_file
from pipeline.serve.run import ServerOptions, run_server
from pipeline.serve.spec import load_serve_spec
from pipeline.spec import SpecError

if TYPE_CHECKING:
    from pipeline.serve.spec import ServeSpec


@app.command("serve")
def serve_cmd(
    config: Path = typer.Argument(..., help="Serve YAML (models, replicas, limits, auth)."),
    host: str | None = typer.Option(None, help="Listen address (default: http.host, 127.0.0.1)."),
    port: int | None = typer.Option(None, help="Listen port (default: http.port, 8000)."),
    insecure_no_auth: bool = typer.Option(
        False,
        "--insecure-no-auth",
        help="Serve without API keys. Only for a local test server: anyone who can reach the "
        "port can use it.",
    ),
    num_cpus: int | None = typer.Option(
        None, help="CPUs of the local Ray started here (ignored with RAY_ADDRESS)."
    ),
    object_store_mb: int | None = typer.Option(
        None, help="Object store MiB of the local Ray started here (ignored with RAY_ADDRESS)."
    ),
    make_demo_model: bool = typer.Option(
        False,
        "--make-demo-model",
        help="Build the random tiny model (make-tiny-model) at each local model.path that has "
        "no model yet; for trying jobs/serve.yaml on a fresh checkout.",
    ),
) -> None:
    """Serve the models in CONFIG over OpenAI's HTTP API until Ctrl-C or SIGTERM."""
    # lazy: the CLI starts without Ray Serve's imports; only this command needs them
    from pipeline.doctor.packages import extra_problems

    problems = extra_problems("serve")
    if problems:
        # Ray Serve's own requirements (fastapi, starlette) are not part of the base install,
        # and an environment such as TensorRT-LLM's container pins older ones.
        typer.echo(
            "error: tokenmill serve needs the serve extra, which this environment lacks: "
            + "; ".join(problems)
            + ". Install it with pip install 'tokenmill[serve]', or serve from an image that "
            "has it (docs/deploy.md).",
            err=True,
        )
        raise typer.Exit(2)

    try:
        spec = load_serve_spec(config)
        keys = load_key_digests(spec.auth, insecure_no_auth=insecure_no_auth)
        if spec.auth.keys_file:
            # Checked here too, so a broken file fails before Ray starts (the ingress replicas
            # read it themselves).
            load_key_file(spec.auth.keys_file)
    except (SpecError, AuthConfigError, KeyFileError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if make_demo_model:
        _make_missing_models([m.model.path for m in spec.models])
    missing = _missing_local_models(spec)
    if missing:
        typer.echo(f"error: {config}: {missing}", err=True)
        raise typer.Exit(2)
    if keys.insecure:
        typer.echo("warning: serving without API keys (--insecure-no-auth)", err=True)
    options = ServerOptions(
        host=host or spec.http.host,
        port=port or spec.http.port,
        num_cpus=num_cpus,
        object_store_mb=object_store_mb,
    )
    models = ", ".join(m.name for m in spec.models)
    run_server(
        spec,
        keys,
        options,
        on_ready=lambda url: typer.echo(f"serving {models} at {url}", err=False),
    )


@app.command("key-digest")
def key_digest_cmd(
    name: str | None = typer.Option(
        None, help="Print a keys-file entry with this name instead of the bare digest."
    ),
) -> None:
    """SHA-256 digest of an API key for auth.keys_file. Reads the key from stdin (one line)
    or, at a terminal, asks for it without echo; the key itself is never printed."""
    import sys

    if sys.stdin.isatty():
        key = typer.prompt("API key", hide_input=True)
    else:
        key = sys.stdin.readline()
    key = key.strip()
    if not key:
        typer.echo("error: no key given (pipe it in: echo -n KEY | tokenmill key-digest)", err=True)
        raise typer.Exit(2)
    value = digest(key)
    typer.echo(entry_snippet(name, value) if name else value, nl=not name)


def _make_missing_models(paths: list[str]) -> None:

    for path in paths:
        local = Path(path).expanduser()
        if "://" in path or (local / "config.json").is_file():
            continue
        make_tiny_model(local, arch="llama")
        typer.echo(f"built the tiny demo model at {local}")


def _missing_local_models(spec: ServeSpec) -> str | None:
    """A message for local model paths with no model, checked before Ray starts: a replica that
    cannot load fails only after Serve's constructor retries, far from the cause."""
    for i, served in enumerate(spec.models):
        path = served.model.path
        if "://" in path and not path.startswith("file://"):
            continue
        local = Path(path.removeprefix("file://")).expanduser()
        if not (local / "config.json").is_file():
            return (
                f"models[{i}] ({served.name}): model.path {local} has no config.json; point it "
                "at a Hugging Face model directory, or pass --make-demo-model to build the tiny "
                "demo model there"
            )
    return None
