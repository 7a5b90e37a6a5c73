"""A decoded image into what the engine takes: the model's own image processor, and the
prompt's placeholder expanded to one token per image token.

A chat template writes one image placeholder per image (Qwen2.5-VL: `<|image_pad|>` between
`<|vision_start|>` and `<|vision_end|>`); the model reads one embedding per merged patch, so
the placeholder is repeated as many times as the processed image has merged patches, which
depends on its size. Runs on CPU workers (prompt actors, Serve's ingress); the engine actors
only run the encoder.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engines.api import ImageInput


class ImageError(ValueError):
    """An image that cannot be used, with the reason (the caller names the row and part)."""


class VisionProcessor:
    """The model directory's image processor and placeholder rule, loaded once."""

    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir)
        config = json.loads((path / "config.json").read_text())
        vision = config.get("vision_config")
        if vision is None or "image_token_id" not in config:
            raise ImageError(
                f"{path} is a text-only model (config.json has no vision_config); images need "
                "a vision-language model such as Qwen2.5-VL"
            )
        if not (path / "preprocessor_config.json").exists():
            raise ImageError(
                f"{path} has no preprocessor_config.json: the model's image processor is "
                "needed to turn images into its inputs"
            )
        self.image_token_id = int(config["image_token_id"])
        self.merge = int(vision.get("spatial_merge_size", 2))
        self._images = load_image_processor(path)

    def process(self, image: Any) -> ImageInput:
        """A PIL image into the engine's input (pixels float32, grid, content digest)."""
        out = self._images(images=[image], return_tensors="np")
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        raw = pixels.tobytes()
        return ImageInput(
            pixel_values=raw,
            grid_thw=grid,  # type: ignore[arg-type]
            content_hash=hashlib.blake2b(raw, digest_size=16).hexdigest(),
        )

    def tokens(self, image: ImageInput) -> int:
        t, h, w = image.grid_thw
        return t * h * w // (self.merge * self.merge)

    def expand(self, prompt: Sequence[int], images: Sequence[ImageInput]) -> list[int]:
        """The prompt with its i-th placeholder repeated for the i-th image's tokens."""
        out: list[int] = []
        found = 0
        for token in prompt:
            if token != self.image_token_id:
                out.append(token)
                continue
            if found >= len(images):
                raise ImageError(
                    f"the prompt has more image placeholders than its {len(images)} image(s)"
                )
            out.extend([token] * self.tokens(images[found]))
            found += 1
        if found != len(images):
            raise ImageError(
                f"the prompt places {found} image(s) but {len(images)} were given; the chat "
                "template writes one placeholder per image part"
            )
        return out


def load_image_processor(path: Path) -> Any:
    """transformers' image processor of the model, without torchvision (the PIL backend)."""
    import transformers

    raw = json.loads((path / "preprocessor_config.json").read_text())
    if raw.get("image_processor_type", "").startswith("Qwen2VLImageProcessor"):
        # transformers 5 names the PIL backend apart; 4.5x's Qwen2VLImageProcessor is that one
        # (its fast sibling, which AutoImageProcessor may pick, needs torchvision).
        kind = getattr(transformers, "Qwen2VLImageProcessorPil", None)
        return (kind or transformers.Qwen2VLImageProcessor).from_pretrained(path)
    return transformers.AutoImageProcessor.from_pretrained(path)
