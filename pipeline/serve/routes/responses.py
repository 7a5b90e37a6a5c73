"""/v1/responses: the Responses API on the chat path. The body is read into a chat request
(pipeline.openai.responses_api), admitted, charged and run as chat requests are, and the answer
goes back as a Response or as the Responses stream's events. Stateless: nothing is stored, so
what needs storage is refused by name (see the request reader)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pipeline.openai.errors import ApiError
from pipeline.openai.responses_api import (
    ResponseEvents,
    Translation,
    frame,
    response_body,
    response_id,
    translate,
)
from pipeline.serve.gateway import Gateway
from pipeline.serve.routes import generate


class ResponsesShape:
    """One Responses request around its chat request (generate.Shape)."""

    def __init__(self) -> None:
        self.translation: Translation | None = None

    def read(self, data: dict[str, Any]) -> dict[str, Any]:
        self.translation = translate(data)
        return self.translation.chat

    def restate(self, error: ApiError) -> ApiError:
        return error if self.translation is None else self.translation.restate(error)

    def body(self, chat: dict[str, Any]) -> dict[str, Any]:
        assert self.translation is not None
        return response_body(chat, self.translation.echo)

    async def events(self, chunks: AsyncIterator[dict | None]) -> AsyncIterator[bytes]:
        assert self.translation is not None
        stream: ResponseEvents | None = None
        try:
            async for chunk in chunks:
                if chunk is None:  # chat's [DONE]: the Responses stream ended with its event
                    break
                if stream is None:
                    # The first chunk names the response (the chat id) and when it began.
                    rid = response_id(str(chunk.get("id", "")))
                    stream = ResponseEvents(
                        rid, chunk.get("model", ""), chunk.get("created", 0), self.translation.echo
                    )
                    for event in stream.start():
                        yield frame(event)
                for event in stream.feed(chunk):
                    yield frame(event)
        finally:
            await chunks.aclose()


async def handle(gw: Gateway, request: Request) -> Response:
    return await generate.handle(gw, request, "chat", ResponsesShape())
