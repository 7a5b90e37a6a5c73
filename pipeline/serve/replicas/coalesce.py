"""Stream deltas merged in time: one Serve stream item per interval, not one per token.

Every item a replica yields crosses Ray to the ingress (serialised, reported, deserialised);
at one item per token that per-item cost, not the engine, bounds how many streams a replica
feeds. Merging what arrived within `interval_s` into one item keeps the first token immediate
(time to first token is untouched) and sends later text in chunks, as OpenAI's API allows: a
chunk's `delta.content` may hold several tokens.

A merged delta is flushed when the next delta arrives after the interval, or with the final
one, so text can lag by at most the interval plus one engine step. No timer task runs per
stream: a per-item task would cost what merging saves.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from engines.api import StreamDelta


def merge(first: StreamDelta, then: StreamDelta) -> StreamDelta:
    """`first` followed by `then` as one delta (finished and result from `then`)."""
    logprobs = None
    if first.logprobs is not None or then.logprobs is not None:
        logprobs = [*(first.logprobs or ()), *(then.logprobs or ())]
    return StreamDelta(
        token_ids=[*first.token_ids, *then.token_ids],
        text=first.text + then.text,
        finished=then.finished,
        result=then.result,
        logprobs=logprobs,
    )


async def coalesce(
    deltas: AsyncIterator[StreamDelta],
    interval_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[StreamDelta]:
    """`deltas`, merged so that at most one item leaves per `interval_s` (0: no merging).

    The first delta with content and the finished delta always go out at once."""
    pending: StreamDelta | None = None
    last_sent: float | None = None  # None until the first content went out
    async for delta in deltas:
        if interval_s <= 0:
            yield delta
            continue
        pending = delta if pending is None else merge(pending, delta)
        if pending.finished:
            yield pending
            return
        if not (pending.token_ids or pending.text):
            continue  # nothing to show yet (e.g. held-back stop text)
        now = clock()
        if last_sent is None or now - last_sent >= interval_s:
            yield pending
            pending, last_sent = None, now
    if pending is not None and (pending.token_ids or pending.text or pending.finished):
        yield pending  # the engine's stream ended without a finished delta: lose nothing
