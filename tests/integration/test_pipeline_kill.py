"""An engine actor's process is killed mid-run: Ray restarts it, retries its unfinished
batches, and the output still holds every input id exactly once."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engines import faults
from pipeline.batch.driver.run import RunResult, run_job
from pipeline.spec import parse_job_spec

pytestmark = pytest.mark.timeout(300)
ACTOR_TITLE = "EngineWorker"


def engine_actor_pids() -> list[int]:
    """Processes of this session's engine actors: descendants of this test process only (the
    local Ray it started), never another cluster's workers on the machine."""
    pids = []
    for proc in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if ACTOR_TITLE in " ".join(proc.cmdline()):
                pids.append(proc.pid)
        except psutil.Error:
            continue
    return pids


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.2)


def test_killed_engine_actor_is_restarted_and_rows_land_once(
    ray_local: Any, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 50 ms after every engine step (the driver passes it on to its actors): rows take ~1 s,
    # so the kill lands mid-run on any machine.
    for name, value in faults.step_delay_env(0.05).items():
        monkeypatch.setenv(name, value)
    ids = [f"row-{i:03d}" for i in range(48)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "p": f"Count the {i} rivers"}) + "\n" for i in ids))
    out = tmp_path / "out"
    spec = parse_job_spec(
        {
            "name": "kill-actor",
            "input": {"uri": str(src), "format": "jsonl", "id_column": "id", "prompt_column": "p"},
            "model": {"path": str(tiny_model_dir)},
            "engine": {"kind": "reference", "device": "cpu", "max_batch_size": 8},
            # ignore_eos: every row takes the same, known number of steps
            "sampling": {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True},
            "resources": {
                "num_actors": 1,
                "cpus_per_actor": 0.25,
                "batch_size": 4,
                "max_in_flight": 8,
                "max_restarts": 2,
                "max_task_retries": 3,
            },
            "output": {"uri": str(out), "rows_per_file": 4, "report": False},
        }
    )
    results: list[RunResult | BaseException] = []

    def target() -> None:
        try:
            results.append(run_job(spec))
        except BaseException as exc:  # surfaced by the assertion below
            results.append(exc)

    runner = threading.Thread(target=target, daemon=True)
    runner.start()
    wait_for(lambda: len(list(out.glob("part-*.parquet"))) >= 1, 180, "a committed part")
    pids = engine_actor_pids()
    assert len(pids) == 1, f"expected one engine actor process, found {pids}"
    committed_at_kill = len(list(out.glob("part-*.parquet")))
    os.kill(pids[0], signal.SIGKILL)
    runner.join(timeout=240)
    assert not runner.is_alive(), "the job did not finish after the actor was killed"

    result = results[0]
    assert not isinstance(result, BaseException), result
    assert committed_at_kill < len(ids) // 4, "the kill came after all rows were done"
    assert result.status == "complete" and result.exit_code == 0
    table = pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("part-*.parquet")))
    got = table.column("id").to_pylist()
    assert len(got) == len(set(got)), "an id was written twice"
    assert sorted(got) == ids
    assert set(table.column("completion_tokens").to_pylist()) == {24}
    assert (out / "_SUCCESS").exists()
    manifest = json.loads((out / "_manifest.json").read_text())
    incarnations = {a["incarnation"] for a in manifest["runs"][0]["actors"]}
    assert len(incarnations) == 2, "rows came from the killed actor and its restart"
    assert manifest["totals"]["rows"] == len(ids)
