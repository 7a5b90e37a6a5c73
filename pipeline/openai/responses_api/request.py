"""A `/v1/responses` request body as the chat completions request it asks for.

The Responses API and chat completions reach the engine through one reader: a Responses body
is rewritten here into a chat body (input items into messages, `instructions` into the first
system turn, flat function tools into chat's nested ones, `text.format` into
`response_format`, `reasoning.effort`, `max_output_tokens`), and everything after that (tools,
structured output, sampling, limits, tokenization) is the chat path's. What cannot be honoured
by a server that stores nothing is refused by name (400), never ignored: `store: true`,
`previous_response_id`, `conversation`, `background`, stored `prompt` templates, item
references. `Translation.param` maps a chat field named by a later 400 back to the Responses
field the client sent, so errors name what the client wrote (`input[3].call_id`, not
`messages[2].tool_call_id`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.openai.errors import ApiError

# Fields of a Responses body read here; with the extensions below, anything else is an unknown
# field for the chat parser to ignore with a warning (or refuse in strict mode).
_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "reasoning",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "stream_options",
        "store",
        "metadata",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "service_tier",
        "truncation",
        "include",
        "background",
        "previous_response_id",
        "conversation",
        "prompt",
        "max_tool_calls",
        "top_logprobs",
    }
)
# Sampling extensions chat takes under the same names (vLLM's Responses route takes them too).
_EXTENSIONS = (
    "seed",
    "stop",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
    "stop_token_ids",
    "chat_template_kwargs",
)
# Refused unless absent or at the value that means "not used": each needs stored state or a
# feature this server does not have. The message says what to do instead.
_NEEDS_STORAGE = {
    "previous_response_id": "responses are not stored here; send the earlier turns in 'input'",
    "conversation": "conversations are not stored here; send the earlier turns in 'input'",
    "prompt": "stored prompt templates are not available; send the prompt in 'input'",
    "background": "background responses need storage; send the request without it and wait",
    "max_tool_calls": "calls are not run by this server; bound them in your agent loop",
}
# `include` values accepted: reasoning comes back as readable text in the reasoning item, so
# an encrypted copy for the next stateless turn is not needed.
_INCLUDE_ACCEPTED = ("reasoning.encrypted_content",)
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "developer", "assistant")


def _error(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class Translation:
    """A Responses request read: the chat body that runs it, what the response echoes, and how
    chat field names in later errors map back to this request's fields."""

    chat: dict[str, Any]
    echo: dict[str, Any]  # request fields the Response object repeats (tools, text, ...)
    stream: bool
    paths: dict[str, str] = field(default_factory=dict)  # chat path prefix -> Responses path

    def param(self, chat_param: str | None) -> str | None:
        """The Responses field a chat field name stands for (longest known prefix)."""
        if chat_param is None:
            return None
        best = ""
        for prefix in self.paths:
            if len(prefix) > len(best) and (
                chat_param == prefix or chat_param.startswith((prefix + ".", prefix + "["))
            ):
                best = prefix
        if not best:
            return chat_param
        return self.paths[best] + chat_param[len(best) :]

    def restate(self, error: ApiError) -> ApiError:
        """A chat path's 400 in this request's terms: its param and the message's mentions."""
        param = self.param(error.param)
        if param == error.param:
            return error
        message = error.message.replace(f"{error.param}", f"{param}") if error.param else None
        return ApiError(
            error.status,
            message or error.message,
            type=error.type,
            param=param,
            code=error.code,
            headers=error.headers,
        )


def _text_of(content: Any, where: str) -> str:
    """A call output's text: a string, or text parts joined (no images)."""
    parts = _content_of(content, where)
    if isinstance(parts, str):
        return parts
    j = next(j for j, part in enumerate(parts) if part["type"] != "text")
    raise _error(
        f"'{where}[{j}]' is an input_image part; only a message's content takes images",
        f"{where}[{j}].type",
        "unsupported_value",
    )


def _content_of(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content as the chat takes it: its text (a string, or text parts joined),
    or, when it has input_image parts, chat content parts one for one in order (so a chat
    error naming messages[i].content[j] names the same part of this request)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _error(f"'{where}' must be text or a list of content parts", where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            parts.append(_image_part(part, f"{where}[{j}]"))
        elif kind in ("input_file", "input_audio"):
            raise _error(
                f"'{where}[{j}]' is an {kind} part; this server reads text and image parts",
                f"{where}[{j}].type",
                "unsupported_value",
            )
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal", ""))})
        else:
            raise _error(
                f"'{where}[{j}]' must be a content part with type input_text, output_text or "
                "input_image",
                f"{where}[{j}]",
            )
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _image_part(part: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An input_image part as the chat's image_url part (the URL is read, within the model's
    prompt.images limits, by the chat path)."""
    if part.get("file_id") is not None:
        raise _error(
            f"'{where}.file_id': uploaded files are not read as images here; send the image "
            "as image_url (a data: URL)",
            f"{where}.file_id",
            "unsupported_value",
        )
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise _error(
            f"'{where}.image_url' must be the image's URL (e.g. a data: URL)", f"{where}.image_url"
        )
    image: dict[str, Any] = {"url": url}
    if part.get("detail") is not None:
        image["detail"] = part["detail"]
    return {"type": "image_url", "image_url": image}


class _Conversation:
    """Input items into chat messages, remembering which item each message came from."""

    def __init__(self, paths: dict[str, str]) -> None:
        self.messages: list[dict[str, Any]] = []
        self.paths = paths

    def _add(self, message: dict[str, Any], where: str) -> None:
        self.paths[f"messages[{len(self.messages)}]"] = where
        self.messages.append(message)

    def message(self, role: str, content: str | list[dict[str, Any]], where: str) -> None:
        self._add({"role": role, "content": content}, where)

    def call(self, item: Mapping[str, Any], where: str) -> None:
        name, arguments = item.get("name"), item.get("arguments", "")
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or not call_id:
            raise _error(f"'{where}.call_id' must be the call's id", f"{where}.call_id")
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise _error(
                f"'{where}' needs name and arguments (a JSON text) as strings", f"{where}.name"
            )
        body = {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        last = self.messages[-1] if self.messages else None
        # Calls that follow an assistant turn (its text, or earlier calls) belong to that turn.
        if last is not None and last["role"] == "assistant":
            calls = last.setdefault("tool_calls", [])
            index = len(self.messages) - 1
        else:
            calls = []
            index = len(self.messages)
            self._add({"role": "assistant", "content": None, "tool_calls": calls}, where)
        prefix = f"messages[{index}].tool_calls[{len(calls)}]"
        self.paths[prefix] = where
        self.paths[prefix + ".function"] = where
        calls.append(body)

    def output(self, item: Mapping[str, Any], where: str) -> None:
        self._add(
            {
                "role": "tool",
                "tool_call_id": item.get("call_id"),
                "content": _text_of(item.get("output", ""), f"{where}.output"),
            },
            where,
        )
        index = len(self.messages) - 1
        self.paths[f"messages[{index}].tool_call_id"] = f"{where}.call_id"


def _messages(body: Mapping[str, Any], paths: dict[str, str]) -> list[dict[str, Any]]:
    conversation = _Conversation(paths)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _error("'instructions' must be text", "instructions")
        if instructions:
            conversation.message("system", instructions, "instructions")
    raw = body.get("input")
    if raw is None:
        raise _error("Missing required parameter: 'input'.", "input", "missing_required_parameter")
    if isinstance(raw, str):
        conversation.message("user", raw, "input")
        return conversation.messages
    if not isinstance(raw, list) or not raw:
        raise _error("'input' must be text or a non-empty list of input items", "input")
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise _error(f"'{where}' must be an input item (an object)", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _error(
                    f"'{where}.role' must be one of {', '.join(_ROLES)}, got {role!r}",
                    f"{where}.role",
                )
            conversation.message(role, _content_of(item.get("content"), f"{where}.content"), where)
        elif kind == "function_call":
            conversation.call(item, where)
        elif kind == "function_call_output":
            conversation.output(item, where)
        elif kind == "reasoning":
            # An earlier turn's reasoning: chat templates leave it out of later turns.
            continue
        elif kind == "item_reference":
            raise _error(
                f"'{where}' refers to a stored item; responses are not stored here, send the "
                "item itself",
                f"{where}.type",
                "unsupported_value",
            )
        else:
            raise _error(
                f"'{where}.type' {kind!r} is not supported; input items are messages, "
                "function_call, function_call_output and reasoning",
                f"{where}.type",
                "unsupported_value",
            )
    return conversation.messages


def _tools(raw: Any, paths: dict[str, str]) -> list[Any]:
    if not isinstance(raw, list):
        raise _error("'tools' must be a list of function tools", "tools")
    tools = []
    for t, tool in enumerate(raw):
        where = f"tools[{t}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            raise _error(
                f"'{where}.type' {kind!r} is not supported; this server's tools are functions "
                "(type: function), run by the caller",
                f"{where}.type",
                "unsupported_value",
            )
        function = {k: v for k, v in tool.items() if k != "type"}
        if function.get("strict") is None:
            function.pop("strict", None)
        paths[f"{where}.function"] = where
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(raw: Any, paths: dict[str, str]) -> Any:
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, Mapping) and raw.get("type") == "function":
        paths["tool_choice.function"] = "tool_choice"
        return {"type": "function", "function": {"name": raw.get("name")}}
    if isinstance(raw, Mapping) and raw.get("type") == "allowed_tools":
        raise _error(
            "'tool_choice' allowed_tools is not supported; list the allowed tools in 'tools'",
            "tool_choice.type",
            "unsupported_value",
        )
    raise _error(
        "'tool_choice' must be none, auto, required or {type: function, name}", "tool_choice"
    )


def _text_format(raw: Any) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (json_schema is nested one level there)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise _error("'text' must be an object with a format", "text")
    unknown = sorted(set(raw) - {"format", "verbosity"})
    if unknown:
        raise _error(f"'text.{unknown[0]}' is not supported", f"text.{unknown[0]}")
    fmt = raw.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise _error("'text.format' must be an object with a type", "text.format")
    if fmt.get("type") == "json_schema":
        schema = {k: v for k, v in fmt.items() if k != "type"}
        return {"type": "json_schema", "json_schema": schema}
    return dict(fmt)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    if body.get("store"):
        raise _error(
            "'store': responses are not stored by this server; send store: false (or leave it "
            "out) and keep the turns you need in your next request's 'input'",
            "store",
            "unsupported_value",
        )
    for name, why in _NEEDS_STORAGE.items():
        if body.get(name) not in (None, False):
            raise _error(f"'{name}' is not supported: {why}", name, "unsupported_parameter")
    if body.get("truncation") not in (None, "disabled"):
        raise _error(
            "'truncation' auto is not supported: an input too long for the model is a 400; "
            "send truncation: disabled",
            "truncation",
            "unsupported_value",
        )
    include = body.get("include") or []
    if not isinstance(include, list):
        raise _error("'include' must be a list", "include")
    for k, value in enumerate(include):
        if value not in _INCLUDE_ACCEPTED:
            raise _error(
                f"'include[{k}]' {value!r} is not supported here",
                f"include[{k}]",
                "unsupported_value",
            )
    if body.get("top_logprobs") not in (None, 0):
        raise _error(
            "'top_logprobs' is not supported on /v1/responses; use /v1/chat/completions "
            "with logprobs",
            "top_logprobs",
            "unsupported_parameter",
        )


_CHAT_ONLY = re.compile(r"^(messages|n|max_tokens|max_completion_tokens|response_format|logprobs)$")


def translate(body: Mapping[str, Any]) -> Translation:
    """The chat request a Responses body asks for, or a 400 naming the Responses field."""
    _refuse_unsupported(body)
    chat_only = sorted(k for k in body if _CHAT_ONLY.match(k))
    if chat_only:
        raise _error(
            f"'{chat_only[0]}' is a chat completions parameter; /v1/responses takes input, "
            "max_output_tokens and text.format",
            chat_only[0],
            "unknown_parameter",
        )
    paths: dict[str, str] = {
        "messages": "input",
        "max_completion_tokens": "max_output_tokens",
        "response_format": "text.format",
        "response_format.json_schema": "text.format",
        "reasoning_effort": "reasoning.effort",
        "tool_choice.function.name": "tool_choice.name",
    }
    chat: dict[str, Any] = {"model": body.get("model"), "messages": _messages(body, paths)}
    for name in ("temperature", "top_p", "parallel_tool_calls", "metadata", "user"):
        if body.get(name) is not None:
            chat[name] = body[name]
    for name in ("safety_identifier", "prompt_cache_key", "service_tier", *_EXTENSIONS):
        if name in body:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"], paths)
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"], paths)
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, Mapping):
            raise _error("'reasoning' must be an object", "reasoning")
        if reasoning.get("effort") is not None:
            effort = reasoning["effort"]
            # OpenAI's extra levels read as the nearest one a chat template knows.
            chat["reasoning_effort"] = {"minimal": "low", "none": "low", "xhigh": "high"}.get(
                effort, effort
            )
    stream = body.get("stream") is True
    if body.get("stream") not in (None, True, False):
        raise _error("'stream' must be true or false", "stream")
    if stream:
        chat["stream"] = True
        # A Response always ends with its usage, streamed or not.
        chat["stream_options"] = {"include_usage": True}
    unknown = {k: v for k, v in body.items() if k not in _FIELDS and k not in _EXTENSIONS}
    chat.update(unknown)  # the chat parser names them (warning header) or refuses them (strict)
    echo = {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "reasoning": {"effort": (reasoning or {}).get("effort"), "summary": None},
        "temperature": body.get("temperature"),
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or ("auto" if body.get("tools") else "none"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "user": body.get("user"),
    }
    return Translation(chat=chat, echo=echo, stream=stream, paths=paths)
