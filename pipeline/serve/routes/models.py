"""/v1/models: the served models a key may use, and their LoRA adapters, in OpenAI's shape."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from pipeline.openai.errors import ApiError
from pipeline.serve.gateway import Gateway


def model_card(gw: Gateway, name: str) -> dict[str, Any]:
    """A served model's card; an adapter's names its served model as `parent` (vLLM's field:
    clients that group fine-tunes under their base read it)."""
    found = gw.spec.route(name)
    card = {"id": name, "object": "model", "created": gw.created, "owned_by": "tokenmill"}
    if found is not None and found[1] is not None:
        card["parent"] = found[0].name
    return card


def list_models(gw: Gateway, request: Request) -> JSONResponse:
    key = gw.authenticate(request)
    cards = [model_card(gw, n) for n in gw.spec.served_names() if gw.may_use(key, n)]
    return JSONResponse({"object": "list", "data": cards})


def get_model(gw: Gateway, model: str, request: Request) -> JSONResponse:
    key = gw.authenticate(request)
    gw.route(model, param=None, key=key)
    if model not in gw.spec.served_names():
        # A name only routed to an adapter prefix: whether it is there is known when a
        # request uses it, so it is not described as if it were.
        raise ApiError(404, f"The model '{model}' is not listed", code="model_not_found")
    return JSONResponse(model_card(gw, model))
