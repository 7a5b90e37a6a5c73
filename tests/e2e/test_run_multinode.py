"""A job on a Ray cluster of three nodes on this machine, one of which dies mid-job.

The cluster: a head node (no engine slot) and two worker nodes, each its own raylet with one
CPU, its own object store and one `engine_slot` resource; the job asks for two engine actors
with `resources.actor_resources: {engine_slot: 1}`, so one lands on each worker. Once both
actors have written parts, one worker node is killed (its raylet and workers, SIGKILL). The
shards its actor was running go back to the queue with their committed rows kept, the other
actor finishes them, and the output holds every id exactly once. The time from the loss to
the first part written again for a handed-out shard is recorded in the manifest and printed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.e2e.test_run import slow_engine_env

# In the slow set (a three-node cluster: about two minutes): an engine actor lost mid-job, its
# shards handed out again and every row landing once, runs in the default suite in
# tests/integration/test_pipeline_kill.py.
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
ROWS = 480


@pytest.fixture
def cluster() -> Iterator[object]:
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": 150 * 1024**2},
    )
    workers = [cluster.add_node(num_cpus=1, resources={"engine_slot": 1}) for _ in range(2)]
    cluster.wait_for_nodes()
    cluster.workers = workers  # type: ignore[attr-defined]
    try:
        yield cluster
    finally:
        cluster.shutdown()


def test_a_worker_node_dies_mid_job_and_every_id_lands_once(
    cluster: object, tmp_path: Path
) -> None:
    from engines.dev.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "model", arch="llama")
    src = tmp_path / "prompts.jsonl"
    src.write_text(
        "".join(
            json.dumps({"id": f"r{i:04d}", "p": f"Tell me about {i} rivers"}) + "\n"
            for i in range(ROWS)
        )
    )
    out = tmp_path / "out"
    job = {
        "name": "multinode",
        "input": {
            "uri": str(src),
            "format": "jsonl",
            "id_column": "id",
            "prompt_column": "p",
            "shard_bytes": 2048,
        },
        "model": {"path": str(model)},
        "engine": {"kind": "reference", "device": "cpu", "max_batch_size": 8},
        "sampling": {"max_tokens": 64, "temperature": 0.0, "ignore_eos": True},
        "resources": {
            "num_actors": 2,
            "cpus_per_actor": 0.5,
            "max_in_flight": 8,
            "actor_resources": {"engine_slot": 1},
            "prompt_actors": 1,
        },
        "output": {"uri": str(out), "rows_per_file": 10, "flush_interval_s": 1, "report": False},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    # 5 ms after every engine step (passed on to the actors): the job runs for tens of seconds
    # on any machine, so the node dies mid-job.
    env = {**slow_engine_env(0.005), "RAY_ADDRESS": cluster.address}  # type: ignore[attr-defined]
    run = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(path)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def actors_with_parts() -> set[str]:
        try:
            manifest = json.loads((out / "_manifest.json").read_text())
        except (OSError, ValueError):
            return set()
        return {p["actor_id"] for p in manifest["parts"]}

    deadline = time.monotonic() + 300
    while len(actors_with_parts()) < 2:
        assert run.poll() is None, "".join(run.communicate())
        assert time.monotonic() < deadline, "both actors never wrote a part"
        time.sleep(0.5)
    killed_at = time.time()
    cluster.remove_node(cluster.workers[1], allow_graceful=False)  # type: ignore[attr-defined]
    stdout, stderr = run.communicate(timeout=400)
    assert run.returncode == 0, stdout + stderr

    table = pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("part-*.parquet")))
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "an id was written twice"
    assert sorted(ids) == [f"r{i:04d}" for i in range(ROWS)]
    assert set(table.column("completion_tokens").to_pylist()) == {64}
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["status"] == "complete" and (out / "_SUCCESS").exists()
    losses = [e for e in manifest["runs"][0]["events"] if e["event"] == "actor_lost"]
    assert len(losses) == 1 and losses[0]["shards_requeued"], manifest["runs"][0]["events"]
    recovered = losses[0]["recovered_after_s"]
    assert recovered is not None and losses[0]["at"] >= killed_at - 1
    served_by = set(table.column("actor_id").drop_null().to_pylist())
    assert len(served_by) == 2, "rows came from both actors, the lost one's committed ones kept"
    wall = manifest["totals"]["wall_s"]
    print(
        f"\nworker node killed; shards {losses[0]['shards_requeued']} handed out again and "
        f"written again {recovered:.1f}s after the loss; job wall {wall:.1f}s"
    )
