"""What a chat request asks of tools: its function definitions (each parameters schema checked
as JSON Schema), the choice (none, auto, required, or one named function), whether calls may
come in parallel, and the conversation's tool turns (every `tool` message answers an earlier
call). Errors name the field as OpenAI's 400s do (`tools[1].function.parameters`)."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Mode = Literal["none", "auto", "required", "named"]
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128


class ToolError(ValueError):
    """A request's tools, tool choice or tool turns cannot be used; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: OpenAI's `tool_calls[i]` (arguments as a JSON text)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def body(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolPlan:
    """How a request's tools run: the definitions (OpenAI's shape, for the chat template),
    the mode, the one function a named choice forces, and whether calls may be parallel."""

    tools: tuple[dict[str, Any], ...]
    mode: Mode
    forced: str | None = None  # mode "named": the function
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def schema_of(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or {"type": "object"}
        raise KeyError(name)

    @property
    def constrained(self) -> bool:
        """required or named: the output is forced to be calls (constrain.py)."""
        return self.mode in ("required", "named")

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template is given: none when the request may not call any."""
        return None if self.mode == "none" else list(self.tools)


def _check_schema(schema: Any, param: str) -> None:
    import jsonschema

    if not isinstance(schema, dict):
        raise ToolError(f"'{param}' must be a JSON Schema object", param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ToolError(f"'{param}' is not a valid JSON Schema: {exc.message}", param) from None


def _tool(raw: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(raw, dict) or raw.get("type") != "function":
        raise ToolError(f"'{where}' must be {{type: function, function: {{...}}}}", where)
    function = raw.get("function")
    if not isinstance(function, dict):
        raise ToolError(f"'{where}.function' must be an object", f"{where}.function")
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise ToolError(f"'{where}.function' has unknown field {unknown[0]!r}", where)
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolError(
            f"'{where}.function.name' must be 1-64 letters, digits, _ or -, got {name!r}",
            f"{where}.function.name",
        )
    if "parameters" in function and function["parameters"] is not None:
        _check_schema(function["parameters"], f"{where}.function.parameters")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise ToolError(f"'{where}.function.description' must be text", f"{where}.function")
    return {"type": "function", "function": dict(function)}


def _choice(raw: Any, names: list[str]) -> tuple[Mode, str | None]:
    if raw is None:
        return ("auto" if names else "none"), None
    if raw in ("none", "auto", "required"):
        if raw != "none" and not names:
            raise ToolError(f"tool_choice {raw!r} needs tools", "tool_choice")
        return raw, None
    if isinstance(raw, dict) and raw.get("type") == "function":
        name = (raw.get("function") or {}).get("name")
        if name not in names:
            raise ToolError(
                f"tool_choice names function {name!r}, which is not in tools "
                f"({', '.join(names) or 'none'})",
                "tool_choice",
            )
        return "named", name
    raise ToolError(
        "tool_choice must be none, auto, required or {type: function, function: {name}}",
        "tool_choice",
    )


def read_tools(
    tools: Any,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    messages: Sequence[Any] = (),
) -> ToolPlan | None:
    """The request's ToolPlan (None: no tools and no tool turns to check); ToolError for what
    cannot be used."""
    if tools is not None and not isinstance(tools, list):
        raise ToolError("'tools' must be a list of function tools", "tools")
    if tools and len(tools) > MAX_TOOLS:
        raise ToolError(f"'tools' holds {len(tools)} tools; at most {MAX_TOOLS}", "tools")
    defined = [_tool(t, i) for i, t in enumerate(tools or [])]
    names = [t["function"]["name"] for t in defined]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ToolError(f"'tools' defines {twice[0]!r} twice", "tools")
    _check_turns(messages)
    mode, forced = _choice(tool_choice, names)
    if not defined:
        return None
    return ToolPlan(tuple(defined), mode, forced, parallel_tool_calls is not False)


def _check_turns(messages: Sequence[Any]) -> None:
    """Every tool message answers a call an earlier assistant message made."""
    called: set[str] = set()
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        for j, call in enumerate(message.get("tool_calls") or []):
            where = f"messages[{i}].tool_calls[{j}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ToolError(
                    f"'{where}' must be {{id, type, function: {{name, arguments}}}}", where
                )
            arguments = function.get("arguments", "{}")
            if isinstance(arguments, str):
                try:
                    json.loads(arguments or "{}")
                except json.JSONDecodeError:
                    raise ToolError(
                        f"'{where}.function.arguments' is not JSON", f"{where}.function.arguments"
                    ) from None
            if isinstance(call.get("id"), str):
                called.add(call["id"])
        if message.get("role") == "tool":
            answered = message.get("tool_call_id")
            if answered not in called:
                raise ToolError(
                    f"'messages[{i}]' is a tool result for call {answered!r}, which no earlier "
                    "assistant message made",
                    f"messages[{i}].tool_call_id",
                )
