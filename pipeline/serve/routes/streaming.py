"""Streamed chat and completions answers: OpenAI's server-sent events from an engine replica's
stream of deltas, n choices interleaved, reasoning split per choice, usage at the end."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from fastapi.responses import Response
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentResponseGenerator

from engines.api import GenerationResult, StreamDelta
from pipeline.openai.reasoning import Delta
from pipeline.openai.responses import chunk_body, tool_call_chunks, usage_chunk_body
from pipeline.openai.sse import SSE_DONE, sse
from pipeline.openai.tools import ToolStream
from pipeline.serve.gateway import REPLICA_HEADER, Call, Gateway, result_error
from pipeline.serve.http.httpio import HeldStreamingResponse
from pipeline.serve.protocol.logprobs import LogprobsBody
from pipeline.serve.protocol.requests import Prepared, engine_unavailable, finish_reason
from pipeline.serve.replicas.replica import ServedDelta
from pipeline.serve.routes.answers import logprobs_builder, reasoning_parser
from pipeline.serve.usage import CLIENT_CLOSED

logger = logging.getLogger(__name__)


# A stream's chunks: OpenAI's chunk bodies (or an error body), None for its `[DONE]` end.
Chunks = AsyncIterator[dict | None]


async def _chat_frames(chunks: Chunks) -> AsyncIterator[bytes]:
    """Chat and completions on the wire: `data: <chunk>` each, `data: [DONE]` at the end."""
    try:
        async for chunk in chunks:
            yield SSE_DONE if chunk is None else sse(chunk)
    finally:
        await chunks.aclose()


async def stream(
    gw: Gateway, call: Call, frame: Callable[[Chunks], AsyncIterator[bytes]] | None = None
) -> Response:
    """The request on its way to a replica as a stream; the response that sends its events
    once the replica admitted it (a full queue is still a 429 until then). `frame` writes the
    chunks on the wire (default: chat's server-sent events)."""
    prepared = call.prepared
    name = prepared.served.name
    handle = gw.engines[name].options(stream=True)
    if prepared.n == 1:
        deltas = handle.stream.remote(prepared.engine_request)
    else:
        deltas = handle.stream_n.remote(prepared.engine_request, prepared.n)
    gw.metrics.in_flight.labels(name).inc()
    try:
        # The admitted marker: once it arrives the request holds a replica slot, so any
        # backpressure has already shown up here, while a 429 is still possible.
        admitted: ServedDelta = await deltas.__anext__()
    except BackPressureError as exc:
        gw.metrics.in_flight.labels(name).dec()
        raise gw.refunded(call, gw.overloaded(exc)) from None
    except asyncio.CancelledError:
        gw.metrics.in_flight.labels(name).dec()
        deltas.cancel()
        gw.account(call, CLIENT_CLOSED, None)
        raise
    except Exception as exc:
        gw.metrics.in_flight.labels(name).dec()
        logger.exception("engine stream failed for model %s", name)
        raise gw.failed(call, engine_unavailable(name, exc)) from None
    return HeldStreamingResponse(
        (frame or _chat_frames)(_chunks(gw, call, deltas)),
        media_type="text/event-stream",
        headers={
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            REPLICA_HEADER: admitted.replica,
            **prepared.headers,
        },
        # Also when the body never ran or was left suspended (the client went away
        # before it began, or while a chunk was being sent): its `finally` may run late.
        on_close=lambda: _end_stream(gw, call, deltas, finished=call.accounted),
    )


def _end_stream(
    gw: Gateway, call: Call, deltas: DeploymentResponseGenerator, *, finished: bool
) -> None:
    """A stream's response is over (once, whichever of its body and its Response gets
    here first). Unfinished: the client went away, so the replica's generator is cancelled,
    which closes the engine's stream and frees the request's KV blocks."""
    if call.ended:
        return
    call.ended = True
    gw.metrics.in_flight.labels(call.prepared.served.name).dec()
    if not finished:
        deltas.cancel()
        gw.metrics.errors.labels("client_disconnected").inc()
        gw.account(call, CLIENT_CLOSED, None)
    call.held.close()


def _echo_chunk(
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


async def _chunks(gw: Gateway, call: Call, deltas: DeploymentResponseGenerator) -> Chunks:
    prepared, started = call.prepared, call.started
    ids, usage_on = prepared.ids, prepared.include_usage
    name = prepared.served.name
    n = prepared.n
    finished = False
    # One per choice: a completion's logprobs carry text offsets that run per choice.
    logprobs = None
    if prepared.engine_request.sampling.logprobs is not None:
        logprobs = [logprobs_builder(gw, prepared) for _ in range(n)]
    results: dict[int, GenerationResult] = {}
    seconds = 0.0
    # Chat on a reasoning model: one split stream per choice; each delta's text goes to
    # `reasoning_content` or `content` (held back where a marker may be starting).
    parser = reasoning_parser(gw, prepared)
    prompt_ids = prepared.engine_request.prompt_token_ids
    splits = [parser.stream(prompt_ids) for _ in range(n)] if parser is not None else None
    reasoning_tokens = 0
    echo_pending = set(range(n)) if prepared.echo is not None else set()
    # Chat with tools: content goes out as it comes until a call may be starting; the calls
    # go out whole when the choice ends (pipeline.openai.tools.stream).
    tool_streams = None
    if prepared.tools is not None and prepared.tool_parser is not None:
        tool_streams = [ToolStream(prepared.tools, prepared.tool_parser) for _ in range(n)]
    try:
        if ids.endpoint == "chat":
            for index in range(n):
                yield chunk_body(ids, role=True, include_usage=usage_on, index=index)
        async for item in deltas:
            delta, index = item.delta, item.index
            if delta is None:
                continue
            if index in echo_pending:
                # Completions with echo: the prompt opens the choice (with its tokens'
                # logprobs, which the engine sends with the first delta).
                echo_pending.discard(index)
                yield _echo_chunk(prepared, delta, logprobs, index)
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
            calls: list[dict] = []
            if tool_streams is not None:
                text = tool_streams[index].feed(text)
                if delta.finished:
                    split_calls = ()  # harmony's calls, read from the token ids by the split
                    if splits is not None and delta.result is not None:
                        split_calls = splits[index].result(delta.result.output_token_ids).calls
                    rest, found = tool_streams[index].close(split_calls)
                    text += rest
                    calls = [call.body() for call in found]
            if text or reasoning or (entries and (entries.get("content") or entries.get("tokens"))):
                yield (
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
                gw.metrics.errors.labels(api_error.kind).inc()
                gw.failed(call, api_error)
                yield api_error.body()
                gw.finish(prepared, started, api_error.status)
                return
            results[index] = result
            seconds += item.gpu_seconds or 0.0
            if splits is not None:
                reasoning_tokens += splits[index].result(result.output_token_ids).reasoning_tokens
            for chunk in tool_call_chunks(ids, calls, include_usage=usage_on, index=index):
                yield chunk
            end = chunk_body(
                ids,
                finish_reason="tool_calls" if calls else finish_reason(result),
                include_usage=usage_on,
                index=index,
            )
            if len(results) < n:
                yield end
                continue
            finished = True
            usage = gw.usage_of(
                prepared.served, [results[i] for i in range(n)], seconds, reasoning_tokens
            )
            # Accounted before the last bytes go: a client that leaves after seeing its
            # finish chunk still got (and is billed for) the whole answer.
            gw.account(call, 200, usage)
            yield end
            if usage_on:
                yield usage_chunk_body(ids, usage)
            yield None
            gw.finish(prepared, started, 200)
    except Exception as exc:
        # Headers are gone already: report in-band, as OpenAI does, then end the stream.
        logger.exception("engine stream failed for model %s", name)
        api_error = engine_unavailable(name, exc)
        gw.metrics.errors.labels(api_error.kind).inc()
        gw.failed(call, api_error)
        yield api_error.body()
    finally:
        # Client gone mid-stream (or a failure): not finished.
        _end_stream(gw, call, deltas, finished=finished)
