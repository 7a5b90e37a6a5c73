"""Fault injection for the Serve tests: break a replica's engine from outside.

Off unless the server process runs with TOKENMILL_TEST_HOOKS=1 (Ray passes the driver's
environment to the replicas of the local cluster it starts). With it unset the debug route
answers 404 like any unknown route, and the replica refuses the call as well, so a production
server cannot be made to kill its engines over HTTP.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Literal

HOOKS_ENV = "TOKENMILL_TEST_HOOKS"

BreakMode = Literal["crash", "stall"]


def hooks_enabled() -> bool:
    return os.environ.get(HOOKS_ENV) == "1"


def break_engine(engine: Any, mode: BreakMode) -> None:
    """Make the engine's next step fail the way a real fault would.

    crash: the next forward pass raises, so the step loop dies (as tests/contract/harness.py
    `EngineHarness.kill` does); stall: the next forward pass never returns (a hung device).
    Only the reference engine has a runner to break.
    """
    if not hooks_enabled():
        raise PermissionError(f"test hooks are off (set {HOOKS_ENV}=1 in the server)")
    runner = getattr(engine, "runner", None)
    if runner is None:
        raise NotImplementedError(f"cannot break a {engine.info.kind} engine's step loop")
    never = threading.Event()

    def crash(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected: the device fell off the bus")

    def stall(*args: Any, **kwargs: Any) -> Any:
        never.wait()

    runner.execute = crash if mode == "crash" else stall
