"""n > 1 in the reference engine: the samples of one prompt share its KV (computed once, then
forked), each draws from its own seed stream, and the group behaves like n separate requests
in everything a caller can see."""

from __future__ import annotations

import asyncio
import random

import pytest

from engines.api import GenerationRequest, ResponseFormat, SamplingParams
from engines.reference.engine import ReferenceEngine
from engines.samples import check_n, fan_out, generate_all, stream_all
from tests.engine_fixtures import tiny_model

PROMPT = [random.Random(7).randrange(3, 1000) for _ in range(37)]  # 2 full blocks + 5 tokens


def _engine(**settings) -> ReferenceEngine:
    settings.setdefault("num_threads", 1)
    return ReferenceEngine(str(tiny_model("llama")), block_size=16, **settings)


@pytest.fixture(scope="module")
def engine():
    eng = _engine()
    yield eng
    eng.shutdown()


def _sampled(max_tokens=12, seed=5, **more) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True, **more
    )


def _group(n, sampling, prompt=PROMPT, rid="g"):
    return fan_out(GenerationRequest(list(prompt), sampling, request_id=rid), n)


def test_fan_out_gives_each_sample_its_seed_and_a_group_mark() -> None:
    requests = _group(4, _sampled(seed=10))
    assert [r.sampling.seed for r in requests] == [10, 11, 12, 13]
    assert [r.request_id for r in requests] == ["g/0", "g/1", "g/2", "g/3"]
    assert {(r.sample_of.group_id, r.sample_of.count) for r in requests} == {("g", 4)}
    assert [r.sample_of.index for r in requests] == [0, 1, 2, 3]
    single = GenerationRequest([1, 2], _sampled())
    assert fan_out(single, 1) == [single]
    for bad in (0, 129, True, 2.0):
        with pytest.raises(ValueError, match="n must be an integer in"):
            check_n(bad)


def test_n_samples_compute_the_prompt_once_and_match_separate_requests(engine) -> None:
    engine.drain_step_records()
    results = asyncio.run(generate_all(engine, _group(4, _sampled())))
    records = engine.drain_step_records()
    prefills = [rid for rec in records for rid in rec.prefill_tokens]
    assert prefills == ["g/0"], "only the group's first sample computes the prompt"
    assert sum(rec.prefill_tokens["g/0"] for rec in records if "g/0" in rec.prefill_tokens) == 37
    assert [r.cached_prompt_tokens for r in results[1:]] == [37, 37, 37]
    assert all(r.finish_reason == "length" and r.completion_tokens == 12 for r in results)
    # Own seed streams: the samples differ from each other.
    assert len({tuple(r.output_token_ids) for r in results}) == 4

    # The same draws as four separate requests with seeds 5..8 (no sharing, no fork).
    alone = asyncio.run(
        generate_all(
            engine,
            [
                GenerationRequest(list(PROMPT), _sampled(seed=5 + i), request_id=f"a{i}")
                for i in range(4)
            ],
        )
    )
    assert [r.output_token_ids for r in results] == [r.output_token_ids for r in alone]
    # And reproducible.
    again = asyncio.run(generate_all(engine, _group(4, _sampled(), rid="h")))
    assert [r.output_token_ids for r in again] == [r.output_token_ids for r in results]
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("length", [32, 33])
def test_fork_at_a_block_boundary_and_inside_a_block(length) -> None:
    """A prompt that fills its last block shares every block; one that does not gets its own
    copy of the partial block, which the leader keeps writing into."""
    eng = _engine(enable_prefix_caching=False)
    try:
        prompt = PROMPT[:length]
        greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        forked = asyncio.run(generate_all(eng, _group(3, greedy, prompt)))
        alone = asyncio.run(eng.generate(GenerationRequest(list(prompt), greedy)))
        assert all(r.output_token_ids == alone.output_token_ids for r in forked)
        assert eng.block_manager.num_used_blocks == 0
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.shutdown()


def test_samples_that_do_not_fit_run_on_their_own_and_nothing_leaks() -> None:
    """max_batch_size 2: the leader forks one sample, the others queue as ordinary requests.
    A tiny pool forces preemption on top. Every sample still ends right and no block leaks."""
    eng = _engine(max_batch_size=2, kv_cache_tokens=160)
    try:
        results = asyncio.run(generate_all(eng, _group(5, _sampled(max_tokens=30))))
        alone = asyncio.run(
            generate_all(
                eng,
                [
                    GenerationRequest(list(PROMPT), _sampled(max_tokens=30, seed=5 + i))
                    for i in range(5)
                ],
            )
        )
        assert [r.output_token_ids for r in results] == [r.output_token_ids for r in alone]
        assert eng.block_manager.num_used_blocks == 0
    finally:
        eng.shutdown()


def test_aborting_the_leader_before_its_prompt_lets_the_others_run(engine) -> None:
    async def main():
        requests = _group(3, _sampled(max_tokens=4), prompt=PROMPT * 20, rid="ab")
        tasks = [asyncio.create_task(engine.generate(r)) for r in requests]
        await asyncio.sleep(0)
        engine.abort("ab/0")
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert results[0].finish_reason == "cancelled"
    assert [r.finish_reason for r in results[1:]] == ["length", "length"]
    assert engine.stats().num_waiting == 0 and engine.block_manager.num_used_blocks == 0


def test_streamed_samples_carry_their_index_and_add_up(engine) -> None:
    async def main():
        texts: dict[int, list[int]] = {}
        finals = {}
        async for index, delta in stream_all(engine, _group(3, _sampled(max_tokens=9), rid="s")):
            texts.setdefault(index, []).extend(delta.token_ids)
            if delta.finished:
                finals[index] = delta.result
        return texts, finals

    texts, finals = asyncio.run(main())
    assert sorted(finals) == [0, 1, 2]
    for index, result in finals.items():
        assert texts[index] == result.output_token_ids and len(texts[index]) == 9


def test_closing_a_group_stream_aborts_every_sample(engine) -> None:
    async def main():
        stream = stream_all(engine, _group(3, _sampled(max_tokens=400), rid="c"))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(200):
            if engine.stats().num_running == 0:
                return
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert engine.stats().num_running == 0 and engine.block_manager.num_used_blocks == 0


def test_samples_with_a_format_and_logprobs_fork_too(engine) -> None:
    fmt = ResponseFormat("choice", choices=("alpha", "beta", "gamma"))
    sampling = _sampled(max_tokens=20, response_format=fmt, logprobs=2)
    engine.drain_step_records()
    results = asyncio.run(generate_all(engine, _group(4, sampling, rid="f")))
    prefills = {rid for rec in engine.drain_step_records() for rid in rec.prefill_tokens}
    assert prefills == {"f/0"}
    for r in results:
        assert r.text in fmt.choices
        assert len(r.logprobs) == len(r.output_token_ids)
        assert [lp.token_id for lp in r.logprobs] == r.output_token_ids
        assert all(len(lp.top) == 2 for lp in r.logprobs)
    # Every sample's first token came from the same distribution: the same logprob of a token.
    first = {lp.token_id: lp.logprob for r in results for lp in r.logprobs[:1]}
    for r in results:
        assert r.logprobs[0].logprob == pytest.approx(first[r.logprobs[0].token_id], abs=1e-6)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_forked_samples_speculate_like_any_request(method) -> None:
    """Forked samples decode with speculation on (the draft model catches its own KV up on
    the fork's prompt): greedy samples equal one greedy request without speculation."""
    speculative = {"method": method, "num_tokens": 3}
    if method == "draft":
        speculative["model"] = str(tiny_model("llama"))  # the target as its own draft
    eng = _engine(speculative=speculative)
    plain = _engine()
    try:
        prompt = (PROMPT[:10] * 4)[:37]  # repeats: prompt lookup finds proposals
        greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        forked = asyncio.run(generate_all(eng, _group(3, greedy, prompt, rid="sp")))
        alone = asyncio.run(plain.generate(GenerationRequest(list(prompt), greedy)))
        assert all(r.output_token_ids == alone.output_token_ids for r in forked)
        assert sum(r.spec_proposed_tokens for r in forked) > 0
        assert eng.block_manager.num_used_blocks == 0
    finally:
        eng.shutdown()
        plain.shutdown()
