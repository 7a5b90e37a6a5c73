"""One output, one run at a time: `tokenmill run` processes racing, hanging and stopping.

- two drivers started together on one output (local disk, and the S3 server over HTTP):
  exactly one runs, the other exits 1 naming the running attempt, its host and its age;
- a driver that hangs (SIGSTOP) stops renewing its lease: a second run takes the output over
  after the lease timeout, its late parts are never counted, and when the hung driver wakes
  up it exits 1 without committing anything;
- a driver stopped inside its finish (a test hook stops it there with SIGSTOP), whose output
  another run takes over and completes: when it wakes it deletes nothing and exits 1;
- SIGTERM: the driver writes the rows that are finished, exits 1 (incomplete), and the rerun
  generates only the rest.
Every output ends with each id exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from engines import faults
from tests.e2e.test_run import cli_env, kill_tree, slow_engine_env
from tests.integration.s3_server import S3Server, running_s3_server

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.dev.tiny import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("model") / "llama", arch="llama"))


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with running_s3_server() as server:
        yield server


def job(
    where: Path, model: Path, rows: int, output_uri: str, storage: dict | None = None, **extra: Any
) -> Path:
    src = where / "prompts.jsonl"
    src.write_text(
        "".join(
            json.dumps({"id": f"r{i:04d}", "p": f"Tell me about {i} rivers"}) + "\n"
            for i in range(rows)
        )
    )
    data: dict[str, Any] = {
        "name": "fencing",
        "input": {
            "uri": str(src),
            "format": "jsonl",
            "id_column": "id",
            "prompt_column": "p",
            "shard_bytes": 2048,
        },
        "model": {"path": str(model)},
        "engine": {"kind": "reference", "device": "cpu", "max_batch_size": 8},
        "sampling": {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True},
        "resources": {"num_actors": 1, "cpus_per_actor": 0.5, "max_in_flight": 8},
        "output": {"uri": output_uri, "rows_per_file": 8, "report": False, "flush_interval_s": 1},
    }
    if storage:
        data["storage"] = storage
    for section, values in extra.items():
        data[section] = {**data.get(section, {}), **values}
    path = where / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def start(path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(path), *args],
        cwd=REPO,
        env=env or cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def manifest(read: Any) -> dict[str, Any]:
    return json.loads(read("_manifest.json"))


def ids_once(tables: list[pa.Table], expected: int) -> None:
    ids = pa.concat_tables(tables).column("id").to_pylist()
    assert len(ids) == len(set(ids)), "an id is in the output twice"
    assert sorted(ids) == [f"r{i:04d}" for i in range(expected)]


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.2)


# --- two drivers at once ---------------------------------------------------------------------


def check_one_ran(first: subprocess.Popen[str], second: subprocess.Popen[str]) -> str:
    """Exactly one of two racing runs succeeded; returns the loser's stderr."""
    outcomes = []
    for proc in (first, second):
        out, err = proc.communicate(timeout=400)
        outcomes.append((proc.returncode, out + err))
    codes = sorted(code for code, _ in outcomes)
    assert codes == [0, 1], outcomes
    loser = next(text for code, text in outcomes if code == 1)
    assert "is being written by" in loser and "renewed its lease" in loser, loser
    assert "host" in loser and "output.lease_timeout_s" in loser
    return loser


def test_two_drivers_on_a_local_output_exactly_one_runs(tmp_path: Path, model_dir: Path) -> None:
    out = tmp_path / "out"
    path = job(tmp_path, model_dir, 60, str(out))
    first = start(path)
    second = start(path, "--set", "resources.max_in_flight=4")  # a resubmission with a change
    check_one_ran(first, second)
    ids_once([pq.read_table(p) for p in sorted(out.glob("part-*.parquet"))], 60)
    record = manifest(lambda n: (out / n).read_text())
    assert record["status"] == "complete" and len(record["runs"]) == 1
    assert (out / "_SUCCESS").exists() and not (out / "_lease.json").exists()


# In the slow set: tests/integration/test_commit.py refuses a second run on the S3 server in
# seconds (test_second_run_is_refused_naming_the_first[s3]); the local race above runs here.
@pytest.mark.slow
def test_two_drivers_on_an_s3_output_exactly_one_runs(
    tmp_path: Path, model_dir: Path, s3: S3Server
) -> None:
    bucket = s3.make_bucket()
    prefix = f"s3://{bucket}/out"
    path = job(tmp_path, model_dir, 60, prefix, storage={"endpoint_url": s3.endpoint_url})
    first, second = start(path), start(path)
    check_one_ran(first, second)
    parts = [u for u in s3.list_uris(prefix + "/") if u.rsplit("/", 1)[-1].startswith("part-")]
    ids_once([pq.read_table(pa.BufferReader(s3.get(u))) for u in parts], 60)
    record = manifest(lambda n: s3.get(f"{prefix}/{n}"))
    assert record["status"] == "complete" and len(record["runs"]) == 1 and record["fenced"]


# --- a hung driver ---------------------------------------------------------------------------


# In the slow set (the lease is waited out: over a minute and a half): a lease that is not
# renewed is taken over and its old holder loses it in tests/integration/test_commit.py, on
# local disk and the S3 server, and a stopped driver wakes after a takeover below.
@pytest.mark.slow
def test_a_hung_driver_is_fenced_off_and_its_output_taken_over(
    tmp_path: Path, model_dir: Path
) -> None:
    out = tmp_path / "out"
    # The lease outlives the second run's start-up by far on a loaded machine: renewed every
    # 10 s, it is fresh for at least 20 s after the hang, while `tokenmill run` reaches its
    # lease check in a few seconds (7 s with a CPU hog on one core).
    lease_timeout_s = 30
    path = job(
        tmp_path,
        model_dir,
        240,
        str(out),
        output={"lease_timeout_s": lease_timeout_s},
        sampling={"max_tokens": 48},  # long enough that the run is still going when it hangs
    )
    # 10 ms after every engine step: still going at the hang on any machine.
    hung = start(path, env=slow_engine_env(0.01))
    wait_for(lambda: len(list(out.glob("part-*.parquet"))) >= 2, 240, "parts of the first run")
    os.kill(hung.pid, signal.SIGSTOP)  # the driver hangs; its engine actor goes on for now
    hung_at = time.monotonic()
    try:
        early = start(path)
        _, err = early.communicate(timeout=120)
        assert early.returncode == 1 and "is being written by attempt 1" in err, err
        time.sleep(max(0.0, hung_at + lease_timeout_s + 1 - time.monotonic()))  # lease expired
        taker = start(path)
        out_text, err = taker.communicate(timeout=400)
        assert taker.returncode == 0, out_text + err
        assert "took over the lease" in err or "complete" in out_text + err
    finally:
        os.kill(hung.pid, signal.SIGCONT)
    _, err = hung.communicate(timeout=120)
    assert hung.returncode == 1, err  # woke up without its lease: nothing more committed
    assert "taken over" in err or "lease" in err, err
    kill_tree(hung.pid)
    record = manifest(lambda n: (out / n).read_text())
    listed = {p["name"] for p in record["parts"]}
    on_disk = {p.name for p in out.glob("part-*.parquet")}
    assert on_disk == listed, "a part of the fenced-off run is in the output"
    ids_once([pq.read_table(out / n) for n in sorted(listed)], 240)
    assert [r["attempt"] for r in record["runs"]] == [1, 2] and record["status"] == "complete"


# --- a driver stopped inside its finish ------------------------------------------------------


# On the S3 server too, in the slow set: tests/integration/test_commit_takeover.py checks the
# same stalls on S3 step by step, in seconds.
# Slow (85 s each): by default tests/integration/test_commit_takeover.py wakes a run inside its
# finish after a takeover, in process, and checks it deletes nothing.
@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_driver_stopped_inside_finish_wakes_after_a_takeover_and_deletes_nothing(
    tmp_path: Path, model_dir: Path, where: str, request: pytest.FixtureRequest
) -> None:
    if where == "local":
        uri, storage = str(tmp_path / "out"), None
    else:
        s3: S3Server = request.getfixturevalue("s3")
        uri, storage = f"s3://{s3.make_bucket()}/out", {"endpoint_url": s3.endpoint_url}

    def read(name: str) -> bytes:
        return (Path(uri) / name).read_bytes() if where == "local" else s3.get(f"{uri}/{name}")

    def part_names() -> list[str]:
        if where == "local":
            return sorted(p.name for p in Path(uri).glob("part-*.parquet"))
        names = [u.rsplit("/", 1)[-1] for u in s3.list_uris(uri + "/")]
        return [n for n in names if n.startswith("part-")]

    rows = 60
    path = job(
        tmp_path,
        model_dir,
        rows,
        uri,
        storage=storage,
        input={"shard_bytes": 1024},  # several shards, so the second run has some to do
        output={"lease_timeout_s": 5},
        sampling={"max_tokens": 16},
    )
    # The first driver is slow (so the stop comes midway) and stops itself, every thread at
    # once, when it reaches Committer.finish: as a GC pause or a stopped container would.
    env = {**slow_engine_env(0.02), faults.PAUSE_AT_ENV: "finish"}
    first = start(path, env=env)
    try:
        wait_for(lambda: part_names(), 240, "the first driver's first part")
        first.send_signal(signal.SIGTERM)  # it writes what is finished, then finishes
        proc = psutil.Process(first.pid)
        wait_for(
            lambda: proc.status() == psutil.STATUS_STOPPED, 120, "the driver to stop in finish"
        )
        mine = part_names()
        time.sleep(5 + 2)  # its lease expires (S3 dates tick in whole seconds)
        taker = start(path)
        out_text, err = taker.communicate(timeout=400)
        assert taker.returncode == 0, out_text + err
        assert "took over the lease" in err, err
    finally:
        os.kill(first.pid, signal.SIGCONT)
    _, err = first.communicate(timeout=120)
    kill_tree(first.pid)
    assert first.returncode == 1, err  # woke up without its lease: it stops
    assert "lease" in err, err
    record = manifest(read)
    assert record["status"] == "complete" and [r["attempt"] for r in record["runs"]] == [1, 2]
    listed = {p["name"] for p in record["parts"]}
    assert any(name.split("-")[2] == "00002" for name in listed), "the second run wrote nothing"
    on_storage = set(part_names())
    assert listed <= on_storage, f"committed parts were deleted: {sorted(listed - on_storage)}"
    assert on_storage == listed, f"uncommitted parts left: {sorted(on_storage - listed)}"
    ids_once([pq.read_table(pa.BufferReader(read(n))) for n in sorted(listed)], rows)
    assert read("_SUCCESS") == b""
    assert set(mine) & listed, "none of the first driver's parts was kept"


# --- SIGTERM ---------------------------------------------------------------------------------


def test_sigterm_writes_what_is_finished_and_the_rerun_does_the_rest(
    tmp_path: Path, model_dir: Path
) -> None:
    rows = 120
    out = tmp_path / "out"
    # One big shard written every 3 s (rows_per_file is out of reach): the stop comes right
    # after the first timed part, so what finished since is written only because of the stop.
    path = job(
        tmp_path,
        model_dir,
        rows,
        str(out),
        input={"shard_bytes": 10**6},
        output={"rows_per_file": 1000, "flush_interval_s": 3},
        sampling={"max_tokens": 100},  # the shard takes much longer than the first 3 s
    )
    # 10 ms after every engine step: the rows take 15 waves of 100 steps, 15 s and more on any
    # machine (the rerun runs at full speed, and does only the rest).
    run = start(path, env=slow_engine_env(0.01))
    wait_for(lambda: list(out.glob("part-*.parquet")), 240, "the first timed part")
    before = sum(pq.read_table(p).num_rows for p in out.glob("part-*.parquet"))
    run.send_signal(signal.SIGTERM)
    said = "".join(run.communicate(timeout=200))
    assert run.returncode == 1, said
    assert "SIGTERM: stopping" in said and "rerun the same command" in said
    written = sum(pq.read_table(p).num_rows for p in out.glob("part-*.parquet"))
    # The rows finished or in the engine at the stop were written, not thrown away.
    assert before < written < rows, (before, written)
    record = manifest(lambda n: (out / n).read_text())
    assert record["status"] == "incomplete" and record["missing_rows"] == rows - written
    assert not (out / "_SUCCESS").exists()
    rerun = start(path)
    _, err = rerun.communicate(timeout=400)
    assert rerun.returncode == 0, err
    record = manifest(lambda n: (out / n).read_text())
    assert record["runs"][1]["rows"] == rows - written  # only the rest was generated
    ids_once([pq.read_table(p) for p in out.glob("part-*.parquet")], rows)
