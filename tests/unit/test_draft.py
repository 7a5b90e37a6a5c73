"""Draft-model speculation with no model: the whole sampling distribution, rejection sampling
against a real draft distribution q (chi-square tests that every emitted token follows the
target's p), seeded reproducibility, and the draft's KV bookkeeping under random outcomes."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from engines.api import SamplingParams
from engines.reference.runtime.kv_cache import BlockManager
from engines.reference.sampling.sampler import make_generator, probabilities, sample
from engines.reference.speculative.draft import DraftBook, draft_pool_blocks
from engines.reference.speculative.verify import verify

GREEDY = SamplingParams(temperature=0.0, max_tokens=100)


def _logits(vocab: int, seed: int, scale: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * scale


def _pvalue(observed: torch.Tensor, p: torch.Tensor) -> float:
    keep = p > 0
    assert observed[~keep].sum() == 0  # tokens without mass are never emitted
    obs = observed[keep].double()
    exp = p[keep].double() / p[keep].double().sum() * obs.sum()
    return chisquare(obs.numpy(), exp.numpy()).pvalue


# --- the whole distribution ---------------------------------------------------------------


def test_probabilities_is_what_sample_draws_from() -> None:
    """For each kind of row (plain temperature, top-k, top-p, both), 20k draws of `sample`
    follow `probabilities`; greedy rows are one-hot at the argmax."""
    vocab, n = 8, 20_000
    row = _logits(vocab, 4)
    cases = [
        SamplingParams(temperature=0.9, max_tokens=1),
        SamplingParams(temperature=0.7, top_k=4, max_tokens=1),
        SamplingParams(temperature=1.2, top_p=0.8, max_tokens=1),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.7, max_tokens=1),
    ]
    gen = torch.Generator().manual_seed(1)
    for params in cases:
        p = probabilities(row[None, :], [params])[0]
        assert abs(p.sum().item() - 1.0) < 1e-5
        drawn = sample(row.repeat(n, 1), [params] * n, [None] * n, gen)
        assert _pvalue(torch.bincount(torch.tensor(drawn), minlength=vocab), p) > 1e-3
    greedy = probabilities(row[None, :], [GREEDY])[0]
    assert greedy[row.argmax()] == 1.0 and greedy.sum() == 1.0


# --- rejection sampling against q -----------------------------------------------------------


def _draft_run(params, q_rows: torch.Tensor, n: int, seed: int) -> list[list[int]]:
    """n independent requests' proposals, each token drawn from its q row."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.multinomial(q_rows, n, replacement=True, generator=g)  # [k, n]
    return draws.T.tolist()


def test_draft_rejection_sampling_keeps_the_target_distribution() -> None:
    """Many requests, each with two proposals drawn from a draft distribution q that differs
    from the target's p (q puts mass where p has none and misses some of p's): the first
    emitted token follows p1, the first proposal is accepted with probability
    sum(min(p1, q1)), and the second token, given the first was accepted, follows p2."""
    vocab, n = 6, 30_000
    params = SamplingParams(temperature=0.8, top_k=5, max_tokens=10)
    rows = torch.stack([_logits(vocab, 1), _logits(vocab, 2), _logits(vocab, 3)])
    p = probabilities(rows, [params] * 3)  # [3, V]: the target's at each position
    q = torch.stack([_logits(vocab, 11, 1.0), _logits(vocab, 12, 1.0)]).softmax(-1)
    q[0, p[0].argmax()] = 0.0  # the draft never proposes the target's favourite
    q = q / q.sum(-1, keepdim=True)
    assert (q[0] > 0).logical_and(p[0] == 0).any()  # and proposes what the target never says
    proposals = _draft_run(params, q, n, seed=5)
    default = torch.Generator().manual_seed(7)
    out = verify(rows.repeat(n, 1), proposals, [params] * n, [None] * n, default, [q] * n)

    firsts = torch.bincount(torch.tensor([v.tokens[0] for v in out]), minlength=vocab)
    assert _pvalue(firsts, p[0]) > 1e-3
    accepted = [v for v in out if v.num_accepted >= 1]
    expected_rate = torch.minimum(p[0], q[0]).sum().item()
    assert abs(len(accepted) / n - expected_rate) < 4 * (0.25 / n) ** 0.5
    seconds = torch.bincount(torch.tensor([v.tokens[1] for v in accepted]), minlength=vocab)
    assert _pvalue(seconds, p[1]) > 1e-3
    for v, props in zip(out, proposals, strict=True):
        assert v.tokens[: v.num_accepted] == props[: v.num_accepted]
        assert len(v.tokens) == v.num_accepted + 1 and v.num_proposed == 2


def test_draft_equal_to_target_is_always_accepted() -> None:
    vocab, n = 7, 2_000
    params = SamplingParams(temperature=1.0, max_tokens=10)
    rows = torch.stack([_logits(vocab, s) for s in range(3)])
    p = probabilities(rows, [params] * 3)
    proposals = _draft_run(params, p[:2], n, seed=2)
    out = verify(rows.repeat(n, 1), proposals, [params] * n, [None] * n, None, [p[:2]] * n)
    assert all(v.num_accepted == 2 for v in out)


def test_mixed_rows_follow_each_request() -> None:
    """A greedy row with q (argmax rule), a sampled row with q, and an n-gram row in one call:
    each gets its own logit rows; the greedy one is decided by argmax alone."""
    vocab = 8
    logits = torch.full((6, vocab), -9.0)
    for row, token in enumerate([3, 4, 1, 5, 6, 2]):
        logits[row, token] = 9.0
    q = torch.full((2, vocab), 1.0 / vocab)
    sampled = SamplingParams(temperature=1.0, max_tokens=10)
    out = verify(
        logits,
        [[3, 7], [5], []],  # rows 0-2, 3-4, 5
        [GREEDY, sampled, GREEDY],
        [None, make_generator(3, torch.device("cpu")), None],
        None,
        [q, q[:1], None],
    )
    assert out[0].tokens == [3, 4] and out[0].num_accepted == 1
    # p is one-hot at 5 (logit gap 18 at temperature 1): proposal 5 is accepted, bonus 6.
    assert out[1].tokens == [5, 6] and out[1].num_accepted == 1
    assert out[2].tokens == [2]


def test_seeded_draft_verification_is_reproducible() -> None:
    """Same seed, same proposals: same tokens; the generator advances by k + 1 draws."""
    vocab = 10
    rows = torch.stack([_logits(vocab, s) for s in range(4)])
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=10)
    q = torch.stack([_logits(vocab, 20 + s, 1.0) for s in range(3)]).softmax(-1)
    results = []
    for _ in range(2):
        gen = make_generator(4, torch.device("cpu"))
        results.append(verify(rows, [[1, 2, 3]], [params], [gen], None, [q])[0].tokens)
        replay = make_generator(4, torch.device("cpu"))
        torch.rand(4, generator=replay)
        assert torch.equal(gen.get_state(), replay.get_state())
    assert results[0] == results[1]


# --- draft KV bookkeeping -------------------------------------------------------------------


def _check(book: DraftBook, tokens: dict[str, list[int]]) -> None:
    bm = book.block_manager
    holders: dict[int, int] = {}
    for rid in tokens:
        if not book.has(rid):
            continue
        written = book.written(rid)
        table = bm._tables[rid]
        # Exactly the blocks the written tokens need (proposals included until the next sync).
        assert len(table.block_ids) >= bm.blocks_needed(len(written))
        for block_id in table.block_ids:
            holders[block_id] = holders.get(block_id, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in bm._free)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(6, 40),
    block_size=st.sampled_from([2, 4, 8]),
    budget=st.integers(1, 40),
    k=st.integers(1, 6),
    prefix=st.booleans(),
)
def test_draft_kv_never_leaks_blocks(seed, num_blocks, block_size, budget, k, prefix) -> None:
    """Requests speculate step after step with random accept/reject outcomes, budgets that cut
    catch-ups, a pool that is sometimes too small, preemptions and aborts: after each sync the
    draft holds exactly the prefix the request's tokens agree with, and when every request is
    gone every block is back in the pool."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    book = DraftBook(bm, max_len=64)
    shared = [rng.randrange(5) for _ in range(block_size * 2)]
    tokens = {
        f"r{i}": (shared if i % 2 else []) + [rng.randrange(5) for _ in range(rng.randint(1, 9))]
        for i in range(6)
    }
    for _ in range(60):
        if not tokens:
            break
        left = budget
        for rid, ids in list(tokens.items()):
            chunk = book.plan(rid, ids, k, left)
            if chunk is None:
                continue
            assert chunk.start + chunk.num_tokens <= len(ids)
            assert book.written(rid) == ids[: chunk.start]  # synced: what the draft keeps agrees
            left -= chunk.num_tokens
            book.caught_up(chunk, ids)
            proposals = [rng.randrange(5) for _ in range(chunk.num_proposals)]
            for token in proposals[:-1]:
                book.proposed(rid, token)
            assert len(bm.block_ids(rid)) == bm.blocks_needed(len(book.written(rid)))
            # The target keeps a random prefix of the proposals, then adds its own token.
            accepted = rng.randint(0, len(proposals))
            ids.extend([*proposals[:accepted], rng.randrange(5)])
        _check(book, tokens)
        for rid in list(tokens):
            if len(tokens[rid]) > 40 or rng.random() < 0.05:  # finished or aborted
                book.free(rid)
                del tokens[rid]
            elif rng.random() < 0.05:  # preempted: the draft starts over
                book.free(rid)
    for rid in tokens:
        book.free(rid)
    assert bm.num_used_blocks == 0


def test_draft_pool_holds_the_target_pool_and_proposal_room() -> None:
    assert draft_pool_blocks(100, 16, 4, 8) == 100 + 8 * 2
    assert draft_pool_blocks(10, 2, 5, 3) == 10 + 3 * 4
