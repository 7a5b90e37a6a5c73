"""The sampling surface beyond temperature / top-k / top-p: each parameter's validation, and the
reference engine's processed logits against transformers' logits processors (frequency and
presence penalties, which transformers lacks, against OpenAI's formula)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from engines.api import SamplingParams
from engines.reference.sampling.processing import LogitsProcessing
from engines.reference.sampling.sampler import _min_p, make_generator, sample

CPU = torch.device("cpu")
VOCAB = 40
PROMPT = [3, 5, 5, 7]
OUTPUT = [9, 3, 9, 11, 9]


@dataclass
class _Sched:
    token_ids: list[int]
    num_prompt_tokens: int


@dataclass
class _Request:
    request_id: str


@dataclass
class _Live:
    """What LogitsProcessing.apply reads of the engine's live request."""

    request: _Request
    sched: _Sched = field(default_factory=lambda: _Sched([], 0))


def _logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _processed(
    params: SamplingParams,
    output: list[int] = OUTPUT,
    eos: tuple[int, ...] = (2,),
    bad_words: list[list[int]] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw logits, the same after LogitsProcessing) for one request."""
    processing = LogitsProcessing(VOCAB, CPU)
    processing.admit("r", params, PROMPT, eos, bad_words)
    live = _Live(_Request("r"), _Sched(PROMPT + list(output), len(PROMPT)))
    raw = _logits()
    logits = raw.clone()
    processing.apply(logits, [0], [live])
    return raw, logits


def _input_ids(output: list[int] = OUTPUT) -> torch.Tensor:
    return torch.tensor([PROMPT + output])


# --- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frequency_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("min_tokens", -1),
        ("min_tokens", 17),  # above max_tokens (16)
        ("logit_bias", {5: 101}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"5": 1.0}),
        ("bad_words", [" "]),
    ],
)
def test_invalid_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_neutral_values_use_no_processing_and_logit_bias_is_hashable() -> None:
    neutral = SamplingParams(
        frequency_penalty=0.0,
        presence_penalty=0,
        repetition_penalty=1.0,
        min_p=0.0,
        min_tokens=0,
        logit_bias={},
        bad_words=[],
    )
    assert not neutral.uses_logits_processing
    biased = SamplingParams(logit_bias={7: 1, 2: -3.5})
    assert biased.logit_bias == ((2, -3.5), (7, 1.0))
    assert hash(biased) == hash(SamplingParams(logit_bias=[(7, 1.0), (2, -3.5)]))
    assert biased.uses_logits_processing
    assert not SamplingParams(min_p=0.5).uses_logits_processing  # min_p lives in the sampler


def test_a_step_without_processing_rows_leaves_logits_alone() -> None:
    processing = LogitsProcessing(VOCAB, CPU)
    logits = _logits(rows=2)
    before = logits.clone()
    processing.apply(logits, [0, 1], [_Live(_Request("a")), _Live(_Request("b"))])
    assert torch.equal(logits, before)


# --- against transformers --------------------------------------------------------------------


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    raw, ours = _processed(SamplingParams(repetition_penalty=penalty))
    expected = RepetitionPenaltyLogitsProcessor(penalty)(_input_ids(), raw.clone())
    torch.testing.assert_close(ours, expected)


def test_frequency_and_presence_penalties_follow_openai_formula() -> None:
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=-1.25)
    raw, ours = _processed(params)
    counts = torch.zeros(VOCAB)
    for token in OUTPUT:  # generated tokens only: the prompt's 5 and 7 are not penalized
        counts[token] += 1
    expected = raw - 0.5 * counts - (-1.25) * (counts > 0)
    torch.testing.assert_close(ours, expected)


def test_penalties_combine_in_vllm_order() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    params = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.4)
    raw, ours = _processed(params)
    counts = torch.zeros(VOCAB)
    for token in OUTPUT:
        counts[token] += 1
    expected = RepetitionPenaltyLogitsProcessor(1.2)(_input_ids(), raw.clone())
    expected = expected - 0.3 * counts - 0.4 * (counts > 0)
    torch.testing.assert_close(ours, expected)


def test_logit_bias_matches_transformers_sequence_bias() -> None:
    from transformers import SequenceBiasLogitsProcessor

    bias = {4: 5.0, 9: -100.0, 30: 0.25}
    raw, ours = _processed(SamplingParams(logit_bias=bias))
    hf = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    torch.testing.assert_close(ours, hf(_input_ids(), raw.clone()))


@pytest.mark.parametrize("num_output", [0, 2, 3, 4])
def test_min_tokens_matches_transformers(num_output: int) -> None:
    from transformers import MinNewTokensLengthLogitsProcessor

    output = OUTPUT[:num_output]
    params = SamplingParams(min_tokens=3, stop_token_ids=(12,))
    raw, ours = _processed(params, output=output, eos=(2, 6))
    hf = MinNewTokensLengthLogitsProcessor(len(PROMPT), 3, [2, 6, 12])
    torch.testing.assert_close(ours, hf(_input_ids(output), raw.clone()))
    assert torch.isinf(ours[0, [2, 6, 12]]).all() == (num_output < 3)


@pytest.mark.parametrize("num_output", [0, 1, 3, 5])
def test_bad_words_match_transformers_on_the_output(num_output: int) -> None:
    from transformers import NoBadWordsLogitsProcessor

    output = OUTPUT[:num_output]
    words = [[13], [9, 3, 20], [11, 9, 21], [9, 22]]
    raw, ours = _processed(SamplingParams(bad_words=("x",)), output=output, bad_words=words)
    # The prefix is matched against the generated tokens (vLLM's rule): transformers sees
    # the output after a token no word holds (it skips words as long as its whole context).
    hf = NoBadWordsLogitsProcessor(words)
    generated = torch.tensor([[0, *output]])
    torch.testing.assert_close(ours, hf(generated, raw.clone()))


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_min_p_matches_transformers_after_temperature(min_p: float, temperature: float) -> None:
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    raw = _logits(rows=3, seed=4)
    params = [SamplingParams(min_p=min_p, temperature=temperature)] * 3
    ours = _min_p(raw / temperature, params)
    scaled = TemperatureLogitsWarper(temperature)(None, raw.clone())
    torch.testing.assert_close(ours, MinPLogitsWarper(min_p)(None, scaled))


def test_min_p_samples_only_kept_tokens_and_leaves_other_rows_alone() -> None:
    logits = _logits(rows=2, seed=9)
    kept = set(
        (_min_p(logits[:1], [SamplingParams(min_p=0.2)]) > -torch.inf).nonzero()[:, 1].tolist()
    )
    plain = SamplingParams(temperature=1.0, seed=1)
    seen = set()
    for seed in range(100):
        params = [SamplingParams(min_p=0.2, seed=seed), plain]
        tokens = sample(logits, params, [make_generator(seed, CPU), make_generator(1, CPU)])
        seen.add(tokens[0])
        # the row without min_p draws what it draws alone
        assert tokens[1] == sample(logits[1:], [plain], [make_generator(1, CPU)])[0]
    assert seen <= kept


def test_counts_grow_incrementally_and_slots_are_reused() -> None:
    processing = LogitsProcessing(VOCAB, CPU)
    params = SamplingParams(frequency_penalty=1.0)
    processing.admit("a", params, PROMPT, (2,))
    live = _Live(_Request("a"), _Sched(list(PROMPT), len(PROMPT)))
    for step, token in enumerate([4, 4, 8]):
        live.sched.token_ids.append(token)
        logits = torch.zeros(1, VOCAB)
        processing.apply(logits, [0], [live])
        assert logits[0, 4] == -min(step + 1, 2)
    processing.free("a")
    processing.admit("b", params, PROMPT, (2,))  # the freed slot, counts zeroed
    fresh = _Live(_Request("b"), _Sched(list(PROMPT), len(PROMPT)))
    logits = torch.zeros(1, VOCAB)
    processing.apply(logits, [0], [fresh])
    assert torch.equal(logits, torch.zeros(1, VOCAB))


# --- the job spec ------------------------------------------------------------------------------


def test_job_sampling_fields_reach_every_rows_params() -> None:
    from pipeline.batch.stages.rows import row_sampling
    from pipeline.spec import SamplingSpec

    spec = SamplingSpec(
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        repetition_penalty=1.1,
        min_p=0.05,
        min_tokens=2,
        logit_bias={7: -100, 3: 2.5},
        bad_words=["foo"],
    )
    params = row_sampling({"id": "r"}, spec)
    assert (params.frequency_penalty, params.presence_penalty) == (0.5, -0.5)
    assert (params.repetition_penalty, params.min_p, params.min_tokens) == (1.1, 0.05, 2)
    assert params.logit_bias == ((3, 2.5), (7, -100.0)) and params.bad_words == ("foo",)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frequency_penalty", 3),
        ("repetition_penalty", 0),
        ("min_p", 2),
        ("min_tokens", -1),
        ("logit_bias", {1: 200}),
        ("bad_words", [" "]),
    ],
)
def test_job_spec_refuses_bad_values_by_field(field: str, value: object) -> None:
    from pydantic import ValidationError

    from pipeline.spec import SamplingSpec

    with pytest.raises(ValidationError, match=field):
        SamplingSpec(**{field: value})
