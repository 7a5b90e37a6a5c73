"""Embeddings and the vllm kind.

The vllm kind refuses embed requests (vLLM embeds only in its pooling runner, a separate
engine that cannot generate), as a row error naming the reference engine. vLLM's own pooling
runner is the peer the reference engine's default is checked against: on the same tiny model
and token ids, its default embeddings for a decoder-only model (last token, normalised) equal
the reference engine's default within fp32 noise."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from engines import load_engine
from engines.api import EmbedParams, GenerationRequest
from tests.vllm.test_parity import text_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def _model() -> Path:
    from engines.dev.tiny import make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="tokenmill-embed-vllm-"))
    return make_tiny_model(root / "llama", arch="llama", size="tiny-hd32")


# Slow (90 s): by default the reference engine's embeddings equal transformers'
# (tests/integration/test_reference_embed.py); this compares vLLM's pooling runner too.
@pytest.mark.slow
def test_vllm_pooling_runner_equals_the_reference_default() -> None:
    from vllm import LLM

    model = _model()
    prompts = text_prompts(model, 8)

    async def reference():
        engine = load_engine("reference", model=str(model), num_threads=1, dtype="float32")
        try:
            requests = [GenerationRequest(p, embed=EmbedParams()) for p in prompts]
            return await asyncio.gather(*(engine.generate(r) for r in requests))
        finally:
            engine.shutdown()

    ours = [r.embedding for r in asyncio.run(reference())]
    llm = LLM(
        model=str(model),
        runner="pooling",
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        kv_cache_memory_bytes=64 << 20,  # the default reserves most of the machine's memory
    )
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts])
    theirs = [list(o.outputs.embedding) for o in outputs]
    for a, b in zip(ours, theirs, strict=True):
        assert len(a) == len(b)
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
