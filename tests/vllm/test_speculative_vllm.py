"""engine.speculative on vLLM (CPU build): n-gram speculation leaves greedy ids unchanged, and
vLLM's spec-decode counters show up in stats()."""

from __future__ import annotations

import asyncio
import random
import tempfile
from pathlib import Path

import pytest

from engines import load_engine
from engines.api import GenerationRequest, SamplingParams
from engines.speculative import resolve
from engines.vllm import speculative_config

pytestmark = pytest.mark.vllm


def test_speculative_config_dicts() -> None:
    ngram = speculative_config(resolve("vllm", {"method": "ngram", "prompt_lookup_max": 3}))
    assert ngram == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 3,
    }
    draft = speculative_config(resolve("vllm", {"method": "draft", "model": "/d", "num_tokens": 2}))
    assert draft == {"method": "draft_model", "model": "/d", "num_speculative_tokens": 2}


# In the slow set (two vLLM engines, a minute and a half here): the settings translation is
# checked above, and speculation itself on the reference engine in the default suite.
@pytest.mark.slow
def test_greedy_ids_equal_with_ngram_speculation() -> None:
    from engines.dev.tiny import make_tiny_model

    # Narrow init: the model's greedy output repeats itself, so n-gram proposals are accepted.
    model = make_tiny_model(
        Path(tempfile.mkdtemp(prefix="tokenmill-vllm-spec-")) / "llama",
        size="tiny-hd32",
        initializer_range=0.05,
    )
    rng = random.Random(0)
    requests = []
    for i in range(8):
        span = [rng.randrange(3, 1000) for _ in range(rng.randint(3, 8))]
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        requests.append(GenerationRequest(span * 3, params, request_id=f"r{i}"))

    async def run(**settings):
        engine = load_engine(
            "vllm", model=str(model), kv_cache_tokens=8192, enforce_eager=True, **settings
        )
        try:
            results = await asyncio.gather(*(engine.generate(r) for r in requests))
            return results, engine.stats()
        finally:
            engine.shutdown()

    plain, _ = asyncio.run(run())
    spec, stats = asyncio.run(run(speculative={"method": "ngram", "num_tokens": 3}))
    for a, b in zip(plain, spec, strict=True):
        assert b.output_token_ids == a.output_token_ids, a.request_id
    assert stats.spec_proposed_tokens >= stats.spec_accepted_tokens > 0
