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
from typing import Any

from pydantic import Field, ValidationError, model_validator

from engines.strict import StrictModel
from pipeline.serve.spec.models import (
    ROUTER_PATH,
    HealthSpec,
    ModelBatchSpec,
    ReplicaSpec,
    RequestLimitsSpec,
    ServedModelSpec,
)
from pipeline.serve.spec.server import (
    DEFAULT_API_KEYS_ENV,
    AuthSpec,
    BatchApiSpec,
    HttpSpec,
    UsageLogSpec,
)
from pipeline.spec import (
    SpecError,
    StorageSpec,
    format_validation_error,
    load_yaml,
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
        # A request's `model` names a served model or one of its adapters: one namespace.
        owners: dict[str, str] = {}
        for served in self.models:
            for adapter in served.model.adapters:
                if adapter in names or adapter in owners:
                    other = owners.get(adapter, adapter)
                    raise ValueError(
                        f"models[{served.name}].model.adapters.{adapter}: the name is already "
                        f"taken by {'model' if adapter in names else 'an adapter of'} {other!r}; "
                        "a request's model field must name one thing, so rename one of them"
                    )
                owners[adapter] = served.name
        prefixed = [m.name for m in self.models if m.model.adapter_prefix]
        if len(prefixed) > 1:
            raise ValueError(
                f"models {prefixed}: model.adapter_prefix on more than one model; a name not "
                "listed anywhere could belong to either, so give one model the prefix and "
                "list the other's adapters in model.adapters"
            )
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

    def route(self, name: str) -> tuple[ServedModelSpec, str | None] | None:
        """What a request's `model` names: a served model (adapter None) or a LoRA adapter of
        one (its served model and the adapter's name); None: neither."""
        served = self.model_named(name)
        if served is not None:
            return served, None
        owner = next((m for m in self.models if name in m.model.adapters), None)
        if owner is None:
            # Any other name goes to the model with an adapter prefix (at most one has one),
            # whose engine looks it up there on first use (404 when it is not there either).
            owner = next((m for m in self.models if m.model.adapter_prefix), None)
        return (owner, name) if owner is not None else None

    def served_names(self) -> list[str]:
        """Every name a request's `model` may give: the models, then their adapters."""
        return [m.name for m in self.models] + [a for m in self.models for a in m.model.adapters]


# --- Serve options ---------------------------------------------------------------------------

# The ingress deployment's name in Serve (its class name): with http.one_hop it holds the engine.
__all__ = [
    "DEFAULT_API_KEYS_ENV",
    "INGRESS_DEPLOYMENT",
    "ROUTER_PATH",
    "AuthSpec",
    "BatchApiSpec",
    "HealthSpec",
    "HttpSpec",
    "ModelBatchSpec",
    "ReplicaSpec",
    "RequestLimitsSpec",
    "ServeSpec",
    "ServedModelSpec",
    "UsageLogSpec",
    "engine_deployment_name",
    "engine_deployment_options",
    "engine_deployments",
    "find_secrets",
    "load_serve_spec",
    "one_hop_deployment_options",
    "parse_serve_spec",
]

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
