"""What every OpenAI route of the ingress shares: who the caller is, what it may hold, which
engine serves a model, and the books a request leaves behind.

    authenticate ─► enter (an ingress slot + the key's admission) ─► read the body
      ─► served model (404 for one the key may not use) ─► engine info ─► prepare (tokenize)
      ─► the route's own work (pipeline.serve.routes) ─► usage, metrics, the key's charge

One Gateway per ingress replica, built by pipeline.serve.app.OpenAIIngress; the route modules
are functions of it. The ingress does everything that can reject a request before it takes an
engine slot: key check (401), its own slots (429 ingress_full), the key's limits (429 with
Retry-After from the key's budget), body size (413), JSON and parameter validation (400),
model lookup and the key's allowed models (404), prompt length from its bytes (400), the
tokenizer queue (429 tokenizer_busy), token caps (400) and the key's tokens per minute (429).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from ray import serve
from ray.serve.handle import DeploymentHandle

from engines.api import FORMAT_ERROR_PREFIX, EngineInfo, EngineStats, GenerationResult
from engines.lora.peft import UNKNOWN_ADAPTER
from pipeline.openai.errors import ApiError
from pipeline.openai.responses import Endpoint, Usage
from pipeline.serve.access.auth import KeyDigests
from pipeline.serve.access.keys import ApiKey, KeyFileWatcher
from pipeline.serve.access.limits import (
    Admission,
    Gate,
    LimitExceeded,
    RequestLease,
    retry_after_header,
)
from pipeline.serve.access.shared_limits import admission_for
from pipeline.serve.http.httpio import read_body
from pipeline.serve.metrics import ServeMetrics
from pipeline.serve.protocol.requests import (
    Prepared,
    check_prompt_bytes,
    has_image_parts,
    parse_request,
    read_images,
    to_engine_request,
    usage_of_all,
)
from pipeline.serve.protocol.tokens import PromptTokenizer
from pipeline.serve.replicas.board import open_board
from pipeline.serve.spec import ServedModelSpec, ServeSpec
from pipeline.serve.usage import CLIENT_CLOSED, UsageAccounting, UsageLog, sink_for

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-tokenmill-replica"  # which engine replica served a response
# Threads per ingress replica reading requests' images: fetches wait on remote hosts, and the
# image processor (numpy, Pillow) releases the GIL for most of its work.
IMAGE_THREADS = 4


def replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # built outside Serve
        return "local"


def app_name(default: str) -> str:
    """The Serve application this ingress belongs to (the name it was deployed under)."""
    try:
        return serve.get_replica_context().replica_id.deployment_id.app_name
    except Exception:  # built outside Serve
        return default


@dataclass
class Held:
    """What one request holds in this ingress: a request slot and its key's lease. Released
    exactly once, by whoever finishes the response (a stream's body or its Response)."""

    gate: Gate
    slot: bool = False
    lease: RequestLease | None = None

    def close(self) -> None:
        if self.lease is not None:
            self.lease.release()
        if self.slot:
            self.slot = False
            self.gate.give()


@dataclass
class Call:
    """A prepared request on its way to an engine, with what its accounting needs."""

    prepared: Prepared
    key: ApiKey
    held: Held
    started: float
    accounted: bool = field(default=False)  # its usage record is made
    ended: bool = field(default=False)  # a stream's end-of-response bookkeeping is done


def result_error(name: str, result: GenerationResult | None) -> ApiError | None:
    """The error a finished engine result stands for; None when it is an answer.

    "cancelled" here never means this client went away: then Serve cancels the ingress call
    and no result is read. It means the engine stopped the request (shutdown during a
    rollout, a replica being replaced), so the client gets 503 and may retry, rather than a
    truncated text passed off as finish_reason "stop".
    """
    if result is None:
        return ApiError(
            500,
            "generation failed: stream ended without result",
            type="server_error",
            code="engine_error",
        )
    if result.finish_reason == "cancelled":
        return ApiError(
            503,
            f"model '{name}' stopped this request before it finished (its replica is shutting "
            "down or restarting); retry shortly",
            type="server_error",
            code="engine_unavailable",
        )
    if not result.ok and (result.error or "").startswith(FORMAT_ERROR_PREFIX):
        # The engine could not compile the request's format (a schema feature or regex it
        # does not support): the request's fault, not the server's.
        return ApiError(400, result.error, param="response_format", code="invalid_value")
    if not result.ok and (result.error or "").startswith(UNKNOWN_ADAPTER):
        # A name routed to a model's adapter prefix that holds no such adapter: as OpenAI
        # answers a model it does not have.
        return ApiError(404, result.error, param="model", code="model_not_found")
    if not result.ok:
        return ApiError(
            500, f"generation failed: {result.error}", type="server_error", code="engine_error"
        )
    return None


class Gateway:
    """One ingress replica's shared state and the steps every route takes (module docstring).
    `engines` maps a served model to its engine replicas' handle (or the one-hop local one)."""

    def __init__(self, spec: ServeSpec, engines: dict[str, Any], keys: KeyDigests) -> None:
        self.spec = spec
        self.engines: dict[str, DeploymentHandle] = engines
        self.tokenizers = {
            m.name: PromptTokenizer(m.model, m.prompt, spec.storage, m.engine.kind)
            for m in spec.models
        }
        # One shared fetch per model: concurrent first requests must not each send an info
        # call, since those calls take engine slots like requests do.
        self._infos: dict[str, asyncio.Future[EngineInfo]] = {}
        self.tokenize_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        # Images are fetched, decoded and processed apart from the tokenizer's one thread: a
        # slow remote host (up to prompt.images.http_timeout_s) must not hold up the requests
        # queued to be tokenized behind it.
        self.image_threads = ThreadPoolExecutor(
            max_workers=IMAGE_THREADS, thread_name_prefix="images"
        )
        self.metrics = ServeMetrics()
        self.created = int(time.time())
        self.app_name = app_name(spec.name)
        self.board = open_board(self.app_name)
        # Named keys: this replica reads (and re-reads) the keys file itself.
        self.key_watcher = KeyFileWatcher(keys, spec.auth.keys_file, spec.auth.reload_interval_s)
        self.key_watcher.start()
        # Per-key limits: this replica's own, or leased from the app's coordinator when the
        # app can run several ingress replicas (pipeline.serve.access.shared_limits).
        self.limiter: Admission = admission_for(spec, self.app_name, replica_id())
        self.slots = Gate(spec.http.max_concurrent_requests)
        self.tokenize_slots = Gate(spec.http.max_tokenizing_requests)
        self.usage = UsageAccounting(self.metrics, self._open_usage_log(spec))

    def _open_usage_log(self, spec: ServeSpec) -> UsageLog | None:
        if spec.usage_log is None:
            return None
        log = UsageLog(
            sink_for(spec.usage_log, spec.storage, replica_id()),
            spec.usage_log.flush_interval_s,
            spec.usage_log.max_pending_records,
            on_write_error=self.metrics.usage_write_errors.inc,
        )
        log.start()
        return log

    def close(self) -> None:
        """Stop polling the keys file and write the usage records still buffered, so a
        rollout loses none."""
        self.key_watcher.stop()
        self.limiter.close()
        if self.usage.log is not None:
            self.usage.log.close()

    # --- who, and what it may hold -------------------------------------------------------

    def authenticate(self, request: Request) -> ApiKey:
        # The ring is read once per request: a reload swaps it whole, never half.
        key = self.key_watcher.ring.identify(request.headers.get("authorization"))
        if key is None:
            raise ApiError(
                401,
                "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )
        return key

    async def enter(self, key: ApiKey) -> Held:
        """An ingress slot and the key's admission (max_concurrent, requests_per_minute) for
        one request, or the 429 that refuses it; the caller closes what it gets."""
        held = Held(self.slots)
        # Refuse, never queue, once this replica holds its maximum: bounded memory.
        if not self.slots.try_take():
            raise self.busy(
                "ingress_full",
                f"this server is handling its maximum of {self.slots.capacity} requests",
            )
        held.slot = True
        try:
            held.lease = await self._admit(key)
        except BaseException:
            held.close()
            raise
        return held

    async def enter_batch_api(self, key: ApiKey) -> Any:
        return (await self.enter(key)).close

    async def _admit(self, key: ApiKey) -> RequestLease:
        try:
            return await self.limiter.acquire(key)
        except LimitExceeded as exc:
            raise self.rate_limited(exc) from None

    def rate_limited(self, exc: LimitExceeded) -> ApiError:
        """429 in OpenAI's shape for a key over its own limit; Retry-After from its budget."""
        self.metrics.key_rate_limited.labels(exc.key, exc.limit).inc()
        seconds = exc.retry_after_s
        retry = retry_after_header(seconds) if seconds is not None else None
        return ApiError(
            429,
            exc.message,
            type="tokens" if exc.limit == "tokens_per_minute" else "requests",
            code="concurrency_limit_exceeded"
            if exc.limit == "max_concurrent"
            else "rate_limit_exceeded",
            headers={"Retry-After": retry or str(self.spec.http.retry_after_s)},
        )

    def busy(self, code: str, what: str) -> ApiError:
        return ApiError.busy(code, what, self.spec.http.retry_after_s)

    def overloaded(self, exc: Exception) -> ApiError:
        retry = self.spec.http.retry_after_s
        return ApiError(
            429,
            f"Every replica's queue is full ({exc}); retry after {retry} s",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(retry)},
        )

    async def read_body(self, request: Request) -> bytes:
        limit = self.spec.http.max_body_bytes
        too_large = ApiError(
            413,
            f"Request body is larger than this server's limit of {limit} bytes; send a shorter "
            "prompt",
            code="request_too_large",
        )
        return await read_body(request, limit, self.spec.http.body_idle_timeout_s, too_large)

    # --- which model, which engine -------------------------------------------------------

    def served(
        self, name: str, param: str | None = "model", key: ApiKey | None = None
    ) -> ServedModelSpec:
        """The served model `name` names (404 for one the key may not use); an adapter's name
        is refused here: the route asking runs base models only (embeddings, ops)."""
        served, adapter = self.route(name, param, key)
        if adapter is not None and adapter not in served.model.adapters:
            # Only routed to a model's adapter prefix: no served model of that name.
            raise ApiError(
                404,
                f"The model '{name}' does not exist; available: {', '.join(self.names)}",
                param=param,
                code="model_not_found",
            )
        if adapter is not None:
            raise ApiError(
                400,
                f"'{name}' is a LoRA adapter of model '{served.name}'; this route runs base "
                f"models only: send model '{served.name}'",
                param=param,
                code="unsupported_model",
            )
        return served

    def route(
        self, name: str, param: str | None = "model", key: ApiKey | None = None
    ) -> tuple[ServedModelSpec, str | None]:
        """The served model and LoRA adapter (None: the model itself) a request's `model`
        names. A key allowed a model may use its adapters; a key may also be allowed one
        adapter alone. One it may not use looks like one that does not exist (404, as OpenAI
        answers for a model a key cannot see): no listing of what other keys get."""
        found = self.spec.route(name)
        if key is not None and key.models is not None:
            allowed = found is not None and (key.allows(name) or key.allows(found[0].name))
            if not allowed:
                available = ", ".join(n for n in self.names if self.may_use(key, n))
                raise ApiError(
                    404,
                    f"The model '{name}' does not exist or this key may not use it; available "
                    f"to this key: {available or 'none'}",
                    param=param,
                    code="model_not_found",
                )
        if found is None:
            raise ApiError(
                404,
                f"The model '{name}' does not exist; available: {', '.join(self.names)}",
                param=param,
                code="model_not_found",
            )
        return found

    @property
    def names(self) -> list[str]:
        """What a request may name, sorted: the served models and their adapters."""
        return sorted(self.spec.served_names())

    def may_use(self, key: ApiKey, name: str) -> bool:
        found = self.spec.route(name)
        return found is not None and (key.allows(name) or key.allows(found[0].name))

    async def engine_stats(self) -> dict[str, EngineStats]:
        try:
            return await asyncio.wait_for(self.board.latest.remote(), timeout=5)
        except Exception:
            # Killed (its app was deleted and redeployed on a shared cluster): open it again;
            # the replicas find it at their next post. This scrape goes without engine gauges.
            logger.warning("the app's board is unreachable; opening it again", exc_info=True)
            self.board = await asyncio.to_thread(open_board, self.app_name)
            return {}

    async def info(self, name: str) -> EngineInfo:
        future = self._infos.get(name)
        if future is None or (future.done() and future.exception() is not None):
            future = asyncio.ensure_future(self._fetch_info(name))
            self._infos[name] = future
        # shield: one cancelled (disconnected) request must not cancel the others' fetch.
        return await asyncio.shield(future)

    async def _fetch_info(self, name: str) -> EngineInfo:
        return await self.engines[name].info.remote()

    async def prepare(
        self, data: dict[str, Any], endpoint: Endpoint, strict: bool, key: ApiKey
    ) -> Prepared:
        request = parse_request(data, endpoint, strict=strict)
        served, adapter = self.route(request.model, key=key)
        info = await self.info(served.name)
        tokenizer = self.tokenizers[served.name]
        # A prompt whose bytes alone prove it too long never reaches the tokenizer.
        check_prompt_bytes(request, served, info, tokenizer.max_bytes_per_token)
        if not self.tokenize_slots.try_take():
            raise self.busy(
                "tokenizer_busy",
                f"{self.tokenize_slots.capacity} requests are already waiting to be tokenized",
            )
        try:
            # Tokenizing a long prompt takes milliseconds: done off the event loop so the
            # streams this ingress is sending meanwhile do not stall, on one thread because a
            # Hugging Face tokenizer must not be used by two threads at once ("Already
            # borrowed").
            loop = asyncio.get_running_loop()
            images = None
            if has_image_parts(request):
                images = await loop.run_in_executor(
                    self.image_threads, read_images, request, tokenizer
                )
            return await loop.run_in_executor(
                self.tokenize_thread,
                to_engine_request,
                request,
                endpoint,
                served,
                tokenizer,
                info,
                adapter,
                images,
            )
        finally:
            self.tokenize_slots.give()

    # --- the books -----------------------------------------------------------------------

    def usage_of(
        self,
        served: ServedModelSpec,
        results: list[GenerationResult],
        seconds: float,
        reasoning_tokens: int = 0,
    ) -> Usage:
        usage = usage_of_all(served, results, seconds, reasoning_tokens)
        result = results[0]
        name = served.name
        self.metrics.prompt_tokens.labels(name).inc(usage.prompt_tokens)
        self.metrics.cached_tokens.labels(name).inc(usage.cached_tokens)
        self.metrics.completion_tokens.labels(name).inc(usage.completion_tokens)
        self.metrics.cost_usd.labels(name).inc(usage.cost_usd)
        if result.metrics is not None and result.metrics.ttft_s is not None:
            self.metrics.ttft.labels(name).observe(result.metrics.ttft_s)
        return usage

    def finish(self, prepared: Prepared, started: float, status: int) -> None:
        name = prepared.served.name
        self.metrics.requests.labels(name, prepared.endpoint, str(status)).inc()
        self.metrics.latency.labels(name, prepared.endpoint).observe(time.monotonic() - started)

    def account(self, call: Call, status: int, usage: Usage | None) -> None:
        """A request that reached an engine ended: settle its key's token charge (to what it
        used; a failure refunds it, an abandoned request keeps it: its use is unknown) and
        record its usage under the key's name."""
        if call.accounted:
            return
        call.accounted = True
        lease = call.held.lease
        if lease is not None:
            if status == CLIENT_CLOSED:
                lease.settle(None)
            else:
                lease.settle(usage.prompt_tokens + usage.completion_tokens if usage else 0)
        prepared = call.prepared
        self.usage.finished(
            key=call.key.name,
            model=prepared.served.name,
            endpoint=prepared.endpoint,
            request_id=prepared.ids.id,
            status=status,
            stream=prepared.stream,
            usage=usage,
            latency_s=time.monotonic() - call.started,
            adapter=prepared.adapter,
        )

    def refunded(self, call: Call, error: ApiError) -> ApiError:
        """A request the engine side refused before running it (queue full): its token charge
        goes back; it is not a usage record."""
        if call.held.lease is not None:
            call.held.lease.settle(0)
        return error

    def failed(self, call: Call, error: ApiError) -> ApiError:
        """An engine failure after dispatch: recorded (status, no usage), charge refunded."""
        self.account(call, error.status, None)
        return error

    def observe_limits(self) -> None:
        m = self.metrics
        m.ingress_in_flight.set(self.slots.in_use)
        m.tokenizing.set(self.tokenize_slots.in_use)
        self.limiter.forget(set(self.key_watcher.ring.names))
        for name, count in self.limiter.in_flight().items():
            m.key_in_flight.labels(name).set(count)
        if self.usage.log is not None:
            m.usage_pending.set(self.usage.log.pending)
