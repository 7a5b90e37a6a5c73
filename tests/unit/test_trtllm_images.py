"""Images through the TensorRT-LLM adapter, against the stand-in written to 1.2's multimodal
input path (tests/standins/tensorrt_llm/_multimodal.py: the token prompt decoded and run
through the checkpoint's image processor, which expands one placeholder per image).

The prompt stage for engine.kind trtllm sends each image's file and no pixels; the adapter
collapses each image's placeholder run back to one and sends the images as PIL images; the
answer follows the prompt TensorRT-LLM expands, which must be the prompt stage's own (so
token counts and cost agree), and the image's content. What cannot run is the request's
error, and the engine goes on."""

from __future__ import annotations

import base64
import hashlib
import io
from pathlib import Path

import pytest

from engines.api import GenerationRequest, ImageInput, SamplingParams
from pipeline.batch.columns import IMAGES
from pipeline.batch.stages.images import images_cells, row_images
from pipeline.media.process import VisionProcessor
from pipeline.media.prompt import PromptImages
from pipeline.openai.chat import chat_messages
from pipeline.spec.images import ImagesSpec
from tests.unit.test_trtllm import engine_for, model_dir, run, toy_tokens, trt  # noqa: F401
from tests.vision_fixtures import random_images


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.dev.tiny import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("vl") / "qwen2_5_vl", arch="qwen2_5_vl"))


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


def prompt_stage(
    vl_dir: Path, images: list, text: str = "Describe it.", *, source: bool = True
) -> GenerationRequest:
    """A chat with `images` then `text`, as the prompt stage makes it for a trtllm (source)
    or reference (pixels) job: rendered, its images read, placeholders expanded."""
    from transformers import AutoTokenizer

    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    reader = PromptImages(vl_dir, ImagesSpec(), None, source=source)
    inputs = reader.inputs(
        chat_messages([{"role": "user", "content": [*parts, {"type": "text", "text": text}]}])
    )
    template_parts = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
    ids = AutoTokenizer.from_pretrained(vl_dir).apply_chat_template(
        [{"role": "user", "content": template_parts}], add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    sampling = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    return GenerationRequest(reader.expand(ids, inputs), sampling, images=inputs)


def image_values(vl_dir: Path, images: list) -> list[int]:
    """The stand-in's per-image toy value, from our own processing of the same image."""
    processor = VisionProcessor(vl_dir)
    out = []
    for image in images:
        pixels = processor.process(image).pixel_values
        digest = hashlib.blake2b(pixels, digest_size=4).digest()
        out.append(int.from_bytes(digest, "big") % 1000)
    return out


def test_the_prompt_stage_sends_the_file_for_trtllm_and_pixels_for_the_reference_engine(
    vl_dir: Path,
) -> None:
    image = random_images(((60, 90),))[0]
    trt_side = prompt_stage(vl_dir, [image])
    reference_side = prompt_stage(vl_dir, [image], source=False)
    (sent,) = trt_side.images
    (pixels,) = reference_side.images
    assert sent.source == png(image) and sent.pixel_values == b""
    assert pixels.source == b"" and len(pixels.pixel_values) == pixels.num_patches * 1176 * 4
    # The same image: the same grid, digest and expanded prompt either way.
    assert (sent.grid_thw, sent.content_hash) == (pixels.grid_thw, pixels.content_hash)
    assert trt_side.prompt_token_ids == reference_side.prompt_token_ids
    # Through the batch column between the prompt stage and the engine actors.
    assert row_images({IMAGES: images_cells(trt_side.images)}) == trt_side.images


def test_images_go_as_pil_images_one_placeholder_each_and_answers_follow_them(
    trt,  # noqa: F811
    vl_dir: Path,
) -> None:
    a, b, c = random_images(((60, 90), (120, 80), (60, 90)), seed=3)
    requests = [
        prompt_stage(vl_dir, [], "Just text."),
        prompt_stage(vl_dir, [a]),
        prompt_stage(vl_dir, [a, b]),
        prompt_stage(vl_dir, [c]),  # the size of a, other pixels
    ]
    engine = engine_for(vl_dir)
    llm = trt.LLM.instances[-1]
    results = run(_all(engine, requests))
    values = {0: [], 1: image_values(vl_dir, [a]), 2: image_values(vl_dir, [a, b])}
    values[3] = image_values(vl_dir, [c])
    for i, (request, result) in enumerate(zip(requests, results, strict=True)):
        assert result.finish_reason == "length", result.error
        # The stand-in expanded the collapsed prompt itself: equal to the prompt stage's.
        key = request.prompt_token_ids + values[i]
        assert result.output_token_ids == toy_tokens(key, 5), i
        assert result.prompt_tokens == len(request.prompt_token_ids)
    assert results[1].output_token_ids != results[3].output_token_ids  # other pixels
    # What crossed: each run as one placeholder, the images as PIL images of their sizes.
    image_token = VisionProcessor(vl_dir).image_token_id
    sent = [inputs["prompt_token_ids"] for inputs in llm.multimodal_inputs]
    assert [p.count(image_token) for p in sent] == [1, 2, 1]
    assert [len(p) for p in sent] == [
        len(r.prompt_token_ids) - sum(i.num_patches // 4 - 1 for i in r.images)
        for r in requests[1:]
    ]
    # The text-only request went as plain ids; TensorRT-LLM ran the expanded prompts.
    assert [p for p, _, _ in llm.submitted] == [r.prompt_token_ids for r in requests]
    images = [inputs["multi_modal_data"]["image"] for inputs in llm.multimodal_inputs]
    assert [[im.size for im in m] for m in images] == [
        [(90, 60)],
        [(90, 60), (80, 120)],
        [(90, 60)],
    ]
    engine.shutdown()


def test_what_cannot_be_sent_is_the_requests_error_and_the_engine_goes_on(
    trt,  # noqa: F811
    vl_dir: Path,
    model_dir: Path,  # noqa: F811
) -> None:
    import dataclasses

    image = random_images(((60, 90),))[0]
    good = prompt_stage(vl_dir, [image])
    (sent,) = good.images
    pixels_only = dataclasses.replace(
        good, images=(ImageInput(b"\0" * 4, sent.grid_thw, sent.content_hash),)
    )
    ids = list(good.prompt_token_ids)
    ids.remove(VisionProcessor(vl_dir).image_token_id)  # the image's run one short
    short = dataclasses.replace(good, prompt_token_ids=ids)
    engine = engine_for(vl_dir)
    llm = trt.LLM.instances[-1]
    missing, mismatch, fine = run(_all(engine, [pixels_only, short, good]))
    assert missing.finish_reason == "error" and "ImageInput.source" in missing.error
    assert mismatch.finish_reason == "error"
    assert "placeholder runs (5)" in mismatch.error and "token counts (6)" in mismatch.error
    assert fine.finish_reason == "length" and len(llm.submitted) == 1
    engine.shutdown()
    # A text checkpoint refuses images by name (the shared admission).
    text_engine = engine_for(model_dir)
    (refused,) = run(
        _all(text_engine, [GenerationRequest([5, 6, 7], good.sampling, images=good.images)])
    )
    assert refused.finish_reason == "error" and "takes text only" in refused.error
    text_engine.shutdown()


def test_a_streamed_request_with_an_image_ends_as_the_whole_one(
    trt,  # noqa: F811
    vl_dir: Path,
) -> None:
    request = prompt_stage(vl_dir, random_images(((120, 80),), seed=9))
    engine = engine_for(vl_dir)

    async def both():
        whole = await engine.generate(request)
        ids: list[int] = []
        async for delta in engine.stream(request):
            ids += delta.token_ids
        return whole, ids

    whole, streamed = run(both())
    assert whole.finish_reason == "length" and streamed == whole.output_token_ids
    engine.shutdown()


async def _all(engine, requests):
    import asyncio

    return await asyncio.gather(*(engine.generate(r) for r in requests))
