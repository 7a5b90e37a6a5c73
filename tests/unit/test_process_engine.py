"""engines/process.py beyond the contract suite (which runs it as `reference-process`): what the
Serve replica relies on from an engine in a child process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from engines import faults
from engines.api import EngineDeadError, GenerationRequest, SamplingParams
from engines.process import STATS_INTERVAL_S, ProcessEngine

SETTINGS = {"max_model_len": 256, "max_batch_size": 8, "kv_cache_tokens": 2048, "num_threads": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.dev.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("proc") / "llama", arch="llama", size="tiny")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_step_records_arrive_before_the_result_and_match_in_process(model_dir: Path) -> None:
    """Cost splits a request's steps once it has finished: every step it took part in must be
    drainable by then. The tokens are the in-process engine's, to the id."""
    from engines.factory import load_engine

    engine = ProcessEngine("reference", model=str(model_dir), **SETTINGS)
    local = load_engine("reference", model=str(model_dir), **SETTINGS)
    try:

        async def go() -> None:
            requests = [
                GenerationRequest([5, 6, 7, i + 1], greedy(6), request_id=f"r{i}") for i in range(4)
            ]
            for request in requests:
                result = await engine.generate(request)
                records = engine.drain_step_records()
                decoded = sum(r.decode_tokens.get(request.request_id, 0) for r in records)
                assert decoded == 6
                expected = await local.generate(request)
                assert result.output_token_ids == expected.output_token_ids
                assert result.metrics.finish_time >= records[-1].end  # one clock for both

        asyncio.run(go())
    finally:
        engine.shutdown()
        local.shutdown()


def test_a_stalled_child_shows_busy_with_its_step_count_frozen(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replica's stall watch needs a hung step loop to look busy and not stepping; the
    child posts its stats on its own, with nothing delivered."""
    monkeypatch.setenv(faults.HOOKS_ENV, "1")  # the child inherits it
    engine = ProcessEngine("reference", model=str(model_dir), **SETTINGS)
    try:
        engine.break_step_loop("stall")

        async def go() -> None:
            task = asyncio.ensure_future(engine.generate(GenerationRequest([1, 2, 3], greedy(4))))
            deadline = time.monotonic() + 30
            while engine.stats().num_running + engine.stats().num_waiting == 0:
                assert time.monotonic() < deadline, "the hung request never showed"
                await asyncio.sleep(0.05)
            steps = engine.stats().num_steps
            await asyncio.sleep(4 * STATS_INTERVAL_S)
            assert engine.stats().num_steps == steps
            assert not task.done()
            task.cancel()

        asyncio.run(go())
    finally:
        engine._process.kill()  # a hung step loop cannot be shut down cleanly
        engine.shutdown()


def test_a_crashed_step_loop_fails_requests_with_engine_dead(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(faults.HOOKS_ENV, "1")
    engine = ProcessEngine("reference", model=str(model_dir), **SETTINGS)
    try:
        engine.break_step_loop("crash")

        async def go() -> None:
            with pytest.raises(EngineDeadError, match="device fell off the bus"):
                await engine.generate(GenerationRequest([1, 2, 3], greedy(4)))
            with pytest.raises(EngineDeadError):
                await engine.generate(GenerationRequest([1, 2, 3], greedy(4)))

        asyncio.run(go())
    finally:
        engine.shutdown()


def test_a_bad_setting_is_the_engines_own_error(model_dir: Path) -> None:
    with pytest.raises(TypeError, match="no_such_setting"):
        ProcessEngine("reference", model=str(model_dir), no_such_setting=1)


def test_the_child_exits_when_its_parent_goes(model_dir: Path) -> None:
    """A replica killed outright leaves no engine behind holding memory (or a GPU): the child
    sees its socket close and exits."""
    engine = ProcessEngine("reference", model=str(model_dir), **SETTINGS)
    engine._conn.close()  # what the kernel does for a parent that died
    assert engine._process.wait(30) == 0


def test_an_idle_child_killed_reads_dead_not_idle(model_dir: Path) -> None:
    """SIGKILL (what the OOM killer sends) of an idle child: its last stats said idle, and a
    health check reading them would call the replica healthy. stats() itself must fail."""
    import signal

    engine = ProcessEngine("reference", model=str(model_dir), **SETTINGS)
    try:
        assert engine.stats().num_running == 0
        os.kill(engine.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        with pytest.raises(EngineDeadError, match="code -9"):
            while time.monotonic() < deadline:
                engine.stats()
                time.sleep(0.01)
        with pytest.raises(EngineDeadError):  # and it stays dead
            engine.stats()
    finally:
        engine.shutdown()


def test_requests_a_hung_child_never_reported_count_as_waiting(model_dir: Path) -> None:
    """A child stopped before it posted anything (SIGSTOP here; a deadlock alike): requests
    sent to it show as waiting, with its step count frozen, so the stall watch can see it."""
    import signal

    engine = ProcessEngine("reference", model=str(model_dir), **SETTINGS)
    try:
        os.kill(engine.pid, signal.SIGSTOP)

        async def go() -> None:
            steps = engine.stats().num_steps
            tasks = [
                asyncio.ensure_future(engine.generate(GenerationRequest([1, 2, 3], greedy(4))))
                for _ in range(2)
            ]
            await asyncio.sleep(4 * STATS_INTERVAL_S)
            stats = engine.stats()
            assert stats.num_waiting + stats.num_running == 2 and stats.num_steps == steps
            for task in tasks:
                task.cancel()

        asyncio.run(go())
    finally:
        engine._process.kill()
        engine.shutdown()


def test_a_load_interrupted_on_our_side_leaves_no_child(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C (or any error here) while the child loads: the child is stopped, not left
    loading, then serving, a model nobody will use (on a GPU: holding its memory)."""
    from multiprocessing.connection import Connection

    children: list[Any] = []
    real_popen = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> Any:
        children.append(real_popen(*args, **kwargs))
        return children[-1]

    def interrupted(self: Connection) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(Connection, "recv", interrupted)
    with pytest.raises(KeyboardInterrupt) as caught:  # held: the engine object stays alive
        ProcessEngine("reference", model=str(model_dir), **SETTINGS)
    monkeypatch.undo()
    (child,) = children
    try:
        assert child.wait(20) is not None, "the child kept running"
    finally:
        child.kill()
    del caught


# --- under another environment's interpreter (replicas.engine_python) -------------------------

OTHER_PYTHON = Path(__file__).resolve().parents[2] / ".venv-trtllm/bin/python"
needs_other_python = pytest.mark.skipif(
    not OTHER_PYTHON.is_file() or Path(sys.executable) == OTHER_PYTHON,
    reason=f"needs {OTHER_PYTHON} (make setup-trtllm), run from another environment",
)


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model written by the other environment (its transformers' tokenizer format)."""
    out = tmp_path_factory.mktemp("proc-other") / "llama"
    build = "import sys; from engines.dev.tiny import make_tiny_model; make_tiny_model(sys.argv[1])"
    subprocess.run([str(OTHER_PYTHON), "-c", build, str(out)], check=True)
    return out


@needs_other_python
def test_a_child_of_another_tokenmill_version_fails_the_start_naming_both(
    other_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engines.api import EngineError

    # Another install of tokenmill ahead on the other interpreter's path, as a stale image
    # would have it: its metadata says 9.9.9.
    dist = tmp_path / "tokenmill-9.9.9.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tokenmill\nVersion: 9.9.9\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    before = {p.pid for p in _children_named("engines.process")}
    with pytest.raises(EngineError) as caught:
        ProcessEngine(
            "reference", model=str(other_model_dir), interpreter=str(OTHER_PYTHON), **SETTINGS
        )
    message = str(caught.value)
    assert f"tokenmill 9.9.9 under {OTHER_PYTHON}" in message
    assert f"under {sys.executable}" in message and "same tokenmill version" in message
    left = [p for p in _children_named("engines.process") if p.pid not in before]
    assert not left  # none left behind


@needs_other_python
def test_an_environment_without_the_engine_fails_the_start_naming_both(
    other_model_dir: Path,
) -> None:
    from engines.api import EngineError

    # TensorRT-LLM's pins hold no vLLM.
    with pytest.raises(EngineError, match="vLLM") as caught:
        ProcessEngine("vllm", model=str(other_model_dir), interpreter=str(OTHER_PYTHON))
    message = str(caught.value)
    assert f"in the engine process: tokenmill {_version()} under {OTHER_PYTHON}" in message
    assert f"this side: tokenmill {_version()} under {sys.executable}" in message


def test_an_interpreter_without_tokenmill_fails_the_start_saying_so(model_dir: Path) -> None:
    from engines.api import EngineError

    bare = Path(sys.base_prefix) / "bin" / "python3"  # this venv's base: no tokenmill there
    with pytest.raises(EngineError, match=r"exited before it started .*No module named"):
        ProcessEngine("reference", model=str(model_dir), interpreter=str(bare), **SETTINGS)
    with pytest.raises(EngineError, match="cannot start the reference engine process under"):
        ProcessEngine("reference", model=str(model_dir), interpreter="/nonexistent/python")


@needs_other_python
def test_the_engine_under_another_interpreter_answers_as_in_process(other_model_dir: Path) -> None:
    from engines.factory import load_engine

    engine = ProcessEngine(
        "reference", model=str(other_model_dir), interpreter=str(OTHER_PYTHON), **SETTINGS
    )
    local = load_engine("reference", model=str(other_model_dir), **SETTINGS)
    try:
        assert engine.peer.interpreter == str(OTHER_PYTHON)
        request = GenerationRequest([5, 6, 7, 8], greedy(8), request_id="x")
        there = asyncio.run(engine.generate(request))
        here = asyncio.run(local.generate(request))
        assert there.output_token_ids == here.output_token_ids and there.text == here.text
    finally:
        engine.shutdown()
        local.shutdown()


def _version() -> str:
    from importlib import metadata

    return metadata.version("tokenmill")


def _children_named(fragment: str) -> list[Any]:
    """This process's own children (ProcessEngine starts them directly) whose command line holds
    `fragment`. Not recursive: engine processes of a Serve replica another test left running on
    the shared Ray are grandchildren, and not this test's to judge."""
    import psutil

    return [
        p
        for p in psutil.Process().children(recursive=False)
        if fragment in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE
    ]
