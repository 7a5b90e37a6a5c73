"""/v1/models: the served models a key may use, in OpenAI's shape."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from pipeline.serve.gateway import Gateway


def model_card(gw: Gateway, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": gw.created, "owned_by": "tokenmill"}


def list_models(gw: Gateway, request: Request) -> JSONResponse:
    key = gw.authenticate(request)
    cards = [model_card(gw, n) for n in gw.engines if key.allows(n)]
    return JSONResponse({"object": "list", "data": cards})


def get_model(gw: Gateway, model: str, request: Request) -> JSONResponse:
    key = gw.authenticate(request)
    gw.served(model, param=None, key=key)
    return JSONResponse(model_card(gw, model))
