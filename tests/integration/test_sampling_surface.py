"""The reference engine's penalties, logit bias, min_tokens, bad words and min_p on a tiny
random model (fp32, CPU): greedy ids equal transformers `generate` with the matching logits
processors, all requests batched in one engine; speculation leaves such rows alone; seeded
sampling stays reproducible; n > 1 samples keep their own counts."""

from __future__ import annotations

import pytest
import torch

from engines.api import GenerationRequest, SamplingParams
from engines.reference.engine import ReferenceEngine
from engines.requests import bad_words_token_ids
from tests.engine_fixtures import run_all, tiny_model, varied_prompts

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 12


class _OpenAIPenalties:
    """OpenAI's frequency / presence penalties on the generated tokens (transformers has none)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


def _hf(model, prompt: list[int], processors: list, eos: int | None) -> list[int]:
    from transformers import LogitsProcessorList

    ids = torch.tensor([prompt])
    model.generation_config.eos_token_id = eos
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList(processors),
        )
    return out[0, ids.shape[1] :].tolist()


def _cases(model_dir, prompts: list[list[int]]):
    """(name, SamplingParams, transformers processors for a prompt, eos to stop on) per case."""
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        MinNewTokensLengthLogitsProcessor,
        NoBadWordsLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id
    # A word the unconstrained output of the first prompt holds, so banning it bites.
    plain = _hf(model, prompts[0], [], None)
    word = next(w for w in tokenizer.decode(plain).split() if bad_words_token_ids(tokenizer, (w,)))
    bad = bad_words_token_ids(tokenizer, (word,))
    favoured = plain[0] + 1
    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
    cases = [
        (
            "repetition",
            SamplingParams(repetition_penalty=1.8, ignore_eos=True, **greedy),
            lambda p: [RepetitionPenaltyLogitsProcessor(1.8)],
            None,
        ),
        (
            "repetition-below-1",
            SamplingParams(repetition_penalty=0.6, ignore_eos=True, **greedy),
            lambda p: [RepetitionPenaltyLogitsProcessor(0.6)],
            None,
        ),
        (
            # Negative: the random model hardly repeats itself in 12 tokens unless pushed to.
            "frequency-presence",
            SamplingParams(
                frequency_penalty=-1.5, presence_penalty=-2.0, ignore_eos=True, **greedy
            ),
            lambda p: [_OpenAIPenalties(len(p), -1.5, -2.0)],
            None,
        ),
        (
            "frequency-presence-positive",
            SamplingParams(frequency_penalty=2.0, presence_penalty=1.5, ignore_eos=True, **greedy),
            lambda p: [_OpenAIPenalties(len(p), 2.0, 1.5)],
            None,
        ),
        (
            "logit-bias",
            SamplingParams(logit_bias={favoured: 6.0, plain[1]: -4.0}, ignore_eos=True, **greedy),
            lambda p: [SequenceBiasLogitsProcessor([[[favoured], 6.0], [[plain[1]], -4.0]])],
            None,
        ),
        (
            # EOS pushed to the top: min_tokens alone keeps it away for 5 tokens.
            "min-tokens",
            SamplingParams(logit_bias={eos: 100.0}, min_tokens=5, **greedy),
            lambda p: [
                SequenceBiasLogitsProcessor([[[eos], 100.0]]),
                MinNewTokensLengthLogitsProcessor(len(p), 5, eos),
            ],
            eos,
        ),
        (
            "bad-words",
            SamplingParams(bad_words=(word,), ignore_eos=True, **greedy),
            lambda p: [NoBadWordsLogitsProcessor(bad)],
            None,
        ),
        (
            "everything",
            SamplingParams(
                repetition_penalty=1.3,
                frequency_penalty=0.5,
                presence_penalty=0.5,
                logit_bias={favoured: 2.0},
                bad_words=(word,),
                min_p=0.2,  # greedy: the top token always passes
                ignore_eos=True,
                **greedy,
            ),
            lambda p: [
                NoBadWordsLogitsProcessor(bad),
                SequenceBiasLogitsProcessor([[[favoured], 2.0]]),
                RepetitionPenaltyLogitsProcessor(1.3),
                _OpenAIPenalties(len(p), 0.5, 0.5),
            ],
            None,
        ),
    ]
    return model, cases, word


def test_greedy_ids_match_transformers_processors() -> None:
    model_dir = tiny_model("llama")
    prompts = varied_prompts(3, seed=5)
    model, cases, word = _cases(model_dir, prompts)
    requests, expected = [], []
    unprocessed = [_hf(model, prompt, [], None) for prompt in prompts]
    for name, params, processors, eos in cases:
        for i, prompt in enumerate(prompts):
            requests.append(GenerationRequest(prompt, params, request_id=f"{name}-{i}"))
            expected.append(_hf(model, prompt, processors(prompt), eos))
        # Each case changes some output, or the comparison would prove nothing (positive
        # penalties need repeats the random model rarely makes; the negative case bites).
        if name != "frequency-presence-positive":
            assert expected[-len(prompts) :] != unprocessed, name
    engine = ReferenceEngine(str(model_dir), num_threads=1, max_num_tokens=64)
    try:
        results = run_all(engine, requests)
    finally:
        engine.shutdown()
    mismatched = [
        (r.request_id, exp, r.output_token_ids)
        for r, exp in zip(results, expected, strict=True)
        if r.output_token_ids != exp
    ]
    assert not mismatched, mismatched[:3]
    for r in results:
        if r.request_id.startswith("min-tokens"):
            assert len(r.output_token_ids) == 6 and r.finish_reason == "stop"
        if r.request_id.startswith("bad-words"):
            assert word not in r.text.split()


def test_rows_with_processing_do_not_speculate_and_match_plain_decoding() -> None:
    from tests.integration.test_reference_speculative import repeating_model, repeating_prompts

    model_dir = repeating_model("llama", False)  # its outputs repeat: proposals get accepted
    prompts = repeating_prompts(4, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.4)
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    requests = [GenerationRequest(p, params, request_id=f"p{i}") for i, p in enumerate(prompts)]
    requests += [GenerationRequest(p, plain, request_id=f"q{i}") for i, p in enumerate(prompts)]

    def run(speculative):
        engine = ReferenceEngine(
            str(model_dir), num_threads=1, speculative=speculative, max_batch_size=16
        )
        try:
            return run_all(engine, requests)
        finally:
            engine.shutdown()

    without = run(None)
    with_spec = run({"method": "ngram", "num_tokens": 3, "disable_above_batch_size": 16})
    assert [r.output_token_ids for r in with_spec] == [r.output_token_ids for r in without]
    penalized = [r for r in with_spec if r.request_id.startswith("p")]
    assert all(r.spec_proposed_tokens == 0 for r in penalized)
    assert sum(r.spec_proposed_tokens for r in with_spec) > 0  # the others did speculate


def test_seeded_sampling_with_processing_is_reproducible_and_samples_keep_own_counts() -> None:
    from engines.samples import fan_out

    model_dir = tiny_model("llama")
    prompt = varied_prompts(1, seed=3)[0]
    params = SamplingParams(
        temperature=1.0,
        seed=7,
        max_tokens=16,
        ignore_eos=True,
        frequency_penalty=2.0,
        min_p=0.05,
        logit_bias={5: 1.0},
    )
    request = GenerationRequest(prompt, params, request_id="alone")
    others = [
        GenerationRequest(p, SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True))
        for p in varied_prompts(3, seed=4)
    ]
    group = fan_out(GenerationRequest(prompt, params, request_id="group"), 4)
    engine = ReferenceEngine(str(model_dir), num_threads=1)
    try:
        first = run_all(engine, [request])[0]
        crowded = run_all(engine, [*others, request, *group])
    finally:
        engine.shutdown()
    assert crowded[len(others)].output_token_ids == first.output_token_ids
    samples = crowded[len(others) + 1 :]
    # Each sample's own frequency penalty: a heavily penalized token rarely repeats within
    # one sample, whatever the other samples drew.
    for sample in samples:
        ids = sample.output_token_ids
        assert max(ids.count(t) for t in set(ids)) <= 3, ids
    assert len({tuple(s.output_token_ids) for s in samples}) > 1
