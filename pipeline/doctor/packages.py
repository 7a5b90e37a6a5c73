"""Installed versions against tokenmill's own requirements (its installed metadata).

The ranges are read from the installed package's metadata, the same ranges pip resolved
against, so the doctor and the package can never disagree on what is supported.
"""

from __future__ import annotations

from importlib import metadata

from packaging.requirements import Requirement

from pipeline.doctor.findings import Finding, Status

DIST = "tokenmill"
# Reported by name even when fine: the versions that decide what runs.
KEY_PACKAGES = ("torch", "transformers", "tokenizers", "xgrammar", "numpy", "ray", "pyarrow")
# What each extra (pyproject's optional-dependencies) makes possible, as the doctor names it.
EXTRA_USES = {
    "serve": "tokenmill serve and the Batch API",
    "quantize": "tokenmill quantize and model.quantization",
}


def requirements(extra: str = "", dist: str = DIST) -> list[Requirement]:
    """A distribution's requirements (tokenmill's by default): the core ones (extra "") or
    one extra's own."""
    found = []
    for line in metadata.requires(dist) or []:
        req = Requirement(line)
        in_core = req.marker is None or req.marker.evaluate({"extra": ""})
        if extra:
            if not in_core and req.marker.evaluate({"extra": extra}):
                found.append(req)
        elif in_core:
            found.append(req)
    return found


def spelled(req: Requirement) -> str:
    """A requirement as pip takes it, without its environment marker: ray[serve]==2.60.0."""
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{req.name}{extras}{req.specifier}"


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _outside(req: Requirement) -> str | None:
    """Why `req` is not met here (missing, the installed version, or a requirement of the
    extras it asks for, such as ray[serve]'s fastapi), or None when it is met."""
    version = installed_version(req.name)
    if version is None:
        return "not installed"
    if not req.specifier.contains(version, prereleases=True):
        return f"installed {version}"
    for extra in sorted(req.extras):
        for inner in requirements(extra, dist=req.name):
            inner_version = installed_version(inner.name)
            if inner_version is None or not inner.specifier.contains(
                inner_version, prereleases=True
            ):
                found = "not installed" if inner_version is None else f"installed {inner_version}"
                return f"its {extra} extra needs {inner.name}{inner.specifier}, {found}"
    return None


def check_ranges() -> list[Finding]:
    """One finding per key package and per core requirement that is not met."""
    try:
        own = metadata.version(DIST)
    except metadata.PackageNotFoundError:
        return [
            Finding(
                "package",
                DIST,
                Status.CONFLICT,
                "tokenmill is not installed as a package here",
                "pip install tokenmill (or `pip install -e .` in a checkout)",
            )
        ]
    findings = [Finding("package", DIST, Status.OK, own)]
    met = 0
    for req in requirements():
        problem = _outside(req)
        if problem is not None:
            findings.append(
                Finding(
                    "package",
                    req.name,
                    Status.CONFLICT,
                    f"tokenmill {own} needs {spelled(req)}: {problem}",
                    f"pip install '{req.name}{req.specifier}'",
                )
            )
        elif req.name in KEY_PACKAGES:
            findings.append(
                Finding(
                    "package",
                    req.name,
                    Status.OK,
                    f"{installed_version(req.name)} (supported: {req.specifier})",
                )
            )
        else:
            met += 1
    findings.append(Finding("package", "others", Status.OK, f"{met} more requirements met"))
    return findings


def extra_problems(extra: str) -> list[str]:
    """What keeps an extra from working here: one line per unmet requirement."""
    problems = []
    for req in requirements(extra):
        problem = _outside(req)
        if problem is not None:
            problems.append(f"{spelled(req)}: {problem}")
    return problems


def check_extras() -> list[Finding]:
    findings = []
    for extra, use in EXTRA_USES.items():
        problems = extra_problems(extra)
        if problems:
            findings.append(
                Finding(
                    "extra",
                    extra,
                    Status.INFO,
                    f"{use} unavailable: " + "; ".join(problems),
                    f"pip install 'tokenmill[{extra}]' (in an environment whose pins allow it: "
                    "docs/deploy.md)",
                )
            )
        else:
            findings.append(Finding("extra", extra, Status.OK, use, provides=(extra,)))
    return findings
