"""Where an engine's outcomes meet their callers' event loops.

An engine that computes on a thread of its own (the reference engine's step loop, the reader
of an engine in another process) hands each request's outcome to a `Sink` on the caller's
loop: a future for `generate`, a queue of deltas for `stream`. `deliver` and `Outbox` send
many outcomes at once with one `call_soon_threadsafe` per caller loop: each such call writes
the loop's wake-up pipe and queues a callback, so at 32 streams one call per request cost 32
wake-ups per step of the thread that also serves HTTP. Items keep their order per sink.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass
class Sink:
    """One request's outcome on its caller's loop: a future (generate) or a queue (stream)."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future | None = None
    queue: asyncio.Queue | None = None

    def put(self, item: Any) -> None:
        """On the caller's loop: an exception fails the future, anything else resolves it (a
        future takes its first outcome only); a stream queues every item."""
        if self.future is not None:
            if self.future.done():
                return
            if isinstance(item, BaseException):
                self.future.set_exception(item)
            else:
                self.future.set_result(item)
        elif self.queue is not None:
            self.queue.put_nowait(item)


def _put_all(batch: list[tuple[Sink, Any]]) -> None:
    for sink, item in batch:
        sink.put(item)


def deliver(items: Iterable[tuple[Sink, Any]]) -> None:
    """Hand (sink, item) pairs to their loops from any thread: one callback per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Sink, Any]]] = {}
    for sink, item in items:
        by_loop.setdefault(sink.loop, []).append((sink, item))
    for loop, batch in by_loop.items():
        # The loop may already be closed (its callers gone).
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_put_all, batch)


class Outbox:
    """Outcomes gathered on one thread (a step loop's iteration), delivered together."""

    def __init__(self) -> None:
        self._items: list[tuple[Sink, Any]] = []

    def put(self, sink: Sink, item: Any) -> None:
        self._items.append((sink, item))

    def flush(self) -> None:
        items, self._items = self._items, []
        deliver(items)


async def await_result(submit: Callable[[Sink], None], abort: Callable[[], None]) -> Any:
    """`submit` a request with a future sink and await its outcome; a cancelled caller aborts
    the request."""
    loop = asyncio.get_running_loop()
    sink = Sink(loop, future=loop.create_future())
    submit(sink)
    try:
        return await sink.future
    except asyncio.CancelledError:
        abort()
        raise


async def stream_items(
    submit: Callable[[Sink], None], abort: Callable[[], None]
) -> AsyncIterator[Any]:
    """`submit` a request with a queue sink (at the first iteration) and yield its deltas
    until the finished one; an exception item is raised. A consumer that stops early aborts
    the request."""
    sink = Sink(asyncio.get_running_loop(), queue=asyncio.Queue())
    submit(sink)
    assert sink.queue is not None
    finished = False
    try:
        while not finished:
            item = await sink.queue.get()
            if isinstance(item, BaseException):
                finished = True  # the engine has ended the request itself
                raise item
            finished = item.finished
            yield item
    finally:
        if not finished:
            abort()
