"""Request bodies read within a limit, and streamed responses that let go of what their
request held when they end: shared by the chat routes (pipeline.serve.app) and the Batch API
routes (pipeline.serve.batch_api.batch_routes)."""

# No `from __future__ import annotations`: FastAPI modules read annotations at runtime.
import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pipeline.openai.errors import ApiError


def body_too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"Request body is larger than this server's limit of {limit} bytes (http.max_body_bytes)",
        code="request_too_large",
    )


def check_declared_length(request: Request, limit: int, too_large: ApiError) -> None:
    """Refuse a body whose Content-Length is over `limit` before reading any of it."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_large


def body_stalled(idle_timeout_s: float) -> ApiError:
    return ApiError(
        408,
        f"The request body stopped arriving: nothing came for {idle_timeout_s:g} s "
        "(http.body_idle_timeout_s); send the request again",
        code="request_timeout",
    )


async def body_chunks(
    request: Request, limit: int, too_large: ApiError, idle_timeout_s: float
) -> AsyncIterator[bytes]:
    """The body as it arrives. Every byte counts against `limit` however the body is framed
    (a declared length is checked at once, a chunked one as it comes: `too_large`), and a
    body that pauses for `idle_timeout_s` is cut (408)."""
    check_declared_length(request, limit, too_large)
    chunks = request.stream().__aiter__()
    size = 0
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), idle_timeout_s)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise body_stalled(idle_timeout_s) from None
        size += len(chunk)
        if size > limit:
            raise too_large
        yield chunk


async def read_body(
    request: Request,
    limit: int,
    idle_timeout_s: float,
    too_large: ApiError | None = None,
) -> bytes:
    """The whole body, refused (413, or `too_large`) past `limit` bytes, cut (408) when it
    pauses for `idle_timeout_s` (body_chunks)."""
    too_large = too_large or body_too_large(limit)
    return b"".join(
        [chunk async for chunk in body_chunks(request, limit, too_large, idle_timeout_s)]
    )


class HeldStreamingResponse(StreamingResponse):
    """A stream that calls `on_close` once sent, or when it never starts (the client went
    away before the body began: the body's own `finally` never runs then)."""

    def __init__(self, *args: Any, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
