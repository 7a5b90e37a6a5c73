"""Multi-device engine actors on a Ray cluster of three nodes on this machine.

The cluster: a head node without GPUs and two worker nodes, each its own raylet with one CPU
and four fake GPUs (Ray only counts them; the reference engine runs on the CPU with
`engine.device: cpu`). Engine actors of 2 and 4 devices are started by the pipeline's own
`start_engines`, and their placement is read back from Ray's placement-group table and from
inside the actors (the GPU ids each bundle got, the CUDA_VISIBLE_DEVICES the engine sees).

In the slow set (three raylets and four engine processes on two shared cores: about three
minutes); tests/e2e/test_placement_local.py covers one node's placement, the books and the
unplaceable group in the default suite.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engines.reference.model.cpu_kernels import DISABLE_ENV
from pipeline.batch.driver.cluster import start_engines
from pipeline.batch.stages.schema import output_schema
from pipeline.spec import JobSpec, parse_job_spec

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
GPUS_PER_NODE = 4


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    import ray
    from ray.cluster_utils import Cluster

    # The engines' C++ CPU kernels are not what these tests are about: their build check takes
    # minutes on a busy machine. Workers inherit the variable from the nodes started here.
    patch = pytest.MonkeyPatch()
    patch.setenv(DISABLE_ENV, "0")
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "num_gpus": 0, "object_store_memory": 100 * 1024**2},
    )
    workers = [
        cluster.add_node(num_cpus=1, num_gpus=GPUS_PER_NODE, object_store_memory=100 * 1024**2)
        for _ in range(2)
    ]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.gpu_nodes = {w.node_id for w in workers}  # type: ignore[attr-defined]
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        patch.undo()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.dev.tiny import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama"))


def job(model: Path, out: Path, **resources: Any) -> JobSpec:
    return parse_job_spec(
        {
            "name": "placement",
            "input": {"uri": str(out / "in.jsonl"), "format": "jsonl", "prompt_column": "p"},
            "model": {"path": str(model)},
            "engine": {"kind": "reference", "device": "cpu"},
            "resources": {"cpus_per_actor": 0.25, "placement_timeout_s": 60, **resources},
            "output": {"uri": str(out), "report": False},
        }
    )


def started(spec: JobSpec) -> tuple[Any, list[dict[str, Any]]]:
    """The pool and each actor's `ready` answer (the engine is loaded by then)."""
    import ray

    pool = start_engines(spec, output_schema(), None, None)
    try:
        return pool, ray.get([h.ready.remote() for h in pool.handles], timeout=240)
    except BaseException:
        pool.stop()  # the groups must not outlive a failed test
        raise


def group_nodes(group: Any) -> list[str]:
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(group)
    assert table["state"] == "CREATED", table
    return [table["bundles_to_node_id"][i] for i in range(len(table["bundles"]))]


def removed(group: Any) -> bool:
    from ray.util.placement_group import placement_group_table

    return placement_group_table(group)["state"] == "REMOVED"


def test_pack_puts_each_two_device_engine_on_one_node(cluster: Any, model: Path, tmp_path):
    import ray

    spec = job(model, tmp_path, num_actors=2, devices_per_actor=2)  # placement: pack (default)
    pool, ready = started(spec)
    groups = list(pool.groups.groups)
    try:
        for group, info in zip(groups, ready, strict=True):
            nodes = group_nodes(group)
            assert len(set(nodes)) == 1 and nodes[0] in cluster.gpu_nodes
            assert info["node_id"] == nodes[0]  # the actor runs in its group's first bundle
            gpu_ids = [g for bundle in info["devices"] for g in bundle["gpu_ids"]]
            assert len(gpu_ids) == 2 and len(set(gpu_ids)) == 2
            assert sorted(info["cuda_visible_devices"].split(",")) == sorted(gpu_ids)
        accounts = ray.get([h.account.remote() for h in pool.handles])
        # The books count every device of the actor's bundles, not the one it runs in.
        assert [a["devices"] for a in accounts] == [2.0, 2.0]
        assert ray.available_resources().get("GPU", 0) == 2 * GPUS_PER_NODE - 4
    finally:
        pool.stop()
    assert all(removed(g) for g in groups)
    deadline = time.monotonic() + 30
    while ray.available_resources().get("GPU", 0) < 2 * GPUS_PER_NODE:
        assert time.monotonic() < deadline, "the groups' GPUs did not come back"
        time.sleep(0.2)


def test_spread_puts_a_four_device_engine_over_two_nodes(cluster: Any, model: Path, tmp_path):
    spec = job(model, tmp_path, num_actors=1, devices_per_actor=4, placement="spread")
    pool, [info] = started(spec)
    try:
        nodes = group_nodes(pool.groups.groups[0])
        assert set(nodes) == cluster.gpu_nodes
        here = [b for b in info["devices"] if b["node_id"] == info["node_id"]]
        assert len(info["devices"]) == 4 and 1 <= len(here) < 4
        # The engine's process sees the group's GPUs on its own node only.
        visible = info["cuda_visible_devices"].split(",")
        assert sorted(visible) == sorted(g for b in here for g in b["gpu_ids"])
    finally:
        pool.stop()
