"""`tokenmill doctor` as a user runs it: this environment, then one broken on purpose.

The broken environment is this one with a directory put first on PYTHONPATH that holds what a
bad install leaves behind: an old xgrammar's metadata shadowing the real one, a TensorRT-LLM
whose import fails although the NVIDIA driver is "there" is not reproducible here, so the
broken parts are the ones a CPU machine can really have: a version outside the supported
range, half a set of storage credentials, an unreachable RAY_ADDRESS and a capability asked
for with --require that the machine lacks.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SECRET = "do-not-print-this-secret-value"


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "RAY_ADDRESS"}
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "doctor", *args],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        cwd=REPO,
        timeout=300,
    )


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_this_environment_has_no_conflicts() -> None:
    env = {"AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": SECRET}
    proc = doctor("--json", "--require", "reference", "--require", "storage", env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and report["unmet_requirements"] == []
    by_name = {(f["area"], f["name"]): f for f in report["findings"]}
    assert by_name[("engine", "reference")]["status"] == "ok"
    assert by_name[("package", "torch")]["status"] == "ok"
    assert "supported:" in by_name[("package", "xgrammar")]["detail"]
    assert by_name[("storage", "s3")]["status"] == "ok"
    assert SECRET not in proc.stdout + proc.stderr  # names of credentials, never values


def test_a_broken_environment_exits_1_naming_every_conflict(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    info = shadow / "xgrammar-0.0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: xgrammar\nVersion: 0.0.1\n")
    env = {
        "PYTHONPATH": f"{shadow}{os.pathsep}{REPO}",
        "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE",  # without its secret
        "RAY_ADDRESS": f"127.0.0.1:{closed_port()}",
    }
    proc = doctor("--require", "cuda", "--ray-timeout-s", "2", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    problems = proc.stderr
    assert "needs xgrammar<0.3,>=0.1.25: installed 0.0.1" in problems
    assert "fix: pip install 'xgrammar" in problems
    assert "$AWS_ACCESS_KEY_ID is set without $AWS_SECRET_ACCESS_KEY" in problems
    assert "is not reachable" in problems and "RAY_ADDRESS" in problems
    assert "required cuda: not available here" in problems
    assert "4 problem(s)" in problems


def test_an_unknown_requirement_is_a_usage_error() -> None:
    proc = doctor("--require", "tpu", "--no-import")
    assert proc.returncode == 2
    assert "--require tpu: unknown" in proc.stderr


# --- two environments on one node (replicas.engine_python) -----------------------------------

OTHER_PYTHON = REPO / ".venv-trtllm" / "bin" / "python"
needs_other_python = pytest.mark.skipif(
    not OTHER_PYTHON.is_file() or Path(sys.executable) == OTHER_PYTHON,
    reason=f"needs {OTHER_PYTHON} (make setup-trtllm), run from another environment",
)


def engine_python(tmp_path: Path, dists: dict[str, str]) -> Path:
    """The other environment's interpreter behind a wrapper (as a deployment may name one) that
    puts metadata of `dists` (name -> version) first on its path, for that side only."""
    shadow = tmp_path / "engine-side"
    for name, version in dists.items():
        info = shadow / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    wrapper = tmp_path / "engine-python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={shadow} exec {OTHER_PYTHON} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


@needs_other_python
def test_the_engine_side_is_checked_and_its_engine_counts_for_require(tmp_path: Path) -> None:
    """Serve's environment lacks TensorRT-LLM, the engine's has it (its metadata, here): the
    pair can serve it, and both sides run the same tokenmill."""
    python = engine_python(tmp_path, {"tensorrt_llm": "1.2.1"})
    proc = doctor("--json", "--no-import", "--require", "trtllm", "--engine-python", str(python))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    report = json.loads(proc.stdout)
    by_name = {(f["area"], f["name"]): f for f in report["findings"]}
    assert by_name[("engine", "trtllm")]["status"] == "info"  # not here
    there = by_name[("engine (engine side)", "trtllm")]
    assert there["status"] == "ok" and "tensorrt_llm 1.2.1" in there["detail"]
    handshake = by_name[("engine side", "handshake")]
    assert handshake["status"] == "ok" and str(OTHER_PYTHON) in handshake["detail"]
    assert "4.57.1" in by_name[("package (engine side)", "transformers")]["detail"]
    assert not any(area.startswith(("storage (", "ray (")) for area, _ in by_name)


@needs_other_python
def test_an_engine_side_of_another_tokenmill_version_is_a_conflict(tmp_path: Path) -> None:
    python = engine_python(tmp_path, {"tokenmill": "9.9.9"})
    proc = doctor("--no-import", "--engine-python", str(python))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    assert f"tokenmill 9.9.9 under {OTHER_PYTHON}" in proc.stderr
    assert f"under {sys.executable}" in proc.stderr
    assert "install the same tokenmill version in both environments" in proc.stderr


def test_an_engine_python_that_does_not_exist_is_a_conflict() -> None:
    proc = doctor("--no-import", "--engine-python", "/nonexistent/python")
    assert proc.returncode == 1
    assert "engine side interpreter: /nonexistent/python" in proc.stderr
