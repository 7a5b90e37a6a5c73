"""Logprobs in the reference engine: each chosen token's logprob is the model's log-softmax at
its position (checked against transformers' forward pass over prompt + output), the top
alternatives are sorted and consistent, and streaming carries the same values."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from engines.api import GenerationRequest, ResponseFormat, SamplingParams
from engines.reference.engine import ReferenceEngine
from tests.engine_fixtures import run_all, tiny_model, varied_prompts

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = ReferenceEngine(str(model_dir), num_threads=1, max_model_len=256)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_logprobs(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax over the vocabulary at every output position: [len(output), V]."""
    ids = torch.tensor([prompt + output])
    with torch.inference_mode():
        logits = hf(ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) + len(output) - 1].log_softmax(-1)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_chosen_logprob_is_the_models_log_softmax(engine, hf, temperature) -> None:
    prompts = varied_prompts(6, seed=11)
    requests = [
        GenerationRequest(
            list(p),
            SamplingParams(max_tokens=12, temperature=temperature, seed=i, logprobs=5),
        )
        for i, p in enumerate(prompts)
    ]
    for request, result in zip(requests, run_all(engine, requests), strict=True):
        assert result.logprobs is not None
        assert [lp.token_id for lp in result.logprobs] == result.output_token_ids
        expected = _hf_logprobs(hf, request.prompt_token_ids, result.output_token_ids)
        for pos, lp in enumerate(result.logprobs):
            # Temperature does not change what is reported: the model's own distribution.
            assert lp.logprob == pytest.approx(expected[pos, lp.token_id].item(), abs=1e-4)
            assert len(lp.top) == 5
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True)
            assert lp.top[0][0] == int(expected[pos].argmax())
            assert all(v == pytest.approx(expected[pos, t].item(), abs=1e-4) for t, v in lp.top)
            if temperature == 0.0:
                assert lp.top[0] == (lp.token_id, pytest.approx(lp.logprob))
            assert math.log(sum(math.exp(v) for v in values)) <= 1e-6


def test_no_logprobs_unless_asked_and_zero_means_chosen_only(engine) -> None:
    prompt = varied_prompts(1, seed=2)[0]
    plain, chosen_only = run_all(
        engine,
        [
            GenerationRequest(list(prompt), SamplingParams(max_tokens=4, temperature=0)),
            GenerationRequest(
                list(prompt), SamplingParams(max_tokens=4, temperature=0, logprobs=0)
            ),
        ],
    )
    assert plain.logprobs is None
    assert [lp.top for lp in chosen_only.logprobs] == [()] * 4
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


def test_stream_carries_the_same_logprobs_and_masks_do_not_change_them(engine) -> None:
    prompt = varied_prompts(1, seed=4)[0]
    fmt = ResponseFormat("choice", choices=("alpha", "beta"))
    sampling = SamplingParams(max_tokens=10, temperature=0, logprobs=2, response_format=fmt)

    async def stream():
        deltas = []
        async for d in engine.stream(GenerationRequest(list(prompt), sampling)):
            deltas.append(d)
        return deltas

    deltas = asyncio.run(stream())
    streamed = [lp for d in deltas for lp in (d.logprobs or [])]
    result = deltas[-1].result
    assert streamed == result.logprobs
    assert len(streamed) == len(result.output_token_ids)
    # Under a mask the chosen token need not be the model's favourite; its logprob is still
    # the unmasked one, so it can be below the top alternative.
    assert all(lp.logprob <= lp.top[0][1] + 1e-6 for lp in streamed)


def _hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """log_softmax at every prompt position but the last: row p predicts token p + 1."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return logits[:-1].log_softmax(-1)


@pytest.mark.parametrize(
    "settings",
    [
        {},
        # Chunks of 16 tokens, and a pool so small that requests are preempted and recomputed.
        {"max_num_tokens": 16, "kv_cache_tokens": 192, "block_size": 8},
    ],
    ids=["one-chunk", "chunked-preempted"],
)
def test_prompt_logprobs_are_the_models_log_softmax(model_dir, hf, settings) -> None:
    """Every prompt token after the first gets its logprob given the tokens before it, also
    when the prompt is in the prefix cache (it is then computed anyway), split into chunks, or
    recomputed after a preemption (recorded once)."""
    eng = ReferenceEngine(str(model_dir), num_threads=1, max_model_len=256, **settings)
    try:
        prompts = [p for p in varied_prompts(8, seed=5) if len(p) > 20]
        # Warm the prefix cache with the same prompts first.
        run_all(eng, [GenerationRequest(list(p), SamplingParams(max_tokens=2)) for p in prompts])
        requests = [
            GenerationRequest(
                list(p), SamplingParams(max_tokens=30, temperature=0, prompt_logprobs=3)
            )
            for p in prompts
        ]
        results = run_all(eng, requests)
        if settings:
            assert sum(r.num_preemptions for r in results) > 0, "the pool should preempt"
        for request, result in zip(requests, results, strict=True):
            prompt = request.prompt_token_ids
            got = result.prompt_logprobs
            assert got is not None and len(got) == len(prompt) and got[0] is None
            assert result.cached_prompt_tokens == 0
            expected = _hf_prompt_logprobs(hf, prompt)
            for pos, lp in enumerate(got[1:]):
                assert lp.token_id == prompt[pos + 1]
                assert lp.logprob == pytest.approx(expected[pos, lp.token_id].item(), abs=1e-4)
                assert [t for t, _ in lp.top] == expected[pos].topk(3).indices.tolist()
        plain = run_all(eng, [GenerationRequest(list(prompts[0]), SamplingParams(max_tokens=2))])
        assert plain[0].prompt_logprobs is None
    finally:
        eng.shutdown()
