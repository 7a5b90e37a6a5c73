"""The package installs beside each engine's own pins: pip's resolver, dry run, per target.

Each deployment target (images/pins/) is modelled as an environment that already carries the
target's exact pins: an empty virtual environment holding a metadata-only stand-in of every
`name==version` line (so pip counts them as installed, as in the vendor's image, and never
fetches their wheels: no CUDA wheel is downloaded). pip then resolves `tokenmill[extras]`
from this checkout into it with `--dry-run --report`, under the target file as constraints.
The target passes when pip finds a solution and that solution replaces none of the image's
packages (images/check_install.py, the same check the image builds run).

Needs the package index (metadata of tokenmill's other requirements); about 30 s a target
with pip's cache warm.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
PINS = REPO / "images" / "pins"


def _images_script(name: str):
    """A stdlib script of images/ (not a package: the image builds run it before any install)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "images" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_install = _images_script("check_install")
constraints = _images_script("constraints")


@dataclass(frozen=True)
class Target:
    pins: str  # file under images/pins/
    extras: str  # what that image installs: tokenmill[extras]
    # A pins file whose lines replace the target's (images/constraints.py), for an environment
    # beside the image that must differ on a few packages; those may change, nothing else.
    override: str | None = None
    # Versions the image carries that its pins file gives only as a range: installed in the
    # stand-in too, so that a change to them is seen.
    carries: tuple[tuple[str, str], ...] = ()


TARGETS = {
    # Batch GPU workers in NVIDIA's container: the engine is already there.
    "trtllm-1.2": Target("trtllm-1.2.txt", "trtllm"),
    # Serve replicas and vLLM batch workers in vLLM's image.
    "vllm-0.32-cuda": Target("vllm-0.32-cuda.txt", "serve,vllm"),
    # Development and CI: everything the test suite uses.
    "cpu": Target("cpu.txt", "dev,quantize,serve"),
    # Serve's environment inside the TensorRT-LLM image (/opt/serve-env, over the container's
    # packages): the container's fastapi and starlette (top and bottom of its ranges) are
    # shadowed by Serve's; tokenmill gets its own copy of the same version.
    "trtllm-1.2-serve": Target(
        "trtllm-1.2.txt",
        "serve",
        override="trtllm-1.2-serve.txt",
        carries=(("fastapi", "0.121.3"), ("starlette", "0.49.1")),
    ),
}


def exact_pins(path: Path) -> dict[str, str]:
    """The `name==version` lines of a pins file: what the target's image carries."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        if len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version:
            pins[check_install.canonical(req.name)] = specs[0].version
    return pins


def stand_in_environment(root: Path, pins: dict[str, str]) -> Path:
    """An empty venv whose site-packages holds a metadata-only dist of every pin; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    for name, version in pins.items():
        info = Path(purelib) / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "INSTALLER").write_text("stand-in\n")
        (info / "RECORD").write_text("")
    return python


def resolve(target: Target, tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path, dict]:
    pins_file = PINS / target.pins
    pins = {**exact_pins(pins_file), **dict(target.carries)}
    if target.override is not None:
        merged = tmp_path / "constraints.txt"
        merged.write_text(
            constraints.merged(pins_file.read_text(), (PINS / target.override).read_text())
        )
        pins_file = merged
    python = stand_in_environment(tmp_path / "env", pins)
    report = tmp_path / "report.json"
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--dry-run",
            "--report",
            str(report),
            "-c",
            str(pins_file),
            f"tokenmill[{target.extras}] @ {REPO.as_uri()}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    return proc, report, pins


def pip_says(proc: subprocess.CompletedProcess) -> str:
    """pip's explanation of a failed resolution, without the build backend's chatter."""
    at = proc.stdout.find("The conflict is caused by")
    explanation = proc.stdout[at:] if at >= 0 else proc.stdout[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
    return explanation + "\n".join(errors)


# The CPU target in the slow set: `make test` installs .venv from images/pins/cpu.txt itself,
# so a package that does not resolve there fails before any test runs.
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "cpu" else n for n in sorted(TARGETS)]
)
def test_the_package_resolves_beside_the_targets_pins(name: str, tmp_path: Path) -> None:
    proc, report, pins = resolve(TARGETS[name], tmp_path)
    assert proc.returncode == 0, (
        f"{name}: pip finds no solution beside images/pins/{TARGETS[name].pins}:\n{pip_says(proc)}"
    )
    plan = check_install.planned(json.loads(report.read_text()))
    assert "tokenmill" in plan
    target = TARGETS[name]
    allowed = []
    if target.override is not None:
        allowed = ["tokenmill", *exact_pins(PINS / target.override)]
        for package, version in exact_pins(PINS / target.override).items():
            assert plan.get(package) == version, f"{name}: {package} {plan.get(package)}"
    changed = check_install.changes(plan, pins, allowed)
    assert changed == [], f"{name}: the install would change the image: {changed}"
