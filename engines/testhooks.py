"""Test hooks of the engines, off unless the process runs with TOKENMILL_TEST_HOOKS=1.

TOKENMILL_TEST_STEP_DELAY_S: the reference engine sleeps this long after every step. Tests that
kill or stop a run midway need a midway on any machine; without it a fast machine finishes
their few rows before the kill lands.

TOKENMILL_TEST_ONEDNN_REFUSES: dtype names (comma-separated, e.g. `bfloat16`) the reference
engine's oneDNN linears take as refused by the CPU, as on one without the instructions (bf16
needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT): the fallback to nn.Linear runs on any machine.

The batch driver passes these variables on to its engine actors (pipeline.batch.cluster), so
they reach actors on a cluster the driver joined too.
"""

from __future__ import annotations

import os

HOOKS_ENV = "TOKENMILL_TEST_HOOKS"
STEP_DELAY_ENV = "TOKENMILL_TEST_STEP_DELAY_S"
ONEDNN_REFUSES_ENV = "TOKENMILL_TEST_ONEDNN_REFUSES"
_FORWARDED = (HOOKS_ENV, STEP_DELAY_ENV, ONEDNN_REFUSES_ENV)


def enabled() -> bool:
    return os.environ.get(HOOKS_ENV) == "1"


def step_delay_s() -> float:
    """Seconds to sleep after each engine step: 0 unless the hooks are on."""
    return float(os.environ.get(STEP_DELAY_ENV) or 0.0) if enabled() else 0.0


def onednn_refused_dtypes() -> frozenset[str]:
    """dtype names oneDNN is to be taken as refusing on this CPU: empty unless the hooks are on."""
    if not enabled():
        return frozenset()
    names = os.environ.get(ONEDNN_REFUSES_ENV, "").split(",")
    return frozenset(name.strip() for name in names if name.strip())


def forwarded_env() -> dict[str, str]:
    """The hook variables to hand to actors (empty unless the hooks are on)."""
    if not enabled():
        return {}
    return {name: os.environ[name] for name in _FORWARDED if name in os.environ}


def step_delay_env(seconds: float) -> dict[str, str]:
    """The variables that turn the hooks on with a step delay of `seconds` (for tests)."""
    return {HOOKS_ENV: "1", STEP_DELAY_ENV: str(seconds)}
