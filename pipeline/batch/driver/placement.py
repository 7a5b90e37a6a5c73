"""Placement groups for engine actors that span several GPUs (resources.devices_per_actor > 1).

Each such actor gets its own placement group: one bundle per GPU ({"GPU": 1}), the actor's
CPUs (and its custom resources) in the first bundle, placed by `resources.placement`. The actor
runs in bundle 0 holding no GPU itself, so the GPUs stay free for whoever drives them inside
the group: vLLM's Ray workers (distributed_executor_backend "ray" finds the actor's group) or,
for engines that start their own worker processes on the actor's node (TensorRT-LLM over MPI,
the reference engine), the actor's CUDA_VISIBLE_DEVICES, which `claim_devices` sets to the
GPUs of the group's bundles on the actor's node.

The driver waits for the groups at most `resources.placement_timeout_s`; a group that cannot
be placed by then fails the job with what was asked and what the cluster has (Ray itself would
leave it pending forever). Groups are removed when the pool stops.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from typing import Any

from pipeline.spec import ResourcesSpec

# resources.placement → Ray's placement-group strategy.
STRATEGIES = {
    "pack": "PACK",
    "spread": "SPREAD",
    "strict_pack": "STRICT_PACK",
    "strict_spread": "STRICT_SPREAD",
}


class PlacementError(RuntimeError):
    """An engine actor's placement group could not be placed in time."""


def bundles(res: ResourcesSpec) -> list[dict[str, float]]:
    """One bundle per GPU; the first also holds the actor's CPUs and custom resources (the
    actor itself runs there)."""
    count = int(res.devices_per_actor)
    first = {"GPU": 1.0, "CPU": float(res.cpus_per_actor), **dict(res.actor_resources)}
    return [first] + [{"GPU": 1.0} for _ in range(count - 1)]


def strategy(res: ResourcesSpec) -> str:
    return STRATEGIES[res.placement]


@dataclass
class EngineGroups:
    """The placement groups of one engine pool (one per actor)."""

    groups: list[Any]

    def actor_options(self, index: int) -> dict[str, Any]:
        """Ray options that start actor `index` in bundle 0 of its group, holding no GPU (the
        GPUs are for the engine's own workers, or made visible by `claim_devices`). Tasks and
        actors the engine starts (vLLM's Ray workers) stay in the group."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            "num_gpus": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.groups[index],
                placement_group_bundle_index=0,
                placement_group_capture_child_tasks=True,
            ),
        }

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in self.groups:
            # Already gone with its cluster: nothing left to free.
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        self.groups = []


def reserve(res: ResourcesSpec, count: int, required: int) -> EngineGroups:
    """Create `count` placement groups and wait until `required` of them are placed (the rest
    may stay pending, e.g. for an autoscaler); raises PlacementError after
    res.placement_timeout_s, with the groups removed."""
    import ray
    from ray.util.placement_group import placement_group

    shape = bundles(res)
    run = uuid.uuid4().hex[:8]
    groups = EngineGroups(
        [
            # Names are unique per Ray namespace: another job's (or a retry's) groups on the
            # same cluster must not clash with these.
            placement_group(shape, strategy=strategy(res), name=f"tokenmill-engine-{run}-{i}")
            for i in range(count)
        ]
    )
    ready, _ = ray.wait(
        [g.ready() for g in groups.groups],
        num_returns=required,
        timeout=res.placement_timeout_s,
    )
    if len(ready) < required:
        groups.remove()
        raise PlacementError(unplaced_message(res, count, required, len(ready)))
    return groups


def unplaced_message(res: ResourcesSpec, count: int, required: int, placed: int) -> str:
    """What was asked and what the cluster has, naming the fields to change."""
    import ray

    per_node = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        have = node.get("Resources", {})
        per_node.append(f"{have.get('GPU', 0):g} GPU / {have.get('CPU', 0):g} CPU")
    total = ray.cluster_resources()
    asked = " + ".join(_bundle_text(b) for b in bundles(res))
    return (
        f"resources: {placed} of the {required} engine placement group(s) needed were placed "
        f"within resources.placement_timeout_s {res.placement_timeout_s:g}s. Each engine actor "
        f"asks for resources.devices_per_actor {res.devices_per_actor:g} GPUs as bundles "
        f"[{asked}] with resources.placement {res.placement} ({strategy(res)}), {count} "
        f"actor(s) in all; the cluster has {total.get('GPU', 0):g} GPU and "
        f"{total.get('CPU', 0):g} CPU over {len(per_node)} node(s) "
        f"({'; '.join(per_node) or 'none alive'}). Use fewer actors or devices, another "
        "placement (strict_pack needs one node with all the GPUs, strict_spread one node per "
        "GPU), or add nodes."
    )


def _bundle_text(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"


# --- inside the engine actor -----------------------------------------------------------------
