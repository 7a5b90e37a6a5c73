"""Test hooks of the engines, off unless the process runs with TOKENMILL_TEST_HOOKS=1.

TOKENMILL_TEST_STEP_DELAY_S: the reference engine sleeps this long after every step. Tests that
kill or stop a run midway need a midway on any machine; without it a fast machine finishes
their few rows before the kill lands. The batch driver passes these variables on to its engine
actors (pipeline.batch.cluster), so they reach actors on a cluster the driver joined too.
"""

from __future__ import annotations

import os

HOOKS_ENV = "TOKENMILL_TEST_HOOKS"
STEP_DELAY_ENV = "TOKENMILL_TEST_STEP_DELAY_S"


def enabled() -> bool:
    return os.environ.get(HOOKS_ENV) == "1"


def step_delay_s() -> float:
    """Seconds to sleep after each engine step: 0 unless the hooks are on."""
    return float(os.environ.get(STEP_DELAY_ENV) or 0.0) if enabled() else 0.0


def forwarded_env() -> dict[str, str]:
    """The hook variables to hand to actors (empty unless the hooks are on)."""
    if not enabled():
        return {}
    return {name: os.environ[name] for name in (HOOKS_ENV, STEP_DELAY_ENV) if name in os.environ}


def step_delay_env(seconds: float) -> dict[str, str]:
    """The variables that turn the hooks on with a step delay of `seconds` (for tests)."""
    return {HOOKS_ENV: "1", STEP_DELAY_ENV: str(seconds)}
