"""The architecture as code: the import-linter contracts of pyproject.toml (the layers, batch
and serve independent but for the Batch API's interface, engines standalone, no cycle among
the children of any package of pipeline/ or engines/, counting imports inside functions) hold,
and what import-linter cannot express: a project import inside a function says why, on the
line above it (an optional or heavy dependency, the CLI's start-up, a lazy package).
`make lint` runs the same contracts with `lint-imports`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_import_contracts_hold() -> None:
    linter = Path(sys.executable).parent / "lint-imports"
    if not linter.exists():
        pytest.skip("import-linter is in the dev extra")
    run = subprocess.run(
        [str(linter), "--no-cache"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


def _function_level_project_imports() -> list[tuple[Path, int, str]]:
    found = []
    for top in ("pipeline", "engines"):
        for path in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for sub in ast.walk(node):
                    if isinstance(sub, ast.ImportFrom) and sub.module and not sub.level:
                        name = sub.module
                    elif isinstance(sub, ast.Import):
                        name = sub.names[0].name
                    else:
                        continue
                    if name.split(".")[0] in ("pipeline", "engines"):
                        found.append((path, sub.lineno, name))
    return sorted(set(found))


def test_a_project_import_inside_a_function_says_why() -> None:
    unexplained = []
    for path, line, name in _function_level_project_imports():
        lines = path.read_text().splitlines()
        above = lines[line - 2].strip() if line >= 2 else ""
        # A reason on the line above, or above a block of imports it covers.
        i = line - 2
        while i >= 0 and lines[i].strip().startswith(("from ", "import ")):
            i -= 1
        if not (above.startswith("#") or (i >= 0 and lines[i].strip().startswith("#"))):
            unexplained.append(f"{path.relative_to(ROOT)}:{line} {name}")
    assert not unexplained, "imports inside functions without a reason: " + ", ".join(unexplained)
