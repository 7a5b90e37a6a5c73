"""A periodic one-line progress report of a running job (rows, tokens/s, errors, parts).

The total is exact when every shard's row count is known (Parquet footers, or JSONL shards
already read); JSONL shards not read yet are estimated from their byte range and the mean bytes
per line of a sample (pipeline.batch.driver.shards.bytes_per_line), and the line marks the total
with `~` (`rows 1200/~5000`) until it is exact.

The driver blocks while it waits for the next output batch (engines loading, a long batch), so
the line is printed by a small background thread: the user sees the job is alive even before
the first row comes back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType

from pipeline.batch.commit.parts import PartRecord
from pipeline.batch.driver.shards import bytes_per_line
from pipeline.batch.units import WorkUnit
from pipeline.spec import JobSpec
from pipeline.storage import InputFile

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowTotal:
    """Rows a run has to generate: exact, estimated, or unknown (rows None)."""

    rows: int | None
    exact: bool = True

    def text(self) -> str:
        if self.rows is None:
            return "?"
        return str(self.rows) if self.exact else f"~{self.rows}"


def estimate_total(
    units: Sequence[WorkUnit],
    known_rows: Callable[[int], int | None],
    bytes_per_line: float | None,
) -> RowTotal:
    """The rows of `units` still to generate. `known_rows(shard index)`: the shard's row count
    once known (it is read, or Parquet); else a byte-range shard is estimated as its bytes over
    `bytes_per_line`. Unknown (a compressed JSONL file, no sample) when any shard is neither."""
    rows, exact = 0, True
    for unit in units:
        shard = unit.shard
        count = known_rows(shard.index)
        if count is None:
            count = shard.num_rows
        skipped = len(unit.selection.skip)
        if count is not None:
            rows += max(count - skipped, 0)
        elif shard.kind == "byte_range" and bytes_per_line:
            rows += max(round((shard.end - shard.start) / bytes_per_line) - skipped, 0)
            exact = False
        else:
            return RowTotal(None, exact=False)
    return RowTotal(rows, exact)


def sample_bytes_per_line(
    spec: JobSpec, units: Sequence[WorkUnit], known_rows: Callable[[int], int | None]
) -> float | None:
    """Mean bytes per line of the first unread JSONL shard's file (one sample read, as the shard
    planner does), or None: no shard needs an estimate, or the sample cannot be read."""

    for unit in units:
        shard = unit.shard
        if shard.kind == "byte_range" and known_rows(shard.index) is None:
            try:
                file = InputFile(shard.uri, shard.file_size, shard.file_version)
                return bytes_per_line(spec, file)
            except Exception as exc:  # only the progress line's estimate is lost
                logger.warning("no row estimate for the progress line: %s", exc)
                return None
    return None


@dataclass
class Progress:
    """Counts of the rows this run has written in parts; `line()` formats them."""

    # Rows this run has to generate: fixed, or asked anew for each line (an estimate that
    # becomes exact as shards are read).
    total: RowTotal | Callable[[], RowTotal]
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

    def current_total(self) -> RowTotal:
        if isinstance(self.total, RowTotal):
            return self.total
        try:
            return self.total()
        except Exception as exc:  # a progress line never fails the job
            logger.debug("row total not known: %s", exc)
            return RowTotal(None, exact=False)

    def line(self, now: float | None = None) -> str:
        elapsed = max((now or time.monotonic()) - self.started, 1e-9)
        total = self.current_total()
        pct = ""
        if total.rows:
            # An estimate can fall short of what is done: never past 100%.
            share = min(100 * self.rows / total.rows, 100.0)
            pct = f" ({'' if total.exact else '~'}{share:.0f}%)"
        return (
            f"rows {self.rows}/{total.text()}{pct}"
            f" | {self.completion_tokens / elapsed:.1f} tok/s"
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
