"""A request with images as TensorRT-LLM 1.2 (PyTorch backend) takes it.

The prompt stage sends the prompt with each image's placeholder already expanded (one
`<|image_pad|>` per image token: the reference engine needs them there, and every engine
kind counts them as prompt tokens) and, for this kind, each image's file
(`ImageInput.source`) instead of pixels. TensorRT-LLM's multimodal input processor works from
the other end: handed `{"prompt_token_ids", "multi_modal_data": {"image": [...]}}`, it decodes
the ids back to text and runs the checkpoint's Hugging Face processor on that text and the
images, which expands each single placeholder itself (a run already expanded would be read as
one image per placeholder). So each run is collapsed back to one placeholder here, after
checking that the runs are exactly the request's images, and the images go as PIL images.
The expansion TensorRT-LLM makes equals the prompt stage's when both read the same
`preprocessor_config.json` (the checkpoint's), so token counts and cost agree.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.api import GenerationRequest, ImageInput


@dataclass(frozen=True)
class VisionTokens:
    """The checkpoint's image placeholder and how many patches make one image token."""

    image: int  # <|image_pad|>
    merge: int  # vision_config.spatial_merge_size: tokens = patches / merge²

    @classmethod
    def read(cls, model_dir: Path) -> VisionTokens | None:
        """From the checkpoint's whole config.json (requests.read_config keeps only the
        language model's part); None for a text-only checkpoint."""
        return cls.of(json.loads((model_dir / "config.json").read_text()))

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> VisionTokens | None:
        """From a whole config.json; None for a text-only checkpoint."""
        vision = config.get("vision_config")
        if not isinstance(vision, Mapping) or "image_token_id" not in config:
            return None
        return cls(int(config["image_token_id"]), int(vision.get("spatial_merge_size", 2)))

    def tokens(self, image: ImageInput) -> int:
        return image.num_patches // (self.merge * self.merge)

    def collapse(self, prompt: Sequence[int], images: Sequence[ImageInput]) -> list[int]:
        """`prompt` with each image's run of placeholders back to one; ValueError naming the
        mismatch when the runs are not exactly `images`' token counts, in order."""
        out: list[int] = []
        runs: list[int] = []
        for token in prompt:
            if token == self.image and out and out[-1] == self.image:
                runs[-1] += 1
                continue
            if token == self.image:
                runs.append(1)
            out.append(token)
        want = [self.tokens(i) for i in images]
        if runs != want:
            raise ValueError(
                f"the prompt's image placeholder runs ({_counts(runs)}) do not match its "
                f"images' token counts ({_counts(want)}): expand each image's placeholder "
                "once, for its own tokens"
            )
        return out

    def check(self, request: GenerationRequest) -> None:
        """ValueError (the request's error) when `inputs` cannot be made: an image without its
        file, or placeholder runs that are not the images'. Decodes nothing."""
        missing = [i for i, image in enumerate(request.images) if not image.source]
        if missing:
            raise ValueError(
                f"image(s) {missing} carry pixels only: TensorRT-LLM runs the model's image "
                "processor itself and needs each image's file (ImageInput.source)"
            )
        self.collapse(request.prompt_token_ids, request.images)

    def inputs(self, request: GenerationRequest) -> dict[str, Any]:
        """generate_async's `inputs` for a request with images (checked by `check`)."""
        return {
            "prompt_token_ids": self.collapse(request.prompt_token_ids, request.images),
            "multi_modal_data": {"image": [decode(i.source) for i in request.images]},
        }


def decode(data: bytes) -> Any:
    """An image file as the RGB PIL image TensorRT-LLM's processor takes."""
    # Pillow: only where images are sent (TensorRT-LLM's own dependencies include it).
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


def _counts(values: Sequence[int]) -> str:
    return ", ".join(str(v) for v in values) or "none"
