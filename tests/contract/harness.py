"""Engines of every kind behind one loop, for the contract suite.

vLLM's async engine binds itself to the event loop it first runs on, so each engine lives on
a loop of its own in a background thread for its whole life, and tests hand coroutines to
that loop (`EngineHarness.run`). The reference engine, the TensorRT-LLM stand-in and the
synthetic engine run the same way, so every kind is driven identically.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from engines import Engine, load_engine

STANDINS = Path(__file__).resolve().parents[1] / "standins"
KINDS = ("reference", "trtllm", "vllm", "synthetic")
MAX_MODEL_LEN = 256  # small, so that "beyond the context" is cheap to reach


def has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


def kind_params() -> list[Any]:
    """pytest params for the engine kinds: vllm carries the `vllm` mark (its own venv)."""
    return [
        pytest.param("reference", id="reference"),
        # The reference engine in a process of its own (engines/process.py), as Serve runs it.
        pytest.param("reference-process", id="reference-process"),
        pytest.param("trtllm", id="trtllm-standin"),
        pytest.param("vllm", id="vllm", marks=pytest.mark.vllm),
        pytest.param("synthetic", id="synthetic"),
    ]


def settings_for(kind: str) -> dict[str, Any]:
    if kind == "synthetic":
        # GPU-like pace, but slow enough that a 200-token request is still running when a
        # test aborts, closes or shuts it down (200 steps of 5 ms).
        return {"max_model_len": MAX_MODEL_LEN, "max_batch_size": 16, "ttft_ms": 2.0}
    common = {"max_model_len": MAX_MODEL_LEN, "max_batch_size": 16, "max_num_tokens": 512}
    if kind in ("reference", "reference-process"):
        return {**common, "kv_cache_tokens": 4096, "num_threads": 1}
    if kind == "trtllm":
        return {**common, "check_gpu": False}
    return {**common, "kv_cache_tokens": 4096, "enforce_eager": True}


class EngineHarness:
    """One engine of `kind` on its own event loop thread."""

    def __init__(self, kind: str, model_dir: Path) -> None:
        self.kind = kind
        if kind == "trtllm":
            _use_trtllm_standin()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

        async def load() -> Engine:
            if kind == "reference-process":
                from engines.process import ProcessEngine

                return ProcessEngine("reference", model=str(model_dir), **settings_for(kind))
            return load_engine(kind, model=str(model_dir), **settings_for(kind))

        self.engine: Engine = self.run(load)

    def run(self, make: Callable[[], Coroutine[Any, Any, Any]], timeout: float = 300) -> Any:
        """Run the coroutine `make()` on the engine's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(make(), self.loop).result(timeout)

    def kill(self) -> None:
        """Make the engine die the way a real failure would (not a clean shutdown)."""
        if self.kind == "reference":
            runner = self.engine.runner

            def broken(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("injected: the device fell off the bus")

            runner.execute = broken  # the next forward pass raises inside the step loop
        elif self.kind == "reference-process":
            os.kill(self.engine.pid, signal.SIGKILL)  # the engine's process dies outright
        elif self.kind == "synthetic":

            def failing(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("injected: the step loop failed")

            self.engine._step = failing  # the next step raises inside the step loop
        elif self.kind == "vllm":
            import psutil

            for child in psutil.Process().children(recursive=True):
                if _is_vllm_engine_core(child):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child.pid, signal.SIGKILL)
        else:
            self.engine._llm.kill_executor()  # the stand-in's hook: its executor dies

    def close(self) -> None:
        try:
            self.run(_shutdown(self.engine), timeout=120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)


def _is_vllm_engine_core(process: Any) -> bool:
    """Whether a child process is vLLM's engine core (a psutil.Process)."""
    import psutil

    try:
        command = " ".join(process.cmdline())
        return "EngineCore" in command or process.name().startswith("VLLM")
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False  # a helper that already exited and is not reaped yet: not the engine


def _shutdown(engine: Engine) -> Callable[[], Coroutine[Any, Any, None]]:
    async def go() -> None:
        engine.shutdown()

    return go


def _use_trtllm_standin() -> None:
    """Import the TensorRT-LLM stand-in (written to the real signatures) as tensorrt_llm."""
    if str(STANDINS) not in sys.path:
        sys.path.insert(0, str(STANDINS))
    import tensorrt_llm
    from tensorrt_llm._core import LlmCore

    assert tensorrt_llm.IS_STANDIN, "TensorRT-LLM is installed; the suite needs the stand-in"
    # A step takes time on a GPU too: without it the stand-in finishes 200 tokens before a
    # test can abort, cancel or shut down anything in flight.
    LlmCore.step_seconds = 0.005
