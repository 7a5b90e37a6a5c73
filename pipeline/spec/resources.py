"""The `resources` section: the engine actor pool, placement and batching."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engines.strict import StrictModel


class ResourcesSpec(StrictModel):
    num_actors: int | None = Field(
        1, ge=1, description="Fixed number of engine actors. Null with min/max_actors: autoscale."
    )
    min_actors: int | None = Field(None, ge=1, description="Autoscaling lower bound.")
    max_actors: int | None = Field(None, ge=1, description="Autoscaling upper bound.")
    devices_per_actor: float = Field(
        0,
        ge=0,
        description="GPUs per engine actor (0 on CPU-only clusters). Above 1 it must be a whole "
        "number: the actor then gets a Ray placement group of that many one-GPU bundles (see "
        "`placement`), and the engine's parallel sizes in engine.extra must multiply to it "
        "(docs/engine.md, multi-device engines).",
    )
    placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = Field(
        "pack",
        description="With devices_per_actor > 1: how one actor's GPU bundles are placed. pack: "
        "on as few nodes as possible (one node when it has the GPUs; tensor and expert "
        "parallel need that); strict_pack: one node or not at all; spread: over as many nodes "
        "as possible; strict_spread: every GPU on a different node (pipeline parallel across "
        "nodes).",
    )
    placement_timeout_s: float = Field(
        600.0,
        gt=0,
        description="With devices_per_actor > 1: how long the driver waits for the engine "
        "actors' placement groups (the fixed pool, or min_actors) before failing with what was "
        "asked and what the cluster has; long enough for an autoscaler to add nodes.",
    )
    cpus_per_actor: float = Field(
        0.5,
        gt=0,
        description="CPUs reserved per engine actor; fractional on small machines so read and "
        "write tasks still get a CPU.",
    )
    batch_size: int = Field(
        256,
        ge=1,
        description="Rows an engine actor takes from its shard at a time: asked of the budget "
        "together and submitted to the engine together.",
    )
    max_in_flight: int = Field(
        128,
        ge=1,
        description="Requests one actor keeps in its engine at once, across the shards it "
        "works on, so the engine never starves.",
    )
    actor_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each engine actor asks for, e.g. {engine_slot: 1} to "
        "place one actor per node that offers that resource.",
    )
    prompt_actors: int | None = Field(
        None,
        ge=1,
        description="Tokenizer actors feeding the engine actors (chat template + tokenization, "
        "1/4 CPU each). A fixed pool, started before any row is generated, so none starts "
        "mid-run and takes CPU from the engines. Null: one per four engine actors (at least "
        "one); raise it when long prompts make tokenizing the slower stage.",
    )
    max_restarts: int = Field(3, ge=0, description="Restarts of a crashed engine actor.")
    engine_stall_timeout_s: float | None = Field(
        900.0,
        gt=0,
        description="An engine actor whose engine has work but makes no progress (no step, no "
        "finished request) for this long is taken for hung (a lost device, a stuck collective) "
        "and exits, so Ray restarts it and its shards are handed out again, instead of the "
        "job waiting on it until limits.stop_at. An engine that died while idle exits at once. "
        "Set it above the longest request on engines that show no step count (TensorRT-LLM). "
        "null: no watch.",
    )
    max_task_retries: int = Field(
        3,
        ge=0,
        description="Times one shard is tried again after its work failed (an unreadable "
        "input, a write failing past storage.retry_s) or a prompt actor died tokenizing it. "
        "Past this, a shard that kills prompt actors becomes error rows naming the cause; "
        "other failures fail the job. A shard whose engine actor died is handed out again "
        "with its committed rows kept (the actor restarts up to max_restarts).",
    )
    tail_split: bool = Field(
        True,
        description="At the end of a job, when no shard is left to hand out and an engine "
        "actor has nothing to do, split the running shard with the most rows left: the rows "
        "its actor has not yet taken go to the idle one, so the night does not end waiting for "
        "one actor. Every row is still generated and committed once; the manifest lists each "
        "split (events: tail_split). false: each shard runs on one actor to its end.",
    )

    @property
    def peak_actors(self) -> int:
        """Most engine actors the job runs at once: the fixed pool, or the autoscaling maximum."""
        return self.num_actors or self.max_actors or 1

    @model_validator(mode="after")
    def _pool_size(self) -> ResourcesSpec:
        if self.num_actors is None and (self.min_actors is None or self.max_actors is None):
            raise ValueError("resources: set num_actors, or both min_actors and max_actors")
        if self.min_actors and self.max_actors and self.min_actors > self.max_actors:
            raise ValueError("resources.min_actors must be <= resources.max_actors")
        if self.devices_per_actor > 1 and not float(self.devices_per_actor).is_integer():
            raise ValueError(
                f"resources.devices_per_actor {self.devices_per_actor:g}: above 1 it must be a "
                "whole number of GPUs (one placement-group bundle per GPU)"
            )
        return self

    @property
    def multi_device(self) -> bool:
        """Whether each engine actor spans several GPUs (and gets its own placement group)."""
        return self.devices_per_actor > 1
