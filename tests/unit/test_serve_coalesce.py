"""Stream coalescing: fewer items, the same tokens and text, the first token at once."""

from __future__ import annotations

import asyncio

from engines.api import GenerationRequest, GenerationResult, SamplingParams, StreamDelta
from pipeline.serve.replicas.coalesce import coalesce


def _deltas(n: int, times: list[float], clock: list[float]):
    """n one-token deltas, the i-th arriving at times[i] on the fake clock, then a finish."""

    async def gen():
        for i in range(n):
            clock[0] = times[i]
            yield StreamDelta(token_ids=[i], text=f"t{i} ")
        request = GenerationRequest([1, 2], SamplingParams(max_tokens=n))
        result = GenerationResult.without_output(request, "length")
        yield StreamDelta(token_ids=[], text="", finished=True, result=result)

    return gen()


def _collect(n: int, times: list[float], interval: float) -> list[StreamDelta]:
    clock = [0.0]

    async def run():
        return [d async for d in coalesce(_deltas(n, times, clock), interval, lambda: clock[0])]

    return asyncio.run(run())


def test_merged_stream_keeps_every_token_and_the_text():
    times = [i * 0.005 for i in range(40)]  # a token every 5 ms
    out = _collect(40, times, interval=0.02)
    assert [t for d in out for t in d.token_ids] == list(range(40))
    assert "".join(d.text for d in out) == "".join(f"t{i} " for i in range(40))
    assert out[-1].finished and out[-1].result is not None
    assert all(not d.finished for d in out[:-1])
    # First token alone, then about one item per 20 ms: ~4x fewer items than tokens.
    assert out[0].token_ids == [0]
    assert len(out) <= 40 // 4 + 2


def test_slow_steps_are_not_delayed():
    times = [i * 0.05 for i in range(10)]  # slower than the interval: nothing to merge
    out = _collect(10, times, interval=0.02)
    assert [d.token_ids for d in out[:-1]] == [[i] for i in range(10)]


def test_zero_interval_passes_every_delta_through():
    times = [i * 0.001 for i in range(8)]
    out = _collect(8, times, interval=0.0)
    assert len(out) == 9
    assert [d.token_ids for d in out[:-1]] == [[i] for i in range(8)]


def test_pending_tokens_ride_with_the_finish():
    times = [0.0, 0.001, 0.002]  # the last two arrive inside the interval
    out = _collect(3, times, interval=1.0)
    assert out[0].token_ids == [0]
    assert out[-1].finished and out[-1].token_ids == [1, 2] and out[-1].text == "t1 t2 "
