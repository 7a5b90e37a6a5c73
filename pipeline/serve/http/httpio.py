"""Request bodies read within a limit, and streamed responses that let go of what their
request held when they end: shared by the chat routes (pipeline.serve.app) and the Batch API
routes (pipeline.serve.batch_api.batch_routes)."""

# No `from __future__ import annotations`: FastAPI modules read annotations at runtime.
from collections.abc import Callable
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


async def read_body(request: Request, limit: int, too_large: ApiError | None = None) -> bytes:
    """The whole body, refused (413, or `too_large`) past `limit` bytes: by its declared
    length at once, by counting for a chunked body that declares none."""
    too_large = too_large or body_too_large(limit)
    check_declared_length(request, limit, too_large)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


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
