"""Greedy ids of the reference engine == transformers `generate`, one prompt at a time, for
Llama / Qwen2 / Qwen3 (tied and untied), Qwen3-MoE and GPT-OSS (sliding window of 8 tokens
under prompts of up to ~80: the window masks matter), whatever the batching features do
underneath."""

from __future__ import annotations

import pytest

from engines.reference.engine import ReferenceEngine
from engines.reference.model.cpu_kernels import kernels_available
from tests.engine_fixtures import (
    check_attention_path,
    count_attention_paths,
    greedy_requests,
    hf_greedy,
    run_all,
    tiny_model,
    varied_prompts,
)

pytestmark = pytest.mark.timeout(300)

MODELS = [
    ("llama", False),
    ("qwen2", False),
    ("qwen3", True),
    ("qwen3_moe", False),
    ("gpt_oss", False),
]

# name -> (engine settings, seconds between submissions)
VARIANTS = {
    "default": ({}, 0.0),
    "no-prefix-cache": ({"enable_prefix_caching": False}, 0.0),
    "no-chunked-prefill": ({"enable_chunked_prefill": False, "max_num_tokens": 128}, 0.0),
    # 16-token steps chunk most prompts; 14 blocks of 8 tokens (room for the longest request
    # alone) force preemptions.
    "chunked-preempting": (
        {"max_num_tokens": 16, "kv_cache_tokens": 112, "block_size": 8, "max_batch_size": 8},
        0.0,
    ),
    "staggered": ({"max_num_tokens": 32}, 0.002),
    # Plain torch ops (gathered decode groups, unfused norms, RoPE and SiLU: what CUDA runs)
    # instead of the CPU kernels; chunked and preempting so every path is exercised.
    "torch-ops": (
        {"max_num_tokens": 16, "kv_cache_tokens": 112, "block_size": 8, "max_batch_size": 8},
        0.0,
    ),
}

_BASELINES: dict[tuple[str, bool], tuple[list, list[list[int]]]] = {}


def _baseline(arch: str, tied: bool):
    if (arch, tied) not in _BASELINES:
        model_dir = tiny_model(arch, tied)
        requests = greedy_requests(varied_prompts(32, seed=len(arch) + tied))
        _BASELINES[arch, tied] = (requests, hf_greedy(model_dir, requests))
    return _BASELINES[arch, tied]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(("arch", "tied"), MODELS, ids=[f"{a}-{t}" for a, t in MODELS])
def test_greedy_ids_match_transformers(arch: str, tied: bool, variant: str, monkeypatch) -> None:
    requests, expected = _baseline(arch, tied)
    settings, stagger = VARIANTS[variant]
    if variant == "torch-ops":
        monkeypatch.setattr("engines.reference.model.cpu_kernels.use_kernels", lambda device: False)
    paths = count_attention_paths(monkeypatch)
    engine = ReferenceEngine(str(tiny_model(arch, tied)), num_threads=1, **settings)
    try:
        results = run_all(engine, requests, stagger_s=stagger)
        stats = engine.stats()
    finally:
        engine.shutdown()

    assert [r.finish_reason for r in results] == ["length"] * len(requests)
    mismatched = [
        (r.request_id, exp, r.output_token_ids)
        for r, exp in zip(results, expected, strict=True)
        if r.output_token_ids != exp
    ]
    assert not mismatched, mismatched[:3]
    assert stats.kv_blocks_used == 0  # every block came back
    assert stats.num_finished == len(requests)
    cached = sum(r.cached_prompt_tokens for r in results)
    if settings.get("max_num_tokens", 2048) <= 128 and settings.get("enable_prefix_caching", True):
        # Small steps admit the prompts over several steps, so later ones reuse the shared
        # 40-token prefix computed by earlier ones.
        assert cached > 0
    if not settings.get("enable_prefix_caching", True):
        assert cached == 0
    if variant == "chunked-preempting":
        assert stats.num_preemptions > 0
        assert sum(r.num_preemptions for r in results) > 0
    check_attention_path(arch, paths, kernel=variant != "torch-ops" and kernels_available())
