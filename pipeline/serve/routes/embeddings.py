"""/v1/embeddings: each input a prompt-only engine request, all of them on the model's
replicas at once, pooled vectors back in OpenAI's shape."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from ray.serve.exceptions import BackPressureError

from engines.api import EmbedParams, EngineInfo, GenerationRequest
from pipeline.openai.embeddings import (
    EmbeddingsError,
    EmbeddingsRequest,
    dimensions_error,
    embeddings_body,
    parse_embeddings_request,
)
from pipeline.openai.errors import ApiError
from pipeline.openai.models import STRICT_HEADER, parse_json_body, strict_mode
from pipeline.openai.responses import Usage
from pipeline.serve.access.keys import ApiKey
from pipeline.serve.access.limits import LimitExceeded
from pipeline.serve.gateway import REPLICA_HEADER, Gateway, Held, result_error
from pipeline.serve.protocol.requests import engine_unavailable
from pipeline.serve.protocol.tokens import PromptTokenizer
from pipeline.serve.replicas.replica import ServedResult
from pipeline.serve.spec import ServedModelSpec

logger = logging.getLogger(__name__)


async def embeddings(gw: Gateway, request: Request) -> Response:
    started = time.monotonic()
    model, status = "-", 500
    key: ApiKey | None = None
    held = Held(gw.slots)
    try:
        key = gw.authenticate(request)
        held = await gw.enter(key)
        data = parse_json_body(await gw.read_body(request))
        strict = strict_mode(request.headers.get(STRICT_HEADER), gw.spec.http.strict_fields)
        try:
            parsed = parse_embeddings_request(data, strict=strict)
        except EmbeddingsError as exc:
            raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
        served = gw.served(parsed.model, key=key)
        model = served.name
        info = await gw.info(served.name)
        prompts = await asyncio.get_running_loop().run_in_executor(
            gw.tokenize_thread, embedding_prompts, parsed, served, info, gw.tokenizers
        )
        num_tokens = sum(len(p) for p in prompts)
        try:
            await held.lease.charge(num_tokens)
        except LimitExceeded as exc:
            held.lease = None  # charge gave it back
            raise gw.rate_limited(exc) from None
        body, usage, replica = await _embed(gw, served, parsed, prompts)
        status = 200
        if held.lease is not None:
            held.lease.settle(usage.prompt_tokens)
        gw.usage.finished(
            key=key.name,
            model=model,
            endpoint="embeddings",
            request_id=f"embd-{uuid.uuid4().hex}",
            status=200,
            stream=False,
            usage=usage,
            latency_s=time.monotonic() - started,
        )
        gw.metrics.requests.labels(model, "embeddings", "200").inc()
        gw.metrics.latency.labels(model, "embeddings").observe(time.monotonic() - started)
        return JSONResponse(body, headers={REPLICA_HEADER: replica})
    except BackPressureError as exc:
        error = gw.overloaded(exc)
        if held.lease is not None:
            held.lease.settle(0)
        gw.metrics.errors.labels(error.kind).inc()
        gw.metrics.requests.labels(model, "embeddings", str(error.status)).inc()
        raise error from None
    except ApiError as exc:
        status = exc.status
        gw.metrics.errors.labels(exc.kind).inc()
        gw.metrics.requests.labels(model, "embeddings", str(exc.status)).inc()
        raise
    finally:
        if status != 200:
            if held.lease is not None:
                held.lease.settle(0)  # refused or failed: the charge goes back
            if key is not None:
                gw.usage.refused(key.name, model, status)
        held.close()


def embedding_prompts(
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


async def _embed(
    gw: Gateway,
    served: ServedModelSpec,
    parsed: EmbeddingsRequest,
    prompts: list[list[int]],
) -> tuple[dict[str, Any], Usage, str]:
    """Every input on the model's replicas at once; the body, usage and a replica."""
    handle = gw.engines[served.name]
    pending = [handle.generate.remote(GenerationRequest(p, embed=EmbedParams())) for p in prompts]
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
    usage = gw.usage_of(
        served, [dataclasses.replace(answers[0].result, prompt_tokens=prompt_tokens)], seconds
    )
    body = embeddings_body(served.name, vectors, parsed.encoding_format, prompt_tokens)
    return body, usage, answers[0].replica
