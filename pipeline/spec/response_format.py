"""Response formats as users write them: one reader for sampling.response_format, a row's
override, an OpenAI Batch line and a Serve request."""

from __future__ import annotations

import json
from typing import Any

from engines.api import ResponseFormat

FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "choice")


class FormatError(ValueError):
    """A response format that cannot be read; the message names the field."""


def parse_response_format(value: Any, where: str = "response_format") -> ResponseFormat | None:
    """A ResponseFormat from a dict or JSON text in one of the accepted shapes; None for text.

    Raises FormatError naming `where` and the field at fault."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise FormatError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise FormatError(f"{where} must be an object with a type, got {type(value).__name__}")
    kind = value.get("type")
    if kind not in FORMAT_TYPES:
        raise FormatError(f"{where}.type must be one of {', '.join(FORMAT_TYPES)}, got {kind!r}")
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return ResponseFormat("json_object")
        if kind == "json_schema":
            return ResponseFormat.json(_schema(value, where))
        if kind == "regex":
            return ResponseFormat("regex", regex=value.get("regex"))
        choices = value.get("choices")
        if not isinstance(choices, list):
            raise FormatError(f"{where}.choices must be a list of strings")
        return ResponseFormat("choice", choices=tuple(choices))
    except ValueError as exc:
        if isinstance(exc, FormatError):
            raise
        raise FormatError(f"{where}: {exc}") from None


def _schema(value: dict[str, Any], where: str) -> dict[str, Any]:
    """The JSON schema of a json_schema format (OpenAI's nesting or the flat one)."""
    nested = value.get("json_schema")
    if nested is not None:
        if not isinstance(nested, dict) or not isinstance(nested.get("schema"), dict):
            raise FormatError(f"{where}.json_schema.schema must be a JSON schema object")
        schema = nested["schema"]
        label = f"{where}.json_schema.schema"
    else:
        schema = value.get("schema")
        if not isinstance(schema, dict):
            raise FormatError(
                f"{where}: json_schema needs json_schema.schema (OpenAI's shape) or schema"
            )
        label = f"{where}.schema"
    from jsonschema import SchemaError, validators

    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        raise FormatError(f"{label} is not a valid JSON schema: {exc.message}") from None
    return schema


def to_json(fmt: ResponseFormat | None) -> str | None:
    """The canonical JSON text of a format (the flat shape), for a row's column."""
    if fmt is None:
        return None
    if fmt.kind == "json_schema":
        return json.dumps({"type": "json_schema", "schema": json.loads(fmt.schema)})
    if fmt.kind == "regex":
        return json.dumps({"type": "regex", "regex": fmt.regex})
    if fmt.kind == "choice":
        return json.dumps({"type": "choice", "choices": list(fmt.choices)})
    return json.dumps({"type": "json_object"})
