"""A streamed chat completion as the Responses API's stream of typed events.

Chat chunks come in (role, `reasoning_content` and `content` deltas, tool call deltas, the
finish, the usage chunk, or an error body); Responses events go out, in the order OpenAI sends
them and its client's stream accumulator checks: `response.created` and `.in_progress`; per
output item `output_item.added`, its content part, its deltas, their `.done`s and
`output_item.done`; then `response.completed` (or `.incomplete` when the output hit
max_output_tokens) with the whole Response and its usage. An error mid-stream is an `error`
event and `response.failed`. Every event carries its `sequence_number`; on the wire each is an
SSE event named by its type (`frame`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.openai.responses_api.answer import (
    call_item,
    call_item_id,
    envelope,
    finish_status,
    message_id,
    message_item,
    reasoning_id,
    reasoning_item,
    text_part,
    usage_body,
)


def frame(event: Mapping[str, Any]) -> bytes:
    """One event on the wire: `event: <type>` and its JSON as `data`."""
    payload = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {payload}\n\n".encode()


@dataclass
class _Open:
    """An output item being streamed: a text item (reasoning or the message) or a call."""

    kind: str  # "reasoning" | "message" | "function_call"
    item_id: str
    index: int  # output_index
    text: str = ""
    call: dict[str, Any] | None = None  # function_call: the chat call, arguments growing


class ResponseEvents:
    """One streamed Response: feed it chat chunks, send what it returns."""

    def __init__(self, rid: str, model: str, created: int, echo: Mapping[str, Any]) -> None:
        self.rid, self.model, self.created, self.echo = rid, model, created, echo
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # finished items, in output order
        self.text: _Open | None = None  # the reasoning or message item open now
        self.calls: dict[int, _Open] = {}  # tool call index -> its open item
        self.items = 0  # output indexes handed out
        self.finish: str | None = None
        self.ended = False

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _response(self, status: str, **extra: Any) -> dict[str, Any]:
        return envelope(
            self.rid,
            self.model,
            self.created,
            self.echo,
            status=status,
            output=self.output,
            **extra,
        )

    def start(self) -> list[dict[str, Any]]:
        response = self._response("in_progress")
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    # --- items ---------------------------------------------------------------------------

    def _open_text(self, kind: str) -> list[dict[str, Any]]:
        events = self._close_text()
        index = self.items
        self.items += 1
        if kind == "reasoning":
            item_id = reasoning_id(self.rid)
            item, part = (
                reasoning_item(item_id, "", "in_progress"),
                {
                    "type": "reasoning_text",
                    "text": "",
                },
            )
        else:
            item_id = message_id(self.rid)
            item, part = message_item(item_id, "", "in_progress"), text_part("")
        self.text = _Open(kind, item_id, index)
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        events.append(self._event("response.output_item.added", output_index=index, item=item))
        events.append(self._event("response.content_part.added", **where, part=part))
        return events

    def _text_delta(self, kind: str, delta: str) -> list[dict[str, Any]]:
        events = [] if self.text is not None and self.text.kind == kind else self._open_text(kind)
        assert self.text is not None
        self.text.text += delta
        where = {"item_id": self.text.item_id, "output_index": self.text.index, "content_index": 0}
        if kind == "reasoning":
            events.append(self._event("response.reasoning_text.delta", **where, delta=delta))
        else:
            events.append(
                self._event("response.output_text.delta", **where, delta=delta, logprobs=[])
            )
        return events

    def _close_text(self, status: str = "completed") -> list[dict[str, Any]]:
        open_, self.text = self.text, None
        if open_ is None:
            return []
        where = {"item_id": open_.item_id, "output_index": open_.index, "content_index": 0}
        if open_.kind == "reasoning":
            item = reasoning_item(open_.item_id, open_.text, status)
            part = item["content"][0]
            done = self._event("response.reasoning_text.done", **where, text=open_.text)
        else:
            item = message_item(open_.item_id, open_.text, status)
            part = item["content"][0]
            done = self._event("response.output_text.done", **where, text=open_.text, logprobs=[])
        self.output.append(item)
        return [
            done,
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=open_.index, item=item),
        ]

    def _call_delta(self, part: Mapping[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        k = part.get("index", 0)
        function = part.get("function") or {}
        if k not in self.calls:
            events.extend(self._close_text())
            index = self.items
            self.items += 1
            call = {
                "id": part["id"],
                "type": "function",
                "function": {"name": function.get("name", ""), "arguments": ""},
            }
            open_ = _Open("function_call", call_item_id(self.rid, k), index, call=call)
            self.calls[k] = open_
            item = call_item(open_.item_id, call, "in_progress")
            events.append(self._event("response.output_item.added", output_index=index, item=item))
        open_ = self.calls[k]
        assert open_.call is not None
        delta = function.get("arguments") or ""
        if delta:
            open_.call["function"]["arguments"] += delta
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=open_.item_id,
                    output_index=open_.index,
                    delta=delta,
                )
            )
        return events

    def _close_calls(self) -> list[dict[str, Any]]:
        events = []
        for open_ in sorted(self.calls.values(), key=lambda o: o.index):
            assert open_.call is not None
            item = call_item(open_.item_id, open_.call)
            self.output.append(item)
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=open_.item_id,
                    output_index=open_.index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            events.append(
                self._event("response.output_item.done", output_index=open_.index, item=item)
            )
        self.calls = {}
        return events

    # --- chunks in, events out -----------------------------------------------------------

    def feed(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The events one chat chunk makes (none for the role opener)."""
        if self.ended:
            return []
        if "error" in chunk:
            return self._failed(chunk["error"])
        choices = chunk.get("choices") or []
        if not choices:
            usage = chunk.get("usage")
            return self._completed(usage) if usage else []
        choice = choices[0]
        delta = choice.get("delta") or {}
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            events.extend(self._text_delta("reasoning", delta["reasoning_content"]))
        if delta.get("content"):
            events.extend(self._text_delta("message", delta["content"]))
        for part in delta.get("tool_calls") or []:
            events.extend(self._call_delta(part))
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
            status = "incomplete" if self.finish == "length" else "completed"
            if self.text is None and not self.calls and not self.output:
                events.extend(self._open_text("message"))  # an empty answer is still a message
            events.extend(self._close_text(status))
            events.extend(self._close_calls())
        return events

    def _completed(self, usage: Mapping[str, Any]) -> list[dict[str, Any]]:
        self.ended = True
        status, incomplete = finish_status(self.finish)
        response = self._response(status, usage=usage_body(usage), incomplete=incomplete)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [self._event(kind, response=response)]

    def _failed(self, error: Mapping[str, Any]) -> list[dict[str, Any]]:
        self.ended = True
        code = error.get("code") or error.get("type") or "server_error"
        message = error.get("message") or "the response failed"
        response = self._response("failed", error={"code": code, "message": message})
        return [
            self._event("error", code=code, message=message, param=error.get("param")),
            self._event("response.failed", response=response),
        ]
