"""n > 1 bookkeeping without a model: the group's leader, its waiters, and the KV fork."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engines.api import GenerationRequest, SamplingParams
from engines.reference.runtime.groups import SampleGroups
from engines.reference.runtime.kv_cache import BlockManager
from engines.samples import fan_out


@dataclass
class Live:
    request: GenerationRequest


def group(n: int = 3, prompt=(1, 2, 3), **sampling) -> list[Live]:
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=9, **sampling)
    return [Live(r) for r in fan_out(GenerationRequest(list(prompt), params, "g"), n)]


def test_first_sample_leads_and_the_others_wait_until_its_first_token() -> None:
    groups = SampleGroups()
    leader, *others = group(4)
    assert not groups.admit(leader)
    assert [groups.admit(x) for x in others] == [True, True, True]
    assert groups.num_waiting == 3 and groups.has_waiters(leader)
    assert groups.first_token(leader) == others
    assert groups.num_waiting == 0 and not groups.has_waiters(leader)
    # Past its first token the group takes no more waiters: a late sample runs on its own.
    late = Live(fan_out(GenerationRequest([1, 2, 3], leader.request.sampling, "g"), 5)[4])
    assert not groups.admit(late)


def test_a_leader_leaving_early_hands_back_its_waiters_and_a_waiter_can_leave() -> None:
    groups = SampleGroups()
    leader, a, b = group(3)
    groups.admit(leader)
    groups.admit(a)
    groups.admit(b)
    assert groups.leave(a) == [] and groups.num_waiting == 1
    assert groups.leave(leader) == [b] and groups.num_waiting == 0
    assert groups.first_token(b) == []


def test_only_same_prompt_and_sampling_wait() -> None:
    groups = SampleGroups()
    leader, same = group(2)
    other_prompt = Live(group(2, prompt=(7, 8))[1].request)
    groups.admit(leader)
    assert not groups.admit(other_prompt)  # same group id, another prompt: on its own
    assert groups.admit(same)
    single = Live(GenerationRequest([1, 2, 3], SamplingParams()))
    assert not groups.admit(single)


@pytest.mark.parametrize(("tokens", "copied"), [(32, False), (37, True)])
def test_kv_fork_shares_full_blocks_and_copies_a_partial_one(tokens: int, copied: bool) -> None:
    bm = BlockManager(num_blocks=8, block_size=16)
    bm.allocate("a", tokens)
    pair = bm.fork("a", "b", tokens)
    shared = bm.block_ids("a")[: tokens // 16]
    assert bm.block_ids("b")[: tokens // 16] == shared
    assert all(bm.blocks[i].ref_count == 2 for i in shared)
    if copied:
        assert pair == (bm.block_ids("a")[-1], bm.block_ids("b")[-1])
        assert pair[0] != pair[1] and bm.blocks[pair[1]].ref_count == 1
    else:
        assert pair is None and len(bm.block_ids("b")) == 2
    bm.free("a")
    assert all(bm.blocks[i].ref_count == 1 for i in shared)
    bm.free("b")
    assert bm.num_free_blocks == 8


def test_kv_fork_needs_a_free_block_for_a_partial_one() -> None:
    bm = BlockManager(num_blocks=3, block_size=16)
    bm.allocate("a", 37)
    assert not bm.can_fork(37) and bm.can_fork(32)
    with pytest.raises(ValueError, match="no free block"):
        bm.fork("a", "b", 37)
