"""OpenAI's response bodies for chat completions and completions: whole responses, stream
chunks, and `usage` (with tokenmill's cost extensions).

Shapes follow the public API reference, so an OpenAI client reads them as OpenAI's: ids
`chatcmpl-*` / `cmpl-*`, `object` names, chunk order in streams (role first, content deltas, a
finish chunk, an optional usage chunk with empty choices, then `[DONE]`, see sse.py). Serve
answers with them, and batch openai_batch output lines carry the same bodies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Usage:
    """Token counts and what they cost; `usage` in every response (plus the cost extensions)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    gpu_seconds: float  # device time attributed to this request
    cost_usd: float  # gpu_seconds at the model's device-hour price
    list_price_usd: float | None  # what a token-priced API would charge (if prices given)
    reasoning_tokens: int = 0  # of completion_tokens, those of reasoning (0: none, or not split)

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "gpu_seconds": round(self.gpu_seconds, 9),
            "cost_usd": self.cost_usd,
        }
        if self.list_price_usd is not None:
            body["list_price_usd"] = self.list_price_usd
        return body


Endpoint = Literal["chat", "completions"]


@dataclass(frozen=True)
class ResponseIds:
    """Identity shared by every chunk of one response."""

    endpoint: Endpoint
    id: str
    model: str
    created: int

    @classmethod
    def new(cls, endpoint: Endpoint, request_id: str, model: str) -> ResponseIds:
        prefix = "chatcmpl-" if endpoint == "chat" else "cmpl-"
        return cls(endpoint, prefix + request_id, model, int(time.time()))

    def _head(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }


@dataclass(frozen=True)
class Choice:
    """One generated answer of a response (there are n of them)."""

    text: str  # the answer (with a reasoning format: without the reasoning)
    finish_reason: str
    logprobs: dict[str, Any] | None = None
    reasoning: str | None = None  # chat: `reasoning_content`; None: no reasoning part
    tool_calls: tuple[dict[str, Any], ...] = ()  # chat: the calls made (ToolCall.body()s)


def completion_body(
    ids: ResponseIds,
    text: str,
    finish_reason: str,
    usage: Usage,
    logprobs: dict[str, Any] | None = None,
) -> dict:
    """A whole (non-streamed) chat.completion or text_completion with one choice."""
    return choices_body(ids, [Choice(text, finish_reason, logprobs)], usage)


def choices_body(ids: ResponseIds, choices: list[Choice], usage: Usage) -> dict:
    """A whole chat.completion or text_completion; `usage` covers all choices (the prompt
    counted once, completion tokens summed), as OpenAI reports n > 1."""
    out: list[dict[str, Any]] = []
    for index, c in enumerate(choices):
        if ids.endpoint == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
            if c.reasoning is not None:
                message["reasoning_content"] = c.reasoning
            if c.tool_calls:
                # OpenAI's shape: the calls, and content null when nothing was said besides.
                message["tool_calls"] = list(c.tool_calls)
                message["content"] = c.text or None
            out.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": c.logprobs,
                    "finish_reason": c.finish_reason,
                }
            )
        else:
            out.append(
                {
                    "index": index,
                    "text": c.text,
                    "logprobs": c.logprobs,
                    "finish_reason": c.finish_reason,
                }
            )
    body = ids._head("chat.completion" if ids.endpoint == "chat" else "text_completion")
    body["choices"] = out
    body["usage"] = usage.body()
    return body


def chunk_body(
    ids: ResponseIds,
    *,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    include_usage: bool = False,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
    reasoning: str | None = None,
) -> dict:
    """One streamed chunk with a single choice (number `index` of n): a role opener, a text
    delta (chat: and/or a `reasoning_content` delta), or the finish."""
    if ids.endpoint == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta = {"role": "assistant", "content": ""}
        else:
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text is not None and (text or not reasoning):
                delta["content"] = text
        choice: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        body = ids._head("chat.completion.chunk")
    else:
        choice = {
            "index": index,
            "text": text or "",
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        body = ids._head("text_completion")
    body["choices"] = [choice]
    if include_usage:
        # OpenAI sends "usage": null on every chunk when usage was asked for.
        body["usage"] = None
    return body


def tool_call_chunks(
    ids: ResponseIds, calls: list[dict[str, Any]], *, include_usage: bool, index: int = 0
) -> list[dict]:
    """The streamed form of a choice's calls, as OpenAI sends them: per call (by its index in
    tool_calls), a delta with id, type and name (arguments empty), then the arguments."""
    chunks = []
    for k, call in enumerate(calls):
        function = call["function"]
        opener = {
            "index": k,
            "id": call["id"],
            "type": "function",
            "function": {"name": function["name"], "arguments": ""},
        }
        arguments = {"index": k, "function": {"arguments": function["arguments"]}}
        for part in (opener, arguments):
            body = chunk_body(ids, include_usage=include_usage, index=index)
            body["choices"][0]["delta"] = {"tool_calls": [part]}
            chunks.append(body)
    return chunks


def usage_chunk_body(ids: ResponseIds, usage: Usage) -> dict:
    """The extra last chunk of a stream with include_usage: no choices, just usage."""
    body = ids._head("chat.completion.chunk" if ids.endpoint == "chat" else "text_completion")
    body["choices"] = []
    body["usage"] = usage.body()
    return body
