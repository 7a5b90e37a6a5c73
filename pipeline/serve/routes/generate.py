"""/v1/chat/completions and /v1/completions: a request from its body to an engine and back as
one JSON answer (streams: pipeline.serve.routes.streaming)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from ray.serve.exceptions import BackPressureError

from pipeline.openai.errors import ApiError
from pipeline.openai.models import STRICT_HEADER, parse_json_body, strict_mode
from pipeline.openai.responses import Choice, Endpoint, choices_body
from pipeline.openai.tools import answer_calls
from pipeline.serve.access.keys import ApiKey
from pipeline.serve.access.limits import LimitExceeded
from pipeline.serve.gateway import REPLICA_HEADER, Call, Gateway, Held, result_error
from pipeline.serve.protocol.logprobs import join_completion_logprobs
from pipeline.serve.protocol.requests import engine_unavailable, finish_reason
from pipeline.serve.replicas.replica import ServedResult
from pipeline.serve.routes import streaming
from pipeline.serve.routes.answers import logprobs_builder, split
from pipeline.serve.usage import CLIENT_CLOSED

logger = logging.getLogger(__name__)


class Shape(Protocol):
    """Another API's request and answer around the chat path (the Responses API's in
    pipeline.serve.routes.responses): its body read into a chat body, chat's 400s restated in
    its fields, a chat answer written back in its form, whole or as a stream of events."""

    def read(self, data: dict[str, Any]) -> dict[str, Any]: ...

    def restate(self, error: ApiError) -> ApiError: ...

    def body(self, chat: dict[str, Any]) -> dict[str, Any]: ...

    def events(self, chunks: AsyncIterator[dict | None]) -> AsyncIterator[bytes]: ...


async def handle(
    gw: Gateway, request: Request, endpoint: Endpoint, shape: Shape | None = None
) -> Response:
    """One chat or completions request: admitted, parsed, tokenized and charged here, then
    answered whole (`complete`) or streamed (pipeline.serve.routes.streaming). With a
    `shape`, the body and the answer are another API's around a chat request."""
    started = time.monotonic()
    model = "-"
    key: ApiKey | None = None
    call: Call | None = None
    held = Held(gw.slots)
    handed_off = False  # a stream's response releases `held` once it is sent
    try:
        key = gw.authenticate(request)
        held = await gw.enter(key)
        data = parse_json_body(await gw.read_body(request))
        if shape is not None:
            data = shape.read(data)
        # Label metrics with served names only: client-chosen strings would let anyone
        # grow the metric label set without bound.
        if isinstance(data.get("model"), str) and data["model"] in gw.engines:
            model = data["model"]
        strict = strict_mode(request.headers.get(STRICT_HEADER), gw.spec.http.strict_fields)
        prepared = await gw.prepare(data, endpoint, strict, key)
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
            raise gw.rate_limited(exc) from None
        call = Call(prepared, key, held, started)
        if prepared.stream:
            frame = shape.events if shape is not None else None
            response = await streaming.stream(gw, call, frame)
            handed_off = True
            return response
        body, headers = await complete(gw, call)
        if shape is not None:
            body = shape.body(body)
        return JSONResponse(body, headers=headers)
    except BackPressureError as exc:
        # Only the engine info fetch gets here; dispatch handles its own backpressure.
        error = gw.overloaded(exc)
        gw.metrics.errors.labels(error.kind).inc()
        gw.metrics.requests.labels(model, endpoint, str(error.status)).inc()
        if key is not None:
            gw.usage.refused(key.name, model, error.status)
        raise error from None
    except ApiError as exc:
        gw.metrics.errors.labels(exc.kind).inc()
        gw.metrics.requests.labels(model, endpoint, str(exc.status)).inc()
        if key is not None and (call is None or not call.accounted):
            gw.usage.refused(key.name, model, exc.status)
        if shape is not None:
            raise shape.restate(exc) from None
        raise
    finally:
        if not handed_off:
            held.close()


async def complete(gw: Gateway, call: Call) -> tuple[dict[str, Any], dict[str, str]]:
    """The engine's answer (n of them for n > 1) as one JSON body, and its headers."""
    prepared, started = call.prepared, call.started
    name = prepared.served.name
    handle, n = gw.engines[name], prepared.n
    if n == 1:
        pending = handle.generate.remote(prepared.engine_request)
    else:
        pending = handle.generate_n.remote(prepared.engine_request, n)
    gw.metrics.in_flight.labels(name).inc()
    try:
        answer: ServedResult | list[ServedResult] = await pending
    except BackPressureError as exc:
        raise gw.refunded(call, gw.overloaded(exc)) from None
    except asyncio.CancelledError:
        # The client disconnected; Serve cancelled this call. Cancel the replica's too.
        pending.cancel()
        gw.metrics.errors.labels("client_disconnected").inc()
        gw.account(call, CLIENT_CLOSED, None)
        raise
    except Exception as exc:
        logger.exception("engine call failed for model %s", name)
        raise gw.failed(call, engine_unavailable(name, exc)) from None
    finally:
        gw.metrics.in_flight.labels(name).dec()
    served = answer if isinstance(answer, list) else [answer]
    results = [s.result for s in served]
    for result in results:
        # One failed choice fails the request, as a single failed answer would.
        failed = result_error(name, result)
        if failed is not None:
            raise gw.failed(call, failed)
    prompt_ids = prepared.engine_request.prompt_token_ids
    splits = [split(gw, prepared, prompt_ids, result) for result in results]
    usage = gw.usage_of(
        prepared.served,
        results,
        sum(s.gpu_seconds for s in served),
        sum(s.reasoning_tokens for s in splits if s is not None),
    )
    choices = []
    for result, parts in zip(results, splits, strict=True):
        logprobs = None
        if result.logprobs is not None:
            builder = logprobs_builder(gw, prepared)
            head = None
            if prepared.echo is not None:  # the prompt's tokens come first
                head = builder.prompt_body(prompt_ids, result.prompt_logprobs)
            logprobs = builder.body(result.logprobs, result)
            if head is not None:
                logprobs = join_completion_logprobs(head, logprobs)
        text = result.text if prepared.echo is None else prepared.echo + result.text
        reasoning = None
        if parts is not None:
            text, reasoning = parts.text, parts.reasoning
        finish, calls = finish_reason(result), ()
        if prepared.tools is not None and prepared.tool_parser is not None:
            # The answer's calls (pipeline.openai.tools): the content is what is left.
            split_calls = parts.calls if parts is not None else ()  # harmony's, by token
            content, found = answer_calls(prepared.tools, prepared.tool_parser, text, split_calls)
            if found or split_calls:  # harmony calls that did not parse stay content
                text = content or ""
            if found:
                finish = "tool_calls"
                calls = tuple(call.body() for call in found)
        choices.append(Choice(text, finish, logprobs, reasoning, calls))
    body = choices_body(prepared.ids, choices, usage)
    gw.finish(prepared, started, 200)
    gw.account(call, 200, usage)
    return body, {REPLICA_HEADER: served[0].replica, **prepared.headers}
