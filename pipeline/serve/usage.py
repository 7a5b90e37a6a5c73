"""Per-key usage: counted in /metrics and appended to a usage log a bill can be computed from.

One record per request that reached an engine (answered, failed in the engine, or abandoned
by its client); refusals before dispatch (400, 401, 404, 413, 429) used no engine time and are
only counted in /metrics. A record (one JSON line):

    {"time": "2026-01-31T12:00:00.123Z", "key": "team-a", "model": "tiny-llama",
     "endpoint": "chat", "request_id": "chatcmpl-...", "status": 200, "stream": false,
     "prompt_tokens": 12, "cached_tokens": 0, "completion_tokens": 16, "gpu_seconds": 0.0123,
     "cost_usd": 0.0000171, "list_price_usd": 0.0000076, "latency_s": 0.21}

status 200 is an answer (usage as in the response); 5xx an engine failure and 499 a client
that went away before the end (token counts 0: unknown, not billed). A bill is the sum of
cost_usd (or list_price_usd, or the token counts at your prices) over a key's status-200
records in the period; `request_id` is the response's `id`, so a record can be matched to
what the client received.

`UsageLog` buffers records in memory (bounded) and a daemon thread writes them every
flush_interval_s, and once more at shutdown: a local path is one file appended to (one write
call per batch, so replicas on one host appending to one file do not interleave lines); an
s3:// URI is a prefix under which each batch becomes a new object, since object stores cannot
append. A failed write keeps the batch for the next try.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from pipeline.openai.responses import Usage
from pipeline.serve.metrics import ServeMetrics
from pipeline.serve.spec import UsageLogSpec
from pipeline.spec import StorageSpec
from pipeline.storage.files import is_s3
from pipeline.storage.prefix import OutputDir
from pipeline.storage.retry import RetryPolicy

logger = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's status for a request whose client went away first


@dataclass(frozen=True)
class UsageRecord:
    time: str  # ISO 8601 UTC, millisecond resolution
    key: str
    model: str
    endpoint: str
    request_id: str
    status: int
    stream: bool
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    gpu_seconds: float
    cost_usd: float
    list_price_usd: float | None
    latency_s: float
    # The LoRA adapter the request ran with (`model` is then its served model); None: none.
    # Last, with a default, so readers of older logs (no such field) still build records.
    adapter: str | None = None

    @classmethod
    def of(
        cls,
        *,
        key: str,
        model: str,
        endpoint: str,
        request_id: str,
        status: int,
        stream: bool,
        usage: Usage | None,
        latency_s: float,
        now: float | None = None,
        adapter: str | None = None,
    ) -> UsageRecord:
        return cls(
            time=utc_iso(time.time() if now is None else now),
            key=key,
            model=model,
            endpoint=endpoint,
            request_id=request_id,
            status=status,
            stream=stream,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            cached_tokens=usage.cached_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            gpu_seconds=round(usage.gpu_seconds, 9) if usage else 0.0,
            cost_usd=usage.cost_usd if usage else 0.0,
            list_price_usd=usage.list_price_usd if usage else None,
            latency_s=round(latency_s, 6),
            adapter=adapter,
        )

    def line(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":")) + "\n"


def utc_iso(epoch: float) -> str:
    stamp = dt.datetime.fromtimestamp(epoch, tz=dt.timezone.utc)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"


# --- where records go --------------------------------------------------------------------------


class Sink(Protocol):
    def write(self, data: bytes) -> None: ...


class FileSink:
    """One local file, appended to with O_APPEND: each batch in one write call."""

    def __init__(self, path: str) -> None:
        self.path = Path(path.removeprefix("file://")).expanduser()

    def write(self, data: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)


class PrefixSink:
    """A prefix of an object store: each batch a new object, named so they sort by time."""

    def __init__(self, uri: str, storage: StorageSpec, replica: str) -> None:

        # A few seconds of retries per batch; a batch that still fails stays buffered.
        self._dir = OutputDir(uri, storage, RetryPolicy(total_s=10.0))
        self._replica = "".join(c if c.isalnum() or c in "-_" else "-" for c in replica)[:40]
        self._seq = 0

    def write(self, data: bytes) -> None:
        self._seq += 1
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        self._dir.put(f"usage-{stamp}-{self._replica}-{self._seq:06d}.jsonl", data)


def sink_for(spec: UsageLogSpec, storage: StorageSpec, replica: str) -> Sink:
    if is_s3(spec.uri):
        return PrefixSink(spec.uri, storage, replica)
    return FileSink(spec.uri)


class UsageLog:
    """Buffered usage records, written by a daemon thread every flush_interval_s."""

    def __init__(
        self,
        sink: Sink,
        flush_interval_s: float,
        max_pending: int,
        on_write_error: Callable[[], None] = lambda: None,
    ) -> None:
        self._sink = sink
        self._interval_s = flush_interval_s
        self._max_pending = max_pending
        self._on_write_error = on_write_error
        self._pending: list[str] = []
        self._lock = threading.Lock()  # add() runs on the event loop, flush() in the thread
        self._flushing = threading.Lock()  # one write at a time (thread vs shutdown)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def pending(self) -> int:
        return len(self._pending)

    def add(self, record: UsageRecord) -> bool:
        """Buffer a record; False (dropped) when max_pending records are already waiting."""
        with self._lock:
            if len(self._pending) >= self._max_pending:
                return False
            self._pending.append(record.line())
            return True

    def flush(self) -> int:
        """Write what is buffered; the number of records written (0 on failure: kept)."""
        with self._flushing:
            with self._lock:
                batch, self._pending = self._pending, []
            if not batch:
                return 0
            try:
                self._sink.write("".join(batch).encode())
            except Exception as exc:
                with self._lock:
                    # Oldest first, as they were; past the cap the newest go.
                    self._pending = (batch + self._pending)[: self._max_pending]
                self._on_write_error()
                logger.error(
                    "writing %d usage records failed (kept for the next try): %s", len(batch), exc
                )
                return 0
            return len(batch)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="usage-log", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.flush()

    def close(self) -> None:
        """Stop the thread and write what is left (the replica is shutting down)."""
        self._stop.set()
        self.flush()


# --- accounting --------------------------------------------------------------------------------


class UsageAccounting:
    """Per-key usage into /metrics and the usage log (if configured)."""

    def __init__(self, metrics: ServeMetrics, log: UsageLog | None) -> None:
        self._metrics = metrics
        self.log = log
        self._dropped = 0

    def refused(self, key: str, model: str, status: int) -> None:
        """A request answered without reaching an engine: counted, not logged."""
        self._metrics.key_requests.labels(key, model, str(status)).inc()

    def finished(
        self,
        *,
        key: str,
        model: str,
        endpoint: str,
        request_id: str,
        status: int,
        stream: bool,
        usage: Usage | None,
        latency_s: float,
        adapter: str | None = None,
    ) -> None:
        """A request that reached an engine: usage counted by key and logged (`adapter`: the
        LoRA adapter it ran with, in the record; the metrics stay per served model)."""
        m = self._metrics
        m.key_requests.labels(key, model, str(status)).inc()
        if usage is not None:
            m.key_prompt_tokens.labels(key, model).inc(usage.prompt_tokens)
            m.key_cached_tokens.labels(key, model).inc(usage.cached_tokens)
            m.key_completion_tokens.labels(key, model).inc(usage.completion_tokens)
            m.key_cost_usd.labels(key, model).inc(usage.cost_usd)
        if self.log is None:
            return
        record = UsageRecord.of(
            key=key,
            model=model,
            endpoint=endpoint,
            request_id=request_id,
            status=status,
            stream=stream,
            usage=usage,
            latency_s=latency_s,
            adapter=adapter,
        )
        if not self.log.add(record):
            m.usage_dropped.inc()
            self._dropped += 1
            if self._dropped % 1000 == 1:  # the first, then every 1000th: no log flood
                logger.error(
                    "usage log buffer full (%d records unwritten): %d records dropped so far",
                    self.log.pending,
                    self._dropped,
                )
