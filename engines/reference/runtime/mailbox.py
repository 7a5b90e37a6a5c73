"""Where the reference engine's callers and its step loop meet.

Callers (on their asyncio loop) put new requests, embed requests and aborts here under one
condition variable; the step loop takes them at the top of each turn. The ids in flight, and
whether the engine is stopping or dead, are kept here too: a request is refused or answered
under the same lock that queues it.
"""

from __future__ import annotations

import threading
from collections import deque

from engines.api import EngineDeadError, GenerationRequest, RequestMetrics, StreamDelta
from engines.reference.runtime.live import Embedding, Live, result_of, take_embed_batch
from engines.sinks import Sink, deliver


class Mailbox:
    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.inbox: deque[Live] = deque()
        self.aborts: deque[str] = deque()
        self.embeds: deque[Embedding] = deque()
        self.embedding: list[Embedding] = []  # the embed batch being run (step loop)
        self.in_flight: set[str] = set()  # ids submitted and not yet finished
        self.stopping = False
        self.dead: str | None = None  # why the engine stopped

    def put(self, live: Live, error: str | None) -> None:
        """Queue an admitted request for the step loop, or answer its row error now."""
        with self.cv:
            if self._accept(live.request, live.sink, live.is_stream, live.metrics, error):
                self.inbox.append(live)
                self.cv.notify()

    def put_embed(self, embedding: Embedding, error: str | None) -> None:
        """Queue an embed request for the step loop, or answer its row error now."""
        with self.cv:
            e = embedding
            if self._accept(e.request, e.sink, e.is_stream, e.metrics, error):
                self.embeds.append(e)
                self.cv.notify()

    def _accept(
        self,
        request: GenerationRequest,
        sink: Sink,
        is_stream: bool,
        metrics: RequestMetrics,
        error: str | None,
    ) -> bool:
        """Under the lock: refuse if the engine stopped (EngineDeadError); answer a row error
        (the request's own, or a request id already in flight) at once; else mark the id in
        flight and return True for the caller to queue it."""
        if self.stopping or self.dead is not None:
            raise EngineDeadError(
                f"the reference engine has stopped ({self.dead or 'shut down'}); "
                "load a new engine to serve more requests"
            )
        if error is None and request.request_id in self.in_flight:
            error = f"request_id {request.request_id!r} is already in flight"
        if error is not None:
            metrics.finish_time = metrics.arrival_time
            result = result_of(request, [], "", "error", metrics, error=error)
            deliver([(sink, StreamDelta([], "", True, result) if is_stream else result)])
            return False
        self.in_flight.add(request.request_id)
        return True

    def abort(self, request_id: str) -> None:
        with self.cv:
            self.aborts.append(request_id)
            self.cv.notify()

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify()

    def take(
        self, has_live: bool, max_embed_tokens: int
    ) -> tuple[deque[Live], deque[str], list[Embedding]] | None:
        """Wait for work (the step loop, with `has_live` requests of its own); the new
        requests, aborts and an embed batch, or None once the engine is stopping."""
        with self.cv:
            while not (self.stopping or self.inbox or self.aborts or has_live or self.embeds):
                self.cv.wait()
            if self.stopping:
                return None
            inbox, self.inbox = self.inbox, deque()
            aborts, self.aborts = self.aborts, deque()
            embeds = take_embed_batch(self.embeds, max_embed_tokens)
            # Held where `die` finds it: a crash mid-batch fails these callers too.
            self.embedding = embeds
            return inbox, aborts, embeds

    def finished(self, request_ids: list[str]) -> None:
        with self.cv:
            for request_id in request_ids:
                self.in_flight.discard(request_id)

    def left(self) -> tuple[deque[Live], deque[Embedding]]:
        """What is queued and not yet taken (at shutdown)."""
        with self.cv:
            inbox, self.inbox = self.inbox, deque()
            embeds, self.embeds = self.embeds, deque()
        return inbox, embeds

    def die(self, reason: str) -> tuple[deque[Live], deque[Embedding]]:
        """Mark the engine dead; what was queued or mid-batch, to be failed."""
        with self.cv:
            self.dead = reason
            inbox, self.inbox = self.inbox, deque()
            embeds, self.embeds = self.embeds, deque()
            embeds.extend(self.embedding)  # the batch the crash interrupted
            self.embedding = []
            self.in_flight.clear()
        return inbox, embeds
