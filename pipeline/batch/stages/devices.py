"""In an engine actor: claim the GPUs its placement group reserved (CUDA_VISIBLE_DEVICES)."""

from __future__ import annotations

import os
from typing import Any


def _probe() -> tuple[str, list[str]]:
    import ray

    return ray.get_runtime_context().get_node_id(), [str(i) for i in ray.get_gpu_ids()]


def claim_devices() -> list[dict[str, Any]]:
    """In an engine actor started by `EngineGroups.actor_options`: find each bundle's node and
    GPU ids (one short task per bundle) and make this node's GPUs of the group visible to the
    actor's process (CUDA_VISIBLE_DEVICES), so that engines starting their own worker processes
    here see exactly the devices reserved for them. Returns [{bundle, node_id, gpu_ids}] per
    bundle; [] outside a placement group (nothing is changed then)."""
    import ray
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # Outside Ray (tools, tests that build the actor class directly) there is no group.
    group = get_current_placement_group() if ray.is_initialized() else None
    if group is None:
        return []
    probe = ray.remote(num_cpus=0, num_gpus=1, max_retries=0)(_probe)
    refs = [
        probe.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=i
            )
        ).remote()
        for i in range(group.bundle_count)
    ]
    found = [
        {"bundle": i, "node_id": node, "gpu_ids": ids}
        for i, (node, ids) in enumerate(ray.get(refs))
    ]
    here = ray.get_runtime_context().get_node_id()
    local = [gpu for b in found if b["node_id"] == here for gpu in b["gpu_ids"]]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(local)
    return found
