"""A running request's images: where their placeholders sit, their pixels, their encodings.

Read once when the request is submitted (bad images are the request's error then, before it
takes a KV block). The encoder runs when the first prefill chunk that reaches an image's
placeholders is built; the result is kept until the chunk that takes the image's last
placeholder has run, so a chunked prefill encodes each image once. A preempted request that
recomputes its prompt encodes again from the pixels it keeps.

Prefix caching: the cache hashes token ids, and every placeholder of every image is the same
id, so the first placeholder of each image stands in the hashes as a negative id derived from
the image's content hash. Blocks chain their hashes, so every block from there on (the rest
of the image and all after it) is keyed by the image's content: a repeated image (with the
same text before it) reuses its blocks, different images never share one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engines.api import ImageInput
from engines.reference.model.config import ModelConfig
from engines.reference.model.mrope import prompt_positions


class MediaError(ValueError):
    """A request's images do not fit its prompt or the model (the request's error)."""


@dataclass
class PromptImage:
    start: int  # prompt index of its first placeholder
    length: int  # placeholders (image tokens)
    pixels: torch.Tensor  # [patches, patch_dim] float32
    grid: tuple[int, int, int]  # patch grid (t, h, w)
    embeds: torch.Tensor | None = None  # [length, hidden] while its prefill is under way

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class PromptMedia:
    images: list[PromptImage]
    positions: torch.Tensor  # [3, P] int64 mrope positions of the prompt
    delta: int  # a token at index p >= P sits at position p + delta
    hash_prompt: list[int] = field(default_factory=list)  # the prompt as the cache hashes it

    def hash_ids(self, token_ids: Sequence[int]) -> list[int]:
        """`token_ids` (prompt + outputs) as the prefix cache hashes them."""
        return self.hash_prompt + list(token_ids[len(self.hash_prompt) :])


def read_media(
    prompt: Sequence[int], images: Sequence[ImageInput], cfg: ModelConfig
) -> PromptMedia:
    """Check `images` against the prompt's placeholders and the model; MediaError says why
    not (naming the image by its place, 0-based)."""
    vision = cfg.vision
    if vision is None or cfg.image_token_id is None:
        raise MediaError(
            f"the prompt has {len(images)} image(s) but this model ({cfg.model_type}) takes "
            "text only; use a vision-language model (e.g. Qwen2.5-VL) or remove the images"
        )
    merge = vision.spatial_merge_size
    spans = []
    parsed = []
    at = 0  # placeholders consumed
    flat = [i for i, token in enumerate(prompt) if token == cfg.image_token_id]  # their places
    for i, image in enumerate(images):
        t, h, w = image.grid_thw
        if min(t, h, w) < 1 or h % merge or w % merge:
            raise MediaError(
                f"image {i}: grid {image.grid_thw} is not a whole number of {merge}x{merge} "
                "merged patches (processed with another model's processor?)"
            )
        count = vision.tokens(image.grid_thw)
        if at + count > len(flat) or flat[at + count - 1] - flat[at] != count - 1:
            raise MediaError(
                f"image {i} needs {count} consecutive image placeholder tokens in the prompt "
                f"(from its grid {image.grid_thw}), but the prompt has {len(flat) - at} left "
                "there; render the prompt with the processor that made the pixels"
            )
        start = flat[at]
        at += count
        expected = image.num_patches * vision.patch_dim * 4
        if len(image.pixel_values) != expected:
            raise MediaError(
                f"image {i}: {len(image.pixel_values)} bytes of pixel values, but grid "
                f"{image.grid_thw} at {vision.patch_dim} float32 values per patch needs {expected}"
            )
        pixels = torch.from_numpy(
            np.frombuffer(image.pixel_values, dtype=np.float32).reshape(-1, vision.patch_dim).copy()
        )
        parsed.append(PromptImage(start, count, pixels, image.grid_thw))
        spans.append((start, count, (t, h // merge, w // merge)))
    if at != len(flat):
        raise MediaError(
            f"the prompt has {len(flat)} image placeholder tokens but its {len(images)} "
            f"image(s) fill {at}; every placeholder needs its image's pixels"
        )
    positions, delta = prompt_positions(len(prompt), spans)
    hash_prompt = list(prompt)
    for image, given in zip(parsed, images, strict=True):
        # Negative: never a real token id; 63 bits of a digest of the content hash.
        digest = hashlib.blake2b(given.content_hash.encode(), digest_size=8).digest()
        hash_prompt[image.start] = -1 - (int.from_bytes(digest, "big") >> 1)
    return PromptMedia(parsed, positions, delta, hash_prompt)
