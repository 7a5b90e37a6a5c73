"""A served model's sections: its replicas (how many, where, their engine process), request
limits, health checks and the batch template the Batch API runs it with."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engines.settings import MODEL_KINDS
from engines.strict import StrictModel
from pipeline.spec import (
    CostSpec,
    EngineSpec,
    ModelSpec,
    PromptSpec,
    ResourcesSpec,
)

ROUTER_PATH = "pipeline.serve.replicas.routing:PrefixAffinityRouter"


class ReplicaSpec(StrictModel):
    min_replicas: int = Field(1, ge=0, description="Autoscaling lower bound of engine replicas.")
    max_replicas: int = Field(1, ge=1, description="Autoscaling upper bound of engine replicas.")
    target_ongoing_requests: float = Field(
        16,
        gt=0,
        description="Requests in flight per replica the autoscaler aims for; an engine batches "
        "in flight, so this is well above 1 (about its max_batch_size / 2).",
    )
    max_ongoing_requests: int = Field(
        64,
        ge=1,
        description="Requests one replica's engine holds at once (running plus its own waiting "
        "queue). More wait in Serve's queue.",
    )
    max_queued_requests: int = Field(
        128,
        ge=0,
        description="Requests waiting in Serve for a free replica slot; beyond this the "
        "endpoint answers 429 with Retry-After instead of queueing without bound.",
    )
    cpus_per_replica: float = Field(
        0.5, gt=0, description="CPUs reserved per engine replica (fractional on small machines)."
    )
    devices_per_replica: float = Field(0, ge=0, description="GPUs per engine replica (0 on CPU).")
    routing: Literal["prefix", "load"] = Field(
        "prefix",
        description="How requests pick a replica: prefix sends prompts that share a prefix "
        "(system prompt, few-shot preamble, chat history) to the replica that computed it, so "
        "its prefix cache hits, unless that replica is `imbalance` requests busier than the "
        "least loaded (pipeline/serve/replicas/routing.py); load is Serve's default (two random "
        "replicas, the shorter queue). One replica: no difference.",
    )
    routing_imbalance: int = Field(
        8,
        ge=1,
        description="Prefix routing gives up affinity when the preferred replica holds this "
        "many more requests than the least loaded one.",
    )
    stream_interval_s: float = Field(
        0.02,
        ge=0,
        description="Streamed responses: text produced within this many seconds goes to the "
        "client as one chunk (the first token always at once). Each chunk is one Ray item "
        "from replica to ingress, so merging raises how many streams a replica can feed; "
        "0 sends every engine step's tokens on their own.",
    )

    engine_process: bool | None = Field(
        None,
        description="Run the engine in a process of its own beside the replica (engines/"
        "process.py), so its step loop and the replica's request handling (HTTP, JSON, "
        "tokenizing, streaming) run in parallel instead of taking turns on one GIL. null: on "
        "for the reference engine, whose step loop is a thread of the replica; off for vLLM "
        "and TensorRT-LLM, which run their engine cores in processes of their own already; "
        "on whenever engine_python is set.",
    )
    engine_python: str | None = Field(
        None,
        description="The Python interpreter (a path on the replica's node) to run the engine "
        "process under, when the engine lives in another environment than Ray Serve: in the "
        "TensorRT-LLM image, the container's own Python (TensorRT-LLM 1.2 pins a fastapi "
        "older than Serve needs, so Serve runs in an environment of its own; docs/deploy.md). "
        "That environment must hold the same tokenmill version; the replica checks it at "
        "start. null: the replica's own interpreter.",
    )

    def runs_engine_process(self, kind: str) -> bool:
        """Whether this model's engine runs in its own process (engine_process resolved)."""
        if self.engine_python is not None:
            return True
        return self.engine_process if self.engine_process is not None else kind == "reference"

    @model_validator(mode="after")
    def _bounds(self) -> ReplicaSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("replicas.min_replicas must be <= replicas.max_replicas")
        if self.engine_python is not None and self.engine_process is False:
            raise ValueError(
                "replicas.engine_python runs the engine in a process of its own: drop "
                "replicas.engine_process: false, or engine_python"
            )
        return self


class RequestLimitsSpec(StrictModel):
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="Longest prompt (after the chat template) accepted; longer gets 400. "
        "Null: the engine's max_model_len minus one output token.",
    )
    max_tokens: int = Field(
        1024,
        ge=1,
        description="Largest max_tokens a request runs with; a larger one is clamped to it "
        "(and the x-tokenmill-warning response header says so).",
    )
    default_max_tokens: int = Field(
        256,
        ge=1,
        description="max_tokens of a chat request that names none (completions default to 16, "
        "as OpenAI's do). Clipped to the room the context leaves.",
    )

    @model_validator(mode="after")
    def _default_within_cap(self) -> RequestLimitsSpec:
        if self.default_max_tokens > self.max_tokens:
            raise ValueError("limits.default_max_tokens must be <= limits.max_tokens")
        return self


# Graceful-shutdown default: long enough for the longest allowed generation to finish at a
# slow decode speed, so a rollout or scale-down does not cut it off.
SHUTDOWN_MARGIN_S = 30.0
SHUTDOWN_FLOOR_S = 60.0


class HealthSpec(StrictModel):
    check_period_s: float = Field(
        10,
        gt=0,
        description="Seconds between Serve's health checks of each engine replica (Serve's "
        "health_check_period_s; with http.one_hop, of the ingress replicas, which hold the "
        "engine). Serve replaces a replica after 3 failed checks in a row.",
    )
    check_timeout_s: float = Field(
        60,
        gt=0,
        description="Seconds a health check may take before it counts as failed (Serve's "
        "health_check_timeout_s). Generous: the check shares the replica's event loop with "
        "streaming requests and can answer late under a full batch.",
    )
    stall_timeout_s: float = Field(
        120,
        gt=0,
        description="A replica whose engine has requests waiting or running but has not "
        "completed a step for this long is unhealthy (its step loop is hung); its in-flight "
        "requests get 503 and Serve replaces it. Longer than the slowest single step.",
    )
    graceful_shutdown_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Seconds a replica being stopped (rollout, scale-down) may spend finishing "
        "its requests before it is killed (Serve's graceful_shutdown_timeout_s). Null: "
        f"max({SHUTDOWN_FLOOR_S:g}, limits.max_tokens / shutdown_decode_tokens_per_s + "
        f"{SHUTDOWN_MARGIN_S:g}).",
    )
    shutdown_decode_tokens_per_s: float = Field(
        10,
        gt=0,
        description="Conservative decode speed of one request on a busy replica, in tokens/s; "
        "only used to derive the default graceful_shutdown_timeout_s.",
    )

    def shutdown_timeout_s(self, max_tokens: int) -> float:
        """The graceful-shutdown timeout: the configured one, or one long enough for a
        request of `max_tokens` to finish at shutdown_decode_tokens_per_s."""
        if self.graceful_shutdown_timeout_s is not None:
            return self.graceful_shutdown_timeout_s
        decode_s = max_tokens / self.shutdown_decode_tokens_per_s
        return max(SHUTDOWN_FLOOR_S, decode_s + SHUTDOWN_MARGIN_S)


class ModelBatchSpec(StrictModel):
    """How `/v1/batches` runs this model: a pipeline job built from the model's own sections
    (model, prompt, cost) with these settings (see docs/batch-api.md)."""

    engine: EngineSpec | None = Field(
        None,
        description="Engine settings of the batch job's actors (e.g. a larger max_batch_size "
        "than interactive serving wants); null: the served model's engine section.",
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec,
        description="The batch job's engine actors (count, CPUs and GPUs each, batching); the "
        "cluster must have room for them besides the Serve replicas.",
    )
    batch_discount: float = Field(
        0.5,
        ge=0,
        lt=1,
        description="Discount on the model's list prices (cost.price_per_million) for batch "
        "requests: each row's list_price_usd and the batch's cost carry it (0.5: half price, as "
        "OpenAI's Batch API).",
    )
    max_tokens: int = Field(
        256,
        ge=1,
        description="max_tokens of a batch request whose body names none (a request's own "
        "max_tokens / max_completion_tokens wins).",
    )


class ServedModelSpec(StrictModel):
    name: str = Field(
        description="Model name clients send in `model` (and /v1/models lists).",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$",
    )
    model: ModelSpec = Field(description="The model to serve (same section as a batch job's).")
    engine: EngineSpec = Field(
        default_factory=EngineSpec, description="Engine and settings (same as a batch job's)."
    )
    prompt: PromptSpec = Field(
        default_factory=PromptSpec,
        description="system_prompt is prepended to chats that bring no system message; "
        "chat_template false rejects /v1/chat/completions for this model. template must be "
        "null (it renders batch rows, not requests). reasoning (think | harmony) splits chat "
        "answers into reasoning_content and content; enable_thinking and reasoning_effort are "
        "chat template variables (a request's reasoning_effort and chat_template_kwargs win).",
    )
    cost: CostSpec = Field(
        default_factory=CostSpec,
        description="Device-hour and list prices; each response's usage carries cost_usd and "
        "(with price_per_million) list_price_usd computed from them.",
    )
    replicas: ReplicaSpec = Field(
        default_factory=ReplicaSpec, description="Engine replicas, autoscaling and queueing."
    )
    limits: RequestLimitsSpec = Field(
        default_factory=RequestLimitsSpec, description="Per-request token caps."
    )
    health: HealthSpec = Field(
        default_factory=HealthSpec,
        description="Replica health checks, stall detection and graceful shutdown.",
    )
    batch: ModelBatchSpec | None = Field(
        None,
        description="Template of the pipeline job `/v1/batches` runs for this model (needs the "
        "top-level batch_api section); null: batches naming this model are refused (400).",
    )

    @model_validator(mode="after")
    def _no_row_template(self) -> ServedModelSpec:
        if self.prompt.template is not None:
            raise ValueError(
                f"models[{self.name}].prompt.template renders batch rows and has no meaning for "
                "requests; remove it"
            )
        if self.model.adapters and self.engine.kind not in MODEL_KINDS:
            raise ValueError(
                f"models[{self.name}].model.adapters: engine.kind {self.engine.kind} runs no "
                f"model, so no LoRA adapters; use one of {', '.join(MODEL_KINDS)}"
            )
        return self
