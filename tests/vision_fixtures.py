"""Prompts with images for the vision tests: random images of a few sizes, rendered with the
tiny Qwen2.5-VL's chat template and processed with its own image processor, and transformers'
greedy ids for them (the baseline every engine path must reproduce)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from engines.api import GenerationRequest, ImageInput, SamplingParams
from pipeline.media.process import VisionProcessor

# (height, width) in pixels: after the tiny processor's resize, grids of 4x6, 8x6 and 14x10
# patches (6, 12 and 35 image tokens; the largest spans several 2x2-block windows).
IMAGE_SIZES = ((60, 90), (120, 80), (200, 150))


def random_images(
    sizes: Sequence[tuple[int, int]] = IMAGE_SIZES, seed: int = 0, block: int = 1
) -> list:
    """Random RGB images; `block` > 1 makes them of block x block squares of one colour,
    whose PNG is a few KB (a request body under a server's size limit)."""
    from PIL import Image

    rs = np.random.RandomState(seed)
    out = []
    for h, w in sizes:
        cells = (rs.rand(-(-h // block), -(-w // block), 3) * 255).astype("uint8")
        pixels = cells.repeat(block, axis=0).repeat(block, axis=1)[:h, :w]
        out.append(Image.fromarray(np.ascontiguousarray(pixels)))
    return out


def vision_requests(
    model_dir: Path,
    cases: Sequence[tuple[list[dict], Sequence[int]]],
    max_tokens: int = 10,
    images: Sequence | None = None,
) -> tuple[list[GenerationRequest], list[ImageInput]]:
    """One greedy request per (content parts, indexes of the images its image parts show),
    over `images` (default: random_images())."""
    from transformers import AutoTokenizer

    processor = VisionProcessor(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    inputs = [processor.process(image) for image in images or random_images()]
    requests = []
    for parts, which in cases:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=True
        )
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        images = tuple(inputs[i] for i in which)
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        requests.append(GenerationRequest(processor.expand(ids, images), sampling, images=images))
    return requests, inputs


def hf_vision_greedy(model_dir: Path, requests: Sequence[GenerationRequest]) -> list[list[int]]:
    """transformers' Qwen2.5-VL `generate(do_sample=False)`, one request at a time."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    image_token = model.config.image_token_id
    takes_types = "mm_token_type_ids" in inspect.signature(model.model.get_rope_index).parameters
    outputs = []
    with torch.inference_mode():
        for request in requests:
            ids = torch.tensor([request.prompt_token_ids])
            extra = {}
            if request.images:
                pixels = [
                    torch.from_numpy(np.frombuffer(i.pixel_values, dtype=np.float32).copy())
                    for i in request.images
                ]
                extra = {
                    "pixel_values": torch.cat(pixels).view(-1, 1176),
                    "image_grid_thw": torch.tensor([i.grid_thw for i in request.images]),
                }
                if takes_types:  # transformers 5: without them, no 3D positions (4.5x: ids)
                    extra["mm_token_type_ids"] = (ids == image_token).int()
            model.model.rope_deltas = None  # a text prompt must not reuse the last image's
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=request.sampling.max_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
                **extra,
            )
            outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


TEXT = {"type": "text", "text": "describe what you see in a few words"}
IMAGE = {"type": "image"}
# 0, 1 and 2 images of different sizes; a repeated image with the same text (prefix cache).
CASES: list[tuple[list[dict], list[int]]] = [
    ([TEXT], []),
    ([IMAGE, TEXT], [0]),
    ([{"type": "text", "text": "compare"}, IMAGE, {"type": "text", "text": "with"}, IMAGE], [1, 2]),
    ([IMAGE, TEXT], [2]),
    ([{"type": "text", "text": "short story please"}], []),
    ([IMAGE, TEXT], [0]),
]
