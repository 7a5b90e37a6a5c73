"""A node lost under a multi-device engine: its shards are handed out again, every id once.

The cluster: a head node without GPUs and two worker nodes with one CPU and two fake GPUs each.
The job has one engine actor of two GPUs (`placement: strict_pack`, so both on one node).
Once it has written a part, its node is removed (raylet and workers killed). Ray places the
group again on the other node and restarts the actor there; the scheduler hands the lost
shards out again with their committed rows kept, and the output holds every id exactly once.

In the slow set: three raylets and two engine loads on two shared cores take minutes.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engines import faults
from engines.reference.model.cpu_kernels import DISABLE_ENV
from pipeline.batch.driver.run import RunResult, run_job
from pipeline.spec import parse_job_spec

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    import ray
    from ray.cluster_utils import Cluster

    monkeypatch.setenv(DISABLE_ENV, "0")  # see test_placement_cluster.py
    # 50 ms after every engine step (passed on to the actors): the loss lands mid-job.
    for name, value in faults.step_delay_env(0.05).items():
        monkeypatch.setenv(name, value)
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "num_gpus": 0, "object_store_memory": 100 * 1024**2},
    )
    cluster.gpu_nodes = [  # type: ignore[attr-defined]
        cluster.add_node(num_cpus=1, num_gpus=2, object_store_memory=100 * 1024**2)
        for _ in range(2)
    ]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.2)


def engine_group_node() -> str:
    from ray.util.placement_group import placement_group_table

    nodes = {
        node
        for group in placement_group_table().values()
        if group["name"].startswith("tokenmill-engine-") and group["state"] == "CREATED"
        for node in group["bundles_to_node_id"].values()
    }
    assert len(nodes) == 1, nodes
    return nodes.pop()


def test_a_lost_node_hands_its_engine_shards_out_again_once(cluster: Any, tmp_path: Path):
    from engines.dev.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "model", arch="llama")
    ids = [f"row-{i:03d}" for i in range(48)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "p": f"Count the {i} rivers"}) + "\n" for i in ids))
    out = tmp_path / "out"
    spec = parse_job_spec(
        {
            "name": "node-loss",
            "input": {
                "uri": str(src),
                "format": "jsonl",
                "id_column": "id",
                "prompt_column": "p",
            },
            "model": {"path": str(model)},
            "engine": {"kind": "reference", "device": "cpu", "max_batch_size": 8},
            "sampling": {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True},
            "resources": {
                "num_actors": 1,
                "devices_per_actor": 2,
                "placement": "strict_pack",
                "cpus_per_actor": 0.25,
                "batch_size": 4,
                "max_in_flight": 8,
                "max_restarts": 2,
            },
            "output": {"uri": str(out), "rows_per_file": 4, "report": False},
        }
    )
    results: list[RunResult | BaseException] = []

    def target() -> None:
        try:
            results.append(run_job(spec))
        except BaseException as exc:  # surfaced below
            results.append(exc)

    runner = threading.Thread(target=target, daemon=True)
    runner.start()
    wait_for(lambda: len(list(out.glob("part-*.parquet"))) >= 1, 300, "a committed part")
    lost = engine_group_node()
    committed_at_loss = len(list(out.glob("part-*.parquet")))
    node = next(n for n in cluster.gpu_nodes if n.node_id == lost)
    cluster.remove_node(node)
    runner.join(timeout=400)
    assert not runner.is_alive(), "the job did not finish after the node was lost"

    result = results[0]
    assert not isinstance(result, BaseException), result
    assert committed_at_loss < len(ids) // 4, "the loss came after all rows were done"
    assert result.status == "complete"
    table = pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("part-*.parquet")))
    got = table.column("id").to_pylist()
    assert len(got) == len(set(got)), "an id was written twice"
    assert sorted(got) == ids
    manifest = json.loads((out / "_manifest.json").read_text())
    actors = manifest["runs"][0]["actors"]
    assert len({a["incarnation"] for a in actors}) == 2, (
        "rows came from the lost actor and its restart"
    )
    assert all(a["devices"] == 2 for a in actors)
