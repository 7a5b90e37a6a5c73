"""Prometheus metrics of the Serve ingress, scraped over HTTP at /metrics.

One private registry per ingress replica, so building the app twice in one process (tests)
cannot trip prometheus_client's duplicate-name check. Latency is measured at the ingress (what
a client sees, minus the network); TTFT comes from the engine's own request metrics so it means
the same thing for streamed and whole responses.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engines.api import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "tokenmill_serve_requests",
            "Requests answered, by model, endpoint and HTTP status.",
            ["model", "endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tokenmill_serve_prompt_tokens", "Prompt tokens processed.", ["model"], registry=r
        )
        self.cached_tokens = Counter(
            "tokenmill_serve_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache.",
            ["model"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "tokenmill_serve_completion_tokens", "Tokens generated.", ["model"], registry=r
        )
        self.cost_usd = Counter(
            "tokenmill_serve_cost_usd", "Device cost of answered requests.", ["model"], registry=r
        )
        self.ttft = Histogram(
            "tokenmill_serve_ttft_seconds",
            "Engine time to first token (arrival in the engine to first sampled token).",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "tokenmill_serve_latency_seconds",
            "Ingress time from request received to last byte sent.",
            ["model", "endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "tokenmill_serve_requests_in_flight",
            "Requests dispatched to an engine replica and not yet finished or cancelled.",
            ["model"],
            registry=r,
        )
        self.errors = Counter(
            "tokenmill_serve_errors",
            "Error responses and aborted requests, by kind (the OpenAI error code).",
            ["kind"],
            registry=r,
        )
        self.engine_running = Gauge(
            "tokenmill_engine_requests_running",
            "Requests holding KV blocks in the engine (sampled from one replica at scrape).",
            ["model"],
            registry=r,
        )
        self.engine_waiting = Gauge(
            "tokenmill_engine_requests_waiting",
            "Requests queued in the engine (sampled from one replica at scrape).",
            ["model"],
            registry=r,
        )
        self.engine_kv_used = Gauge(
            "tokenmill_engine_kv_blocks_used",
            "KV cache blocks in use (sampled from one replica at scrape).",
            ["model"],
            registry=r,
        )

        self.engine_steps = Gauge(
            "tokenmill_engine_steps",
            "Engine steps since load (sampled from one replica at scrape); flat when idle.",
            ["model"],
            registry=r,
        )
        self.engine_spec_proposed = Gauge(
            "tokenmill_engine_spec_proposed_tokens",
            "Speculative tokens proposed and verified since load (one replica, at scrape); "
            "acceptance rate = accepted / proposed. 0 without engine.speculative.",
            ["model"],
            registry=r,
        )
        self.engine_spec_accepted = Gauge(
            "tokenmill_engine_spec_accepted_tokens",
            "Speculative tokens the model accepted since load (one replica, at scrape).",
            ["model"],
            registry=r,
        )

        # Per key: labelled by the key's name (never the key), for usage and billing.
        self.key_requests = Counter(
            "tokenmill_serve_key_requests",
            "Requests by key name, model and HTTP status (refusals included; model '-' when "
            "the request named no served model).",
            ["key", "model", "status"],
            registry=r,
        )
        self.key_prompt_tokens = Counter(
            "tokenmill_serve_key_prompt_tokens",
            "Prompt tokens of answered requests, by key name and model.",
            ["key", "model"],
            registry=r,
        )
        self.key_cached_tokens = Counter(
            "tokenmill_serve_key_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache, by key name and model.",
            ["key", "model"],
            registry=r,
        )
        self.key_completion_tokens = Counter(
            "tokenmill_serve_key_completion_tokens",
            "Tokens generated for answered requests, by key name and model.",
            ["key", "model"],
            registry=r,
        )
        self.key_cost_usd = Counter(
            "tokenmill_serve_key_cost_usd",
            "Device cost of answered requests, by key name and model.",
            ["key", "model"],
            registry=r,
        )
        self.key_rate_limited = Counter(
            "tokenmill_serve_key_rate_limited",
            "Requests refused with 429 by a key's own limit, by key name and limit.",
            ["key", "limit"],
            registry=r,
        )
        self.key_in_flight = Gauge(
            "tokenmill_serve_key_requests_in_flight",
            "Admitted requests of a key not yet finished (this ingress replica).",
            ["key"],
            registry=r,
        )
        # Overload bounds of this ingress replica.
        self.ingress_in_flight = Gauge(
            "tokenmill_serve_ingress_requests_in_flight",
            "Requests this ingress replica holds (key check to last byte); at most "
            "http.max_concurrent_requests.",
            registry=r,
        )
        self.tokenizing = Gauge(
            "tokenmill_serve_tokenizing_requests",
            "Requests waiting for or in the tokenizer thread; at most "
            "http.max_tokenizing_requests.",
            registry=r,
        )
        self.usage_pending = Gauge(
            "tokenmill_serve_usage_records_pending",
            "Usage records buffered, not yet written to the usage log.",
            registry=r,
        )
        self.usage_dropped = Counter(
            "tokenmill_serve_usage_records_dropped",
            "Usage records dropped because the usage log buffer was full.",
            registry=r,
        )
        self.usage_write_errors = Counter(
            "tokenmill_serve_usage_log_write_errors",
            "Failed writes to the usage log (the records are kept for the next try).",
            registry=r,
        )

    def observe_engine(self, model: str, stats: EngineStats) -> None:
        self.engine_running.labels(model).set(stats.num_running)
        self.engine_waiting.labels(model).set(stats.num_waiting)
        self.engine_kv_used.labels(model).set(stats.kv_blocks_used)
        self.engine_steps.labels(model).set(stats.num_steps)
        self.engine_spec_proposed.labels(model).set(stats.spec_proposed_tokens)
        self.engine_spec_accepted.labels(model).set(stats.spec_accepted_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
