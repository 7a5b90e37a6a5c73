"""The server's own sections: keys (auth), the HTTP listener and its limits, the usage log
and the Batch API."""

from __future__ import annotations

from pydantic import Field

from engines.strict import StrictModel

DEFAULT_API_KEYS_ENV = "TOKENMILL_API_KEYS"


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
