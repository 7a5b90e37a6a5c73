"""Several samples of one prompt (OpenAI's `n`) over any engine.

`n` is not a field of the engine contract's SamplingParams: a request is one sample. Asking
for n samples is n requests, marked as one group (`SampleOf`) so that an engine that can
shares the prompt's work among them; the reference engine computes the prompt once and forks
its KV. Engines that ignore the mark serve each sample on its own, which is still correct.

Seeds: sample i gets `seed + i`, as vLLM does for its own n > 1, so a seeded request gives
the same n samples every time and each sample has a stream of its own. Without a seed every
sample draws from the engine's own generator.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import TypeVar

from engines.api import (
    MAX_SAMPLES,
    Engine,
    GenerationRequest,
    GenerationResult,
    SampleOf,
    StreamDelta,
)

T = TypeVar("T")


def check_n(n: object) -> int:
    """`n` as a sample count, or ValueError naming the field and the range."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES:
        raise ValueError(f"n must be an integer in [1, {MAX_SAMPLES}], got {n!r}")
    return n


def fan_out(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The n requests that draw n samples of `request` (just `request` itself when n is 1)."""
    if check_n(n) == 1:
        return [request]
    seed = request.sampling.seed
    return [
        dataclasses.replace(
            request,
            sampling=dataclasses.replace(request.sampling, seed=None if seed is None else seed + i),
            request_id=f"{request.request_id}/{i}",
            sample_of=SampleOf(request.request_id, i, n),
        )
        for i in range(n)
    ]


async def generate_all(engine: Engine, requests: list[GenerationRequest]) -> list[GenerationResult]:
    """Every request of a group to completion, results in the group's order. Cancelling the
    caller cancels (and so aborts) every sample still running."""
    return list(await asyncio.gather(*(engine.generate(r) for r in requests)))


_DONE = object()


def stream_all(
    engine: Engine, requests: list[GenerationRequest]
) -> AsyncIterator[tuple[int, StreamDelta]]:
    """The deltas of every request of a group as they come, each with the request's index.
    Each sample's last delta has `finished` set; the iterator ends after all of them. Closing
    it early aborts every sample still running (each engine stream aborts on close)."""
    return merge([engine.stream(r) for r in requests])


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they arrive, each with its iterator's index; ends
    when all have ended. An iterator's exception ends the merge with it. Closing the merge
    (or its failing) cancels the iterators still running, which runs their own cleanup."""
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((index, exc))
            return
        queue.put_nowait((index, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
