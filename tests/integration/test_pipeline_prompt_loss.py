"""Prompt actors (read + tokenize) that die or never start: the job still ends.

- a shard with a row that kills the prompt actor every time (a test hook makes the actor exit
  on a marked prompt, as a tokenizer that segfaults or runs out of memory on one input would):
  after `resources.max_task_retries` retries the shard's rows become error rows naming the
  cause, every other row is generated, and each id is in the output once;
- prompt actors the cluster cannot place: the job fails naming them instead of waiting forever.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engines import faults
from pipeline.batch.driver.run import RunResult, run_job
from pipeline.spec import JobSpec, parse_job_spec

pytestmark = pytest.mark.timeout(400)
POISON = "POISON-ROW"
# A run that does not end by itself within this is stopped, and the test fails saying so.
END_WITHIN_S = 240.0


def _job(tmp_path: Path, model: Path, lines: list[dict[str, Any]], **resources: Any) -> JobSpec:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return parse_job_spec(
        {
            "name": "prompt-loss",
            "input": {
                "uri": str(src),
                "format": "jsonl",
                "id_column": "id",
                "prompt_column": "p",
                "shard_bytes": 1024,  # a few shards
            },
            "model": {"path": str(model)},
            "engine": {"kind": "reference", "device": "cpu", "max_batch_size": 8},
            "sampling": {"max_tokens": 4, "temperature": 0.0},
            "resources": {
                "num_actors": 1,
                "cpus_per_actor": 0.25,
                "batch_size": 4,
                "max_in_flight": 8,
                **resources,
            },
            "output": {"uri": str(tmp_path / "out"), "rows_per_file": 8, "report": False},
            "limits": {"max_error_fraction": 1.0},
        }
    )


def _run_bounded(spec: JobSpec) -> RunResult | BaseException:
    """run_job in a thread; if it has not ended within END_WITHIN_S it is stopped (as SIGTERM
    would) and the test fails naming the wait."""
    stop = threading.Event()
    results: list[RunResult | BaseException] = []

    def target() -> None:
        try:
            results.append(run_job(spec, stop=stop))
        except BaseException as exc:  # surfaced by the caller
            results.append(exc)

    runner = threading.Thread(target=target, daemon=True)
    runner.start()
    runner.join(END_WITHIN_S)
    ended = not runner.is_alive()
    if not ended:
        stop.set()
        runner.join(120)
    assert ended, f"the job did not end within {END_WITHIN_S:.0f}s (stopped)"
    return results[0]


def test_a_shard_that_kills_the_prompt_actor_every_time_becomes_error_rows(
    ray_local: Any,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv(faults.HOOKS_ENV, "1")
    monkeypatch.setenv(faults.PROMPT_EXIT_ENV, POISON)
    lines = [{"id": f"row-{i:03d}", "p": f"Count the {i} rivers"} for i in range(60)]
    lines[30]["p"] = f"Count the {POISON} rivers"  # a row in the middle shard
    spec = _job(tmp_path, tiny_model_dir, lines, max_task_retries=1)
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="pipeline.batch.driver.scheduler"):
        result = _run_bounded(spec)
    assert not isinstance(result, BaseException), result
    assert result.status == "complete", result.message
    out = tmp_path / "out"
    parts = sorted(out.glob("part-*.parquet"))
    by_shard: dict[int, pa.Table] = {}
    for path in parts:
        shard = int(path.name.split("-")[1])
        table = pq.read_table(path)
        by_shard[shard] = pa.concat_tables([by_shard[shard], table]) if shard in by_shard else table
    ids = [i for t in by_shard.values() for i in t.column("id").to_pylist()]
    assert sorted(ids) == sorted(x["id"] for x in lines) and len(ids) == len(set(ids))
    poisoned = [s for s, t in by_shard.items() if "row-030" in t.column("id").to_pylist()]
    assert len(poisoned) == 1 and len(by_shard) >= 3, sorted(by_shard)
    for shard, table in by_shard.items():
        reasons = table.column("finish_reason").to_pylist()
        if shard != poisoned[0]:
            assert "error" not in reasons, f"shard {shard} has error rows"
            continue
        assert set(reasons) == {"error"}, "the poisoned shard has generated rows"
        errors = set(table.column("error").to_pylist())
        assert len(errors) == 1, errors
        error = errors.pop()
        assert "prompt actor" in error and "died 2 times" in error, error
        assert f"shard {shard}" in error and "resources.max_task_retries" in error, error
    # Only the shard that kills the actor is ever blamed for a death.
    blamed = re.findall(r"prompt actor died preparing shard (\d+)", caplog.text)
    assert blamed and set(blamed) == {str(poisoned[0])}, blamed
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["totals"]["rows_error"] == by_shard[poisoned[0]].num_rows
    print(f"ended in {time.monotonic() - started:.1f}s")


def test_prompt_actors_the_cluster_cannot_place_fail_the_job_naming_them(
    ray_local: Any, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    from pipeline.batch.driver import cluster, scheduler
    from pipeline.batch.driver import run as run_module
    from pipeline.batch.stages.prompts import PromptWorker

    def unplaceable(spec: JobSpec, passthrough: list[pa.Field]) -> cluster.Pool:
        # Prompt actors asking for a resource no node has: they never start, as on a cluster
        # without room for them.
        actor = ray.remote(PromptWorker).options(
            num_cpus=0.25, resources={"tokenmill-test-absent": 1}, max_task_retries=0
        )
        return cluster.Pool([actor.remote((spec, passthrough))])

    monkeypatch.setattr(run_module, "start_prompters", unplaceable)
    monkeypatch.setattr(scheduler, "PROMPT_START_TIMEOUT_S", 3.0, raising=False)
    lines = [{"id": f"row-{i:03d}", "p": f"Count the {i} rivers"} for i in range(8)]
    started = time.monotonic()
    result = _run_bounded(_job(tmp_path, tiny_model_dir, lines))
    assert isinstance(result, scheduler.JobFailed), result
    message = str(result)
    assert "prompt actor" in message and "3s" in message, message
    assert "resources" in message, message
    print(f"failed after {time.monotonic() - started:.1f}s: {message}")
