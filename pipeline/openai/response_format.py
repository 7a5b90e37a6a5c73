"""Response formats as users write them, and whether a finished text conforms to one.

One reader for every place a format comes from, so a job's `sampling.response_format`, a row's
override column, an OpenAI Batch API line and a Serve request accept the same shapes:

- OpenAI's: `{"type": "text"}` (no constraint), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}`;
- tokenmill's extensions, in the same style: `{"type": "json_schema", "schema": {...}}`,
  `{"type": "regex", "regex": "..."}`, `{"type": "choice", "choices": ["a", "b"]}`.

`conforms` is what the batch output's `parsed` column reports: a row whose generation stopped
at max_tokens has a cut text, and schema-constrained rows are only usable when it is True.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from engines.api import ResponseFormat
from pipeline.spec.response_format import parse_response_format


@functools.lru_cache(maxsize=256)
def from_column(text: str) -> ResponseFormat | None:
    """A format from a row's canonical column text; cached, as most rows share one."""
    return parse_response_format(text)


@functools.lru_cache(maxsize=256)
def _validator(schema: str) -> Any:
    from jsonschema import validators

    loaded = json.loads(schema)
    return validators.validator_for(loaded)(loaded)


def conforms(fmt: ResponseFormat, text: str) -> bool:
    """True when `text` is a whole answer in `fmt`: valid JSON under the schema, a JSON
    object, a full regex match, or one of the choices."""
    if fmt.kind == "choice":
        return text in fmt.choices
    if fmt.kind == "regex":
        try:
            return re.fullmatch(fmt.regex, text) is not None
        except re.error:  # a regex dialect Python's re does not read: not checkable here
            return False
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return False
    if fmt.kind == "json_object":
        return isinstance(value, dict)
    return _validator(fmt.schema).is_valid(value)
