"""tool_choice required or named: the output is constrained by structured output to valid
calls, so it always parses, whatever the model's weights.

- named: the output is the function's arguments (an object valid under its parameters);
- required: a JSON array of {"name", "arguments"} objects, each name one of the tools and its
  arguments valid under that tool's parameters; one call only without parallel_tool_calls.

(vLLM builds the same shapes for these choices.) The schema goes to the engine as a
response_format of type json_schema; the text that comes back is read by calls_from_constrained.
"""

from __future__ import annotations

import json
from typing import Any

from pipeline.openai.tools.request import ToolCall, ToolPlan


def _arguments_schema(plan: ToolPlan, name: str) -> dict[str, Any]:
    schema = dict(plan.schema_of(name))
    schema.setdefault("type", "object")
    return schema


def call_schema(plan: ToolPlan) -> dict[str, Any]:
    """The response_format (json_schema) that makes the output the plan's calls."""
    if plan.mode == "named":
        assert plan.forced is not None
        schema = _arguments_schema(plan, plan.forced)
        label = f"{plan.forced}_arguments"
    else:
        one_of = [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "arguments": _arguments_schema(plan, n)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for n in plan.names
        ]
        schema = {
            "type": "array",
            "items": one_of[0] if len(one_of) == 1 else {"anyOf": one_of},
            "minItems": 1,
        }
        if not plan.parallel:
            schema["maxItems"] = 1
        label = "tool_calls"
    return {"type": "json_schema", "json_schema": {"name": label, "schema": schema, "strict": True}}


def calls_from_constrained(plan: ToolPlan, text: str) -> list[ToolCall]:
    """The calls in a constrained output; [] when it does not parse (cut by max_tokens: the
    text then stays the answer's content and finish_reason says length)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if plan.mode == "named":
        if not isinstance(value, dict):
            return []
        assert plan.forced is not None
        return [ToolCall(plan.forced, json.dumps(value, ensure_ascii=False))]
    if not isinstance(value, list):
        return []
    calls = []
    for item in value:
        if isinstance(item, dict) and item.get("name") in plan.names:
            arguments = item.get("arguments", {})
            calls.append(ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls
