"""bf16 parity: the reference engine in bfloat16 against transformers, per model family.

bf16 keeps 8 bits of mantissa, so two correct implementations that round in a different order
(fused q/k/v and gate/up projections, another matmul blocking, paged attention) pick different
argmaxes wherever the top two logits are closer than the rounding, and greedy sequences part
there. Exact equality is therefore not the bar. The documented tolerance (docs/engine.md,
"bf16 parity") is relative to transformers' own bf16 against the fp32 truth:
- the first generated token equals fp32's as often as transformers' bf16 gets it (it is decided
  by the prompt alone: a broken prefill shows here first);
- the share of generated tokens before the first divergence from fp32 is within
  BF16_SHARE_TOLERANCE of transformers' bf16 share (measured: 0.74-0.76 ours, 0.71-0.77 theirs on
  these models);
- and the engine's bf16 agrees with transformers' bf16 on most tokens (a wrong but consistent
  engine would agree with neither).
With prefix caching, chunked prefill and preemption on, as the fp32 equality tests run them.
"""

from __future__ import annotations

import pytest

from engines.reference.engine import ReferenceEngine
from tests.engine_fixtures import greedy_requests, hf_greedy, run_all, tiny_model, varied_prompts

pytestmark = pytest.mark.timeout(300)

BF16_SHARE_TOLERANCE = 0.10
# 16-token steps chunk most prompts; 28 blocks of 8 tokens force preemptions.
SETTINGS = {"max_num_tokens": 16, "kv_cache_tokens": 224, "block_size": 8, "max_batch_size": 8}


def agreement(ours: list[list[int]], truth: list[list[int]]) -> tuple[float, float]:
    """(share of tokens before each sequence's first divergence, share of equal first tokens)."""
    matched = total = firsts = 0
    for a, b in zip(ours, truth, strict=True):
        k = 0
        while k < len(a) and a[k] == b[k]:
            k += 1
        matched, total, firsts = matched + k, total + len(b), firsts + (a[:1] == b[:1])
    return matched / total, firsts / len(truth)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bf16_greedy_is_as_close_to_fp32_as_transformers_bf16(arch: str) -> None:
    model_dir = tiny_model(arch)
    requests = greedy_requests(varied_prompts(32, seed=7), seed=3)
    truth = hf_greedy(model_dir, requests)
    theirs = hf_greedy(model_dir, requests, dtype="bfloat16")
    engine = ReferenceEngine(str(model_dir), dtype="bfloat16", num_threads=1, **SETTINGS)
    try:
        results = run_all(engine, requests)
        stats = engine.stats()
    finally:
        engine.shutdown()
    ours = [r.output_token_ids for r in results]
    assert [len(o) for o in ours] == [r.sampling.max_tokens for r in requests]
    assert stats.num_preemptions > 0 and stats.kv_blocks_used == 0

    our_share, our_firsts = agreement(ours, truth)
    their_share, their_firsts = agreement(theirs, truth)
    assert our_firsts >= their_firsts - 1 / len(requests), (our_firsts, their_firsts)
    assert our_share >= their_share - BF16_SHARE_TOLERANCE, (our_share, their_share)
    assert agreement(ours, theirs)[0] >= 0.6, agreement(ours, theirs)
