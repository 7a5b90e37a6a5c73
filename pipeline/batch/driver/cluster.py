"""Ray for a batch run: which cluster, whether the actors fit, and the two actor pools.

With RAY_ADDRESS set (as under `ray job submit -- tokenmill run job.yaml`) the job runs on
that cluster; otherwise it starts a private local one (`address="local"`, never attaching to
a cluster someone else started on this machine) sized to this machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from engines import faults
from pipeline.batch.driver import placement
from pipeline.batch.driver.placement import EngineGroups
from pipeline.batch.session import ray_init_kwargs
from pipeline.batch.stages.generate import EngineWorker
from pipeline.batch.stages.prompts import PROMPT_STAGE_CPUS, PromptWorker, prompt_pool_size
from pipeline.batch.stages.rows import GenerateConfig
from pipeline.spec import JobSpec


class ResourceError(RuntimeError):
    """The job's actors cannot fit beside the other stages on the cluster."""


def known_cluster_cpus() -> float | None:
    """CPUs of the cluster the job will run on, when known before it starts (None: unknown,
    e.g. an autoscaling cluster at RAY_ADDRESS)."""
    import ray

    if ray.is_initialized():
        return float(ray.cluster_resources().get("CPU", 0.0))
    kwargs = ray_init_kwargs(os.environ)
    return float(kwargs["num_cpus"]) if "num_cpus" in kwargs else None


def check_cpu_headroom(spec: JobSpec, cluster_cpus: float | None) -> None:
    """Refuse a pool whose CPUs leave too little for the prompt actors (they would never be
    scheduled). Raises ResourceError naming the fields to change."""
    if cluster_cpus is None:
        return
    res = spec.resources
    actors = res.num_actors or res.min_actors or 1
    others = PROMPT_STAGE_CPUS * prompt_pool_size(spec)
    if actors * res.cpus_per_actor + others > cluster_cpus + 1e-9:
        fit = max(cluster_cpus - others, 0.0) / actors
        raise ResourceError(
            f"resources: {actors} engine actor(s) x cpus_per_actor {res.cpus_per_actor} plus "
            f"{others:g} CPU for reading and tokenizing exceed the cluster's {cluster_cpus:g} "
            f"CPUs; set resources.cpus_per_actor <= {fit:.2f} (fractions are fine) or use "
            "fewer actors"
        )


@dataclass
class Pool:
    """The actors of one stage. Their constructor arguments are small (a few KB) and passed
    inline, so Ray keeps them with the actor for restarts."""

    handles: list[Any]
    groups: EngineGroups | None = None  # multi-device engines: one placement group per actor

    def stop(self) -> None:
        import ray

        for handle in self.handles:
            ray.kill(handle, no_restart=True)
        if self.groups is not None:  # after the actors: their GPUs go back to the cluster
            self.groups.remove()


def start_engines(spec: JobSpec, schema: pa.Schema, budget: Any, run_id: str) -> Pool:
    """The engine actors (not waited for: each answers `ready` once its engine is loaded).

    An autoscaling pool starts max_actors: those the cluster cannot place yet stay pending
    (and ask a Ray autoscaler for nodes) and get work once they are up.

    With devices_per_actor > 1 each actor starts in its own placement group
    (pipeline.batch.driver.placement); this waits until the fixed pool's (or min_actors') groups are
    placed, and raises ResourceError if they cannot be within resources.placement_timeout_s.
    """
    import dataclasses

    import ray

    res = spec.resources
    config = dataclasses.replace(
        GenerateConfig.from_spec(spec, schema), budget=budget, run_id=run_id
    )
    hooks = faults.forwarded_env()  # empty outside tests
    options: dict[str, Any] = dict(
        num_cpus=res.cpus_per_actor,
        num_gpus=res.devices_per_actor or None,
        resources=dict(res.actor_resources) or None,
        # Ray restarts a dead engine actor; the scheduler hands its shards out again itself,
        # so Ray must not retry the calls (that would run a shard twice).
        max_restarts=res.max_restarts,
        max_task_retries=0,
        runtime_env={"env_vars": hooks} if hooks else None,
    )
    actor = ray.remote(EngineWorker)
    if not res.multi_device:
        return Pool([actor.options(**options).remote(config) for _ in range(res.peak_actors)])
    try:
        groups = placement.reserve(
            res, res.peak_actors, required=res.num_actors or res.min_actors or 1
        )
    except placement.PlacementError as exc:
        raise ResourceError(str(exc)) from exc
    # The group's bundles hold the CPUs, GPUs and custom resources: the actor asks for its
    # CPUs inside bundle 0 and for no GPU (see pipeline.batch.driver.placement).
    handles = [
        actor.options(**{**options, "resources": None, **groups.actor_options(i)}).remote(config)
        for i in range(res.peak_actors)
    ]
    return Pool(handles, groups)


def start_prompters(spec: JobSpec, passthrough: list[pa.Field]) -> Pool:
    """The prompt actors: a fixed pool started with the engines, so none starts mid-run and
    takes CPU from them."""
    import ray

    hooks = faults.forwarded_env()  # empty outside tests
    actor = ray.remote(PromptWorker).options(
        num_cpus=PROMPT_STAGE_CPUS,
        max_restarts=-1,
        max_task_retries=0,
        runtime_env={"env_vars": hooks} if hooks else None,
    )
    return Pool([actor.remote((spec, passthrough)) for _ in range(prompt_pool_size(spec))])
