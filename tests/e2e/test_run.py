"""`tokenmill run` as a user runs it: a subprocess with its own local Ray.

- bad job files fail before any Ray or actor starts, naming the field or the URI;
- the driver is SIGKILLed after parts are committed; the rerun resumes: every id once;
- exit codes: 3 when error rows pass limits.max_error_fraction; a finished job is a no-op.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from engines import faults

RAY_STARTED = "Started a local Ray instance"


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # never attach to a cluster another test started
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def slow_engine_env(step_delay_s: float) -> dict[str, str]:
    """cli_env() with the reference engine's test hook that sleeps after every step: a run a
    test kills or stops midway then has a midway whatever the machine's speed."""
    return {**cli_env(), **faults.step_delay_env(step_delay_s)}


def tokenmill(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from pipeline.cli import app; app()", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(),
        cwd=Path(__file__).resolve().parents[2],
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.dev.tiny import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("model") / "llama", arch="llama"))


def write_job(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def base_job(tmp_path: Path, model: Path, rows: int = 12) -> dict[str, Any]:
    src = tmp_path / "prompts.jsonl"
    src.write_text(
        "".join(
            json.dumps({"id": f"r{i:03d}", "p": f"Tell me about {i} rivers"}) + "\n"
            for i in range(rows)
        )
    )
    return {
        "name": "e2e",
        "input": {"uri": str(src), "format": "jsonl", "id_column": "id", "prompt_column": "p"},
        "model": {"path": str(model)},
        "engine": {"kind": "reference", "device": "cpu", "max_batch_size": 8},
        "sampling": {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True},
        "resources": {"num_actors": 1, "cpus_per_actor": 0.5, "batch_size": 4, "max_in_flight": 8},
        "output": {"uri": str(tmp_path / "out"), "rows_per_file": 4, "report": False},
    }


def kill_tree(pid: int) -> None:
    """SIGKILL a driver and every process it started (its local Ray: raylet, workers), at once,
    as when the machine or pod running it dies."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def committed(out: Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("part-*.parquet")))


# --- bad job files: fail fast, before Ray ----------------------------------------------------


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"sampling": {"max_tokns": 5}}, "sampling.max_tokns: unknown field"),
        ({"resources": {"num_actors": "many"}}, "resources.num_actors"),
        ({"input": {"uri": "/nonexistent/prompts-*.jsonl"}}, "/nonexistent/prompts-*.jsonl"),
        (
            {
                "input": {"uri": "s3://no-such-bucket/in.jsonl"},
                "storage": {"endpoint_url": "http://127.0.0.1:9"},
            },
            "s3://no-such-bucket/in.jsonl",
        ),
    ],
    ids=["unknown-field", "wrong-type", "missing-input", "unreachable-bucket"],
)
def test_bad_job_fails_before_any_actor(
    tmp_path: Path, change: dict[str, Any], expected: str
) -> None:
    job = base_job(tmp_path, tmp_path / "no-model-needed")
    for section, values in change.items():
        job[section] = {**job.get(section, {}), **values}
    started = time.monotonic()
    proc = tokenmill("run", str(write_job(tmp_path / "job.yaml", job)), timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert expected in proc.stderr
    assert RAY_STARTED not in proc.stderr + proc.stdout
    assert not (tmp_path / "out").exists(), "nothing may be written for an invalid job"
    assert time.monotonic() - started < 60


# --- kill the driver, resume -----------------------------------------------------------------


# Slow (80 s): by default, adoption of a dead run's parts is tests/integration/
# test_commit_takeover.py's, rows landing once after a death test_pipeline_kill.py's, and a
# rerun resuming committed rows test_pipeline.py::test_stop_at_ends_the_run_...
@pytest.mark.slow
def test_driver_killed_mid_run_then_rerun_every_id_once(tmp_path: Path, model_dir: Path) -> None:
    job = base_job(tmp_path, model_dir, rows=60)
    job["limits"] = {"max_error_fraction": 0.0}
    with (tmp_path / "prompts.jsonl").open("a") as fh:
        fh.write('{"id": "bad", "p": ""}\n')  # one error row: over the limit of 0 → exit 3
    path = write_job(tmp_path / "job.yaml", job)
    out = tmp_path / "out"

    # Own session: SIGKILL to the group takes the driver and the local Ray it started.
    first = subprocess.Popen(
        [sys.executable, "-c", "from pipeline.cli import app; app()", "run", str(path)],
        env=slow_engine_env(0.05),  # 16 steps a row: parts land ~1 s apart, not all at once
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while len(list(out.glob("part-*.parquet"))) < 2:
            assert first.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no part committed in time"
            time.sleep(0.2)
    finally:
        kill_tree(first.pid)
        first.wait(timeout=30)
    before = committed(out).column("id").to_pylist()
    assert 0 < len(before) < 61
    assert not (out / "_SUCCESS").exists()

    second = tokenmill("run", str(path))
    assert second.returncode == 3, second.stdout + second.stderr  # complete, 1 error row > 0
    assert "max_error_fraction" in second.stderr
    table = committed(out)
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "an id was written twice"
    assert sorted(ids) == sorted([f"r{i:03d}" for i in range(60)] + ["bad"])
    assert set(before) <= set(ids)
    assert (out / "_SUCCESS").exists()
    manifest = json.loads((out / "_manifest.json").read_text())
    assert [r["attempt"] for r in manifest["runs"]] == [1, 2]
    assert manifest["runs"][0]["interrupted"] and manifest["runs"][0]["rows"] == len(before)
    assert manifest["totals"]["rows"] == 61 and manifest["totals"]["rows_error"] == 1
    attempts = {p.name.split("-")[2] for p in out.glob("part-*.parquet")}  # part-<shard>-<run>-
    assert attempts == {"00001", "00002"}

    names = sorted(p.name for p in out.iterdir())
    third = tokenmill("run", str(path))
    assert "already complete" in third.stdout + third.stderr
    assert RAY_STARTED not in third.stderr
    assert sorted(p.name for p in out.iterdir()) == names
    assert third.returncode == 3  # still over the error limit

    changed = tokenmill("run", str(path), "--set", "sampling.max_tokens=8")
    assert changed.returncode == 1
    assert "sampling changed" in changed.stderr and "--fresh" in changed.stderr
