"""Refuse an install that would change a package the base image already carries.

    pip install --dry-run --quiet --report /tmp/plan.json '.[serve]'
    python images/check_install.py /tmp/plan.json [--allow NAME ...]

An engine vendor's image is tested as a whole: its torch, transformers, xgrammar and the rest
are the versions the engine was built and validated with. Installing tokenmill into it may
add packages, never replace one. This reads pip's installation report (what pip would
install: https://pip.pypa.io/en/stable/reference/installation-report/) and this interpreter's
installed distributions, and exits 1 naming every package the install would upgrade,
downgrade or reinstall. `--allow NAME` accepts a change on purpose (say why where it is used).

Standard library only: it runs before tokenmill is installed. The resolution test
(tests/integration/test_install_targets.py) runs the same check against each deployment
target's pins (images/pins/).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(path: list[str] | None = None) -> dict[str, str]:
    """Installed distributions by canonical name -> version (of `path`, default sys.path)."""
    found: dict[str, str] = {}
    for dist in metadata.distributions(path=path) if path else metadata.distributions():
        name = dist.metadata["Name"]
        if name:  # a broken dist-info without metadata is not ours to judge
            found.setdefault(canonical(name), dist.version)
    return found


def planned(report: Mapping) -> dict[str, str]:
    """What pip's installation report would install: canonical name -> version."""
    return {
        canonical(item["metadata"]["name"]): item["metadata"]["version"]
        for item in report.get("install", [])
    }


def changes(
    plan: Mapping[str, str], present: Mapping[str, str], allow: Iterable[str] = ()
) -> list[str]:
    """One line per package of `present` that `plan` would replace, unless allowed."""
    allowed = {canonical(n) for n in allow}
    return [
        f"{name} {present[name]} -> {version}"
        for name, version in sorted(plan.items())
        if name in present and name not in allowed
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="pip's --report JSON of a --dry-run install")
    parser.add_argument(
        "--allow", action="append", default=[], help="a package allowed to change (repeatable)"
    )
    args = parser.parse_args(argv)
    plan = planned(json.loads(args.report.read_text()))
    changed = changes(plan, installed(), args.allow)
    if changed:
        print(
            "installing would change packages of the base image:\n  "
            + "\n  ".join(changed)
            + "\nthe package's requirements must admit the image's versions (images/pins/); "
            "fix the range in pyproject.toml, or pass --allow NAME where a change is intended",
            file=sys.stderr,
        )
        return 1
    new = sorted(plan)
    print(f"ok: {len(new)} new package(s), none of the base image's changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
