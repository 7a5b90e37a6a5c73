"""Sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from engines.api import SamplingParams
from engines.reference.sampler import make_generator, sample

CPU = torch.device("cpu")


def _logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax() -> None:
    logits = _logits()
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(top_k=1)]
    assert sample(logits, params, [None] * 4) == logits.argmax(-1).tolist()


def test_top_k_keeps_only_the_k_most_likely() -> None:
    logits = _logits(rows=1, vocab=30)
    top3 = set(torch.topk(logits[0], 3).indices.tolist())
    params = [SamplingParams(temperature=5.0, top_k=3)]
    seen = {sample(logits, params, [make_generator(s, CPU)])[0] for s in range(200)}
    assert seen <= top3
    assert len(seen) == 3  # a hot temperature reaches all three


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    seen = {
        sample(logits, [SamplingParams(top_p=0.75)], [make_generator(s, CPU)])[0]
        for s in range(300)
    }
    assert seen == {0, 1}  # 0.5 < 0.75 needs the second token; the third is never needed
    seen = {
        sample(logits, [SamplingParams(top_p=0.1)], [make_generator(s, CPU)])[0] for s in range(50)
    }
    assert seen == {0}  # the most likely token always stays


def test_temperature_sharpens_and_flattens() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])

    def share_of_top(temperature: float) -> float:
        picks = [
            sample(logits, [SamplingParams(temperature=temperature)], [make_generator(s, CPU)])[0]
            for s in range(400)
        ]
        return picks.count(0) / len(picks)

    assert share_of_top(0.2) > 0.95
    assert 0.25 < share_of_top(50.0) < 0.45


def test_seeded_row_ignores_its_batch_neighbours() -> None:
    target = SamplingParams(temperature=1.0, seed=1234)
    logits = _logits(rows=5, vocab=200, seed=3)
    alone = [sample(logits[2:3], [target], [gen])[0] for gen in [make_generator(1234, CPU)]]
    # Same row among others (greedy, unseeded, other seeds), several times in a row.
    gen_alone = make_generator(1234, CPU)
    gen_batched = make_generator(1234, CPU)
    for _ in range(10):
        alone = sample(logits[2:3], [target], [gen_alone])[0]
        params = [
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.7),
            target,
            SamplingParams(temperature=1.0, seed=5),
            SamplingParams(top_p=0.5),
        ]
        gens = [None, None, gen_batched, make_generator(5, CPU), None]
        batched = sample(logits, params, gens, default_generator=torch.Generator())[2]
        assert batched == alone


def test_unseeded_rows_use_the_default_generator() -> None:
    logits = _logits(rows=1, vocab=100)
    params = [SamplingParams(temperature=1.0)]
    a = [sample(logits, params, [None], torch.Generator().manual_seed(9))[0] for _ in range(3)]
    b = [sample(logits, params, [None], torch.Generator().manual_seed(9))[0] for _ in range(3)]
    assert a == b
