"""vLLM's CPU build and the reference engine produce the same greedy ids and texts on a tiny
Qwen3-MoE (fp32), with the requests batched together as a job would send them.

vLLM runs the experts through its CPU fused-MoE kernel (CPUUnquantizedExperts), which takes
fp32 and wants hidden_size a multiple of 32 (it zero-pads the expert width to one itself);
`tiny-hd32` has hidden 128 and head_dim 32, the smallest head vLLM's CPU attention takes."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from engines import load_engine
from tests.engine_fixtures import greedy_requests
from tests.vllm.test_parity import text_prompts

# In the slow set (two minutes on two cores: vLLM's fused-MoE start-up): by default the MoE
# family is checked against transformers (tests/integration/test_reference_moe.py) and vLLM
# against the reference engine on a dense model (test_parity.py).
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


def test_greedy_ids_and_texts_equal_the_reference_engines_on_qwen3_moe() -> None:
    from engines.dev.tiny import make_tiny_model

    model = make_tiny_model(
        Path(tempfile.mkdtemp(prefix="tokenmill-moe-vllm-")) / "qwen3_moe",
        arch="qwen3_moe",
        size="tiny-hd32",
    )
    requests = greedy_requests(text_prompts(model, 16))

    async def run(kind: str, **settings):
        engine = load_engine(kind, model=str(model), kv_cache_tokens=8192, **settings)
        try:
            return await asyncio.gather(*(engine.generate(r) for r in requests))
        finally:
            engine.shutdown()

    reference = asyncio.run(run("reference", num_threads=1))
    vllm = asyncio.run(run("vllm", enforce_eager=True))
    assert [r.finish_reason for r in vllm] == [r.finish_reason for r in reference]
    for ref, got in zip(reference, vllm, strict=True):
        assert got.output_token_ids == ref.output_token_ids, ref.request_id
        assert got.text == ref.text, ref.request_id
        assert got.completion_tokens == ref.completion_tokens
