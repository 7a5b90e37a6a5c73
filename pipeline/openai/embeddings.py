"""OpenAI's embeddings wire format: the request body of `/v1/embeddings` (Serve and Batch API
lines alike) and the response body.

`input` is a string, a list of strings, a list of token ids, or a list of token id lists;
`encoding_format` "float" (lists of numbers) or "base64" (the float32 values, little-endian,
base64-encoded, as OpenAI sends them); `dimensions` is accepted only when it equals the
model's own size (there is no truncation to shorter, Matryoshka-style, embeddings).
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Any, Literal

EncodingFormat = Literal["float", "base64"]
ENCODING_FORMATS: tuple[str, ...] = ("float", "base64")
# OpenAI's limit on inputs in one request.
MAX_INPUTS = 2048
# Body fields this endpoint reads; `user` is accepted and ignored, as OpenAI only logs it.
FIELDS = ("model", "input", "encoding_format", "dimensions", "user")


class EmbeddingsError(ValueError):
    """A request body the endpoint refuses; `param` names the field."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class EmbeddingsRequest:
    model: str
    inputs: list[str | list[int]]  # each: a text to tokenize, or token ids as given
    encoding_format: EncodingFormat = "float"
    dimensions: int | None = None


def parse_embeddings_request(body: Any, *, strict: bool = False) -> EmbeddingsRequest:
    """The request, or EmbeddingsError naming the field to change. `strict`: unknown fields
    are refused (otherwise ignored, as OpenAI-compatible servers commonly do)."""
    if not isinstance(body, dict):
        raise EmbeddingsError("the request body must be a JSON object", None)
    unknown = sorted(set(body) - set(FIELDS))
    if strict and unknown:
        raise EmbeddingsError(f"unknown field(s) for embeddings: {', '.join(unknown)}", unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise EmbeddingsError("'model' is required: the name of a served model", "model")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ENCODING_FORMATS:
        raise EmbeddingsError(
            f"'encoding_format' must be one of {', '.join(ENCODING_FORMATS)}, got {fmt!r}",
            "encoding_format",
        )
    dimensions = body.get("dimensions")
    if dimensions is not None and (
        isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1
    ):
        raise EmbeddingsError(
            f"'dimensions' must be an integer >= 1, got {dimensions!r}", "dimensions"
        )
    return EmbeddingsRequest(model, _inputs(body.get("input")), fmt, dimensions)


def _inputs(raw: Any) -> list[str | list[int]]:
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif isinstance(raw, list) and raw and all(_is_token(t) for t in raw):
        items = [raw]  # one token id list
    elif isinstance(raw, list) and raw:
        items = raw
    else:
        raise EmbeddingsError(
            "'input' must be a string, a list of strings, a list of token ids or a list of "
            "token id lists, and not empty",
            "input",
        )
    if len(items) > MAX_INPUTS:
        raise EmbeddingsError(
            f"'input' holds {len(items)} items; at most {MAX_INPUTS} per request", "input"
        )
    out: list[str | list[int]] = []
    for i, item in enumerate(items):
        if isinstance(item, str) and item:
            out.append(item)
        elif isinstance(item, list) and item and all(_is_token(t) for t in item):
            out.append(list(item))
        else:
            raise EmbeddingsError(
                f"'input[{i}]' must be a non-empty string or a non-empty list of token ids",
                "input",
            )
    return out


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def encode(vector: list[float], fmt: EncodingFormat) -> list[float] | str:
    """One embedding as the response carries it."""
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def decode_base64(data: str) -> list[float]:
    """The inverse of encode(..., "base64") (clients and tests)."""
    raw = base64.b64decode(data)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def embeddings_body(
    model: str, vectors: list[list[float]], fmt: EncodingFormat, prompt_tokens: int
) -> dict[str, Any]:
    """The response body: one `embedding` object per input, in input order."""
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode(v, fmt)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def dimensions_error(requested: int | None, size: int) -> EmbeddingsError | None:
    """The refusal of a `dimensions` other than the model's own size, or None."""
    if requested is None or requested == size:
        return None
    return EmbeddingsError(
        f"'dimensions' {requested} is not supported: this model's embeddings have {size} "
        "dimensions and are not truncated; leave it out or send it",
        "dimensions",
    )
