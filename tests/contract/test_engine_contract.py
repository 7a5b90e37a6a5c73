"""The engine contract (engines/api.py), checked the same way for every engine kind.

Kinds: the reference engine, the TensorRT-LLM adapter over its stand-in (tests/standins, written
to TensorRT-LLM 1.2's signatures and behaviours), vLLM for real (marked `vllm`: it runs in
its own environment through `make test-vllm`), and the synthetic engine (random tokens at a set
rate: it has no structured output and no prefix cache, which its tests say).

What every engine must agree on, whatever its model:
- finish reasons: "length" at max_tokens, "stop" at a stop token or stop string with
  `stop_reason` naming it, "cancelled" for aborted, closed or shut-down requests;
- token counting: completion_tokens == len(output_token_ids), and a stop token stays in the ids
  and is counted (a stop string's tokens too; the string itself is cut from the text);
- max_tokens beyond the context is clipped and finishes with "length";
- an empty prompt, an out-of-vocabulary id or a prompt that fills the context is a row error
  (finish_reason "error", the error names the problem), never an exception;
- streaming yields the same ids and text as generate, ending with one finished delta;
- after shutdown, requests in flight finish "cancelled" and new ones raise EngineDeadError;
  after the engine dies, requests raise EngineDeadError;
- a response_format constrains the text (JSON schema, choice), or, where a kind has no
  structured output yet, the row is an error saying so: never unconstrained text.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from engines.api import (
    FORMAT_ERROR_PREFIX,
    EngineDeadError,
    GenerationRequest,
    GenerationResult,
    ResponseFormat,
    SamplingParams,
)
from pipeline.openai.response_format import conforms
from tests.contract.harness import MAX_MODEL_LEN, EngineHarness, kind_params, needs_other_python

PROMPT = [11, 42, 7, 300, 5, 99, 12]
KINDS = kind_params()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def generate(h: EngineHarness, prompt: list[int], sampling: SamplingParams, rid: str):
    async def go() -> GenerationResult:
        return await h.engine.generate(GenerationRequest(list(prompt), sampling, request_id=rid))

    return h.run(go)


def assert_counted(result: GenerationResult, prompt: list[int]) -> None:
    assert result.completion_tokens == len(result.output_token_ids)
    assert result.prompt_tokens == len(prompt)


def assert_ordered(result: GenerationResult) -> None:
    m = result.metrics
    assert m is not None and m.finish_time is not None
    times = [m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finish_time]
    present = [t for t in times if t is not None]
    assert present == sorted(present), f"request timestamps out of order: {m}"
    if result.completion_tokens:
        # Interval cost split needs a real interval: never-reached is None, not 0.
        assert m.first_scheduled_time is not None and m.first_scheduled_time > 0
        assert m.first_token_time is not None and m.first_token_time > 0


# --- structured output ---------------------------------------------------------------------------

CONTRACT_SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["a", "b"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tag": {"type": "string", "maxLength": 5},
    },
    "required": ["kind", "n", "tag"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("harness", KINDS, indirect=True)
def test_response_format_constrains_the_text(harness: EngineHarness) -> None:
    formats = [
        ResponseFormat.json(CONTRACT_SCHEMA),
        ResponseFormat("choice", choices=("left", "right")),
    ]
    for i, fmt in enumerate(formats):
        sampling = SamplingParams(max_tokens=64, temperature=0.0, response_format=fmt)
        result = generate(harness, PROMPT, sampling, f"fmt-{i}")
        if harness.kind == "synthetic":  # random tokens cannot follow a format: refused
            assert result.finish_reason == "error" and result.output_token_ids == []
            assert result.error.startswith(FORMAT_ERROR_PREFIX), result.error
            continue
        assert result.finish_reason == "stop", (fmt.kind, result.text, result.error)
        assert conforms(fmt, result.text), (fmt.kind, result.text)
        if fmt.kind == "json_schema":
            assert set(json.loads(result.text)) == {"kind", "n", "tag"}


@pytest.mark.parametrize("harness", KINDS, indirect=True)
def test_logprobs_one_per_token_with_sorted_alternatives(harness: EngineHarness) -> None:
    result = generate(harness, PROMPT, greedy(6, logprobs=3), "logprobs")
    assert result.logprobs is not None
    assert [lp.token_id for lp in result.logprobs] == result.output_token_ids
    for lp in result.logprobs:
        assert len(lp.top) == 3 and lp.logprob <= 0
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        # Greedy: the chosen token is the most likely one (ties aside).
        assert lp.logprob == pytest.approx(values[0], abs=1e-4)
    assert generate(harness, PROMPT, greedy(2), "no-logprobs").logprobs is None


@pytest.mark.parametrize("harness", KINDS, indirect=True)
def test_prompt_logprobs_one_per_prompt_token(harness: EngineHarness) -> None:
    result = generate(harness, PROMPT, greedy(2, prompt_logprobs=2), "prompt-logprobs")
    if harness.kind == "trtllm":  # 1.2 lacks the prompt token's own logprob: refused
        assert result.finish_reason == "error" and "prompt_logprobs" in result.error
        return
    got = result.prompt_logprobs
    assert got is not None and len(got) == len(PROMPT) and got[0] is None
    assert [lp.token_id for lp in got[1:]] == PROMPT[1:]
    for lp in got[1:]:
        assert lp.logprob <= 0 and len(lp.top) == 2
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and lp.logprob <= values[0] + 1e-4
    # The same prompt again: still every position (a cached prefix holds no logits).
    again = generate(harness, PROMPT, greedy(2, prompt_logprobs=0), "prompt-logprobs-2")
    assert [lp.logprob for lp in again.prompt_logprobs[1:]] == pytest.approx(
        [lp.logprob for lp in got[1:]], abs=1e-3
    )
    assert generate(harness, PROMPT, greedy(2), "no-prompt-logprobs").prompt_logprobs is None


# --- finishing and counting ----------------------------------------------------------------------


@pytest.mark.parametrize("harness", KINDS, indirect=True)
def test_length_finish_counts_every_token(harness: EngineHarness) -> None:
    result = generate(harness, PROMPT, greedy(6), "len")
    assert result.finish_reason == "length"
    assert result.error is None and result.stop_reason is None
    assert len(result.output_token_ids) == 6
    assert_counted(result, PROMPT)
    assert_ordered(result)


@pytest.mark.parametrize("harness", KINDS, indirect=True)
def test_stop_token_ends_the_request_and_is_kept_and_counted(harness: EngineHarness) -> None:
    full = generate(harness, PROMPT, greedy(10), "stop-full").output_token_ids
    # The first position whose token did not appear before it: the stop fires exactly there.
    at = next(i for i in range(1, len(full)) if full[i] not in full[:i])
    result = generate(harness, PROMPT, greedy(10, stop_token_ids=(full[at],)), "stop-tok")
    assert result.finish_reason == "stop"
    assert result.stop_reason == full[at]
    assert result.output_token_ids == full[: at + 1]
    assert_counted(result, PROMPT)
    assert_ordered(result)


@pytest.mark.parametrize("harness", KINDS, indirect=True)
def test_stop_string_is_cut_from_the_text_and_its_tokens_are_kept(harness: EngineHarness) -> None:
    full = generate(harness, PROMPT, greedy(16), "str-full")
    text = full.text
    # A two-character stop string that first occurs after the start of the text.
    at = next(
        i
        for i in range(1, len(text) - 1)
        if text[i : i + 2].isprintable() and text.find(text[i : i + 2]) == i
    )
    stop = text[at : at + 2]
    result = generate(harness, PROMPT, greedy(16, stop=(stop,)), "str-stop")
    assert result.finish_reason == "stop"
    assert result.stop_reason == stop
    assert result.text == text[:at]
    ids = result.output_token_ids
    assert 0 < len(ids) <= len(full.output_token_ids)
    assert ids == full.output_token_ids[: len(ids)]
    assert_counted(result, PROMPT)


@pytest.mark.parametrize("harness", KINDS, indirect=True)
def test_max_tokens_beyond_the_context_is_clipped_to_length(harness: EngineHarness) -> None:
    prompt = [(7 * i) % 900 + 3 for i in range(MAX_MODEL_LEN - 3)]
    result = generate(harness, prompt, greedy(50), "clip")
    assert result.finish_reason == "length", result.error
    assert result.completion_tokens == 3
    assert_counted(result, prompt)


@pytest.mark.parametrize("harness", KINDS, indirect=True)
def test_a_repeated_prompt_reports_its_cached_tokens(harness: EngineHarness) -> None:
    if harness.kind == "synthetic":
        pytest.skip("the synthetic engine has no KV cache: there is nothing to reuse")
    prompt = [(13 * i) % 900 + 3 for i in range(200)]
    first = generate(harness, prompt, greedy(4), "cache-1")
    again = generate(harness, prompt, greedy(4), "cache-2")
    assert 0 < again.cached_prompt_tokens < len(prompt)
    assert first.cached_prompt_tokens < again.cached_prompt_tokens
    assert again.output_token_ids == first.output_token_ids
    assert again.prompt_tokens == len(prompt)


# --- bad requests are row errors -----------------------------------------------------------------


@pytest.mark.parametrize("harness", KINDS, indirect=True)
@pytest.mark.parametrize(
    ("prompt", "words"),
    [
        ([], "empty"),
        ([5, 10**6, 7], "vocabulary"),
        ([-1, 5], "vocabulary"),
        ([9] * MAX_MODEL_LEN, "context"),
    ],
    ids=["empty", "beyond-vocab", "negative-id", "fills-context"],
)
def test_bad_prompts_are_row_errors(harness: EngineHarness, prompt: list[int], words: str) -> None:
    result = generate(harness, prompt, greedy(4), f"bad-{words}-{len(prompt)}")
    assert result.finish_reason == "error"
    assert words in (result.error or "")
    assert result.output_token_ids == [] and result.completion_tokens == 0
    assert result.prompt_tokens == len(prompt)
    # The engine is unharmed.
    assert generate(harness, PROMPT, greedy(2), f"after-{words}").finish_reason == "length"


# --- streaming, abort, cancel ---------------------------------------------------------------------


@pytest.mark.parametrize("harness", KINDS, indirect=True)
def test_stream_yields_what_generate_returns(harness: EngineHarness) -> None:
    whole = generate(harness, PROMPT, greedy(12), "whole")

    async def go():
        request = GenerationRequest(list(PROMPT), greedy(12), request_id="streamed")
        return [delta async for delta in harness.engine.stream(request)]

    deltas = harness.run(go)
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert [t for d in deltas for t in d.token_ids] == whole.output_token_ids
    assert "".join(d.text for d in deltas) == whole.text
    final = deltas[-1].result
    assert final is not None and final.finish_reason == "length"
    assert final.output_token_ids == whole.output_token_ids and final.text == whole.text


@pytest.mark.parametrize("harness", KINDS, indirect=True)
def test_abort_finishes_the_request_cancelled(harness: EngineHarness) -> None:
    async def go():
        request = GenerationRequest(list(PROMPT), greedy(200), request_id="to-abort")
        task = asyncio.create_task(harness.engine.generate(request))
        await _wait_for_tokens(harness, "to-abort")
        harness.engine.abort("to-abort")
        return await asyncio.wait_for(task, 60)

    result = harness.run(go)
    assert result.finish_reason == "cancelled"
    assert result.completion_tokens < 200
    assert_counted(result, PROMPT)
    assert generate(harness, PROMPT, greedy(2), "after-abort").finish_reason == "length"


@pytest.mark.parametrize("harness", KINDS, indirect=True)
def test_closing_a_stream_early_cancels_it(harness: EngineHarness) -> None:
    async def go():
        request = GenerationRequest(list(PROMPT), greedy(200), request_id="closed")
        stream = harness.engine.stream(request)
        got = 0
        async for delta in stream:
            got += len(delta.token_ids)
            if got >= 2:
                break
        await stream.aclose()
        return got

    assert harness.run(go) >= 2
    # Closed means gone: the engine lets go of the request (its id is free again soon; the
    # abort reaches the step loop asynchronously) and serves the next ones.
    assert generate(harness, PROMPT, greedy(3), "after-close").finish_reason == "length"

    async def reuse():
        for _ in range(100):
            again = GenerationRequest(list(PROMPT), greedy(3), request_id="closed")
            result = await harness.engine.generate(again)
            if "already in flight" not in (result.error or ""):
                return result
            await asyncio.sleep(0.05)
        raise AssertionError("the closed stream's request never left the engine")

    assert harness.run(reuse).finish_reason == "length"


@pytest.mark.parametrize("harness", KINDS, indirect=True)
def test_cancelling_the_caller_cancels_the_request(harness: EngineHarness) -> None:
    async def go():
        request = GenerationRequest(list(PROMPT), greedy(200), request_id="caller-gone")
        task = asyncio.create_task(harness.engine.generate(request))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    harness.run(go)
    assert generate(harness, PROMPT, greedy(3), "after-caller").finish_reason == "length"


@pytest.mark.parametrize("harness", KINDS, indirect=True)
def test_concurrent_requests_each_get_their_own_result(harness: EngineHarness) -> None:
    prompts = [PROMPT[: 2 + i] for i in range(6)]
    alone = [generate(harness, p, greedy(5), f"alone-{i}") for i, p in enumerate(prompts)]

    async def go():
        return await asyncio.gather(
            *(
                harness.engine.generate(GenerationRequest(list(p), greedy(5), request_id=f"b{i}"))
                for i, p in enumerate(prompts)
            )
        )

    together = harness.run(go)
    assert [r.request_id for r in together] == [f"b{i}" for i in range(6)]
    assert [r.output_token_ids for r in together] == [r.output_token_ids for r in alone]


@pytest.mark.parametrize("harness", KINDS, indirect=True)
def test_n_samples_of_one_prompt(harness: EngineHarness) -> None:
    """n > 1 is a group of requests (engines.samples): every engine serves each sample as a
    request of its own; greedy samples equal one greedy request, seeded ones reproduce."""
    from engines.samples import fan_out, generate_all

    alone = generate(harness, PROMPT, greedy(5), "n-alone")

    async def group(rid: str, sampling: SamplingParams):
        request = GenerationRequest(list(PROMPT), sampling, request_id=rid)
        return await generate_all(harness.engine, fan_out(request, 3))

    greedy_samples = harness.run(lambda: group("n-greedy", greedy(5)))
    assert [r.request_id for r in greedy_samples] == [f"n-greedy/{i}" for i in range(3)]
    assert all(r.output_token_ids == alone.output_token_ids for r in greedy_samples)
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    first = harness.run(lambda: group("n-seeded", seeded))
    assert all(r.finish_reason == "length" and r.completion_tokens == 6 for r in first)
    if not any("seed" in text for text in harness.engine.info.limitations):
        again = harness.run(lambda: group("n-seeded-again", seeded))
        assert [r.output_token_ids for r in again] == [r.output_token_ids for r in first]


# --- shutdown and death ------------------------------------------------------------------


@pytest.mark.parametrize("fresh", KINDS, indirect=True)
def test_shutdown_cancels_requests_in_flight_and_refuses_new_ones(fresh: EngineHarness) -> None:
    async def go():
        tasks = [
            asyncio.create_task(
                fresh.engine.generate(GenerationRequest(list(PROMPT), greedy(500), f"s{i}"))
            )
            for i in range(3)
        ]
        await _wait_for_tokens(fresh, "s0")
        fresh.engine.shutdown()
        fresh.engine.shutdown()  # idempotent
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    results = fresh.run(go)
    assert {r.finish_reason for r in results} == {"cancelled"}
    for result in results:
        assert_counted(result, PROMPT)
    with pytest.raises(EngineDeadError):
        generate(fresh, PROMPT, greedy(2), "late")


@pytest.mark.parametrize("fresh", KINDS, indirect=True)
def test_a_dead_engine_raises_engine_dead_for_every_request(fresh: EngineHarness) -> None:
    async def go():
        request = GenerationRequest(list(PROMPT), greedy(500), request_id="in-flight")
        task = asyncio.create_task(fresh.engine.generate(request))
        await _wait_for_tokens(fresh, "in-flight")
        fresh.kill()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(task, 60)

    fresh.run(go)
    with pytest.raises(EngineDeadError):
        generate(fresh, PROMPT, greedy(2), "after-death")
    with pytest.raises(EngineDeadError):  # health checks read stats: a dead engine looks dead
        fresh.engine.stats()


# Kinds whose engine runs in a process that can die while idle (the others' deaths are
# injected into their next step: idle, they cannot die).
# vLLM's (20 s for its engine) is slow: by default its stats() raising once its engine core
# died is test_a_dead_engine_raises_engine_dead_for_every_request's.
PROCESS_KINDS = [
    pytest.param("reference-process", id="reference-process"),
    pytest.param("trtllm-elsewhere", id="trtllm-standin-elsewhere", marks=needs_other_python),
    pytest.param("vllm", id="vllm", marks=[pytest.mark.vllm, pytest.mark.slow]),
]


@pytest.mark.parametrize("fresh", PROCESS_KINDS, indirect=True)
def test_an_engine_killed_while_idle_reads_dead_without_a_request(fresh: EngineHarness) -> None:
    """The OOM killer picks an idle engine process as readily as a busy one: with no request to
    trip over the death, stats() itself must say it (a Serve replica's health check reads
    nothing else)."""
    fresh.kill()
    deadline = time.monotonic() + 30
    with pytest.raises(EngineDeadError):
        while time.monotonic() < deadline:
            fresh.engine.stats()
            time.sleep(0.05)


async def _wait_for_tokens(h: EngineHarness, request_id: str, timeout: float = 60) -> None:
    """Until the engine has stepped a few times with work in it (the request is running).

    Engines without a step count (TensorRT-LLM's API shows none) are given a moment once the
    request is in."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    start = h.engine.stats().num_steps
    while True:
        stats = h.engine.stats()
        if stats.num_steps >= start + 3:
            return
        if stats.num_steps == 0 and stats.num_running > 0:
            await asyncio.sleep(0.1)
            return
        if loop.time() > deadline:
            raise AssertionError(f"{request_id} never started")
        await asyncio.sleep(0.01)


# --- logits processing -----------------------------------------------------------------------


@pytest.mark.parametrize("harness", KINDS, indirect=True)
def test_logit_bias_and_min_tokens_act_alike(harness: EngineHarness) -> None:
    eos = harness.engine.info.eos_token_ids[0]
    forced = generate(harness, PROMPT, greedy(4, logit_bias={5: 100}), "bias")
    held = generate(
        harness,
        PROMPT,
        SamplingParams(max_tokens=12, temperature=0.0, logit_bias={eos: 100}, min_tokens=3),
        "min-tokens",
    )
    if harness.kind == "synthetic":  # random ids, not from logits: refused
        assert forced.finish_reason == held.finish_reason == "error"
        assert "not supported by engine.kind synthetic" in forced.error
        return
    assert forced.output_token_ids == [5] * 4 and forced.finish_reason == "length"
    assert_counted(forced, PROMPT)
    assert held.finish_reason == "stop" and held.stop_reason is None
    assert len(held.output_token_ids) == 4 and held.output_token_ids[-1] == eos
    assert_counted(held, PROMPT)


# Kinds that do not compute embeddings: the request is a row error saying which kind does.
NO_EMBED_KINDS = [p for p in KINDS if p.values[0] in ("trtllm", "vllm")]


@pytest.mark.parametrize("harness", NO_EMBED_KINDS, indirect=True)
def test_an_embed_request_is_a_row_error_where_the_kind_cannot_embed(
    harness: EngineHarness,
) -> None:
    from engines.api import EmbedParams
    from engines.requests import EMBED_UNSUPPORTED

    async def go() -> GenerationResult:
        request = GenerationRequest(list(PROMPT), request_id="embed", embed=EmbedParams())
        return await harness.engine.generate(request)

    result = harness.run(go)
    assert result.finish_reason == "error" and result.error == EMBED_UNSUPPORTED
