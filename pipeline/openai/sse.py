"""Server-sent events as OpenAI frames a stream: one `data: <json>` event per chunk, ended by
`data: [DONE]`."""

from __future__ import annotations

import json


def sse(data: dict | str) -> bytes:
    """One server-sent event line pair, as OpenAI frames stream chunks."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")
