"""Stand-in for what TensorRT-LLM 1.2 does with `generate_async({"prompt_token_ids": ...,
"multi_modal_data": {"image": [...]}})` on a Qwen2-VL-family checkpoint (PyTorch backend).

What it copies: the LLM decodes the token prompt to text and hands it, with the images, to the
model's input processor (`_torch/models/modeling_qwen2vl.py`), which runs the checkpoint's
Hugging Face processor. That processor walks the text's `<|image_pad|>` placeholders, one per
image, and repeats each for its image's tokens (patches / merge²): a prompt with more
placeholders than images (one already expanded) runs past the image grid list (IndexError);
fewer is a ValueError. Images are PIL images (or CHW tensors, not used here). Errors surface
from generate_async itself, before any request exists.

The toy model then sees the expanded prompt plus one value per image drawn from its processed
pixels, so a different image changes the answer, as it would on the real model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


class ToyVisionInput:
    """The checkpoint's placeholder rule and image processor (its preprocessor_config.json)."""

    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir)
        config = json.loads((path / "config.json").read_text())
        vision = config.get("vision_config")
        self.is_vision = isinstance(vision, dict) and "image_token_id" in config
        if self.is_vision:
            self.image_token = int(config["image_token_id"])
            self.merge = int(vision.get("spatial_merge_size", 2))
        self._path = path
        self._processor: Any = None

    def expand(self, prompt: list[int], media: dict[str, Any]) -> tuple[list[int], list[int]]:
        """(the prompt as the model runs it, the toy model's key: that prompt plus one value
        per image)."""
        if not self.is_vision:
            # A text checkpoint gets the default input processor, which takes no media.
            raise ValueError("multi_modal_data needs a multimodal model")
        if set(media) - {"image"}:
            raise ValueError(f"unsupported modalities {sorted(set(media) - {'image'})}")
        images = media["image"]
        if not isinstance(images, list):
            raise TypeError("multi_modal_data['image'] must be a list of images")
        from PIL import Image

        for image in images:
            if not isinstance(image, Image.Image):
                raise TypeError(f"an image must be a PIL image, got {type(image).__name__}")
        placeholders = prompt.count(self.image_token)
        if placeholders > len(images):
            raise IndexError("index 1 is out of bounds for dimension 0 (image_grid_thw)")
        if placeholders < len(images):
            raise ValueError(
                f"Mismatch in `image` token count between text and `input_ids`: "
                f"{placeholders} placeholders, {len(images)} images"
            )
        out = self._processor_of()(images=images, return_tensors="np")
        grids = [int(t * h * w) for t, h, w in out["image_grid_thw"]]
        pixels = out["pixel_values"]
        expanded: list[int] = []
        found = 0
        for token in prompt:
            if token == self.image_token:
                expanded += [token] * (grids[found] // (self.merge * self.merge))
                found += 1
            else:
                expanded.append(token)
        values, start = [], 0
        for n in grids:
            digest = hashlib.blake2b(pixels[start : start + n].tobytes(), digest_size=4)
            values.append(int.from_bytes(digest.digest(), "big") % 1000)
            start += n
        return expanded, expanded + values

    def _processor_of(self) -> Any:
        if self._processor is None:
            # The checkpoint's own image processor, as the real input processor loads it (here
            # its PIL backend: no torchvision on CPU machines).
            from pipeline.media.process import load_image_processor

            self._processor = load_image_processor(self._path)
        return self._processor
