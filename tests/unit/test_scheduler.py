"""Scheduler with no model: a fake step loop samples token 7 for every sampling chunk."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from engines.reference.runtime.kv_cache import BlockManager
from engines.reference.runtime.scheduler import (
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)


def make(
    num_blocks=64, block_size=4, max_num_tokens=32, max_batch_size=8, chunked=True, prefix=True
):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    config = SchedulerConfig(max_num_tokens, max_batch_size, chunked)
    return Scheduler(config, bm)


def add(s: Scheduler, rid: str, prompt_len: int, max_tokens: int, first: int = 100) -> Request:
    req = Request(rid, list(range(first, first + prompt_len)), max_tokens)
    assert s.admission_error(prompt_len, max_tokens) is None
    s.add_request(req)
    return req


def step(s: Scheduler) -> tuple[SchedulerOutput, list[str]]:
    """Schedule, 'run' (sample 7), update, finish requests at max_tokens."""
    out = s.schedule()
    sampled = {c.request_id: 7 for c in out.chunks if c.is_sampling}
    s.update_from_output(out, sampled)
    done = [
        rid
        for rid in sampled
        if len(s.requests[rid].output_token_ids) >= s.requests[rid].max_tokens
    ]
    for rid in done:
        s.finish_request(rid)
    return out, done


def run_to_end(s: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    while s.has_work():
        outs.append(step(s)[0])
        assert len(outs) < max_steps, "scheduler made no progress"
    return outs


def test_long_prompt_is_chunked_and_samples_only_at_the_end() -> None:
    s = make(max_num_tokens=32)
    add(s, "a", 100, 3)
    outs = run_to_end(s)
    chunks = [o.chunks[0] for o in outs]
    assert [(c.start, c.num_tokens) for c in chunks[:4]] == [(0, 32), (32, 32), (64, 32), (96, 4)]
    assert [c.is_sampling for c in chunks[:4]] == [False, False, False, True]
    assert [c.num_prefill_tokens for c in chunks] == [32, 32, 32, 4, 0, 0]
    assert [(c.start, c.num_tokens) for c in chunks[4:]] == [(100, 1), (101, 1)]


def test_budget_is_shared_and_respected() -> None:
    s = make(max_num_tokens=32)
    add(s, "a", 20, 4)
    add(s, "b", 20, 4)
    out, _ = step(s)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 20), ("b", 12)]
    out, _ = step(s)
    # a decodes one token, b finishes its prompt with the rest.
    assert [(c.request_id, c.num_tokens, c.is_sampling) for c in out.chunks] == [
        ("a", 1, True),
        ("b", 8, True),
    ]


def test_unchunked_prompt_waits_for_a_step_with_room() -> None:
    s = make(max_num_tokens=32, chunked=False)
    assert s.admission_error(33, 1) is not None
    assert "chunked prefill" in s.admission_error(33, 1)
    add(s, "a", 20, 4, first=0)
    add(s, "b", 20, 4, first=200)
    add(s, "c", 5, 4, first=400)
    out, _ = step(s)
    # b does not fit whole; c must not jump the queue (FCFS).
    assert [c.request_id for c in out.chunks] == ["a"]
    out, _ = step(s)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 20), ("c", 5)]


def test_batch_size_limits_running_requests() -> None:
    s = make(max_batch_size=2, max_num_tokens=100)
    for i in range(4):
        add(s, f"r{i}", 3, 5)
    out, _ = step(s)
    assert [c.request_id for c in out.chunks] == ["r0", "r1"]
    assert len(s.running) == 2 and len(s.waiting) == 2


def test_fcfs_admission_order() -> None:
    s = make(max_num_tokens=8, max_batch_size=3)
    for i in range(6):
        add(s, f"r{i}", 6, 2, first=10 * i)
    first_seen: list[str] = []
    for out in run_to_end(s):
        for c in out.chunks:
            if c.request_id not in first_seen:
                first_seen.append(c.request_id)
    assert first_seen == [f"r{i}" for i in range(6)]


def test_preemption_evicts_latest_admitted_and_it_resumes_by_recompute() -> None:
    # 6 blocks of 4 tokens; two requests of 8 prompt tokens growing to 14 tokens each.
    s = make(num_blocks=6, block_size=4, max_num_tokens=64, prefix=False)
    a = add(s, "a", 8, 6, first=0)
    b = add(s, "b", 8, 6, first=50)
    preempted: list[str] = []
    resumed_from = None
    while s.has_work():
        out, _ = step(s)
        preempted += out.preempted
        for c in out.chunks:
            if c.request_id == "b" and b.num_preemptions and resumed_from is None:
                resumed_from = (c.start, c.num_tokens)
    assert preempted and preempted[0] == "b"
    assert s.num_preemptions >= 1
    # b recomputed its prompt and the outputs it already had, from position 0.
    assert resumed_from is not None and resumed_from[0] == 0 and resumed_from[1] > 8
    assert a.output_token_ids == [7] * 6 and b.output_token_ids == [7] * 6
    assert s.block_manager.num_used_blocks == 0


def test_request_too_big_for_the_pool_is_refused() -> None:
    s = make(num_blocks=4, block_size=4)
    error = s.admission_error(10, 7)  # 17 tokens need 5 blocks
    assert error is not None and "5 KV blocks" in error and "only 4" in error
    assert s.admission_error(10, 6) is None


def test_prefix_hit_starts_after_cached_blocks() -> None:
    s = make(block_size=4, max_num_tokens=64)
    add(s, "a", 10, 1, first=0)
    run_to_end(s)
    b = add(s, "b", 12, 1, first=0)  # same first 10 tokens, then 2 more
    out, _ = step(s)
    assert (out.chunks[0].start, out.chunks[0].num_tokens) == (8, 4)
    assert b.num_cached_tokens == 8


def test_prefix_hit_never_covers_the_last_prompt_token() -> None:
    s = make(block_size=4, max_num_tokens=64)
    add(s, "a", 8, 1, first=0)
    run_to_end(s)
    add(s, "b", 8, 1, first=0)
    out, _ = step(s)
    assert (out.chunks[0].start, out.chunks[0].num_tokens) == (4, 4)


def test_finish_while_waiting_or_running_frees_blocks() -> None:
    s = make(max_batch_size=1)
    add(s, "a", 5, 10)
    add(s, "b", 5, 10)
    step(s)
    assert s.finish_request("b").status is RequestStatus.FINISHED
    assert s.finish_request("a") is not None
    assert s.finish_request("a") is None
    assert not s.has_work() and s.block_manager.num_used_blocks == 0


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    chunked=st.booleans(),
    prefix=st.booleans(),
    budget=st.sampled_from([8, 16, 64]),
    num_blocks=st.sampled_from([12, 24, 200]),
)
def test_random_workloads_finish_within_limits_without_leaks(
    seed, chunked, prefix, budget, num_blocks
) -> None:
    rng = random.Random(seed)
    s = make(
        num_blocks=num_blocks,
        block_size=4,
        max_num_tokens=budget,
        max_batch_size=4,
        chunked=chunked,
        prefix=prefix,
    )
    pending = []
    for i in range(12):
        prompt_len, max_tokens = rng.randint(1, 30), rng.randint(1, 12)
        if s.admission_error(prompt_len, max_tokens) is None:
            pending.append(
                Request(f"r{i}", [rng.randrange(4) for _ in range(prompt_len)], max_tokens)
            )
    admitted = list(pending)
    steps = 0
    while pending or s.has_work():
        for _ in range(rng.randint(0, 2)):  # requests keep arriving between steps
            if pending:
                s.add_request(pending.pop(0))
        if not s.has_work():
            continue
        out, _ = step(s)
        steps += 1
        assert steps < 2_000
        assert 0 < out.num_tokens <= budget
        assert len(s.running) <= 4
        assert len({c.request_id for c in out.chunks}) == len(out.chunks)
    assert all(len(r.output_token_ids) == r.max_tokens for r in admitted)
    assert s.block_manager.num_used_blocks == 0
