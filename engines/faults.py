"""Fault injection for the tests, shipped with the product and off unless the process runs with
TOKENMILL_TEST_HOOKS=1 (then each hook below acts only when its own variable is set too).
Product code calls these hooks where a fault must land; without the switch they do nothing.

TOKENMILL_TEST_STEP_DELAY_S: the reference engine sleeps this long after every step. Tests that
kill or stop a run midway need a midway on any machine; without it a fast machine finishes
their few rows before the kill lands.

TOKENMILL_TEST_ONEDNN_REFUSES: dtype names (comma-separated, e.g. `bfloat16`) the reference
engine's oneDNN linears take as refused by the CPU, as on one without the instructions (bf16
needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT): the fallback to nn.Linear runs on any machine.

TOKENMILL_TEST_PAUSE_AT: the name of a pause point (`pause_point`); a process reaching it stops
itself with SIGSTOP, every thread at once, as a long GC pause, a stopped container or a slow
node would stop it, until the test sends SIGCONT. Tests of the commit protocol stop a driver at
the worst moment this way.

TOKENMILL_TEST_PROMPT_EXIT_ON: a prompt actor asked to tokenize a shard with a row whose prompt
contains this text exits at once (os._exit), as a tokenizer that segfaults or runs out of
memory on one input would.

TOKENMILL_TEST_PROCESSOR_BARRIER: a number n of engine actors; a Ray Data processor's engine
actors hold every batch until n different actors have a batch. An autoscaling test then sees
the pool grow and the new actor take rows on any machine: the first actor's batches cannot
finish before the second actor has one.

The batch driver passes these variables on to its engine and prompt actors
(pipeline.batch.driver.cluster), and a processor to its engine actors (pipeline.data.processor), so
they reach actors on a cluster the driver joined too.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

HOOKS_ENV = "TOKENMILL_TEST_HOOKS"
STEP_DELAY_ENV = "TOKENMILL_TEST_STEP_DELAY_S"
ONEDNN_REFUSES_ENV = "TOKENMILL_TEST_ONEDNN_REFUSES"
PAUSE_AT_ENV = "TOKENMILL_TEST_PAUSE_AT"
PROMPT_EXIT_ENV = "TOKENMILL_TEST_PROMPT_EXIT_ON"
PROCESSOR_BARRIER_ENV = "TOKENMILL_TEST_PROCESSOR_BARRIER"
_FORWARDED = (
    HOOKS_ENV,
    STEP_DELAY_ENV,
    ONEDNN_REFUSES_ENV,
    PAUSE_AT_ENV,
    PROMPT_EXIT_ENV,
    PROCESSOR_BARRIER_ENV,
)
# Exit status of a prompt actor the hook kills (EX_SOFTWARE), to tell it apart in logs.
PROMPT_EXIT_STATUS = 70


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


def pause_point(name: str) -> None:
    """Stop this process (SIGSTOP) if the hooks are on and TOKENMILL_TEST_PAUSE_AT names
    `name`; it goes on where it stopped once it gets SIGCONT."""
    if enabled() and os.environ.get(PAUSE_AT_ENV) == name:
        os.kill(os.getpid(), signal.SIGSTOP)


def prompt_exit_marker() -> str | None:
    """The text that makes a prompt actor exit (None unless the hooks are on and it is set)."""
    return (os.environ.get(PROMPT_EXIT_ENV) or None) if enabled() else None


def processor_barrier() -> int:
    """Engine actors a processor's batches wait for (0: none, unless the hooks are on)."""
    return int(os.environ.get(PROCESSOR_BARRIER_ENV) or 0) if enabled() else 0


def exit_prompt_actor() -> None:
    os._exit(PROMPT_EXIT_STATUS)


def forwarded_env() -> dict[str, str]:
    """The hook variables to hand to actors (empty unless the hooks are on)."""
    if not enabled():
        return {}
    return {name: os.environ[name] for name in _FORWARDED if name in os.environ}


def step_delay_env(seconds: float) -> dict[str, str]:
    """The variables that turn the hooks on with a step delay of `seconds` (for tests)."""
    return {HOOKS_ENV: "1", STEP_DELAY_ENV: str(seconds)}


def break_step_loop(engine: Any, mode: str) -> None:
    """Make the engine's next step fail the way a real fault would (hooks on only).

    crash: the next forward pass raises, so the step loop dies; stall: the next forward pass
    never returns (a hung device). An engine in a process of its own (engines.process) is
    broken there. Only the reference engine has a runner to break.
    """
    if not enabled():
        raise PermissionError(f"test hooks are off (set {HOOKS_ENV}=1 in the server)")
    remote = getattr(engine, "break_step_loop", None)
    if remote is not None:
        remote(mode)
        return
    runner = getattr(engine, "runner", None)
    if runner is None:
        raise NotImplementedError(f"cannot break a {engine.info.kind} engine's step loop")
    never = threading.Event()

    def crash(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected: the device fell off the bus")

    def stall(*args: Any, **kwargs: Any) -> Any:
        never.wait()

    runner.execute = crash if mode == "crash" else stall
