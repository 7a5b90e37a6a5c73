"""Print a pins file with another's lines put in place of its lines for the same packages.

    python images/constraints.py images/pins/trtllm-1.2.txt images/pins/trtllm-1.2-serve.txt

The images install tokenmill under an engine image's pins (images/pins/); an environment that
must differ on a few packages (Serve beside TensorRT-LLM: a newer fastapi) names them in an
override file, and this writes the constraints it installs under. Standard library only: it
runs before anything is installed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def name_of(line: str) -> str | None:
    """The canonical package name a constraint line is about; None for comments and blanks."""
    body = line.split("#", 1)[0]
    match = NAME.match(body)
    return re.sub(r"[-_.]+", "-", match.group(1)).lower() if match else None


def merged(base: str, override: str) -> str:
    """`base` without the lines for packages `override` names, then `override`'s lines."""
    replaced = {n for line in override.splitlines() if (n := name_of(line))}
    kept = [line for line in base.splitlines() if name_of(line) not in replaced]
    added = [line for line in override.splitlines() if name_of(line)]
    return "\n".join([*kept, *added]) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: constraints.py BASE_PINS [OVERRIDE_PINS]", file=sys.stderr)
        return 2
    base = Path(argv[0]).read_text()
    override = Path(argv[1]).read_text() if len(argv) == 2 else ""
    sys.stdout.write(merged(base, override))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
