"""A periodic one-line progress report of a running job (rows, tokens/s, errors, parts)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.write import CommitStats


@dataclass
class Progress:
    """Counts of the rows the driver has committed this run; `line()` formats them."""

    total: int  # rows this run has to generate
    rows: int = 0
    error_rows: int = 0
    completion_tokens: int = 0
    parts: int = 0
    started: float = field(default_factory=time.monotonic)

    def update(self, stats: CommitStats) -> None:
        """Take the counts of what has been committed so far."""
        self.rows = stats.rows
        self.error_rows = stats.error_rows
        self.completion_tokens = stats.completion_tokens
        self.parts = len(stats.parts)

    def line(self, now: float | None = None) -> str:
        elapsed = max((now or time.monotonic()) - self.started, 1e-9)
        pct = f" ({100 * self.rows / self.total:.0f}%)" if self.total else ""
        return (
            f"rows {self.rows}/{self.total}{pct} | {self.completion_tokens / elapsed:.1f} tok/s"
            f" | errors {self.error_rows} | parts {self.parts} | {elapsed:.0f}s"
        )


class ProgressPrinter:
    """Calls `emit(progress.line())` at most every `interval_s` seconds (and on `final`)."""

    def __init__(self, emit: Callable[[str], None], interval_s: float = 10.0):
        self.emit = emit
        self.interval_s = interval_s
        self._last = time.monotonic()

    def maybe_emit(self, progress: Progress, final: bool = False) -> None:
        now = time.monotonic()
        if final or now - self._last >= self.interval_s:
            self._last = now
            self.emit(progress.line(now))
