"""The package's import rules (shared/design: the layout), checked on the source.

- `engines/` never imports Ray or `pipeline`: an engine runs in any process, with or without
  a cluster, and the batch and Serve products sit on top of it, not inside it.
- batch never imports serve; serve imports batch only for the Batch API (which runs jobs).
- `pipeline/openai/` (the OpenAI wire format, chat rendering) imports neither batch nor serve:
  both products sit on it.
- nothing imports the report but the CLI: the report reads committed output, the batch run
  never calls it (batch and report do not import each other).

`KNOWN` lists the edges that still break a rule, each with where it goes. The test fails when
a new one appears and also when a listed one is gone, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The Serve package that is the Batch API (/v1/files, /v1/batches): it and the modules below it
# run batch jobs.
BATCH_API = "pipeline.serve.batch_api"

# Edges that break a rule today, and where each goes; none at present.
KNOWN: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every module `path` imports, at the top or inside functions."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.add(node.module)
    return found


def _edges() -> set[tuple[str, str]]:
    edges = set()
    for top in ("pipeline", "engines"):
        for path in sorted((ROOT / top).rglob("*.py")):
            source = _module_name(path)
            edges.update((source, target) for target in _imports(path))
    return edges


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _breaks_a_rule(source: str, target: str) -> str | None:
    if _within(source, "engines") and (_within(target, "ray") or _within(target, "pipeline")):
        return "engines/ imports Ray or pipeline"
    if _within(source, "pipeline.batch") and _within(target, "pipeline.serve"):
        return "batch imports serve"
    if _within(source, "pipeline.openai") and (
        _within(target, "pipeline.batch") or _within(target, "pipeline.serve")
    ):
        return "the OpenAI layer imports batch or serve"
    if (
        _within(source, "pipeline.serve")
        and _within(target, "pipeline.batch")
        and not _within(source, BATCH_API)
    ):
        return "serve imports batch outside the Batch API"
    if (
        _within(target, "pipeline.report")
        and not _within(source, "pipeline.report")
        and not _within(source, "pipeline.cli")
    ):
        return "the report is imported outside the CLI"
    return None


def test_import_rules_hold():
    broken = {
        (source, target): rule
        for source, target in _edges()
        if (rule := _breaks_a_rule(source, target))
    }
    new = {edge: rule for edge, rule in broken.items() if edge not in KNOWN}
    assert not new, "imports that break the layout's rules:\n" + "\n".join(
        f"  {s} -> {t}: {rule}" for (s, t), rule in sorted(new.items())
    )
    gone = KNOWN - set(broken)
    assert not gone, f"fixed, so take them off KNOWN: {sorted(gone)}"


def test_the_rules_see_an_edge():
    """The walk finds real imports (a rule checked on nothing would always pass)."""
    edges = _edges()
    assert ("pipeline.batch.driver.run", "pipeline.batch.driver.scheduler") in edges
    assert ("engines.reference.engine", "torch") in edges
    assert _breaks_a_rule("engines.vllm", "ray") and _breaks_a_rule(
        "pipeline.batch.x", "pipeline.serve.y"
    )
    assert not _breaks_a_rule("pipeline.serve.batch_api.batches", "pipeline.batch.commit.manifest")
    assert _breaks_a_rule("pipeline.serve.app", "pipeline.batch.commit.manifest")
    assert _breaks_a_rule("pipeline.openai.chat", "pipeline.batch.stages.prompts")
    assert not _breaks_a_rule("pipeline.serve.protocol.tokens", "pipeline.openai.chat")
