"""Sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from engines.api import SamplingParams
from engines.reference.sampling.sampler import make_generator, sample

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


# ---- properties of the vectorised sampler -------------------------------------------------


def _draws(logits_row: torch.Tensor, params: SamplingParams, n: int, first_seed: int = 0):
    """`n` samples of one distribution in ONE call: n copies of the row, seeds differ."""
    logits = logits_row.expand(n, -1).contiguous()
    gens = [make_generator(first_seed + s, CPU) for s in range(n)]
    return sample(logits, [params] * n, gens)


def test_top_k_support_is_exactly_the_k_largest() -> None:
    for trial in range(5):
        row = _logits(rows=1, vocab=40, seed=trial)[0]
        k = 2 + trial
        picks = _draws(row, SamplingParams(temperature=10.0, top_k=k), 1500)
        assert set(picks) == set(torch.topk(row, k).indices.tolist())


def test_top_k_keeps_no_more_than_k_when_the_kth_value_is_tied() -> None:
    row = torch.tensor([5.0, 4.0, 3.0, 3.0, 3.0, 1.0])
    picks = _draws(row, SamplingParams(temperature=50.0, top_k=3), 1500)
    assert len(set(picks)) == 3 and {0, 1} <= set(picks) and 5 not in picks


def _nucleus(probs: torch.Tensor, top_p: float) -> list[int]:
    """The shortest most-likely-first prefix whose mass reaches top_p."""
    order = torch.sort(probs, descending=True).indices.tolist()
    kept, mass = [], 0.0
    for token in order:
        kept.append(token)
        mass += float(probs[token])
        if mass >= top_p:
            break
    return kept


def test_top_p_support_is_the_smallest_prefix_reaching_p_with_the_right_shares() -> None:
    row = torch.linspace(0.0, 3.0, 12)[
        torch.randperm(12, generator=torch.Generator().manual_seed(2))
    ]
    probs = row.softmax(-1)
    for top_p in (0.3, 0.6, 0.85):
        kept = _nucleus(probs, top_p)
        n = 4000
        picks = _draws(row, SamplingParams(temperature=1.0, top_p=top_p), n)
        assert set(picks) == set(kept)
        expected = probs[kept] / probs[kept].sum()
        shares = torch.tensor([picks.count(t) / n for t in kept])
        assert (shares - expected).abs().max() < 0.03


def test_top_k_then_top_p_renormalises_over_the_k() -> None:
    # k=3 leaves 0.5/0.3/0.2 (renormalised); top_p 0.75 then keeps the first two.
    row = torch.tensor([0.4, 0.24, 0.16, 0.1, 0.1]).log()
    picks = _draws(row, SamplingParams(temperature=1.0, top_k=3, top_p=0.75), 1000)
    assert set(picks) == {0, 1}


def test_seeded_rows_reproduce_whatever_the_batch_composition() -> None:
    vocab = 300
    targets = [
        SamplingParams(temperature=0.9, seed=11),
        SamplingParams(temperature=1.3, top_k=20, seed=12),
        SamplingParams(temperature=1.0, top_p=0.8, seed=13),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=14),
    ]
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, top_k=20),
        SamplingParams(temperature=0.5, top_k=50, top_p=0.5, seed=99),
        SamplingParams(top_p=0.3),
    ]
    steps = 15
    logits = [_logits(rows=1, vocab=vocab, seed=100 + s)[0] for s in range(steps)]

    def run(layout: list[int | None], default_seed: int) -> dict[int, list[int]]:
        """layout: target index or None (a filler row); returns each target's tokens."""
        gens = {t: make_generator(targets[t].seed, CPU) for t in layout if t is not None}
        filler = [i % len(others) for i in range(len(layout))]
        default = torch.Generator().manual_seed(default_seed)
        out: dict[int, list[int]] = {t: [] for t in gens}
        for step in range(steps):
            params = [
                targets[t] if t is not None else others[f]
                for t, f in zip(layout, filler, strict=True)
            ]
            row_gens = [
                gens[t] if t is not None else make_generator(others[f].seed, CPU)
                for t, f in zip(layout, filler, strict=True)
            ]
            noise = _logits(rows=len(layout), vocab=vocab, seed=step + default_seed)
            batch = torch.stack(
                [logits[step] if t is not None else noise[i] for i, t in enumerate(layout)]
            )
            tokens = sample(batch, params, row_gens, default)
            for t, token in zip(layout, tokens, strict=True):
                if t is not None:
                    out[t].append(token)
        return out

    alone = {t: run([t], 0)[t] for t in range(len(targets))}
    assert len({tuple(v) for v in alone.values()}) == len(targets)  # really random
    for layout, seed in [
        ([None, 0, 1, None, 2, 3], 1),
        ([3, None, None, 2, None, 1, 0, None, None], 2),
        ([2, 0], 3),
        ([None] * 7 + [1] + [None] * 20 + [3], 4),
    ]:
        assert run(layout, seed) == {t: alone[t] for t in layout if t is not None}


def test_tiny_temperatures_are_greedy_and_small_ones_still_sample() -> None:
    from engines.api import GREEDY_TEMPERATURE

    logits = _logits(rows=6, vocab=500, seed=7)
    params = [SamplingParams(temperature=t) for t in (0.0, 1e-9, GREEDY_TEMPERATURE / 2)] + [
        SamplingParams(temperature=0.8, top_k=1),
        SamplingParams(temperature=GREEDY_TEMPERATURE * 2, top_p=0.5),
        SamplingParams(temperature=GREEDY_TEMPERATURE * 2),
    ]
    gens = [make_generator(i, CPU) for i in range(6)]
    # Just above the threshold the distribution is a point mass too; no inf / nan on the way.
    assert sample(logits, params, gens) == logits.argmax(-1).tolist()


def test_one_host_sync_per_step(monkeypatch) -> None:
    calls = {"tolist": 0}
    real_tolist = torch.Tensor.tolist

    def counting_tolist(self):
        calls["tolist"] += 1
        return real_tolist(self)

    def no_item(self):
        raise AssertionError("a per-row .item() sync")

    logits = _logits(rows=8, vocab=100)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.5, seed=4),
    ] * 2
    gens = [make_generator(p.seed, CPU) for p in params]
    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    monkeypatch.setattr(torch.Tensor, "item", no_item)
    sample(logits, params, gens)
    assert calls["tolist"] == 1


def test_top_p_over_a_large_vocabulary_on_both_paths() -> None:
    # A peaked row's nucleus lies in its top 256 tokens (the topk path); a flat row's does not
    # (the full sort). Each keeps exactly its nucleus and, batched together, gives the tokens
    # it gives alone.
    gen = torch.Generator().manual_seed(8)
    peaked = torch.randn(1000, generator=gen) * 4
    flat = torch.randn(1000, generator=gen) * 0.05
    params = SamplingParams(temperature=1.0, top_p=0.5)
    kept_peaked = _nucleus(peaked.softmax(-1), 0.5)
    kept_flat = _nucleus(flat.softmax(-1), 0.5)
    assert len(kept_peaked) < 30 and len(kept_flat) > 256
    assert set(_draws(peaked, params, 1500)) == set(kept_peaked)
    picks = _draws(flat, params, 1500)
    assert set(picks) <= set(kept_flat) and len(set(picks)) > 256

    both = torch.stack([peaked, flat])
    for seed in range(20):
        alone = [
            sample(row[None], [params], [make_generator(seed + i, CPU)])[0]
            for i, row in enumerate((peaked, flat))
        ]
        batched = sample(both, [params, params], [make_generator(seed + i, CPU) for i in (0, 1)])
        assert batched == alone
