"""Engine health read from the engine itself: the stall watch's notion of progress, and
engines whose step loop ended on its own reading dead from stats()."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from engines.api import EngineDeadError, EngineStats, GenerationRequest, SamplingParams
from engines.health import StallWatch


def busy(steps: int, finished: int) -> EngineStats:
    return EngineStats(
        num_running=1,
        num_waiting=0,
        num_finished=finished,
        num_preemptions=0,
        kv_blocks_total=0,
        kv_blocks_used=0,
        num_steps=steps,
    )


def test_finishing_requests_is_progress_for_engines_without_a_step_count() -> None:
    """TensorRT-LLM's API shows no step count (always 0): a loaded engine finishing requests
    is progressing, and one finishing none while busy is stalled."""
    watch = StallWatch(stall_timeout_s=10)
    assert watch.observe(busy(0, 0), now=0.0) is None
    for t in range(1, 6):
        assert watch.observe(busy(0, t), now=5.0 * t) is None  # 25 s busy, always finishing
    assert watch.observe(busy(0, 5), now=34.0) is None
    stalled = watch.observe(busy(0, 5), now=36.0)
    assert stalled is not None and "no engine step for 11 s" in stalled


def test_a_synthetic_engine_whose_loop_was_cancelled_reads_dead(tmp_path: Path) -> None:
    from engines.dev.tiny import make_tiny_model
    from engines.factory import load_engine

    model = make_tiny_model(tmp_path / "llama", arch="llama", size="tiny")
    engine = load_engine("synthetic", model=str(model), max_model_len=128)

    async def go() -> None:
        request = GenerationRequest([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
        await engine.generate(request)
        assert engine.stats().num_running == 0
        task = engine._task  # type: ignore[attr-defined]
        task.cancel()  # its loop cancelled from outside (the loop closing, say)
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(EngineDeadError, match="cancelled"):
            engine.stats()

    asyncio.run(go())
    engine.shutdown()


def test_the_batch_watchdog_sees_a_hung_engine_and_an_idle_death(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine actor's process stays alive while its engine hangs, so the driver would wait
    on it until the job's deadline: the watchdog calls it (the actor then exits and Ray
    restarts it), for a hung step loop with work in it and for an idle engine process killed."""
    import os
    import signal
    import threading

    from engines import faults
    from engines.dev.tiny import make_tiny_model
    from engines.process import ProcessEngine
    from engines.reference.engine import ReferenceEngine
    from pipeline.batch.stages.generate import EngineWatchdog

    model = make_tiny_model(tmp_path / "llama", arch="llama", size="tiny")
    settings = {"max_model_len": 128, "kv_cache_tokens": 1024, "num_threads": 1}
    monkeypatch.setenv(faults.HOOKS_ENV, "1")

    def watch(engine: object) -> tuple[threading.Event, list[str]]:
        why: list[str] = []
        called = threading.Event()

        def failed(reason: str) -> None:
            why.append(reason)
            called.set()

        EngineWatchdog(engine, stall_timeout_s=1.0, on_failure=failed, period_s=0.1).start()
        return called, why

    engine = ReferenceEngine(str(model), **settings)
    try:
        called, why = watch(engine)
        faults.break_step_loop(engine, "stall")

        async def submit() -> None:
            request = GenerationRequest([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
            task = asyncio.ensure_future(engine.generate(request))
            assert await asyncio.to_thread(called.wait, 30), "the hung engine went unseen"
            task.cancel()

        asyncio.run(submit())
        assert "engine hung" in why[0] and "no engine step" in why[0]
    finally:
        engine._mailbox.stopping = True  # a hung step loop cannot be joined: let it be

    process = ProcessEngine("reference", model=str(model), **settings)
    try:
        called, why = watch(process)
        time.sleep(0.5)
        assert not called.is_set()  # idle is not hung
        os.kill(process.pid, signal.SIGKILL)
        assert called.wait(30), "the idle engine's death went unseen"
        assert why[0].startswith("engine died")
    finally:
        process.shutdown()
