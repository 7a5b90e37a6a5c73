"""Response formats as users write them: every accepted shape, clear errors, conformance."""

from __future__ import annotations

import json

import pytest

from engines.api import ResponseFormat
from pipeline.openai.response_format import conforms, from_column
from pipeline.spec.response_format import FormatError, parse_response_format, to_json

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "value",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}},
        {"type": "json_schema", "schema": SCHEMA},
        json.dumps({"type": "json_schema", "schema": SCHEMA}),
    ],
)
def test_openai_and_flat_json_schema_shapes_read_the_same(value) -> None:
    fmt = parse_response_format(value)
    assert fmt == ResponseFormat.json(SCHEMA)
    assert from_column(to_json(fmt)) == fmt  # the canonical column text round-trips


def test_other_kinds_and_text() -> None:
    assert parse_response_format({"type": "text"}) is None
    assert parse_response_format(None) is None
    assert parse_response_format({"type": "json_object"}).kind == "json_object"
    assert parse_response_format({"type": "regex", "regex": "[0-9]+"}).regex == "[0-9]+"
    choice = parse_response_format({"type": "choice", "choices": ["a", "b"]})
    assert choice.choices == ("a", "b")
    assert from_column(to_json(choice)) == choice


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ({"type": "xml"}, "type must be one of"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
        ({"type": "json_schema", "schema": {"type": "strin"}}, "not a valid JSON schema"),
        ({"type": "regex"}, "regex"),
        ({"type": "choice", "choices": "a"}, "choices"),
        ({"type": "choice", "choices": ["a", ""]}, "non-empty"),
        ("{not json", "not valid JSON"),
        ([1, 2], "must be an object"),
    ],
)
def test_bad_formats_name_the_field(value, needle) -> None:
    with pytest.raises(FormatError, match="col 'f'") as info:
        parse_response_format(value, "col 'f'")
    assert needle in str(info.value)


def test_conforms() -> None:
    fmt = ResponseFormat.json(SCHEMA)
    assert conforms(fmt, '{"a": 3}')
    assert not conforms(fmt, '{"a": "3"}')
    assert not conforms(fmt, '{"a": 3')
    assert not conforms(fmt, '{"a": "\x16"}')  # raw control characters are not JSON
    assert conforms(ResponseFormat.json(), "{}") and not conforms(ResponseFormat.json(), "[]")
    assert conforms(ResponseFormat("regex", regex="[A-Z]{2}"), "AB")
    assert not conforms(ResponseFormat("regex", regex="[A-Z]{2}"), "ABC")
    assert conforms(ResponseFormat("choice", choices=("x y",)), "x y")
    assert not conforms(ResponseFormat("choice", choices=("x y",)), "x")


def test_job_spec_checks_the_format_at_validation() -> None:
    from pipeline.spec import SamplingSpec

    SamplingSpec(response_format={"type": "json_schema", "schema": SCHEMA})
    with pytest.raises(ValueError, match=r"sampling.response_format.type"):
        SamplingSpec(response_format={"type": "yaml"})
    SamplingSpec(overrides={"response_format": "fmt"})
