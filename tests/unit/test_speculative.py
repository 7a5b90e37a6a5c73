"""Speculative decoding pieces with no model: n-gram proposals, verification (incl. a
chi-square test that sampling keeps the target distribution), KV rollback bookkeeping, and
the engine.speculative settings."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from engines.api import EngineError, SamplingParams
from engines.reference.runtime.kv_cache import BlockManager, hash_block
from engines.reference.runtime.scheduler import Request, Scheduler, SchedulerConfig
from engines.reference.speculative.verify import NgramIndex, verify
from engines.speculative import SpeculativeConfig, problems, resolve

GREEDY = SamplingParams(temperature=0.0, max_tokens=100)

# --- proposals -----------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    index = NgramIndex(min_n=2, max_n=3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 5, 6, 7]
    # Suffix (5, 6, 7) matched at 0..3 (the longest match wins over the later (6, 7) at 5).
    assert index.propose(tokens, 3) == [8, 1, 6]
    tokens += [8]
    # (6, 7, 8) occurred ending at 4: what followed is 1, 6, 7.
    assert index.propose(tokens, 2) == [1, 6]


def test_ngram_prefers_the_latest_occurrence_and_respects_min() -> None:
    index = NgramIndex(min_n=2, max_n=2)
    tokens = [1, 2, 3, 1, 2, 4, 1, 2]
    assert index.propose(tokens, 1) == [4]  # latest (1, 2) is followed by 4, not 3
    assert NgramIndex(min_n=3, max_n=4).propose([1, 2, 3, 9, 2, 3], 2) == []  # (2, 3) too short
    assert index.propose([7], 3) == []


def test_ngram_extends_a_short_period_to_k_tokens() -> None:
    index = NgramIndex(min_n=1, max_n=2)
    tokens = [4, 9, 9, 9]
    # Latest earlier (9, 9) ended at 3: only one token follows, the copy continues from itself.
    assert index.propose(tokens, 4) == [9, 9, 9, 9]
    assert NgramIndex(1, 3).propose([1, 2, 3, 1, 2, 3, 1], 5) == [2, 3, 1, 2, 3]


def test_ngram_index_grows_incrementally_like_a_fresh_one() -> None:
    rng = random.Random(3)
    tokens = [rng.randrange(4) for _ in range(5)]
    incremental = NgramIndex(1, 3)
    for _ in range(60):
        tokens.append(rng.randrange(4))
        assert incremental.propose(tokens, 3) == NgramIndex(1, 3).propose(tokens, 3)


# --- verification --------------------------------------------------------------------------


def test_greedy_verification_accepts_the_matching_prefix() -> None:
    logits = torch.full((4, 8), -5.0)
    for row, token in enumerate([3, 4, 6, 2]):  # target argmax per position
        logits[row, token] = 5.0
    out = verify(logits, [[3, 4, 5]], [GREEDY], [None])
    assert out[0].tokens == [3, 4, 6]  # 3 and 4 accepted, 5 rejected: the target's 6 instead
    assert (out[0].num_proposed, out[0].num_accepted) == (3, 2)
    all_good = verify(logits, [[3, 4, 6]], [GREEDY], [None])[0]
    assert all_good.tokens == [3, 4, 6, 2] and all_good.num_accepted == 3  # plus the bonus


def test_verification_rows_follow_each_request() -> None:
    logits = torch.zeros(5, 8)
    logits[0, 1] = logits[1, 2] = logits[2, 7] = logits[3, 5] = logits[4, 6] = 9.0
    out = verify(logits, [[2], [], [5]], [GREEDY] * 3, [None] * 3)
    # Rows 0-1 verify request 0 (2 rejected), row 2 is request 1's, rows 3-4 request 2's.
    assert [v.tokens for v in out] == [[1], [7], [5, 6]]
    assert [v.num_accepted for v in out] == [0, 0, 1]


def _target(vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * 1.5


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Many independent requests, each proposing the same two tokens: the first emitted token
    must follow p1 (the draft accepted with probability p1(d1), else drawn from p1 without
    d1), and the second, given the first draft was accepted, must follow p2."""
    vocab, n = 6, 30_000
    first, second = _target(vocab, 1), _target(vocab, 2)
    bonus = _target(vocab, 3)
    params = SamplingParams(temperature=0.8, top_k=5, max_tokens=10)
    logits = torch.stack([first, second, bonus]).repeat(n, 1)  # [3n, V]
    default = torch.Generator().manual_seed(7)
    drafts = [2, 4]
    out = verify(logits, [drafts] * n, [params] * n, [None] * n, default)

    def expected(row: torch.Tensor) -> torch.Tensor:
        scaled = row / params.temperature
        kth = scaled.topk(params.top_k).values[-1]
        return torch.where(scaled >= kth, scaled, -torch.inf).softmax(-1)

    def chi2_pvalue(observed: torch.Tensor, p: torch.Tensor) -> float:
        keep = p > 0
        assert observed[~keep].sum() == 0  # filtered tokens are never emitted
        obs = observed[keep].double()
        exp = p[keep].double() / p[keep].double().sum() * obs.sum()
        return chisquare(obs.numpy(), exp.numpy()).pvalue

    p1, p2 = expected(first), expected(second)
    firsts = torch.bincount(torch.tensor([v.tokens[0] for v in out]), minlength=vocab)
    assert chi2_pvalue(firsts, p1) > 1e-3
    accepted = [v for v in out if v.num_accepted >= 1]
    assert abs(len(accepted) / n - p1[drafts[0]].item()) < 4 * (0.25 / n) ** 0.5
    seconds = torch.bincount(torch.tensor([v.tokens[1] for v in accepted]), minlength=vocab)
    assert chi2_pvalue(seconds, p2) > 1e-3


def test_seeded_verification_emits_what_plain_sampling_would() -> None:
    """A seeded request gets the same tokens whether its rows are verified in one step or
    sampled one per step, and its generator ends up at the same place."""
    from engines.reference.sampling.sampler import make_generator, sample

    vocab = 12
    rows = torch.stack([_target(vocab, s) for s in range(5)])
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=10)
    plain_gen = make_generator(11, torch.device("cpu"))
    plain = [sample(rows[i : i + 1], [params], [plain_gen])[0] for i in range(5)]
    for accept in range(5):  # proposals agreeing with the plain draws for `accept` tokens
        drafts = [*plain[:accept], (plain[accept] + 1) % vocab] if accept < 4 else plain[:4]
        gen = make_generator(11, torch.device("cpu"))
        out = verify(rows[: len(drafts) + 1], [drafts], [params], [gen])[0]
        assert out.tokens == plain[: len(out.tokens)]
        assert out.num_accepted == min(accept, 4)
        # The generator advanced once per emitted token, as plain decoding would.
        replay = make_generator(11, torch.device("cpu"))
        for _ in out.tokens:
            torch.rand(1, generator=replay)
        assert torch.equal(gen.get_state(), replay.get_state())


# --- KV rollback bookkeeping ---------------------------------------------------------------


def _check_blocks(s: Scheduler) -> None:
    bm = s.block_manager
    holders: dict[int, int] = {}
    for req in s.running:
        table = bm._tables[req.request_id]
        # Exactly the blocks the computed tokens need: rejected positions hold none.
        assert len(table.block_ids) == bm.blocks_needed(req.num_computed_tokens)
        assert req.num_computed_tokens <= req.num_tokens - 1
        parent = None
        for i, block_hash in enumerate(table.block_hashes):
            # Hashes cover computed (so accepted) tokens only, chained like a fresh prefix.
            assert (i + 1) * bm.block_size <= req.num_computed_tokens
            parent = hash_block(parent, req.token_ids[i * bm.block_size : (i + 1) * bm.block_size])
            assert block_hash == parent
        for block_id in table.block_ids:
            holders[block_id] = holders.get(block_id, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in bm._free)
    for block_hash, block_id in bm._cached.items():
        assert bm.blocks[block_id].block_hash == block_hash


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(12, 40),
    block_size=st.sampled_from([2, 4, 8]),
    budget=st.integers(4, 40),
    k=st.integers(1, 6),
    prefix=st.booleans(),
)
def test_kv_rollback_never_leaks_blocks(seed, num_blocks, block_size, budget, k, prefix) -> None:
    """Random proposals and random accept/reject outcomes over many steps, with preemption
    (small pools), chunking and prefix caching: the bookkeeping stays exact."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    s = Scheduler(SchedulerConfig(budget, 6, True), bm)
    shared = [rng.randrange(5) for _ in range(block_size * 2)]
    for i in range(8):
        prompt = (shared if i % 2 else []) + [rng.randrange(5) for _ in range(rng.randint(1, 9))]
        max_tokens = rng.randint(1, 20)
        if s.admission_error(len(prompt), max_tokens) is None:
            s.add_request(Request(f"r{i}", prompt, max_tokens))
    steps = 0
    while s.has_work():
        steps += 1
        assert steps < 5_000
        for req in s.running:
            room = req.max_tokens - len(req.output_token_ids) - 1
            if req.is_decoding and room > 0 and rng.random() < 0.8:
                req.spec_token_ids = [rng.randrange(5) for _ in range(min(k, room))]
        out = s.schedule()
        assert out.num_tokens <= budget  # proposals count against the budget
        sampled = {}
        for chunk in out.chunks:
            if chunk.is_sampling:
                accepted = rng.randint(0, len(chunk.spec_token_ids))
                sampled[chunk.request_id] = [*chunk.spec_token_ids[:accepted], rng.randrange(5)]
        s.update_from_output(out, sampled)
        for rid, tokens in sampled.items():
            req = s.requests[rid]
            excess = len(req.output_token_ids) - req.max_tokens
            assert excess <= 0  # proposals never run past max_tokens
            if excess == 0 or rng.random() < 0.03:  # sometimes a stop in the middle
                req.drop_last_tokens(rng.randint(0, len(tokens) - 1))
                s.finish_request(rid)
        _check_blocks(s)
    assert bm.num_used_blocks == 0
    assert not s.requests


def test_truncate_frees_tail_blocks_first_in_line() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("a", 13)  # 4 blocks
    assert bm.num_used_blocks == 4
    bm.truncate("a", 5)  # 2 blocks hold the 5 computed tokens
    assert bm.num_used_blocks == 2 and len(bm.block_ids("a")) == 2
    bm.allocate("b", 4)
    assert bm.block_ids("b")[0] in (2, 3)  # the freed, unhashed blocks are reused first


# --- settings ------------------------------------------------------------------------------


def test_settings_name_what_each_kind_supports() -> None:
    assert problems("reference", {"method": "ngram"}) == []
    (msg,) = problems("reference", {"method": "eagle3", "model": "/m"})
    assert "not supported by engine.kind reference" in msg and "trtllm: ngram, draft" in msg
    assert problems("trtllm", {"method": "mtp", "num_layers": 2}) == []
    assert any("needs model" in p for p in problems("trtllm", {"method": "draft"}))
    assert any(
        "ngram only" in p
        for p in problems("vllm", {"method": "draft", "model": "/d", "prompt_lookup_max": 3})
    )
    assert any(
        "<=" in p
        for p in problems(
            "reference", {"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}
        )
    )
    assert any(
        "batch-size" in p
        for p in problems("vllm", {"method": "ngram", "disable_above_batch_size": 4})
    )


def test_resolve_fills_defaults_around_the_given_bound() -> None:
    assert resolve("reference", None) is None
    cfg = resolve("reference", {"method": "ngram", "prompt_lookup_max": 1})
    assert cfg == SpeculativeConfig("ngram", prompt_lookup_min=1, prompt_lookup_max=1)
    with pytest.raises(EngineError, match="unknown setting"):
        resolve("reference", {"method": "ngram", "lookahead": 3})
    with pytest.raises(EngineError, match="not supported"):
        resolve("reference", {"method": "eagle3", "model": "/d"})
    draft = resolve("reference", {"method": "draft", "model": "/d", "num_tokens": 3})
    assert draft == SpeculativeConfig("draft", num_tokens=3, model="/d")
