"""vLLM and the reference engine agree on the sampling surface beyond temperature / top-k /
top-p (fp32, CPU, greedy): penalties, logit bias, min_tokens, bad words and min_p give the same
ids, texts and finish reasons on both, all requests batched together."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from engines import load_engine
from engines.api import GenerationRequest, SamplingParams
from tests.vllm.test_parity import text_prompts

pytestmark = pytest.mark.vllm

MAX_TOKENS = 16


def _cases(model: Path, prompts: list[list[int]]) -> list[SamplingParams]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    eos = tokenizer.eos_token_id
    word = tokenizer.decode(prompts[0][:4]).split()[0]
    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
    return [
        SamplingParams(repetition_penalty=1.8, ignore_eos=True, **greedy),
        SamplingParams(repetition_penalty=0.7, ignore_eos=True, **greedy),
        SamplingParams(frequency_penalty=-1.5, presence_penalty=-2.0, ignore_eos=True, **greedy),
        SamplingParams(frequency_penalty=2.0, presence_penalty=1.0, ignore_eos=True, **greedy),
        SamplingParams(logit_bias={prompts[0][1]: 5.0, prompts[0][2]: -50.0}, **greedy),
        # EOS pushed to the top: min_tokens alone holds it off for 6 tokens.
        SamplingParams(logit_bias={eos: 100.0}, min_tokens=6, **greedy),
        SamplingParams(bad_words=(word, "the"), ignore_eos=True, **greedy),
        SamplingParams(
            min_p=0.3,
            repetition_penalty=1.2,
            frequency_penalty=0.4,
            presence_penalty=0.2,
            logit_bias={prompts[0][1]: 1.5},
            bad_words=(word,),
            ignore_eos=True,
            **greedy,
        ),
    ]


def test_processed_greedy_ids_equal_the_reference_engines() -> None:
    from engines.dev.tiny import make_tiny_model

    model = make_tiny_model(
        Path(tempfile.mkdtemp(prefix="tokenmill-sampling-")) / "llama",
        arch="llama",
        size="tiny-hd32",
    )
    prompts = text_prompts(model, 4)
    requests = [
        GenerationRequest(prompt, params, request_id=f"c{c}-p{p}")
        for c, params in enumerate(_cases(model, prompts))
        for p, prompt in enumerate(prompts)
    ]

    async def run(kind: str, **settings):
        engine = load_engine(kind, model=str(model), kv_cache_tokens=8192, **settings)
        try:
            return await asyncio.gather(*(engine.generate(r) for r in requests))
        finally:
            engine.shutdown()

    reference = asyncio.run(run("reference", num_threads=1))
    vllm = asyncio.run(run("vllm", enforce_eager=True))
    for ref, got in zip(reference, vllm, strict=True):
        assert got.finish_reason == ref.finish_reason, ref.request_id
        assert got.output_token_ids == ref.output_token_ids, ref.request_id
        assert got.text == ref.text, ref.request_id
    min_tokens = [r for r in reference if r.request_id.startswith("c5-")]
    assert all(len(r.output_token_ids) == 7 and r.finish_reason == "stop" for r in min_tokens)
