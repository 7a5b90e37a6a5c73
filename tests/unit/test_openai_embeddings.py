"""The embeddings wire format: input shapes, refusals naming the field, base64 as OpenAI."""

from __future__ import annotations

import base64
import struct

import pytest

from pipeline.openai.embeddings import (
    EmbeddingsError,
    decode_base64,
    dimensions_error,
    embeddings_body,
    encode,
    parse_embeddings_request,
)


@pytest.mark.parametrize(
    ("given", "inputs"),
    [
        ("a", ["a"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_input_shapes(given, inputs) -> None:
    assert parse_embeddings_request({"model": "m", "input": given}).inputs == inputs


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "a"}, "model"),
        ({"model": "m"}, "input"),
        ({"model": "m", "input": []}, "input"),
        ({"model": "m", "input": ["a", ""]}, "input"),
        ({"model": "m", "input": [[1], [True]]}, "input"),
        ({"model": "m", "input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"model": "m", "input": "a", "dimensions": 0}, "dimensions"),
    ],
)
def test_refusals_name_the_field(body, param) -> None:
    with pytest.raises(EmbeddingsError) as err:
        parse_embeddings_request(body)
    assert err.value.param == param


def test_strict_refuses_unknown_fields() -> None:
    body = {"model": "m", "input": "a", "temperature": 1}
    assert parse_embeddings_request(body).inputs == ["a"]
    with pytest.raises(EmbeddingsError, match="temperature"):
        parse_embeddings_request(body, strict=True)


def test_base64_is_little_endian_float32() -> None:
    vector = [0.5, -1.25, 3.0]
    data = encode(vector, "base64")
    assert base64.b64decode(data) == struct.pack("<3f", *vector)
    assert decode_base64(data) == vector
    assert encode(vector, "float") == vector


def test_body_and_dimensions() -> None:
    body = embeddings_body("m", [[1.0], [2.0]], "float", 7)
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert dimensions_error(None, 64) is None and dimensions_error(64, 64) is None
    assert dimensions_error(32, 64).param == "dimensions"
