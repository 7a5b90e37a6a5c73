"""A periodic one-line progress report of a running job (rows, tokens/s, errors, parts).

The driver blocks while it waits for the next output batch (engines loading, a long batch), so
the line is printed by a small background thread: the user sees the job is alive even before
the first row comes back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

from pipeline.batch.commit.parts import PartRecord


@dataclass
class Progress:
    """Counts of the rows this run has written in parts; `line()` formats them."""

    total: int  # rows this run has to generate (0: not known before the shards are read)
    rows: int = 0
    error_rows: int = 0
    completion_tokens: int = 0
    parts: int = 0
    started: float = field(default_factory=time.monotonic)

    def add(self, record: PartRecord) -> None:
        """Count one part an engine actor wrote."""
        self.rows += record.sums.rows
        self.error_rows += record.sums.errors
        self.completion_tokens += record.sums.completion_tokens
        self.parts += 1

    def line(self, now: float | None = None) -> str:
        elapsed = max((now or time.monotonic()) - self.started, 1e-9)
        pct = f" ({100 * self.rows / self.total:.0f}%)" if self.total else ""
        total = self.total or "?"
        return (
            f"rows {self.rows}/{total}{pct} | {self.completion_tokens / elapsed:.1f} tok/s"
            f" | errors {self.error_rows} | parts {self.parts} | {elapsed:.0f}s"
        )


class ProgressPrinter:
    """Emits `progress.line()` every `interval_s` seconds from a daemon thread while entered,
    and once more on exit."""

    def __init__(self, progress: Progress, emit: Callable[[str], None], interval_s: float = 10.0):
        self.progress = progress
        self.emit = emit
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="progress", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.emit(self.progress.line())

    def __enter__(self) -> ProgressPrinter:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        if exc_type is None:
            self.emit(self.progress.line())
