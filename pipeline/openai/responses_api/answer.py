"""A chat completion as the Response object of `/v1/responses`: output items (reasoning, the
message, function calls), status, and usage in the Responses API's names.

One conversion serves Serve's whole answers, its streams (events.py builds the same items as
they grow) and the Batch API's output lines, so a response looks the same whichever way it came.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# tokenmill's cost extensions ride along in usage, as they do in chat's.
_COST_FIELDS = ("gpu_seconds", "cost_usd", "list_price_usd")


def response_id(chat_id: str) -> str:
    """`resp_<id>` for the chat completion `chatcmpl-<id>` that produced it."""
    return "resp_" + chat_id.removeprefix("chatcmpl-")


def _suffix(rid: str) -> str:
    return rid.removeprefix("resp_")


def message_id(rid: str) -> str:
    return "msg_" + _suffix(rid)


def reasoning_id(rid: str) -> str:
    return "rs_" + _suffix(rid)


def call_item_id(rid: str, index: int) -> str:
    return f"fc_{_suffix(rid)}_{index}"


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [text_part(text)] if status != "in_progress" else []
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def call_item(item_id: str, call: Mapping[str, Any], status: str = "completed") -> dict[str, Any]:
    """A chat tool call ({id, type, function: {name, arguments}}) as a function_call item."""
    function = call["function"]
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"] if status != "in_progress" else "",
        "status": status,
    }


def usage_body(chat_usage: Mapping[str, Any]) -> dict[str, Any]:
    """Chat's usage in the Responses API's names (input/output tokens and their details)."""
    body: dict[str, Any] = {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        },
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {
            "reasoning_tokens": (chat_usage.get("completion_tokens_details") or {}).get(
                "reasoning_tokens", 0
            )
        },
        "total_tokens": chat_usage["total_tokens"],
    }
    body.update({k: chat_usage[k] for k in _COST_FIELDS if k in chat_usage})
    return body


def envelope(
    rid: str,
    model: str,
    created: int,
    echo: Mapping[str, Any],
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    incomplete: str | None = None,
) -> dict[str, Any]:
    """The Response object around its output: what was asked (echo), where it stands."""
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "model": model,
        "output": output,
        "previous_response_id": None,
        "service_tier": "default",
        "store": False,
        "truncation": "disabled",
        "usage": usage,
        **echo,
    }


def finish_status(finish_reason: str | None) -> tuple[str, str | None]:
    """A choice's finish as the Response's status and incomplete reason."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


def response_body(chat: Mapping[str, Any], echo: Mapping[str, Any]) -> dict[str, Any]:
    """A whole chat.completion (one choice) as a whole Response."""
    rid = response_id(chat["id"])
    choice = chat["choices"][0]
    message = choice["message"]
    status, incomplete = finish_status(choice["finish_reason"])
    item_status = "incomplete" if status == "incomplete" else "completed"
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        output.append(reasoning_item(reasoning_id(rid), message["reasoning_content"], item_status))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        output.append(message_item(message_id(rid), message.get("content") or "", item_status))
    output.extend(call_item(call_item_id(rid, k), call) for k, call in enumerate(calls))
    return envelope(
        rid,
        chat["model"],
        chat["created"],
        echo,
        status=status,
        output=output,
        usage=usage_body(chat["usage"]),
        incomplete=incomplete,
    )
