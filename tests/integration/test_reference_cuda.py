"""The reference engine on CUDA: same code as on CPU (skipped without a CUDA device)."""

from __future__ import annotations

import pytest

from engines.reference.engine import ReferenceEngine
from tests.engine_fixtures import greedy_requests, hf_greedy, run_all, tiny_model, varied_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def test_cuda_fp32_greedy_matches_transformers_and_bf16_runs() -> None:
    model_dir = tiny_model("qwen2")
    requests = greedy_requests(varied_prompts(32, seed=5))
    expected = hf_greedy(model_dir, requests)  # CPU fp32

    engine = ReferenceEngine(str(model_dir), device="cuda", dtype="float32", max_num_tokens=64)
    try:
        assert engine.info.device.startswith("cuda")
        results = run_all(engine, requests)
    finally:
        engine.shutdown()
    same = sum(r.output_token_ids == e for r, e in zip(results, expected, strict=True))
    # GPU kernels round differently from CPU ones; a rare late argmax flip is tolerated.
    assert same >= 0.9 * len(requests)
    assert all(r.output_token_ids[:2] == e[:2] for r, e in zip(results, expected, strict=True))

    engine = ReferenceEngine(str(model_dir), device="cuda", dtype="bfloat16")
    try:
        assert engine.info.dtype == "bfloat16"
        results = run_all(engine, requests)
    finally:
        engine.shutdown()
    assert [r.completion_tokens for r in results] == [r.sampling.max_tokens for r in requests]
