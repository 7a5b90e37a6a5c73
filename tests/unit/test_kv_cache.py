"""BlockManager with no model: allocation, growth, prefix hits, LRU eviction, no leaks."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.reference.runtime.kv_cache import BlockManager


def test_allocate_grow_free_returns_every_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", 5)  # 2 blocks
    assert len(bm.block_ids("a")) == 2
    assert bm.num_free_blocks == 6
    assert bm.can_append("a", 8)
    bm.append("a", 9)  # 3 blocks
    assert len(bm.block_ids("a")) == 3
    assert not bm.can_append("a", 4 * 10)
    with pytest.raises(ValueError):
        bm.append("a", 4 * 10)
    bm.free("a")
    assert bm.num_free_blocks == 8
    assert bm.num_used_blocks == 0


def test_prefix_hit_reuses_full_blocks_and_leaves_last_token() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(100, 112))  # exactly 3 full blocks
    bm.allocate("a", len(tokens))
    bm.cache_full_blocks("a", tokens, num_computed=len(tokens))
    # Same 12 tokens: only 2 blocks may be reused, the last token needs its logits.
    assert bm.find_cached_prefix(tokens) == bm.block_ids("a")[:2]
    # A longer prompt with the same start reuses all 3.
    assert bm.find_cached_prefix([*tokens, 7]) == bm.block_ids("a")
    # A different first block breaks the chain even if later blocks are equal.
    assert bm.find_cached_prefix([0, *tokens[1:], 7]) == []


def test_shared_blocks_are_refcounted_and_survive_free_until_evicted() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    bm.allocate("a", 5)
    bm.cache_full_blocks("a", prompt, 5)
    hit = bm.find_cached_prefix(prompt)
    assert len(hit) == 2
    bm.allocate("b", 5, hit)  # shares 2 blocks, adds 1
    assert bm.block_ids("b")[:2] == hit
    assert bm.num_free_blocks == 0
    bm.free("a")
    assert bm.num_free_blocks == 1  # shared blocks still held by b
    bm.free("b")
    assert bm.num_free_blocks == 4
    # Freed but not evicted: still a hit.
    assert bm.find_cached_prefix(prompt) == hit
    # Allocating everything evicts the cached blocks; the prefix is gone.
    bm.allocate("c", 8)
    assert bm.find_cached_prefix(prompt) == []
    bm.free("c")
    assert bm.num_used_blocks == 0


def test_can_allocate_counts_cached_free_blocks_once() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate("a", 4)
    bm.cache_full_blocks("a", [1, 2, 3, 4], 4)
    bm.free("a")
    hit = bm.find_cached_prefix([1, 2, 3, 4, 5])
    assert len(hit) == 2
    # 3 blocks total: 2 reused + 1 new fits; needing 2 new does not.
    assert bm.can_allocate(5, hit)
    assert not bm.can_allocate(7, hit)


def test_eviction_prefers_unhashed_then_least_recently_freed() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("old", 2)
    bm.cache_full_blocks("old", [1, 2], 2)
    bm.free("old")
    bm.allocate("new", 2)
    bm.cache_full_blocks("new", [3, 4], 2)
    bm.free("new")
    bm.allocate("scratch", 1)  # partial block, no hash
    bm.free("scratch")
    bm.allocate("x", 4)  # two blocks: the unhashed one and the never-used one
    assert bm.find_cached_prefix([1, 2, 9]) and bm.find_cached_prefix([3, 4, 9])
    bm.allocate("y", 1)  # now a cached block must go: the least recently freed ("old")
    assert bm.find_cached_prefix([1, 2, 9]) == []
    assert bm.find_cached_prefix([3, 4, 9]) != []


def test_disabled_prefix_caching_never_hits() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    bm.allocate("a", 4)
    bm.cache_full_blocks("a", [1, 2, 3, 4], 4)
    bm.free("a")
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]) == []


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=10_000))
def test_random_workload_never_leaks(seed: int) -> None:
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=24, block_size=4)
    live: dict[str, str] = {}
    for step in range(60):
        if live and rng.random() < 0.4:
            bm.free(live.pop(rng.choice(sorted(live))))
            continue
        tokens = [rng.randrange(3) for _ in range(rng.randint(1, 20))]
        hit = bm.find_cached_prefix(tokens)
        if bm.can_allocate(len(tokens), hit):
            name = f"r{step}"
            bm.allocate(name, len(tokens), hit)
            bm.cache_full_blocks(name, tokens, len(tokens))
            live[name] = name
        held = sum(len(bm.block_ids(n)) for n in live)
        assert bm.num_used_blocks <= held  # shared blocks counted once
    for name in list(live):
        bm.free(name)
    assert bm.num_used_blocks == 0
    assert all(b.ref_count == 0 for b in bm.blocks)
