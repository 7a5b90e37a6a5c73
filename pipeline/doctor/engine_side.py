"""The other environment of a two-environment node: the interpreter an engine process runs
under (`replicas.engine_python`, e.g. the TensorRT-LLM container's Python beside Serve's own
environment in images/trtllm.Dockerfile).

The checks run there by that interpreter's own `tokenmill doctor --json` (it judges its own
packages against its own requirements), and here the pair is checked as the replica will check
it at start: the same tokenmill and engine protocol on both sides (engines/process.py).
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

from engines.process import Side, child_env, child_flags, handshake
from pipeline.doctor.findings import Finding, Status

# Capabilities only this side can provide: Serve, Ray and storage run here, the engine there.
HERE_ONLY = frozenset({"serve", "ray", "storage"})
# Areas of the other side's report left out: the same environment variables, read again.
REPEATED_AREAS = frozenset({"storage", "ray"})
# The other side's doctor imports each engine (a minute on a GPU image) unless told not to.
TIMEOUT_S = 300.0

AREA = "engine side"


def check_engine_side(
    python: str, probe: bool = True, timeout_s: float = TIMEOUT_S
) -> list[Finding]:
    """Findings of `python`'s environment (areas suffixed "(engine side)") and of the pair."""
    command = [python, *child_flags(python), "-m", "pipeline.cli", "doctor", "--json"]
    command += [] if probe else ["--no-import"]
    # Its Ray check would only repeat ours (the same RAY_ADDRESS): a short timeout.
    command += ["--ray-timeout-s", "1"]
    fix = (
        f"install the same tokenmill version into the environment of {python} "
        "(images/trtllm.Dockerfile does), or point replicas.engine_python at one that has it"
    )
    try:
        proc = subprocess.run(
            command, env=child_env(python), capture_output=True, text=True, timeout=timeout_s
        )
    except OSError as exc:
        return [Finding(AREA, "interpreter", Status.CONFLICT, f"{python}: {exc}", fix)]
    except subprocess.TimeoutExpired:
        return [
            Finding(
                AREA, "doctor", Status.CONFLICT, f"{python}: no answer in {timeout_s:.0f} s", fix
            )
        ]
    try:
        report: dict[str, Any] = json.loads(proc.stdout)
    except json.JSONDecodeError:
        last = (proc.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        return [
            Finding(
                AREA,
                "tokenmill",
                Status.CONFLICT,
                f"{python} cannot run tokenmill's doctor (exit code {proc.returncode}): {last}",
                fix,
            )
        ]
    findings = [
        _theirs(item)
        for item in report.get("findings", [])
        if item.get("area") not in REPEATED_AREAS
    ]
    return [_pair(python, report.get("side")), *findings]


def _theirs(item: dict[str, Any]) -> Finding:
    provides = tuple(p for p in item.get("provides", []) if p not in HERE_ONLY)
    return Finding(
        area=f"{item['area']} ({AREA})",
        name=item["name"],
        status=Status(item["status"]),
        detail=item["detail"],
        fix=item.get("fix", ""),
        provides=provides,
    )


def _pair(python: str, side: dict[str, Any] | None) -> Finding:
    ours = Side.here()
    if side is None:  # a doctor from before the engine protocol: surely another version
        return Finding(
            AREA,
            "handshake",
            Status.CONFLICT,
            f"{python} runs a tokenmill that does not say its version; this side runs "
            f"{ours.describe()}",
            "install the same tokenmill version in both environments",
        )
    theirs = Side(**side)
    problem = handshake(ours, theirs)
    if problem is not None:
        return Finding(AREA, "handshake", Status.CONFLICT, problem, "")
    return Finding(
        AREA,
        "handshake",
        Status.OK,
        f"{theirs.describe()} answers this side's {ours.describe()} (engine protocol "
        f"{ours.protocol})",
    )
