"""A multi-device engine actor on one Ray node with fake GPUs (Ray only counts them; the
reference engine runs on the CPU with `engine.device: cpu`): its placement group, the devices
its engine sees, its books, the group's removal, and a group that cannot be placed.

Two nodes (pack vs spread) are in tests/e2e/test_placement_cluster.py (slow set).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.reference.model.cpu_kernels import DISABLE_ENV
from pipeline.batch.driver.cluster import ResourceError, start_engines
from pipeline.batch.stages.schema import output_schema
from tests.e2e.test_placement_cluster import group_nodes, job, removed, started

pytestmark = pytest.mark.timeout(420)
GPUS = 4


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    import ray

    # The engines' C++ CPU kernels are not what these tests are about: their build check takes
    # minutes on a busy machine. Workers inherit the variable from the nodes started here.
    patch = pytest.MonkeyPatch()
    patch.setenv(DISABLE_ENV, "0")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        address="local",
        num_cpus=2,
        num_gpus=GPUS,
        object_store_memory=100 * 1024**2,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()
        patch.undo()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.dev.tiny import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama"))


def test_two_device_engine_sees_its_gpus_and_pays_for_both(local_ray, model: Path, tmp_path):
    import ray

    spec = job(model, tmp_path, num_actors=1, devices_per_actor=2)
    pool, [info] = started(spec)
    group = pool.groups.groups[0]
    try:
        assert group_nodes(group) == [info["node_id"]] * 2
        gpu_ids = [g for bundle in info["devices"] for g in bundle["gpu_ids"]]
        assert [b["bundle"] for b in info["devices"]] == [0, 1]
        assert len(set(gpu_ids)) == 2
        assert sorted(info["cuda_visible_devices"].split(",")) == sorted(gpu_ids)
        # The actor itself holds no GPU: both stay with the group for the engine's workers.
        assert ray.available_resources().get("GPU", 0) == GPUS - 2
        account = ray.get(pool.handles[0].account.remote())
        assert account["devices"] == 2.0
    finally:
        pool.stop()
    assert removed(group)
    deadline = time.monotonic() + 30
    while ray.available_resources().get("GPU", 0) < GPUS:
        assert time.monotonic() < deadline, "the group's GPUs did not come back"
        time.sleep(0.2)


def test_a_group_that_cannot_be_placed_fails_naming_what_was_asked(local_ray, model, tmp_path):
    from ray.util.placement_group import placement_group_table

    before = set(placement_group_table())
    spec = job(
        model,
        tmp_path,
        num_actors=1,
        devices_per_actor=GPUS + 1,
        placement="strict_pack",
        placement_timeout_s=2,
    )
    started_at = time.monotonic()
    with pytest.raises(ResourceError) as caught:
        start_engines(spec, output_schema(), None, None)
    assert time.monotonic() - started_at < 30
    message = str(caught.value)
    assert "resources.devices_per_actor 5" in message and "strict_pack" in message
    assert "placement_timeout_s 2s" in message
    assert f"the cluster has {GPUS} GPU and 2 CPU over 1 node(s) ({GPUS} GPU / 2 CPU)" in message
    new = set(placement_group_table()) - before
    assert new and all(placement_group_table()[g]["state"] == "REMOVED" for g in new)
