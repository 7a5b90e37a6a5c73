"""The Serve application: an OpenAI-compatible FastAPI ingress in front of engine replicas.

    client ──HTTP──► Serve proxy ──► OpenAIIngress (auth, limits, parse, tokenize, SSE)
                                         └─ handle ─► EngineReplica[model] × N (one Engine each)

The ingress does everything that can reject a request before it takes an engine slot: key
check (401), body size (413), JSON and parameter validation (400), model lookup (404), token
caps (400). Dispatch goes through Serve handles, so replica choice, autoscaling and queue caps
are Serve's: a full queue raises BackPressureError, answered as 429 with Retry-After. A client
that disconnects makes Serve cancel the ingress call and, through the handle, the replica call,
which aborts the request in the engine.
"""

# No `from __future__ import annotations` here: FastAPI reads the route signatures at runtime
# (Serve re-creates the methods, and string annotations no longer resolve to Request).
import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.exceptions import HTTPException as StarletteHTTPException

from engines.api import EngineInfo, EngineStats, GenerationResult
from pipeline.serve.auth import KeyDigests
from pipeline.serve.board import open_board
from pipeline.serve.health import unready_models
from pipeline.serve.metrics import CONTENT_TYPE, ServeMetrics
from pipeline.serve.protocol import (
    SSE_DONE,
    STRICT_HEADER,
    ApiError,
    Endpoint,
    Usage,
    chunk_body,
    completion_body,
    parse_json_body,
    sse,
    strict_mode,
    usage_chunk_body,
)
from pipeline.serve.replica import EngineReplica, ServedDelta, ServedResult
from pipeline.serve.requests import (
    Prepared,
    engine_unavailable,
    finish_reason,
    parse_request,
    to_engine_request,
    usage_of,
)
from pipeline.serve.spec import ServedModelSpec, ServeSpec, engine_deployment_options
from pipeline.serve.testhooks import hooks_enabled
from pipeline.serve.tokens import PromptTokenizer

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-tokenmill-replica"  # which engine replica served a response
READY_CACHE_S = 1.0  # probes more frequent than this share one Serve status call

fastapi_app = FastAPI(title="tokenmill", docs_url=None, redoc_url=None, openapi_url=None)


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
    if not result.ok:
        return ApiError(
            500, f"generation failed: {result.error}", type="server_error", code="engine_error"
        )
    return None


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
        self, spec: ServeSpec, engines: dict[str, DeploymentHandle], keys: KeyDigests
    ) -> None:
        self._spec = spec
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
        self._deployments = {m.name: engine_deployment_options(m)["name"] for m in spec.models}
        self._board = open_board(self._app_name)
        self._ready_lock = asyncio.Lock()
        self._ready_at = -READY_CACHE_S
        self._unready: list[str] | None = None  # None: Serve's status could not be read

    # --- routes --------------------------------------------------------------------------

    @fastapi_app.get("/health")
    async def health(self) -> JSONResponse:
        """Liveness: this ingress answers. Calls no engine (a busy or broken engine is the
        readiness probe's business, and must not get the ingress restarted)."""
        return JSONResponse({"status": "ok", "models": sorted(self._engines)})

    @fastapi_app.get("/ready")
    async def ready(self) -> JSONResponse:
        """Readiness: every model has a replica Serve reports RUNNING (healthy). Reads Serve's
        status, cached for READY_CACHE_S; never an engine call or a request slot."""
        unready = await self._unready_models()
        if unready is None:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        if unready:
            return JSONResponse({"status": "unavailable", "models": unready}, status_code=503)
        return JSONResponse({"status": "ready", "models": sorted(self._engines)})

    @fastapi_app.get("/metrics")
    async def metrics(self) -> Response:
        # Engine stats come from the board the replicas post to: a scrape takes no slot.
        for name, stats in (await self._engine_stats()).items():
            if name in self._engines:
                self._metrics.observe_engine(name, stats)
        return Response(self._metrics.render(), media_type=CONTENT_TYPE)

    @fastapi_app.post("/debug/break-engine/{model:path}")
    async def debug_break_engine(
        self, model: str, request: Request, mode: str = "crash"
    ) -> JSONResponse:
        """Test hook: break one replica's engine step loop. Off (404, like any unknown route)
        unless the server runs with TOKENMILL_TEST_HOOKS=1."""
        if not hooks_enabled():
            raise StarletteHTTPException(404, "Not Found")
        self._authorize(request)
        self._served(model, param=None)
        if mode not in ("crash", "stall"):
            raise ApiError(400, "mode must be crash or stall", param="mode", code="invalid_value")
        replica = await self._engines[model].debug_break_engine.remote(mode)
        return JSONResponse({"model": model, "mode": mode, "replica": replica})

    @fastapi_app.get("/v1/models")
    async def list_models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse(
            {"object": "list", "data": [self._model_card(n) for n in self._engines]}
        )

    # `path`: served names may hold slashes (org/model-7b), as Hugging Face ids do.
    @fastapi_app.get("/v1/models/{model:path}")
    async def get_model(self, model: str, request: Request) -> JSONResponse:
        self._authorize(request)
        self._served(model, param=None)
        return JSONResponse(self._model_card(model))

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "chat")

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completions")

    # --- request handling ----------------------------------------------------------------

    async def _handle(self, request: Request, endpoint: Endpoint) -> Response:
        started = time.monotonic()
        model = "-"
        try:
            self._authorize(request)
            data = parse_json_body(await self._read_body(request))
            # Label metrics with served names only: client-chosen strings would let anyone
            # grow the metric label set without bound.
            if isinstance(data.get("model"), str) and data["model"] in self._engines:
                model = data["model"]
            strict = strict_mode(request.headers.get(STRICT_HEADER), self._spec.http.strict_fields)
            prepared = await self._prepare(data, endpoint, strict)
            if prepared.warnings:
                logger.debug("request %s: %s", prepared.ids.id, "; ".join(prepared.warnings))
            model = prepared.served.name
            if prepared.stream:
                return await self._stream(prepared, started)
            return await self._complete(prepared, started)
        except BackPressureError as exc:
            # Only the engine info fetch gets here; dispatch handles its own backpressure.
            error = self._overloaded(exc)
            self._metrics.errors.labels(error.kind).inc()
            self._metrics.requests.labels(model, endpoint, str(error.status)).inc()
            raise error from None
        except ApiError as exc:
            self._metrics.errors.labels(exc.kind).inc()
            self._metrics.requests.labels(model, endpoint, str(exc.status)).inc()
            raise

    def _authorize(self, request: Request) -> None:
        if not self._keys.accepts(request.headers.get("authorization")):
            raise ApiError(
                401,
                "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )

    async def _read_body(self, request: Request) -> bytes:
        limit = self._spec.http.max_body_bytes
        too_large = ApiError(
            413,
            f"Request body is larger than this server's limit of {limit} bytes; send a shorter "
            "prompt",
            code="request_too_large",
        )
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise too_large
        # Chunked bodies carry no length: count while reading and stop at the limit.
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def _served(self, name: str, param: str | None = "model") -> ServedModelSpec:
        served = self._spec.model_named(name)
        if served is None:
            raise ApiError(
                404,
                f"The model '{name}' does not exist; available: {', '.join(sorted(self._engines))}",
                param=param,
                code="model_not_found",
            )
        return served

    async def _unready_models(self) -> list[str] | None:
        """Models without a running replica; None when Serve's status is unreadable."""
        async with self._ready_lock:
            if time.monotonic() - self._ready_at >= READY_CACHE_S:
                try:
                    # serve.status() blocks on a controller call: off the event loop.
                    status = await asyncio.wait_for(asyncio.to_thread(serve.status), timeout=10)
                    self._unready = unready_models(status, self._app_name, self._deployments)
                except Exception:
                    logger.exception("reading Serve's status for /ready failed")
                    self._unready = None
                self._ready_at = time.monotonic()
            return self._unready

    async def _engine_stats(self) -> dict[str, EngineStats]:
        try:
            return await asyncio.wait_for(self._board.latest.remote(), timeout=5)
        except Exception:
            # The board died with the ingress replica that created it: make a new one; the
            # replicas find it at their next post. This scrape goes without engine gauges.
            logger.warning("engine stats board unreachable; re-creating it", exc_info=True)
            self._board = open_board(self._app_name)
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

    async def _prepare(self, data: dict[str, Any], endpoint: Endpoint, strict: bool) -> Prepared:
        request = parse_request(data, endpoint, strict=strict)
        served = self._served(request.model)
        info = await self._info(served.name)
        # Tokenizing a long prompt takes milliseconds: done off the event loop so the streams
        # this ingress is sending meanwhile do not stall, on one thread because a Hugging Face
        # tokenizer must not be used by two threads at once ("Already borrowed").
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize_thread,
            to_engine_request,
            request,
            endpoint,
            served,
            self._tokenizers[served.name],
            info,
        )

    def _usage(self, served: ServedModelSpec, result: GenerationResult, seconds: float) -> Usage:
        usage = usage_of(served, result, seconds)
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

    def _overloaded(self, exc: Exception) -> ApiError:
        retry = self._spec.http.retry_after_s
        return ApiError(
            429,
            f"Every replica's queue is full ({exc}); retry after {retry} s",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(retry)},
        )

    async def _complete(self, prepared: Prepared, started: float) -> Response:
        name = prepared.served.name
        call = self._engines[name].generate.remote(prepared.engine_request)
        self._metrics.in_flight.labels(name).inc()
        try:
            served: ServedResult = await call
        except BackPressureError as exc:
            raise self._overloaded(exc) from None
        except asyncio.CancelledError:
            # The client disconnected; Serve cancelled this call. Cancel the replica's too.
            call.cancel()
            self._metrics.errors.labels("client_disconnected").inc()
            raise
        except Exception as exc:
            logger.exception("engine call failed for model %s", name)
            raise engine_unavailable(name, exc) from None
        finally:
            self._metrics.in_flight.labels(name).dec()
        result = served.result
        failed = result_error(name, result)
        if failed is not None:
            raise failed
        usage = self._usage(prepared.served, result, served.gpu_seconds)
        body = completion_body(prepared.ids, result.text, finish_reason(result), usage)
        self._finish(prepared, started, 200)
        return JSONResponse(body, headers={REPLICA_HEADER: served.replica, **prepared.headers})

    async def _stream(self, prepared: Prepared, started: float) -> Response:
        name = prepared.served.name
        handle = self._engines[name].options(stream=True)
        deltas = handle.stream.remote(prepared.engine_request)
        self._metrics.in_flight.labels(name).inc()
        try:
            # The admitted marker: once it arrives the request holds a replica slot, so any
            # backpressure has already shown up here, while a 429 is still possible.
            admitted: ServedDelta = await deltas.__anext__()
        except BackPressureError as exc:
            self._metrics.in_flight.labels(name).dec()
            raise self._overloaded(exc) from None
        except asyncio.CancelledError:
            self._metrics.in_flight.labels(name).dec()
            deltas.cancel()
            raise
        except Exception as exc:
            self._metrics.in_flight.labels(name).dec()
            logger.exception("engine stream failed for model %s", name)
            raise engine_unavailable(name, exc) from None
        return StreamingResponse(
            self._events(prepared, deltas, started),
            media_type="text/event-stream",
            headers={
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                REPLICA_HEADER: admitted.replica,
                **prepared.headers,
            },
        )

    async def _events(
        self, prepared: Prepared, deltas: DeploymentResponseGenerator, started: float
    ) -> AsyncIterator[bytes]:
        ids, usage_on = prepared.ids, prepared.include_usage
        name = prepared.served.name
        finished = False
        try:
            if ids.endpoint == "chat":
                yield sse(chunk_body(ids, role=True, include_usage=usage_on))
            async for item in deltas:
                delta = item.delta
                if delta is None:
                    continue
                if delta.text:
                    yield sse(chunk_body(ids, text=delta.text, include_usage=usage_on))
                if not delta.finished:
                    continue
                finished = True
                result = delta.result
                api_error = result_error(name, result)
                if api_error is not None:
                    self._metrics.errors.labels(api_error.kind).inc()
                    yield sse(api_error.body())
                    self._finish(prepared, started, api_error.status)
                    return
                usage = self._usage(prepared.served, result, item.gpu_seconds or 0.0)
                yield sse(
                    chunk_body(ids, finish_reason=finish_reason(result), include_usage=usage_on)
                )
                if usage_on:
                    yield sse(usage_chunk_body(ids, usage))
                yield SSE_DONE
                self._finish(prepared, started, 200)
        except Exception as exc:
            # Headers are gone already: report in-band, as OpenAI does, then end the stream.
            logger.exception("engine stream failed for model %s", name)
            api_error = engine_unavailable(name, exc)
            self._metrics.errors.labels(api_error.kind).inc()
            yield sse(api_error.body())
        finally:
            self._metrics.in_flight.labels(name).dec()
            if not finished:
                # Client gone mid-stream (or a failure): cancel the replica's generator, which
                # closes the engine's stream and frees the request's KV blocks.
                deltas.cancel()
                self._metrics.errors.labels("client_disconnected").inc()


# --- assembly --------------------------------------------------------------------------------


def build_app(spec: ServeSpec, keys: KeyDigests) -> serve.Application:
    """The bound application: one ingress, one engine deployment per served model."""
    engines = {
        m.name: EngineReplica.options(**engine_deployment_options(m)).bind(m, spec.storage)
        for m in spec.models
    }
    ingress = OpenAIIngress.options(
        num_replicas=spec.http.ingress_replicas,
        ray_actor_options={"num_cpus": spec.http.cpus_per_ingress},
        # The ingress only parses and forwards; the engines' queues are where load is capped.
        max_ongoing_requests=10_000,
    )
    return ingress.bind(spec, engines, keys)


def app_builder(args: dict[str, str]) -> serve.Application:
    """Entry for `serve run pipeline.serve.app:app_builder config=SERVE.yaml` and KubeRay's
    RayService serveConfigV2 (import_path + args). Keys come from this process's environment
    or secrets file; `insecure_no_auth=true` in args opts out explicitly."""
    from pipeline.serve.auth import load_key_digests
    from pipeline.serve.spec import load_serve_spec

    spec = load_serve_spec(args["config"])
    insecure = str(args.get("insecure_no_auth", "false")).lower() in ("1", "true", "yes")
    return build_app(spec, load_key_digests(spec.auth, insecure_no_auth=insecure))
