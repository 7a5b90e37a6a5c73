"""Write console scripts into a directory for distributions this interpreter sees but did not
install itself.

    /opt/serve-env/bin/python images/entry_points.py /opt/serve-env/bin ray tokenmill

A virtual environment made with --system-site-packages imports the container's packages, but
pip writes no scripts for them into the venv's bin: `ray start` on PATH would still be the
container's, run by the container's Python. KubeRay starts Ray with `ray start`, and Ray runs
its workers under the interpreter that started it, so Serve's environment needs its own `ray`
(and `serve`, `tokenmill`) whose first line is its own interpreter. Standard library only.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

TEMPLATE = """#!{python}
# Written by images/entry_points.py: {name} = {value}
import sys

from {module} import {attr}

sys.exit({call}())
"""


def write_scripts(target: Path, dists: list[str], python: str) -> list[Path]:
    """One script per console_scripts entry point of each of `dists`; the paths written.
    An existing file is left alone (pip wrote it: the venv installed that distribution)."""
    written = []
    for dist in dists:
        for entry in metadata.distribution(dist).entry_points:
            if entry.group != "console_scripts":
                continue
            path = target / entry.name
            if path.exists():
                continue
            module, _, attr = entry.value.partition(":")
            head = attr.split(".")[0]
            path.write_text(
                TEMPLATE.format(
                    python=python,
                    name=entry.name,
                    value=entry.value,
                    module=module.strip(),
                    attr=head.strip(),
                    call=attr.strip(),
                )
            )
            path.chmod(0o755)
            written.append(path)
    return written


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: entry_points.py TARGET_DIR DIST [DIST ...]", file=sys.stderr)
        return 2
    try:
        written = write_scripts(Path(argv[0]), argv[1:], sys.executable)
    except metadata.PackageNotFoundError as exc:
        print(f"entry_points.py: {exc} is not installed for {sys.executable}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
