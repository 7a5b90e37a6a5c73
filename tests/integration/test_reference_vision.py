"""Qwen2.5-VL in the reference engine: greedy ids equal to transformers' for prompts with 0, 1
and 2 images of different sizes, batched with text-only prompts, under the prefix cache (a
repeated image), chunked prefill and preemption, and on the plain torch ops; a repeated image
reuses its blocks and a different one never does; bad images are the request's error."""

from __future__ import annotations

import dataclasses

import pytest

from engines.api import GenerationRequest
from engines.reference.engine import ReferenceEngine
from tests.engine_fixtures import run_all, tiny_model
from tests.vision_fixtures import CASES, hf_vision_greedy, vision_requests

pytestmark = pytest.mark.timeout(300)

VARIANTS = {
    "default": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
    # 16-token steps split every image prompt across steps (an image's tokens too); 20 blocks
    # of 8 tokens force preemptions, whose recompute encodes the image again.
    "chunked-preempting": {
        "max_num_tokens": 16,
        "kv_cache_tokens": 160,
        "block_size": 8,
        "max_batch_size": 8,
    },
    "torch-ops": {"max_num_tokens": 16, "kv_cache_tokens": 160, "block_size": 8},
}

_BASELINE: list = []


def _baseline():
    if not _BASELINE:
        model_dir = tiny_model("qwen2_5_vl")
        requests, inputs = vision_requests(model_dir, CASES)
        _BASELINE.extend([requests, hf_vision_greedy(model_dir, requests), inputs])
    return _BASELINE


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_ids_match_transformers(variant: str, monkeypatch) -> None:
    requests, expected, _ = _baseline()
    if variant == "torch-ops":
        monkeypatch.setattr("engines.reference.model.cpu_kernels.use_kernels", lambda device: False)
    engine = ReferenceEngine(str(tiny_model("qwen2_5_vl")), num_threads=1, **VARIANTS[variant])
    try:
        results = run_all(engine, requests)
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert [r.error for r in results] == [None] * len(requests)
    assert [r.output_token_ids for r in results] == expected
    # The images matter: the same text with different images answers differently.
    assert expected[1] != expected[3]
    assert expected[1] == expected[5]  # and the same image the same
    if variant == "chunked-preempting":
        assert stats.num_preemptions > 0
    # Image tokens are prompt tokens (and so are counted and charged as such).
    assert [r.prompt_tokens for r in results] == [len(r.prompt_token_ids) for r in requests]


def test_prefix_cache_keys_images_by_content() -> None:
    requests, _, _ = _baseline()
    first, same, other = requests[1], requests[5], requests[3]  # image 0, image 0, image 2
    image_start = first.prompt_token_ids.index(_image_token())
    engine = ReferenceEngine(str(tiny_model("qwen2_5_vl")), num_threads=1, block_size=4)
    try:
        run_all(engine, [first])
        again, different = run_all(engine, [same, other])
    finally:
        engine.shutdown()
    # The repeated image (same text before it) reuses its blocks past the image...
    assert again.cached_prompt_tokens > image_start + 1
    assert again.cached_prompt_tokens >= (len(first.prompt_token_ids) - 1) // 4 * 4
    # ...a different image of another size shares only the text before the placeholders.
    assert different.cached_prompt_tokens <= image_start


def test_same_size_different_pixels_share_no_image_block() -> None:
    """Two images of one size have identical placeholder ids: only the content key tells them
    apart, so the second must not reuse the first one's image blocks (its answer would be the
    first image's otherwise)."""
    requests, expected, inputs = _baseline()
    first = requests[1]
    swapped = dataclasses.replace(inputs[0], pixel_values=inputs[0].pixel_values[::-1])
    swapped = dataclasses.replace(swapped, content_hash="another-image")
    second = GenerationRequest(first.prompt_token_ids, first.sampling, images=(swapped,))
    engine = ReferenceEngine(str(tiny_model("qwen2_5_vl")), num_threads=1, block_size=4)
    try:
        a, b = run_all(engine, [first]) + run_all(engine, [second])
    finally:
        engine.shutdown()
    image_start = first.prompt_token_ids.index(_image_token())
    assert a.output_token_ids == expected[1]
    assert b.cached_prompt_tokens <= image_start
    assert b.output_token_ids != a.output_token_ids


def test_bad_images_are_the_request_error() -> None:
    requests, expected, inputs = _baseline()
    one = requests[1]
    too_few = GenerationRequest(one.prompt_token_ids, one.sampling, images=())
    extra = GenerationRequest(one.prompt_token_ids, one.sampling, images=(inputs[0], inputs[1]))
    truncated = dataclasses.replace(inputs[0], pixel_values=inputs[0].pixel_values[:-4])
    short = GenerationRequest(one.prompt_token_ids, one.sampling, images=(truncated,))
    wrong_grid = GenerationRequest(one.prompt_token_ids, one.sampling, images=(inputs[1],))
    engine = ReferenceEngine(str(tiny_model("qwen2_5_vl")), num_threads=1)
    try:
        results = run_all(engine, [too_few, extra, short, wrong_grid, one])
    finally:
        engine.shutdown()
    errors = [r.error or "" for r in results]
    assert "placeholder tokens" in errors[0] and "fill 0" in errors[0]
    assert "image 1 needs" in errors[1]
    assert "image 0" in errors[2] and "bytes of pixel values" in errors[2]
    assert "image 0 needs 12" in errors[3]
    assert results[4].error is None and results[4].output_token_ids == expected[1]


def test_images_to_a_text_model_are_refused() -> None:
    requests, _, _ = _baseline()
    engine = ReferenceEngine(str(tiny_model("qwen2")), num_threads=1)
    try:
        (result,) = run_all(engine, [requests[1]])
    finally:
        engine.shutdown()
    assert result.finish_reason == "error"
    assert "takes text only" in result.error


def _image_token() -> int:
    import json

    config = json.loads((tiny_model("qwen2_5_vl") / "config.json").read_text())
    return config["image_token_id"]
