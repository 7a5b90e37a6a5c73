"""/metrics (Prometheus, with a key allowed to read it) and the test hook that breaks an
engine (TOKENMILL_TEST_HOOKS=1 only)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.openai.errors import ApiError
from pipeline.serve.gateway import Gateway
from pipeline.serve.metrics import CONTENT_TYPE
from pipeline.serve.replicas.testhooks import hooks_enabled


async def metrics(gw: Gateway, request: Request) -> Response:
    # Per-key usage is in here: a key allowed to read it, unless the file opens it.
    if not gw.spec.http.metrics_without_key:
        key = gw.authenticate(request)
        if not key.metrics:
            raise ApiError(
                403,
                f"key '{key.name}' may not read /metrics; use a key with metrics: true in "
                "the keys file (or one from the environment)",
                type="permission_error",
                code="permission_denied",
            )
    # Engine stats come from the board the replicas post to: a scrape takes no slot.
    for name, stats in (await gw.engine_stats()).items():
        if name in gw.engines:
            gw.metrics.observe_engine(name, stats)
    gw.observe_limits()
    return Response(gw.metrics.render(), media_type=CONTENT_TYPE)


async def debug_break_engine(gw: Gateway, model: str, request: Request, mode: str) -> JSONResponse:
    """Test hook: break one replica's engine step loop. Off (404, like any unknown route)
    unless the server runs with TOKENMILL_TEST_HOOKS=1."""
    if not hooks_enabled():
        raise StarletteHTTPException(404, "Not Found")
    key = gw.authenticate(request)
    gw.served(model, param=None, key=key)
    if mode not in ("crash", "stall"):
        raise ApiError(400, "mode must be crash or stall", param="mode", code="invalid_value")
    replica = await gw.engines[model].debug_break_engine.remote(mode)
    return JSONResponse({"model": model, "mode": mode, "replica": replica})
