"""Fault injection for the Serve tests: break a replica's engine from outside.

Off unless the server process runs with TOKENMILL_TEST_HOOKS=1 (Ray passes the driver's
environment to the replicas of the local cluster it starts). With it unset the debug route
answers 404 like any unknown route, and the replica refuses the call as well, so a production
server cannot be made to kill its engines over HTTP.
"""

from __future__ import annotations

from typing import Any, Literal

from engines import faults

BreakMode = Literal["crash", "stall"]


def hooks_enabled() -> bool:
    return faults.enabled()


def break_engine(engine: Any, mode: BreakMode) -> None:
    """Make the engine's next step fail the way a real fault would.

    crash: the next forward pass raises, so the step loop dies (as tests/contract/harness.py
    `EngineHarness.kill` does); stall: the next forward pass never returns (a hung device).
    Only the reference engine has a runner to break (in this process or in the engine's own,
    engines.process).
    """
    faults.break_step_loop(engine, mode)
