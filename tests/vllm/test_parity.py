"""vLLM and the reference engine produce the same greedy ids and texts (fp32, CPU) on every
tiny model family, with the requests batched together as a job would send them."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from engines import load_engine
from tests.engine_fixtures import greedy_requests

pytestmark = pytest.mark.vllm


def text_prompts(model: Path, count: int) -> list[list[int]]:
    """Prompts tokenized from text, as a job's are; every other one shares a long prefix.

    (Random ids can end in half a UTF-8 character; vLLM then prints part of the prompt into
    the output text, which no tokenized prompt does.)"""
    from transformers import AutoTokenizer

    from engines.quantize.calibration import sample_text

    tokenizer = AutoTokenizer.from_pretrained(model)
    sentences = sample_text(count + 4, seed=11)
    prefix = " ".join(sentences[-4:])
    texts = [(prefix + " " + s) if i % 2 else s for i, s in enumerate(sentences[:count])]
    return [tokenizer.encode(t) for t in texts]


# Llama in the default run; the other families (a minute each here) in the slow set. Each
# family's reference engine is checked against transformers in the default suite
# (tests/integration/test_reference_models.py).
@pytest.mark.parametrize(
    "arch",
    [
        "llama",
        pytest.param("qwen2", marks=pytest.mark.slow),
        pytest.param("qwen3", marks=pytest.mark.slow),
    ],
)
def test_greedy_ids_and_texts_equal_the_reference_engines(arch: str) -> None:
    from engines.dev.tiny import make_tiny_model

    model = make_tiny_model(
        Path(tempfile.mkdtemp(prefix="tokenmill-parity-")) / arch, arch=arch, size="tiny-hd32"
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
