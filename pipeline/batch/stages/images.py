"""The IMAGES column between the prompt stage and the engine actors: each image of a row as
the engine takes it (engines.api.ImageInput), in placeholder order; empty for text rows."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from engines.api import ImageInput
from pipeline.batch.columns import IMAGES, MESSAGES
from pipeline.spec import JobSpec

if TYPE_CHECKING:
    import pyarrow as pa


def images_type() -> pa.DataType:
    """list<struct<pixel_values, grid_thw, hash, source>>; large_binary: one image's pixels
    can pass 2 GiB over a batch of rows. One of pixel_values and source is empty (the engine
    kind reads the other: pipeline/media/prompt.py SOURCE_KINDS)."""
    import pyarrow as pa

    return pa.list_(
        pa.struct(
            [
                pa.field("pixel_values", pa.large_binary()),
                pa.field("grid_thw", pa.list_(pa.int32())),
                pa.field("hash", pa.string()),
                pa.field("source", pa.large_binary()),
            ]
        )
    )


def images_cells(images: Sequence[ImageInput]) -> list[dict[str, Any]]:
    """A row's IMAGES cell."""
    return [
        {
            "pixel_values": i.pixel_values,
            "grid_thw": list(i.grid_thw),
            "hash": i.content_hash,
            "source": i.source,
        }
        for i in images
    ]


def row_images(row: Mapping[str, Any]) -> tuple[ImageInput, ...]:
    """A prompt-stage row's images as the engine takes them (the engine actor's side)."""
    return tuple(
        ImageInput(
            pixel_values=bytes(cell["pixel_values"]),
            grid_thw=tuple(int(x) for x in cell["grid_thw"]),  # type: ignore[arg-type]
            content_hash=str(cell["hash"]),
            source=bytes(cell.get("source") or b""),
        )
        for cell in row.get(IMAGES) or ()
    )


def may_have_images(row: Mapping[str, Any], spec: JobSpec) -> bool:
    """Cheap pre-check before a row's chat is read again for its images."""
    if any(row.get(c) is not None for c in spec.input.image_columns):
        return True
    messages = row.get(MESSAGES)
    if messages is None:
        return False
    text = messages if isinstance(messages, str) else json.dumps(messages, default=str)
    return "image_url" in text
