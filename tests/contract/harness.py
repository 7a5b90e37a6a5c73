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

REPO = Path(__file__).resolve().parents[2]
STANDINS = REPO / "tests" / "standins"
KINDS = ("reference", "trtllm", "vllm", "synthetic")
MAX_MODEL_LEN = 256  # small, so that "beyond the context" is cheap to reach
# Another environment's interpreter for the engine process: TensorRT-LLM 1.2's pure-Python
# pins (`make setup-trtllm`), where Serve's fastapi cannot install (engines/process.py).
OTHER_PYTHON = Path(os.environ.get("TOKENMILL_TRTLLM_PYTHON", REPO / ".venv-trtllm/bin/python"))
needs_other_python = pytest.mark.skipif(
    not OTHER_PYTHON.is_file() or Path(sys.executable) == OTHER_PYTHON,
    reason=f"needs {OTHER_PYTHON} (make setup-trtllm), run from another environment",
)


def has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


def kind_params() -> list[Any]:
    """pytest params for the engine kinds: vllm carries the `vllm` mark (its own venv)."""
    return [
        pytest.param("reference", id="reference"),
        # The reference engine in a process of its own (engines/process.py), as Serve runs it.
        pytest.param("reference-process", id="reference-process"),
        # ... and under another environment's interpreter, as Serve runs TensorRT-LLM.
        # (slow: the reference engine across interpreters is also tests/unit/
        # test_process_engine.py's, and the default suite runs the stand-in's here)
        pytest.param(
            "reference-elsewhere",
            id="reference-elsewhere",
            marks=[needs_other_python, pytest.mark.slow],
        ),
        pytest.param("trtllm", id="trtllm-standin"),
        pytest.param("trtllm-elsewhere", id="trtllm-standin-elsewhere", marks=needs_other_python),
        pytest.param("vllm", id="vllm", marks=pytest.mark.vllm),
        pytest.param("synthetic", id="synthetic"),
    ]


def settings_for(kind: str) -> dict[str, Any]:
    if kind == "synthetic":
        # GPU-like pace, but slow enough that a 200-token request is still running when a
        # test aborts, closes or shuts it down (200 steps of 5 ms).
        return {"max_model_len": MAX_MODEL_LEN, "max_batch_size": 16, "ttft_ms": 2.0}
    common = {"max_model_len": MAX_MODEL_LEN, "max_batch_size": 16, "max_num_tokens": 512}
    if kind == "reference":
        return {**common, "kv_cache_tokens": 4096, "num_threads": 1}
    if kind == "trtllm":
        return {**common, "check_gpu": False}
    return {**common, "kv_cache_tokens": 4096, "enforce_eager": True}


class EngineHarness:
    """One engine on its own event loop thread. `param` is a kind, or KIND-process (in a
    child process) or KIND-elsewhere (in a child process under OTHER_PYTHON); `kind` is the
    engine kind, `where` how it runs: "here", "process" or "elsewhere"."""

    def __init__(self, param: str, model_dir: Path) -> None:
        kind, _, where = param.partition("-")
        self.kind, self.where = kind, where or "here"
        if self.where == "here" and kind == "trtllm":
            _use_trtllm_standin()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

        async def load() -> Engine:
            if self.where == "here":
                return load_engine(kind, model=str(model_dir), **settings_for(kind))
            from engines.process import ProcessEngine

            if self.where == "process":
                return ProcessEngine(kind, model=str(model_dir), **settings_for(kind))
            with _standin_for_children():
                return ProcessEngine(
                    kind, model=str(model_dir), interpreter=str(OTHER_PYTHON), **settings_for(kind)
                )

        self.engine: Engine = self.run(load)

    def run(self, make: Callable[[], Coroutine[Any, Any, Any]], timeout: float = 300) -> Any:
        """Run the coroutine `make()` on the engine's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(make(), self.loop).result(timeout)

    def kill(self) -> None:
        """Make the engine die the way a real failure would (not a clean shutdown)."""
        if self.where != "here":
            os.kill(self.engine.pid, signal.SIGKILL)  # the engine's process dies outright
        elif self.kind == "reference":
            runner = self.engine.runner

            def broken(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("injected: the device fell off the bus")

            runner.execute = broken  # the next forward pass raises inside the step loop
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


@contextlib.contextmanager
def _standin_for_children() -> Any:
    """While a child engine process starts: the stand-in on its import path and its step
    time (as `_use_trtllm_standin` sets in this process); a child under another interpreter
    takes this process's environment, not its sys.path."""
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", STEP_ENV)}
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(STANDINS), str(REPO), saved["PYTHONPATH"]) if p
    )
    os.environ[STEP_ENV] = str(STEP_SECONDS)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# A step takes time on a GPU too: without it the stand-in finishes 200 tokens before a test can
# abort, cancel or shut down anything in flight.
STEP_SECONDS = 0.005
STEP_ENV = "TOKENMILL_STANDIN_STEP_S"  # read by the stand-in in a child process


def _use_trtllm_standin() -> None:
    """Import the TensorRT-LLM stand-in (written to the real signatures) as tensorrt_llm."""
    if str(STANDINS) not in sys.path:
        sys.path.insert(0, str(STANDINS))
    import tensorrt_llm
    from tensorrt_llm._core import LlmCore

    assert tensorrt_llm.IS_STANDIN, "TensorRT-LLM is installed; the suite needs the stand-in"
    LlmCore.step_seconds = STEP_SECONDS
