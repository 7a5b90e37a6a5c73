"""The Serve application: an OpenAI-compatible FastAPI ingress in front of engine replicas.

    client ──HTTP──► Serve proxy ──► OpenAIIngress (auth, limits, parse, tokenize, SSE)
                                         └─ handle ─► EngineReplica[model] × N (one Engine each)

OpenAIIngress only wires: its routes hand each request to a function of pipeline.serve.routes
over the replica's Gateway (pipeline.serve.gateway: who the caller is, what it may hold, the
books). Dispatch goes through Serve handles, so replica choice, autoscaling and queue caps are
Serve's: a full queue raises BackPressureError, answered as 429 with Retry-After. A client
that disconnects makes Serve cancel the ingress call and, through the handle, the replica
call, which aborts the request in the engine. Requests that reach an engine are accounted per
key (pipeline.serve.usage).
"""

# No `from __future__ import annotations` here: FastAPI reads the route signatures at runtime
# (Serve re-creates the methods, and string annotations no longer resolve to Request).
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.openai.errors import ApiError
from pipeline.serve.access.auth import KeyDigests, load_key_digests
from pipeline.serve.access.keys import load_key_file
from pipeline.serve.batch_api import batch_routes
from pipeline.serve.gateway import Gateway
from pipeline.serve.replicas.local import LocalEngine
from pipeline.serve.replicas.replica import EngineReplica
from pipeline.serve.routes import embeddings, generate, models, ops, responses
from pipeline.serve.spec import (
    INGRESS_DEPLOYMENT,
    ServeSpec,
    engine_deployment_options,
    load_serve_spec,
    one_hop_deployment_options,
)

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


@serve.deployment
@serve.ingress(fastapi_app)
class OpenAIIngress:
    def __init__(
        self, spec: ServeSpec, engines: dict[str, DeploymentHandle] | None, keys: KeyDigests
    ) -> None:
        # engines None: http.one_hop, the one model's engine replica lives in this process.
        self._local: EngineReplica | None = None
        if engines is None:
            served = spec.models[0]
            self._local = EngineReplica.func_or_class(served, spec.storage)
            engines = {served.name: LocalEngine(self._local)}
        self._gw = Gateway(spec, engines, keys)
        batch_routes.install(spec, self._gw.authenticate, self._gw.enter_batch_api)

    async def check_health(self) -> None:
        """Serve's health check: with one_hop, the engine's (a dead or stalled step loop gets
        this replica replaced); otherwise the ingress is healthy while it answers."""
        local = getattr(self, "_local", None)
        if local is not None:
            await local.check_health()

    def __del__(self) -> None:
        # Serve's replica teardown hook: the local engine, then the gateway's books, so a
        # rollout loses no usage record.
        local = getattr(self, "_local", None)
        if local is not None:
            local.__del__()
        gateway = getattr(self, "_gw", None)
        if gateway is not None:
            gateway.close()

    # --- routes: each a function of pipeline.serve.routes ---------------------------------

    @fastapi_app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        return await ops.metrics(self._gw, request)

    @fastapi_app.post("/debug/break-engine/{model:path}")
    async def debug_break_engine(
        self, model: str, request: Request, mode: str = "crash"
    ) -> JSONResponse:
        return await ops.debug_break_engine(self._gw, model, request, mode)

    @fastapi_app.get("/v1/models")
    async def list_models(self, request: Request) -> JSONResponse:
        return models.list_models(self._gw, request)

    # `path`: served names may hold slashes (org/model-7b), as Hugging Face ids do.
    @fastapi_app.get("/v1/models/{model:path}")
    async def get_model(self, model: str, request: Request) -> JSONResponse:
        return models.get_model(self._gw, model, request)

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await generate.handle(self._gw, request, "chat")

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await generate.handle(self._gw, request, "completions")

    @fastapi_app.post("/v1/responses")
    async def create_response(self, request: Request) -> Response:
        return await responses.handle(self._gw, request)

    @fastapi_app.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        return await embeddings.embeddings(self._gw, request)


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
