"""The Serve application: an OpenAI-compatible FastAPI ingress in front of engine replicas.

    client ──HTTP──► Serve proxy ──► OpenAIIngress (auth, limits, parse, tokenize, SSE)
                                         └─ handle ─► EngineReplica[model] × N (one Engine each)

The ingress does everything that can reject a request before it takes an engine slot: key
check (401), its own slots (429 ingress_full), the key's limits (429 with Retry-After from the
key's budget), body size (413), JSON and parameter validation (400), model lookup and the key's
allowed models (404), prompt length from its bytes (400), the tokenizer queue (429
tokenizer_busy), token caps (400) and the key's tokens per minute (429). Dispatch goes through
Serve handles, so replica choice, autoscaling and queue caps are Serve's: a full queue raises
BackPressureError, answered as 429 with Retry-After. A client that disconnects makes Serve
cancel the ingress call and, through the handle, the replica call, which aborts the request in
the engine. Requests that reach an engine are accounted per key (pipeline.serve.usage).
"""

# No `from __future__ import annotations` here: FastAPI reads the route signatures at runtime
# (Serve re-creates the methods, and string annotations no longer resolve to Request).
import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.exceptions import HTTPException as StarletteHTTPException

from engines.api import (
    FORMAT_ERROR_PREFIX,
    EmbedParams,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    StreamDelta,
)
from pipeline.openai.embeddings import (
    EmbeddingsError,
    EmbeddingsRequest,
    dimensions_error,
    embeddings_body,
    parse_embeddings_request,
)
from pipeline.openai.errors import ApiError
from pipeline.openai.models import STRICT_HEADER, parse_json_body, strict_mode
from pipeline.openai.reasoning import Delta, ReasoningParser, Split, split_output
from pipeline.openai.responses import (
    Choice,
    Endpoint,
    Usage,
    choices_body,
    chunk_body,
    usage_chunk_body,
)
from pipeline.openai.sse import SSE_DONE, sse
from pipeline.serve.access.auth import KeyDigests, load_key_digests
from pipeline.serve.access.keys import ApiKey, KeyFileWatcher, load_key_file
from pipeline.serve.access.limits import (
    Admission,
    Gate,
    LimitExceeded,
    RequestLease,
    retry_after_header,
)
from pipeline.serve.access.shared_limits import admission_for
from pipeline.serve.batch_api import batch_routes
from pipeline.serve.http.httpio import HeldStreamingResponse, read_body
from pipeline.serve.metrics import CONTENT_TYPE, ServeMetrics
from pipeline.serve.protocol.logprobs import LogprobsBody, join_completion_logprobs
from pipeline.serve.protocol.requests import (
    Prepared,
    check_prompt_bytes,
    engine_unavailable,
    finish_reason,
    parse_request,
    to_engine_request,
    usage_of_all,
)
from pipeline.serve.protocol.tokens import PromptTokenizer
from pipeline.serve.replicas.board import open_board
from pipeline.serve.replicas.local import LocalEngine
from pipeline.serve.replicas.replica import EngineReplica, ServedDelta, ServedResult
from pipeline.serve.replicas.testhooks import hooks_enabled
from pipeline.serve.spec import (
    INGRESS_DEPLOYMENT,
    ServedModelSpec,
    ServeSpec,
    engine_deployment_options,
    load_serve_spec,
    one_hop_deployment_options,
)
from pipeline.serve.usage import CLIENT_CLOSED, UsageAccounting, UsageLog, sink_for

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-tokenmill-replica"  # which engine replica served a response
# Serve's own cap on the ingress sits this far above http.max_concurrent_requests, so /metrics
# and the ingress's own 429s still get in when every request slot is taken.
INGRESS_HEADROOM = 64

fastapi_app = FastAPI(title="tokenmill", docs_url=None, redoc_url=None, openapi_url=None)
fastapi_app.include_router(batch_routes.router)  # /v1/files, /v1/batches (serve file batch_api)


@fastapi_app.exception_handler(ApiError)
async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Unknown routes and wrong methods still answer in OpenAI's error shape.
    error = ApiError(
        exc.status_code,
        f"{request.method} {request.url.path}: {exc.detail}",
        code="not_found" if exc.status_code == 404 else "method_not_allowed",
    )
    return JSONResponse(error.body(), status_code=exc.status_code)


def _embedding_prompts(
    parsed: EmbeddingsRequest,
    served: ServedModelSpec,
    info: EngineInfo,
    tokenizers: dict[str, PromptTokenizer],
) -> list[list[int]]:
    """Each input's token ids (texts tokenized as /v1/completions prompts are), or the 400
    that refuses the request before any engine work."""
    if info.kind != "reference":
        raise ApiError(
            400,
            f"model '{served.name}' runs on engine kind {info.kind}, which does not compute "
            "embeddings; serve it with engine.kind: reference",
            param="model",
            code="unsupported_endpoint",
        )
    tokenizer = tokenizers[served.name]
    prompts = []
    for i, item in enumerate(parsed.inputs):
        ids = tokenizer.completion_ids(item) if isinstance(item, str) else item
        bad = [t for t in ids if t >= tokenizer.vocab_size]
        if bad or not ids:
            what = f"token ids outside the vocabulary: {bad[:5]}" if bad else "no tokens"
            raise ApiError(400, f"'input[{i}]' has {what}", param="input", code="invalid_value")
        if len(ids) > info.max_model_len:
            raise ApiError(
                400,
                f"'input[{i}]' has {len(ids)} tokens; this model embeds at most "
                f"{info.max_model_len} (max_model_len)",
                param="input",
                code="context_length_exceeded",
            )
        prompts.append(ids)
    if parsed.dimensions is not None and info.embedding_size is not None:
        wrong = dimensions_error(parsed.dimensions, info.embedding_size)
        if wrong is not None:
            raise ApiError(400, str(wrong), param="dimensions", code="invalid_value")
    return prompts


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
    if not result.ok:
        return ApiError(
            500, f"generation failed: {result.error}", type="server_error", code="engine_error"
        )
    return None


@dataclass
class _Held:
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
class _Call:
    """A prepared request on its way to an engine, with what its accounting needs."""

    prepared: Prepared
    key: ApiKey
    held: _Held
    started: float
    accounted: bool = field(default=False)  # its usage record is made
    ended: bool = field(default=False)  # a stream's end-of-response bookkeeping is done


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # built outside Serve
        return "local"


def _app_name(default: str) -> str:
    """The Serve application this ingress belongs to (the name it was deployed under)."""
    try:
        return serve.get_replica_context().replica_id.deployment_id.app_name
    except Exception:  # built outside Serve
        return default


@serve.deployment
@serve.ingress(fastapi_app)
class OpenAIIngress:
    def __init__(
        self, spec: ServeSpec, engines: dict[str, DeploymentHandle] | None, keys: KeyDigests
    ) -> None:
        self._spec = spec
        # engines None: http.one_hop, the one model's engine replica lives in this process.
        self._local: EngineReplica | None = None
        if engines is None:
            served = spec.models[0]
            self._local = EngineReplica.func_or_class(served, spec.storage)
            engines = {served.name: LocalEngine(self._local)}
        self._engines = engines
        self._keys = keys
        self._tokenizers = {
            m.name: PromptTokenizer(m.model, m.prompt, spec.storage) for m in spec.models
        }
        # One shared fetch per model: concurrent first requests must not each send an info
        # call, since those calls take engine slots like requests do.
        self._infos: dict[str, asyncio.Future[EngineInfo]] = {}
        self._tokenize_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._metrics = ServeMetrics()
        self._created = int(time.time())
        self._app_name = _app_name(spec.name)
        self._board = open_board(self._app_name)
        # Named keys: this replica reads (and re-reads) the keys file itself.
        self._key_watcher = KeyFileWatcher(keys, spec.auth.keys_file, spec.auth.reload_interval_s)
        self._key_watcher.start()
        # Per-key limits: this replica's own, or leased from the app's coordinator when the
        # app can run several ingress replicas (pipeline.serve.access.shared_limits).
        self._limiter: Admission = admission_for(spec, self._app_name, _replica_id())
        self._slots = Gate(spec.http.max_concurrent_requests)
        self._tokenize_slots = Gate(spec.http.max_tokenizing_requests)
        self._usage = UsageAccounting(self._metrics, self._open_usage_log(spec))
        batch_routes.install(spec, self._authenticate, self._enter_batch_api)

    def _open_usage_log(self, spec: ServeSpec) -> UsageLog | None:
        if spec.usage_log is None:
            return None
        log = UsageLog(
            sink_for(spec.usage_log, spec.storage, _replica_id()),
            spec.usage_log.flush_interval_s,
            spec.usage_log.max_pending_records,
            on_write_error=self._metrics.usage_write_errors.inc,
        )
        log.start()
        return log

    async def check_health(self) -> None:
        """Serve's health check: with one_hop, the engine's (a dead or stalled step loop gets
        this replica replaced); otherwise the ingress is healthy while it answers."""
        local = getattr(self, "_local", None)
        if local is not None:
            await local.check_health()

    def __del__(self) -> None:
        # Serve's replica teardown hook: stop polling the keys file and write the usage
        # records still buffered, so a rollout loses none.
        local = getattr(self, "_local", None)
        if local is not None:
            local.__del__()
        watcher = getattr(self, "_key_watcher", None)
        if watcher is not None:
            watcher.stop()
        limiter = getattr(self, "_limiter", None)
        if limiter is not None:
            limiter.close()
        usage = getattr(self, "_usage", None)
        if usage is not None and usage.log is not None:
            usage.log.close()

    # --- routes --------------------------------------------------------------------------

    @fastapi_app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        # Per-key usage is in here: a key allowed to read it, unless the file opens it.
        if not self._spec.http.metrics_without_key:
            key = self._authenticate(request)
            if not key.metrics:
                raise ApiError(
                    403,
                    f"key '{key.name}' may not read /metrics; use a key with metrics: true in "
                    "the keys file (or one from the environment)",
                    type="permission_error",
                    code="permission_denied",
                )
        # Engine stats come from the board the replicas post to: a scrape takes no slot.
        for name, stats in (await self._engine_stats()).items():
            if name in self._engines:
                self._metrics.observe_engine(name, stats)
        self._observe_limits()
        return Response(self._metrics.render(), media_type=CONTENT_TYPE)

    def _observe_limits(self) -> None:
        m = self._metrics
        m.ingress_in_flight.set(self._slots.in_use)
        m.tokenizing.set(self._tokenize_slots.in_use)
        self._limiter.forget(set(self._key_watcher.ring.names))
        for name, count in self._limiter.in_flight().items():
            m.key_in_flight.labels(name).set(count)
        if self._usage.log is not None:
            m.usage_pending.set(self._usage.log.pending)

    @fastapi_app.post("/debug/break-engine/{model:path}")
    async def debug_break_engine(
        self, model: str, request: Request, mode: str = "crash"
    ) -> JSONResponse:
        """Test hook: break one replica's engine step loop. Off (404, like any unknown route)
        unless the server runs with TOKENMILL_TEST_HOOKS=1."""
        if not hooks_enabled():
            raise StarletteHTTPException(404, "Not Found")
        key = self._authenticate(request)
        self._served(model, param=None, key=key)
        if mode not in ("crash", "stall"):
            raise ApiError(400, "mode must be crash or stall", param="mode", code="invalid_value")
        replica = await self._engines[model].debug_break_engine.remote(mode)
        return JSONResponse({"model": model, "mode": mode, "replica": replica})

    @fastapi_app.get("/v1/models")
    async def list_models(self, request: Request) -> JSONResponse:
        key = self._authenticate(request)
        cards = [self._model_card(n) for n in self._engines if key.allows(n)]
        return JSONResponse({"object": "list", "data": cards})

    # `path`: served names may hold slashes (org/model-7b), as Hugging Face ids do.
    @fastapi_app.get("/v1/models/{model:path}")
    async def get_model(self, model: str, request: Request) -> JSONResponse:
        key = self._authenticate(request)
        self._served(model, param=None, key=key)
        return JSONResponse(self._model_card(model))

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "chat")

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completions")

    @fastapi_app.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        started = time.monotonic()
        model, key, status = "-", None, 500
        held = _Held(self._slots)
        try:
            key = self._authenticate(request)
            held = await self._enter(key)
            data = parse_json_body(await self._read_body(request))
            strict = strict_mode(request.headers.get(STRICT_HEADER), self._spec.http.strict_fields)
            try:
                parsed = parse_embeddings_request(data, strict=strict)
            except EmbeddingsError as exc:
                raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
            served = self._served(parsed.model, key=key)
            model = served.name
            info = await self._info(served.name)
            prompts = await asyncio.get_running_loop().run_in_executor(
                self._tokenize_thread, _embedding_prompts, parsed, served, info, self._tokenizers
            )
            num_tokens = sum(len(p) for p in prompts)
            try:
                await held.lease.charge(num_tokens)
            except LimitExceeded as exc:
                held.lease = None  # charge gave it back
                raise self._rate_limited(exc) from None
            body, usage, replica = await self._embed(served, parsed, prompts)
            status = 200
            if held.lease is not None:
                held.lease.settle(usage.prompt_tokens)
            self._usage.finished(
                key=key.name,
                model=model,
                endpoint="embeddings",
                request_id=f"embd-{uuid.uuid4().hex}",
                status=200,
                stream=False,
                usage=usage,
                latency_s=time.monotonic() - started,
            )
            self._metrics.requests.labels(model, "embeddings", "200").inc()
            self._metrics.latency.labels(model, "embeddings").observe(time.monotonic() - started)
            return JSONResponse(body, headers={REPLICA_HEADER: replica})
        except BackPressureError as exc:
            error = self._overloaded(exc)
            if held.lease is not None:
                held.lease.settle(0)
            self._metrics.errors.labels(error.kind).inc()
            self._metrics.requests.labels(model, "embeddings", str(error.status)).inc()
            raise error from None
        except ApiError as exc:
            status = exc.status
            self._metrics.errors.labels(exc.kind).inc()
            self._metrics.requests.labels(model, "embeddings", str(exc.status)).inc()
            raise
        finally:
            if status != 200:
                if held.lease is not None:
                    held.lease.settle(0)  # refused or failed: the charge goes back
                if key is not None:
                    self._usage.refused(key.name, model, status)
            held.close()

    async def _embed(
        self,
        served: ServedModelSpec,
        parsed: EmbeddingsRequest,
        prompts: list[list[int]],
    ) -> tuple[dict[str, Any], Usage, str]:
        """Every input on the model's replicas at once; the body, usage and a replica."""
        handle = self._engines[served.name]
        pending = [
            handle.generate.remote(GenerationRequest(p, embed=EmbedParams())) for p in prompts
        ]
        try:
            answers: list[ServedResult] = list(await asyncio.gather(*pending))
        except asyncio.CancelledError:
            for p in pending:
                p.cancel()
            raise
        except BackPressureError:
            raise
        except Exception as exc:
            logger.exception("engine call failed for model %s", served.name)
            raise engine_unavailable(served.name, exc) from None
        for answer in answers:
            failed = result_error(served.name, answer.result)
            if failed is not None:
                raise failed
        vectors = [a.result.embedding or [] for a in answers]
        wrong_size = dimensions_error(parsed.dimensions, len(vectors[0]))
        if wrong_size is not None:
            raise ApiError(400, str(wrong_size), param="dimensions", code="invalid_value")
        seconds = sum(a.gpu_seconds for a in answers)
        prompt_tokens = sum(a.result.prompt_tokens for a in answers)
        usage = self._usage_of(
            served, [dataclasses.replace(answers[0].result, prompt_tokens=prompt_tokens)], seconds
        )
        body = embeddings_body(served.name, vectors, parsed.encoding_format, prompt_tokens)
        return body, usage, answers[0].replica

    # --- request handling ----------------------------------------------------------------

    async def _handle(self, request: Request, endpoint: Endpoint) -> Response:
        started = time.monotonic()
        model = "-"
        key: ApiKey | None = None
        call: _Call | None = None
        held = _Held(self._slots)
        handed_off = False  # a stream's response releases `held` once it is sent
        try:
            key = self._authenticate(request)
            held = await self._enter(key)
            data = parse_json_body(await self._read_body(request))
            # Label metrics with served names only: client-chosen strings would let anyone
            # grow the metric label set without bound.
            if isinstance(data.get("model"), str) and data["model"] in self._engines:
                model = data["model"]
            strict = strict_mode(request.headers.get(STRICT_HEADER), self._spec.http.strict_fields)
            prepared = await self._prepare(data, endpoint, strict, key)
            if prepared.warnings:
                logger.debug("request %s: %s", prepared.ids.id, "; ".join(prepared.warnings))
            model = prepared.served.name
            engine_request = prepared.engine_request
            try:
                # The most the request can use; settled to what it did use when it ends.
                await held.lease.charge(
                    len(engine_request.prompt_token_ids)
                    + prepared.n * engine_request.sampling.max_tokens
                )
            except LimitExceeded as exc:
                held.lease = None  # charge gave it back
                raise self._rate_limited(exc) from None
            call = _Call(prepared, key, held, started)
            if prepared.stream:
                response = await self._stream(call)
                handed_off = True
                return response
            return await self._complete(call)
        except BackPressureError as exc:
            # Only the engine info fetch gets here; dispatch handles its own backpressure.
            error = self._overloaded(exc)
            self._metrics.errors.labels(error.kind).inc()
            self._metrics.requests.labels(model, endpoint, str(error.status)).inc()
            if key is not None:
                self._usage.refused(key.name, model, error.status)
            raise error from None
        except ApiError as exc:
            self._metrics.errors.labels(exc.kind).inc()
            self._metrics.requests.labels(model, endpoint, str(exc.status)).inc()
            if key is not None and (call is None or not call.accounted):
                self._usage.refused(key.name, model, exc.status)
            raise
        finally:
            if not handed_off:
                held.close()

    def _authenticate(self, request: Request) -> ApiKey:
        # The ring is read once per request: a reload swaps it whole, never half.
        key = self._key_watcher.ring.identify(request.headers.get("authorization"))
        if key is None:
            raise ApiError(
                401,
                "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )
        return key

    async def _enter(self, key: ApiKey) -> _Held:
        """An ingress slot and the key's admission (max_concurrent, requests_per_minute) for
        one request, or the 429 that refuses it; the caller closes what it gets."""
        held = _Held(self._slots)
        # Refuse, never queue, once this replica holds its maximum: bounded memory.
        if not self._slots.try_take():
            raise self._busy(
                "ingress_full",
                f"this server is handling its maximum of {self._slots.capacity} requests",
            )
        held.slot = True
        try:
            held.lease = await self._admit(key)
        except BaseException:
            held.close()
            raise
        return held

    async def _enter_batch_api(self, key: ApiKey) -> Callable[[], None]:
        return (await self._enter(key)).close

    async def _admit(self, key: ApiKey) -> RequestLease:
        try:
            return await self._limiter.acquire(key)
        except LimitExceeded as exc:
            raise self._rate_limited(exc) from None

    def _rate_limited(self, exc: LimitExceeded) -> ApiError:
        """429 in OpenAI's shape for a key over its own limit; Retry-After from its budget."""
        self._metrics.key_rate_limited.labels(exc.key, exc.limit).inc()
        seconds = exc.retry_after_s
        retry = retry_after_header(seconds) if seconds is not None else None
        return ApiError(
            429,
            exc.message,
            type="tokens" if exc.limit == "tokens_per_minute" else "requests",
            code="concurrency_limit_exceeded"
            if exc.limit == "max_concurrent"
            else "rate_limit_exceeded",
            headers={"Retry-After": retry or str(self._spec.http.retry_after_s)},
        )

    def _busy(self, code: str, what: str) -> ApiError:
        return ApiError.busy(code, what, self._spec.http.retry_after_s)

    async def _read_body(self, request: Request) -> bytes:
        limit = self._spec.http.max_body_bytes
        too_large = ApiError(
            413,
            f"Request body is larger than this server's limit of {limit} bytes; send a shorter "
            "prompt",
            code="request_too_large",
        )
        return await read_body(request, limit, self._spec.http.body_idle_timeout_s, too_large)

    def _served(
        self, name: str, param: str | None = "model", key: ApiKey | None = None
    ) -> ServedModelSpec:
        served = self._spec.model_named(name)
        # A model the key may not use looks like one that does not exist (404, as OpenAI
        # answers for a model a key cannot see): no listing of what other keys get.
        if key is not None and key.models is not None and (served is None or not key.allows(name)):
            available = ", ".join(n for n in sorted(self._engines) if key.allows(n))
            raise ApiError(
                404,
                f"The model '{name}' does not exist or this key may not use it; available to "
                f"this key: {available or 'none'}",
                param=param,
                code="model_not_found",
            )
        if served is None:
            raise ApiError(
                404,
                f"The model '{name}' does not exist; available: {', '.join(sorted(self._engines))}",
                param=param,
                code="model_not_found",
            )
        return served

    async def _engine_stats(self) -> dict[str, EngineStats]:
        try:
            return await asyncio.wait_for(self._board.latest.remote(), timeout=5)
        except Exception:
            # Killed (its app was deleted and redeployed on a shared cluster): open it again;
            # the replicas find it at their next post. This scrape goes without engine gauges.
            logger.warning("the app's board is unreachable; opening it again", exc_info=True)
            self._board = await asyncio.to_thread(open_board, self._app_name)
            return {}

    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self._created, "owned_by": "tokenmill"}

    async def _info(self, name: str) -> EngineInfo:
        future = self._infos.get(name)
        if future is None or (future.done() and future.exception() is not None):
            future = asyncio.ensure_future(self._fetch_info(name))
            self._infos[name] = future
        # shield: one cancelled (disconnected) request must not cancel the others' fetch.
        return await asyncio.shield(future)

    async def _fetch_info(self, name: str) -> EngineInfo:
        return await self._engines[name].info.remote()

    async def _prepare(
        self, data: dict[str, Any], endpoint: Endpoint, strict: bool, key: ApiKey
    ) -> Prepared:
        request = parse_request(data, endpoint, strict=strict)
        served = self._served(request.model, key=key)
        info = await self._info(served.name)
        tokenizer = self._tokenizers[served.name]
        # A prompt whose bytes alone prove it too long never reaches the tokenizer.
        check_prompt_bytes(request, served, info, tokenizer.max_bytes_per_token)
        if not self._tokenize_slots.try_take():
            raise self._busy(
                "tokenizer_busy",
                f"{self._tokenize_slots.capacity} requests are already waiting to be tokenized",
            )
        try:
            # Tokenizing a long prompt takes milliseconds: done off the event loop so the
            # streams this ingress is sending meanwhile do not stall, on one thread because a
            # Hugging Face tokenizer must not be used by two threads at once ("Already
            # borrowed").
            return await asyncio.get_running_loop().run_in_executor(
                self._tokenize_thread,
                to_engine_request,
                request,
                endpoint,
                served,
                tokenizer,
                info,
            )
        finally:
            self._tokenize_slots.give()

    def _usage_of(
        self,
        served: ServedModelSpec,
        results: list[GenerationResult],
        seconds: float,
        reasoning_tokens: int = 0,
    ) -> Usage:
        usage = usage_of_all(served, results, seconds, reasoning_tokens)
        result = results[0]
        name = served.name
        self._metrics.prompt_tokens.labels(name).inc(usage.prompt_tokens)
        self._metrics.cached_tokens.labels(name).inc(usage.cached_tokens)
        self._metrics.completion_tokens.labels(name).inc(usage.completion_tokens)
        self._metrics.cost_usd.labels(name).inc(usage.cost_usd)
        if result.metrics is not None and result.metrics.ttft_s is not None:
            self._metrics.ttft.labels(name).observe(result.metrics.ttft_s)
        return usage

    def _finish(self, prepared: Prepared, started: float, status: int) -> None:
        name = prepared.served.name
        self._metrics.requests.labels(name, prepared.endpoint, str(status)).inc()
        self._metrics.latency.labels(name, prepared.endpoint).observe(time.monotonic() - started)

    def _account(self, call: _Call, status: int, usage: Usage | None) -> None:
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
        self._usage.finished(
            key=call.key.name,
            model=prepared.served.name,
            endpoint=prepared.endpoint,
            request_id=prepared.ids.id,
            status=status,
            stream=prepared.stream,
            usage=usage,
            latency_s=time.monotonic() - call.started,
        )

    def _overloaded(self, exc: Exception) -> ApiError:
        retry = self._spec.http.retry_after_s
        return ApiError(
            429,
            f"Every replica's queue is full ({exc}); retry after {retry} s",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(retry)},
        )

    def _refunded(self, call: _Call, error: ApiError) -> ApiError:
        """A request the engine side refused before running it (queue full): its token charge
        goes back; it is not a usage record."""
        if call.held.lease is not None:
            call.held.lease.settle(0)
        return error

    def _failed(self, call: _Call, error: ApiError) -> ApiError:
        """An engine failure after dispatch: recorded (status, no usage), charge refunded."""
        self._account(call, error.status, None)
        return error

    async def _complete(self, call: _Call) -> Response:
        prepared, started = call.prepared, call.started
        name = prepared.served.name
        handle, n = self._engines[name], prepared.n
        if n == 1:
            pending = handle.generate.remote(prepared.engine_request)
        else:
            pending = handle.generate_n.remote(prepared.engine_request, n)
        self._metrics.in_flight.labels(name).inc()
        try:
            answer: ServedResult | list[ServedResult] = await pending
        except BackPressureError as exc:
            raise self._refunded(call, self._overloaded(exc)) from None
        except asyncio.CancelledError:
            # The client disconnected; Serve cancelled this call. Cancel the replica's too.
            pending.cancel()
            self._metrics.errors.labels("client_disconnected").inc()
            self._account(call, CLIENT_CLOSED, None)
            raise
        except Exception as exc:
            logger.exception("engine call failed for model %s", name)
            raise self._failed(call, engine_unavailable(name, exc)) from None
        finally:
            self._metrics.in_flight.labels(name).dec()
        served = answer if isinstance(answer, list) else [answer]
        results = [s.result for s in served]
        for result in results:
            # One failed choice fails the request, as a single failed answer would.
            failed = result_error(name, result)
            if failed is not None:
                raise self._failed(call, failed)
        prompt_ids = prepared.engine_request.prompt_token_ids
        splits = [self._split(prepared, prompt_ids, result) for result in results]
        usage = self._usage_of(
            prepared.served,
            results,
            sum(s.gpu_seconds for s in served),
            sum(s.reasoning_tokens for s in splits if s is not None),
        )
        choices = []
        for result, split in zip(results, splits, strict=True):
            logprobs = None
            if result.logprobs is not None:
                builder = self._logprobs(prepared)
                head = None
                if prepared.echo is not None:  # the prompt's tokens come first
                    head = builder.prompt_body(prompt_ids, result.prompt_logprobs)
                logprobs = builder.body(result.logprobs, result)
                if head is not None:
                    logprobs = join_completion_logprobs(head, logprobs)
            text = result.text if prepared.echo is None else prepared.echo + result.text
            reasoning = None
            if split is not None:
                text, reasoning = split.text, split.reasoning
            choices.append(Choice(text, finish_reason(result), logprobs, reasoning))
        body = choices_body(prepared.ids, choices, usage)
        self._finish(prepared, started, 200)
        self._account(call, 200, usage)
        return JSONResponse(body, headers={REPLICA_HEADER: served[0].replica, **prepared.headers})

    async def _stream(self, call: _Call) -> Response:
        prepared = call.prepared
        name = prepared.served.name
        handle = self._engines[name].options(stream=True)
        if prepared.n == 1:
            deltas = handle.stream.remote(prepared.engine_request)
        else:
            deltas = handle.stream_n.remote(prepared.engine_request, prepared.n)
        self._metrics.in_flight.labels(name).inc()
        try:
            # The admitted marker: once it arrives the request holds a replica slot, so any
            # backpressure has already shown up here, while a 429 is still possible.
            admitted: ServedDelta = await deltas.__anext__()
        except BackPressureError as exc:
            self._metrics.in_flight.labels(name).dec()
            raise self._refunded(call, self._overloaded(exc)) from None
        except asyncio.CancelledError:
            self._metrics.in_flight.labels(name).dec()
            deltas.cancel()
            self._account(call, CLIENT_CLOSED, None)
            raise
        except Exception as exc:
            self._metrics.in_flight.labels(name).dec()
            logger.exception("engine stream failed for model %s", name)
            raise self._failed(call, engine_unavailable(name, exc)) from None
        return HeldStreamingResponse(
            self._events(call, deltas),
            media_type="text/event-stream",
            headers={
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                REPLICA_HEADER: admitted.replica,
                **prepared.headers,
            },
            # Also when the body never ran or was left suspended (the client went away
            # before it began, or while a chunk was being sent): its `finally` may run late.
            on_close=lambda: self._end_stream(call, deltas, finished=call.accounted),
        )

    def _end_stream(
        self, call: _Call, deltas: DeploymentResponseGenerator, *, finished: bool
    ) -> None:
        """A stream's response is over (once, whichever of its body and its Response gets
        here first). Unfinished: the client went away, so the replica's generator is cancelled,
        which closes the engine's stream and frees the request's KV blocks."""
        if call.ended:
            return
        call.ended = True
        self._metrics.in_flight.labels(call.prepared.served.name).dec()
        if not finished:
            deltas.cancel()
            self._metrics.errors.labels("client_disconnected").inc()
            self._account(call, CLIENT_CLOSED, None)
        call.held.close()

    def _reasoning(self, prepared: Prepared) -> ReasoningParser | None:
        """The model's reasoning parser, for requests whose answers are split (chat)."""
        if not prepared.split_reasoning:
            return None
        return self._tokenizers[prepared.served.name].reasoning

    def _split(
        self, prepared: Prepared, prompt_ids: list[int], result: GenerationResult
    ) -> Split | None:
        parser = self._reasoning(prepared)
        if parser is None:
            return None
        return split_output(parser, prompt_ids, result.output_token_ids, result.text)

    def _logprobs(self, prepared: Prepared) -> LogprobsBody:
        return LogprobsBody(
            prepared.ids.endpoint, self._tokenizers[prepared.served.name].token_text
        )

    def _echo_chunk(
        self,
        prepared: Prepared,
        delta: StreamDelta,
        logprobs: list[LogprobsBody] | None,
        index: int,
    ) -> dict:
        entries = None
        if logprobs is not None:
            prompt_logprobs = delta.prompt_logprobs
            if prompt_logprobs is None and delta.result is not None:
                prompt_logprobs = delta.result.prompt_logprobs
            entries = logprobs[index].prompt_body(
                prepared.engine_request.prompt_token_ids, prompt_logprobs
            )
        return chunk_body(
            prepared.ids,
            text=prepared.echo,
            include_usage=prepared.include_usage,
            logprobs=entries,
            index=index,
        )

    async def _events(
        self, call: _Call, deltas: DeploymentResponseGenerator
    ) -> AsyncIterator[bytes]:
        prepared, started = call.prepared, call.started
        ids, usage_on = prepared.ids, prepared.include_usage
        name = prepared.served.name
        n = prepared.n
        finished = False
        # One per choice: a completion's logprobs carry text offsets that run per choice.
        logprobs = None
        if prepared.engine_request.sampling.logprobs is not None:
            logprobs = [self._logprobs(prepared) for _ in range(n)]
        results: dict[int, GenerationResult] = {}
        seconds = 0.0
        # Chat on a reasoning model: one split stream per choice; each delta's text goes to
        # `reasoning_content` or `content` (held back where a marker may be starting).
        parser = self._reasoning(prepared)
        prompt_ids = prepared.engine_request.prompt_token_ids
        splits = [parser.stream(prompt_ids) for _ in range(n)] if parser is not None else None
        reasoning_tokens = 0
        echo_pending = set(range(n)) if prepared.echo is not None else set()
        try:
            if ids.endpoint == "chat":
                for index in range(n):
                    yield sse(chunk_body(ids, role=True, include_usage=usage_on, index=index))
            async for item in deltas:
                delta, index = item.delta, item.index
                if delta is None:
                    continue
                if index in echo_pending:
                    # Completions with echo: the prompt opens the choice (with its tokens'
                    # logprobs, which the engine sends with the first delta).
                    echo_pending.discard(index)
                    yield sse(self._echo_chunk(prepared, delta, logprobs, index))
                entries = None
                if logprobs is not None and delta.logprobs:
                    entries = logprobs[index].body(delta.logprobs, delta.result)
                text, reasoning = delta.text, ""
                if splits is not None:
                    part = splits[index].feed(delta.token_ids, delta.text)
                    if delta.finished:  # the end decides what was held back
                        rest = splits[index].close()
                        part = Delta(part.reasoning + rest.reasoning, part.text + rest.text)
                    text, reasoning = part.text, part.reasoning
                if (
                    text
                    or reasoning
                    or (entries and (entries.get("content") or entries.get("tokens")))
                ):
                    yield sse(
                        chunk_body(
                            ids,
                            text=text,
                            include_usage=usage_on,
                            logprobs=entries,
                            index=index,
                            reasoning=reasoning or None,
                        )
                    )
                if not delta.finished:
                    continue
                result = delta.result
                api_error = result_error(name, result)
                if api_error is not None:
                    finished = True
                    if n > 1:
                        deltas.cancel()  # the other choices are of no use now
                    self._metrics.errors.labels(api_error.kind).inc()
                    self._failed(call, api_error)
                    yield sse(api_error.body())
                    self._finish(prepared, started, api_error.status)
                    return
                results[index] = result
                seconds += item.gpu_seconds or 0.0
                if splits is not None:
                    reasoning_tokens += (
                        splits[index].result(result.output_token_ids).reasoning_tokens
                    )
                end = chunk_body(
                    ids, finish_reason=finish_reason(result), include_usage=usage_on, index=index
                )
                if len(results) < n:
                    yield sse(end)
                    continue
                finished = True
                usage = self._usage_of(
                    prepared.served, [results[i] for i in range(n)], seconds, reasoning_tokens
                )
                # Accounted before the last bytes go: a client that leaves after seeing its
                # finish chunk still got (and is billed for) the whole answer.
                self._account(call, 200, usage)
                yield sse(end)
                if usage_on:
                    yield sse(usage_chunk_body(ids, usage))
                yield SSE_DONE
                self._finish(prepared, started, 200)
        except Exception as exc:
            # Headers are gone already: report in-band, as OpenAI does, then end the stream.
            logger.exception("engine stream failed for model %s", name)
            api_error = engine_unavailable(name, exc)
            self._metrics.errors.labels(api_error.kind).inc()
            self._failed(call, api_error)
            yield sse(api_error.body())
        finally:
            # Client gone mid-stream (or a failure): not finished.
            self._end_stream(call, deltas, finished=finished)


# --- assembly --------------------------------------------------------------------------------


def build_app(spec: ServeSpec, keys: KeyDigests) -> serve.Application:
    """The bound application: one ingress, one engine deployment per served model; with
    http.one_hop, one deployment that is both."""
    # The ingress refuses requests beyond http.max_concurrent_requests itself (429 in OpenAI's
    # shape); Serve's cap sits above it so /metrics and those refusals still get in. The proxy's
    # queue of requests not yet assigned to an ingress replica is bounded too: a burst larger
    # than it gets Serve's own 429 (plain-text body) with Retry-After.
    bounds = {
        "max_ongoing_requests": spec.http.max_concurrent_requests + INGRESS_HEADROOM,
        "max_queued_requests": spec.http.max_concurrent_requests,
        "backpressure_config": {"status_code": 429, "retry_after_s": spec.http.retry_after_s},
    }
    if spec.one_hop:
        # The engine's own bounds give way to the ingress's: its gate holds the requests.
        options = {**one_hop_deployment_options(spec), **bounds}
        return OpenAIIngress.options(name=INGRESS_DEPLOYMENT, **options).bind(spec, None, keys)
    engines = {
        m.name: EngineReplica.options(**engine_deployment_options(m)).bind(m, spec.storage)
        for m in spec.models
    }
    ingress = OpenAIIngress.options(
        name=INGRESS_DEPLOYMENT,
        num_replicas=spec.http.ingress_replicas,
        ray_actor_options={"num_cpus": spec.http.cpus_per_ingress},
        **bounds,
    )
    return ingress.bind(spec, engines, keys)


def app_builder(args: dict[str, str]) -> serve.Application:
    """Entry for `serve run pipeline.serve.app:app_builder config=SERVE.yaml` and KubeRay's
    RayService serveConfigV2 (import_path + args). Keys come from this process's environment
    or secrets file; `insecure_no_auth=true` in args opts out explicitly."""

    spec = load_serve_spec(args["config"])
    insecure = str(args.get("insecure_no_auth", "false")).lower() in ("1", "true", "yes")
    keys = load_key_digests(spec.auth, insecure_no_auth=insecure)
    if spec.auth.keys_file:
        load_key_file(spec.auth.keys_file)  # fail here, not in every ingress replica
    return build_app(spec, keys)
