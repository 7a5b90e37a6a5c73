"""ServeSpec: the YAML file behind `tokenmill serve` (models, replicas, limits, auth, prices).

A served model reuses the batch job's sections (ModelSpec, EngineSpec, PromptSpec, CostSpec,
StorageSpec) so an endpoint replica runs the very engine, settings and prices a nightly job
does. Strict like the job spec (`extra="forbid"`), and stricter about one thing: API keys never
live in this file. A key-looking field anywhere is rejected with a pointer to the environment
variable or secrets file that should hold it, because serve files end up in git and in Ray's
stored application config.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from engines.strict import StrictModel
from pipeline.spec import (
    CostSpec,
    EngineSpec,
    ModelSpec,
    PromptSpec,
    ResourcesSpec,
    SpecError,
    StorageSpec,
    format_validation_error,
    load_yaml,
)

ROUTER_PATH = "pipeline.serve.replicas.routing:PrefixAffinityRouter"

DEFAULT_API_KEYS_ENV = "TOKENMILL_API_KEYS"


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
        "and TensorRT-LLM, which run their engine cores in processes of their own already.",
    )

    def runs_engine_process(self, kind: str) -> bool:
        """Whether this model's engine runs in its own process (engine_process resolved)."""
        return self.engine_process if self.engine_process is not None else kind == "reference"

    @model_validator(mode="after")
    def _bounds(self) -> ReplicaSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("replicas.min_replicas must be <= replicas.max_replicas")
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
        return self


class AuthSpec(StrictModel):
    api_keys_env: str = Field(
        DEFAULT_API_KEYS_ENV,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Environment variable holding accepted bearer keys, comma-separated. They "
        "are named env-1, env-2, ... in order, have no limits and may read /metrics.",
    )
    api_keys_file: str | None = Field(
        None,
        description="File with one accepted key per line (# comments allowed), e.g. a mounted "
        "Kubernetes secret. Keys from it and from api_keys_env are both accepted; they are "
        "named file-1, file-2, ... in order, have no limits and may read /metrics. Read once "
        "at start-up.",
    )
    keys_file: str | None = Field(
        None,
        description="YAML or JSON file of named keys: SHA-256 digests (never keys), optional "
        "per-key limits and allowed models (see docs/serve.md). Every ingress replica reads it "
        "itself and reloads it when it changes, without a restart; it must exist on every "
        "node that runs an ingress replica (e.g. a mounted Kubernetes secret).",
    )
    reload_interval_s: float = Field(
        1.0,
        gt=0,
        le=60,
        description="Seconds between checks of keys_file for changes; a removed key is "
        "refused at most about this long after the file changes.",
    )


class HttpSpec(StrictModel):
    host: str = Field("127.0.0.1", description="Listen address; --host overrides it.")
    port: int = Field(8000, ge=1, le=65535, description="Listen port; --port overrides it.")
    max_body_bytes: int = Field(
        1_048_576, ge=1024, description="Largest request body accepted; larger gets 413."
    )
    retry_after_s: int = Field(
        1, ge=1, description="Retry-After seconds sent with a 429 when every queue is full."
    )
    body_idle_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Seconds a request body (a chat request, an upload) may pause between "
        "pieces before the request is cut with 408 and its slots given back: a client that "
        "stops sending holds nothing for longer.",
    )
    access_log: bool = Field(
        False,
        description="Serve's access log line per request in the proxy, ingress and replicas; "
        "off (the default) saves CPU at high request rates (the metrics still count every "
        "request, and the usage log records each one).",
    )
    one_hop: bool | None = Field(
        None,
        description="Run the engine inside the ingress replica, so a request crosses the "
        "proxy and one replica instead of two, and nothing is pickled between them (1.55x the "
        "requests/s, measured in docs/serve.md). Single-model files only. Replicas, CPUs and "
        "GPUs then come from the model's `replicas` section (plus cpus_per_ingress), "
        "ingress_replicas is unused, Serve's proxy routes (no prefix routing), and "
        "http.max_concurrent_requests bounds each replica's engine load. Null: on for a "
        "single-model file, off otherwise.",
    )
    direct_ingress: bool = Field(
        True,
        description="Requests go from HAProxy (bundled with Ray Serve) straight to the ingress "
        "replicas' own HTTP servers (Serve's direct ingress) instead of through Serve's Python "
        "proxy actor: 1.4-2.1x the requests/s of the proxy, with time to first token below "
        "vLLM's server (docs/serve.md). A client that goes away is noticed on both paths and "
        "its request cancelled (HAProxy runs without kernel splice for that: "
        "pipeline/serve/http/haproxy.py). false: Serve's proxy actor, for a platform without "
        "HAProxy. Applies to the Ray that `tokenmill serve` starts itself; on a shared cluster "
        "these are the Ray nodes' settings (RAY_SERVE_ENABLE_DIRECT_INGRESS=1 and "
        "RAY_SERVE_ENABLE_HA_PROXY=1 in their environment, docs/serve.md).",
    )
    ingress_replicas: int = Field(
        1,
        ge=1,
        description="Replicas of the HTTP ingress (parsing, auth, tokenization). With more "
        "than one, per-key limits still hold over all of them together: each replica leases "
        "budget from one small coordinator actor per app (docs/serve.md, Per-key limits).",
    )
    cpus_per_ingress: float = Field(0.25, gt=0, description="CPUs reserved per ingress replica.")
    strict_fields: bool = Field(
        False,
        description="Refuse request fields the server does not know with a 400 (off: they "
        "are ignored and named in the x-tokenmill-warning response header). A request's "
        "x-tokenmill-strict header (1 or 0) overrides it.",
    )
    max_concurrent_requests: int = Field(
        1000,
        ge=1,
        description="Requests one ingress replica handles at once (from the key check to the "
        "last byte sent, streams included); beyond it, 429 ingress_full. Bounds the "
        "ingress's memory under a flood.",
    )
    max_tokenizing_requests: int = Field(
        256,
        ge=1,
        description="Requests waiting for or in one ingress replica's tokenizer thread; "
        "beyond it, 429 tokenizer_busy.",
    )
    metrics_without_key: bool = Field(
        False,
        description="true: /metrics answers without a key (only where the port is reachable "
        "by your scraper alone). false: it needs a key allowed to read it (an env or "
        "api_keys_file key, or a keys_file entry with metrics: true).",
    )


class UsageLogSpec(StrictModel):
    uri: str = Field(
        description="Where usage records go, one JSON line per request sent to an engine. A "
        "local path: one file, appended to. s3://bucket/prefix: a new object per flush under "
        "the prefix (object stores cannot append), named usage-<UTC time>-<replica>-<seq>.jsonl.",
    )
    flush_interval_s: float = Field(
        5.0,
        gt=0,
        description="Seconds between writes of the buffered records (and at shutdown). A "
        "failed write keeps the records for the next one.",
    )
    max_pending_records: int = Field(
        100_000,
        ge=1,
        description="Records buffered while the destination cannot be written; beyond it new "
        "records are dropped (counted in tokenmill_serve_usage_records_dropped_total and "
        "logged), so an unreachable store cannot exhaust the ingress's memory.",
    )


class BatchApiSpec(StrictModel):
    """`/v1/files` and `/v1/batches` (docs/batch-api.md)."""

    uri: str = Field(
        min_length=1,
        description="Object-storage prefix (s3:// or a local path every node can read) holding "
        "uploaded files (files/<owner>/), batch records and their jobs' output (batches/<owner>/). "
        "Batch state lives here, so it survives a restart of the Serve application.",
    )
    jobs_address: str = Field(
        "http://127.0.0.1:8265",
        description="Ray Jobs API (dashboard) URL batch jobs are submitted to, as with "
        "`tokenmill submit --address`; its auth token comes from RAY_AUTH_TOKEN / "
        "RAY_AUTH_TOKEN_PATH in the ingress's environment.",
    )
    max_file_bytes: int = Field(
        200 * 1024**2,
        ge=1024,
        description="Largest upload accepted (bytes); larger gets 400 file_too_large, as "
        "OpenAI answers. An upload streams to storage in parts while it is checked: the "
        "ingress holds a few MiB of each, never the file.",
    )
    max_line_bytes: int = Field(
        8 * 1024**2,
        ge=1024,
        description="Longest line (one request) of an upload checked; a longer one fails the "
        "batch made from the file (line_too_long). Bounds what checking an upload holds.",
    )
    max_concurrent_uploads: int = Field(
        8,
        ge=1,
        description="Uploads one ingress replica takes at once; beyond it, 429 "
        "upload_slots_full with Retry-After http.retry_after_s. Each holds a few MiB (a part "
        "on its way to storage, the line being checked) and a thread while it is checked.",
    )
    max_file_lines: int = Field(
        50_000,
        ge=1,
        description="Most requests (lines) one batch may hold; a batch made from a longer file "
        "fails during validating (too_many_tasks), as OpenAI's does.",
    )
    completion_window_s: int | None = Field(
        None,
        ge=1,
        description="Length of a batch's completion window in seconds, whatever the "
        "completion_window it was created with (the API accepts only '24h'); at its end a "
        "running batch stops, keeps what finished and ends expired. null: the requested "
        "window. Shorter windows are for tests and for operators who must bound batch runs.",
    )
    ship_code: bool = Field(
        False,
        description="Upload the pipeline and engines packages with each batch job (as "
        "`tokenmill submit --ship-code`); false: the cluster's own `tokenmill` runs it.",
    )
    env_from: list[str] | None = Field(
        None,
        description="Environment variables of the ingress passed to batch jobs (storage "
        "credentials); null: the standard AWS variables that are set.",
    )
    cancel_grace_s: int = Field(
        120,
        ge=1,
        description="After a cancel (or expiry), how long a batch job may take to commit and "
        "export what it finished before Ray kills it (RAY_JOB_STOP_WAIT_TIME_S).",
    )


class ServeSpec(StrictModel):
    name: str = Field(
        "tokenmill",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
        description="Serve application name.",
    )
    models: list[ServedModelSpec] = Field(
        min_length=1, description="Models served, each with its own engine replicas."
    )
    auth: AuthSpec = Field(
        default_factory=AuthSpec, description="Where bearer keys come from (never this file)."
    )
    http: HttpSpec = Field(default_factory=HttpSpec, description="HTTP listener and limits.")
    storage: StorageSpec = Field(
        default_factory=StorageSpec,
        description="Object storage for s3:// models and usage logs (no keys).",
    )
    usage_log: UsageLogSpec | None = Field(
        None,
        description="Append-only per-request usage log (JSONL) to bill keys from; null: "
        "usage is only counted in /metrics.",
    )
    batch_api: BatchApiSpec | None = Field(
        None,
        description="OpenAI's /v1/files and /v1/batches over the batch pipeline; null: those "
        "routes answer 404.",
    )

    @model_validator(mode="after")
    def _unique_names(self) -> ServeSpec:
        names = [m.name for m in self.models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"models: duplicate name(s) {duplicates}; each needs its own name")
        if self.http.one_hop is True and len(self.models) != 1:
            raise ValueError(
                f"http.one_hop needs exactly one model (this file serves {len(self.models)}): "
                "the ingress can hold one engine; split the models into files, or turn it off"
            )
        return self

    @property
    def one_hop(self) -> bool:
        """Whether the engine runs inside the ingress (http.one_hop, null: one model)."""
        return self.http.one_hop if self.http.one_hop is not None else len(self.models) == 1

    @property
    def max_ingress_replicas(self) -> int:
        """The most ingress replicas this app can run: with one_hop the model's replicas."""
        return self.models[0].replicas.max_replicas if self.one_hop else self.http.ingress_replicas

    def model_named(self, name: str) -> ServedModelSpec | None:
        return next((m for m in self.models if m.name == name), None)


# --- Serve options ---------------------------------------------------------------------------

# The ingress deployment's name in Serve (its class name): with http.one_hop it holds the engine.
INGRESS_DEPLOYMENT = "OpenAIIngress"


def engine_deployments(spec: ServeSpec) -> dict[str, str]:
    """Model name -> the Serve deployment whose replicas hold its engine."""
    if spec.one_hop:
        return {spec.models[0].name: INGRESS_DEPLOYMENT}
    return {m.name: engine_deployment_name(m) for m in spec.models}


def engine_deployment_name(served: ServedModelSpec) -> str:
    return f"engine-{served.name}"


def one_hop_deployment_options(spec: ServeSpec) -> dict[str, Any]:
    """Options of the ingress deployment when it holds the model's engine (http.one_hop): the
    engine replica's replicas, health and shutdown settings, the ingress's request bounds."""
    options = engine_deployment_options(spec.models[0])
    del options["name"]  # the ingress keeps its own name
    options.pop("request_router_config", None)  # the proxy routes HTTP; no handle to route
    replica = spec.models[0].replicas
    options["ray_actor_options"] = {
        "num_cpus": replica.cpus_per_replica + spec.http.cpus_per_ingress,
        "num_gpus": replica.devices_per_replica,
    }
    return options


def engine_deployment_options(served: ServedModelSpec) -> dict[str, Any]:
    """Serve deployment options (`Deployment.options(**...)`) for a model's engine replicas."""
    replicas = served.replicas
    options: dict[str, Any] = {
        "name": engine_deployment_name(served),
        "max_ongoing_requests": replicas.max_ongoing_requests,
        "max_queued_requests": replicas.max_queued_requests,
        "ray_actor_options": {
            "num_cpus": replicas.cpus_per_replica,
            "num_gpus": replicas.devices_per_replica,
        },
        "health_check_period_s": served.health.check_period_s,
        "health_check_timeout_s": served.health.check_timeout_s,
        "graceful_shutdown_timeout_s": served.health.shutdown_timeout_s(served.limits.max_tokens),
    }
    if replicas.routing == "prefix":
        from ray.serve.config import RequestRouterConfig

        options["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTER_PATH,
            request_router_kwargs={
                # The engine's own block size, so a routed prefix is one its cache can hold.
                "block_tokens": served.engine.block_size,
                "imbalance": replicas.routing_imbalance,
            },
        )
    if replicas.min_replicas == replicas.max_replicas:
        options["num_replicas"] = replicas.max_replicas
    else:
        options["autoscaling_config"] = {
            "min_replicas": replicas.min_replicas,
            "max_replicas": replicas.max_replicas,
            "target_ongoing_requests": replicas.target_ongoing_requests,
        }
    return options


# --- loading ---------------------------------------------------------------------------------

# Field names that can only mean a credential. Matched on whole keys, so `max_tokens` or
# `kv_cache_tokens` never trip it.
_SECRET_KEY = re.compile(
    r"^(api[_-]?keys?|keys?|secrets?|passwords?|bearer|auth[_-]?tokens?|tokens?|"
    r"access[_-]?keys?|secret[_-]?access[_-]?keys?|aws_secret_access_key)$",
    re.IGNORECASE,
)
# OpenAI-style key values ("sk-...") pasted under any name.
_SECRET_VALUE = re.compile(r"^sk-[A-Za-z0-9_-]{8,}$")


def find_secrets(data: Any, path: str = "") -> list[str]:
    """Paths of key-looking fields (by name or by value) anywhere in a parsed YAML tree."""
    found: list[str] = []
    if isinstance(data, dict):
        for key, value in data.items():
            child = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and _SECRET_KEY.match(key):
                found.append(child)
            else:
                found.extend(find_secrets(value, child))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found.extend(find_secrets(value, f"{path}[{i}]"))
    elif isinstance(data, str) and _SECRET_VALUE.match(data.strip()):
        found.append(path)
    return found


def parse_serve_spec(data: Any, source: str = "serve spec") -> ServeSpec:
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    secrets = find_secrets(data)
    if secrets:
        raise SpecError(
            f"{source}: {', '.join(secrets)}: API keys never go in the serve file; put them in "
            f"${DEFAULT_API_KEYS_ENV} (comma-separated; auth.api_keys_env names another "
            "variable) or in a file named by auth.api_keys_file"
        )
    try:
        return ServeSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(
            format_validation_error(exc, source).replace("job spec", "serve spec")
        ) from None


def load_serve_spec(path: str | Path, env: dict[str, str] | None = None) -> ServeSpec:
    """Read, render (`${VAR}`) and validate a serve file; SpecError names file and field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"cannot read serve file {path}: {exc.strerror or exc}") from None
    return parse_serve_spec(load_yaml(text, source=str(path), env=env), source=str(path))
