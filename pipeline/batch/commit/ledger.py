"""The driver's commit bookkeeping: which rows of which shard are committed, in which parts.

Plain Python, no storage and no Ray: the run feeds it the part records that engine actors
report and writes its state into the manifest.

    accept(record)      commit a part if none of its rows is committed already
    replace(record)     swap a part for a new one holding the same rows (--retry-errors)
    set_num_rows(s, n)  a shard's row count, known once it was read (JSONL)

A part whose rows overlap committed rows is refused: it can only come from a shard handed
out twice (its first actor died after writing), and the rows are in the manifest already.
Memory and work grow with shards and parts (row ranges per shard), never with rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pipeline.batch.commit.parts import PartRecord
from pipeline.batch.commit.stats import RowStats, RowSums
from pipeline.batch.units import RowRanges, RowSelection, Shard, ShardPlan


class Decision(Enum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"  # its rows are committed already: the file is an orphan
    INVALID = "invalid"  # rows outside the shard, an unknown shard, a replacement mismatch


@dataclass
class ShardState:
    shard: Shard
    num_rows: int | None  # None until the shard has been read (JSONL)
    committed: RowRanges = field(default_factory=RowRanges)
    parts: list[str] = field(default_factory=list)

    @property
    def is_complete(self) -> bool:
        return self.num_rows is not None and self.committed.covers(self.num_rows)

    @property
    def missing(self) -> int | None:
        return None if self.num_rows is None else self.num_rows - len(self.committed)

    def to_json(self, parts: dict[str, PartRecord]) -> dict[str, Any]:
        """The shard, its row count, whether it is complete, and the sums of its parts."""
        sums = RowSums()
        for name in self.parts:
            sums.add(parts[name].sums)
        return {
            **self.shard.to_json(),
            "num_rows": self.num_rows,
            "complete": self.is_complete,
            "parts": list(self.parts),
            **sums.to_json(),
        }


class CommitLedger:
    """Committed rows per shard and the part records behind them (see the module docstring)."""

    def __init__(self, plan: ShardPlan, stats: RowStats | None = None):
        self.shards = [ShardState(s, s.num_rows) for s in plan.shards]
        self.parts: dict[str, PartRecord] = {}
        self.stats = stats or RowStats()
        self.changes = 0  # accepted records and row counts since the last `mark_saved`

    # --- loading what the manifest holds ---------------------------------------------------

    def restore(self, records: Iterable[PartRecord], num_rows: dict[int, int]) -> None:
        """Take the committed parts and known row counts of earlier runs (stats stay as given:
        they are the manifest's merged stats of these very parts)."""
        for index, count in num_rows.items():
            if 0 <= index < len(self.shards):
                self.shards[index].num_rows = count
        for record in records:
            state = self.shards[record.shard]
            state.committed = state.committed.union(record.rows)
            state.parts.append(record.name)
            self.parts[record.name] = record

    # --- commits ---------------------------------------------------------------------------

    def _check(self, record: PartRecord) -> ShardState | None:
        if not 0 <= record.shard < len(self.shards):
            return None
        state = self.shards[record.shard]
        spans = record.rows.spans
        if state.num_rows is not None and spans and spans[-1][1] > state.num_rows:
            return None
        return state

    def accept(self, record: PartRecord) -> Decision:
        state = self._check(record)
        if state is None or record.replaces is not None:
            return Decision.INVALID
        if record.name in self.parts or state.committed.overlaps(record.rows):
            return Decision.DUPLICATE
        state.committed = state.committed.union(record.rows)
        state.parts.append(record.name)
        self.parts[record.name] = record
        if record.stats is not None:
            self.stats.merge(record.stats)
        self.changes += 1
        return Decision.ACCEPTED

    def replace(self, record: PartRecord) -> Decision:
        """Commit `record` in place of the part it replaces (same rows, new results)."""
        state = self._check(record)
        old = self.parts.get(record.replaces or "")
        if state is None or old is None or old.rows != record.rows or old.shard != record.shard:
            return Decision.INVALID
        del self.parts[old.name]
        state.parts[state.parts.index(old.name)] = record.name
        self.parts[record.name] = record
        if record.replaced_stats is not None:
            self.stats.subtract(record.replaced_stats)
        else:  # no detail: at least keep the sums right
            self.stats.sums.add(old.sums, sign=-1)
        if record.stats is not None:
            self.stats.merge(record.stats)
        self.changes += 1
        return Decision.ACCEPTED

    def set_num_rows(self, shard: int, num_rows: int) -> None:
        state = self.shards[shard]
        if state.num_rows != num_rows:
            state.num_rows = num_rows
            self.changes += 1

    def mark_saved(self) -> None:
        self.changes = 0

    # --- what is left ----------------------------------------------------------------------

    def selection(self, shard: int) -> RowSelection:
        """What a dispatch of `shard` must generate: every row not committed."""
        return RowSelection(skip=self.shards[shard].committed)

    def incomplete(self) -> list[int]:
        return [s.shard.index for s in self.shards if not s.is_complete]

    def missing_rows(self) -> int | None:
        """Input rows without a committed row (None while a shard's count is unknown)."""
        missing = [s.missing for s in self.shards]
        return None if any(m is None for m in missing) else sum(missing)  # type: ignore[misc]

    def sums(self) -> RowSums:
        total = RowSums()
        for record in self.parts.values():
            total.add(record.sums)
        return total

    def records(self) -> list[PartRecord]:
        """Committed parts in shard, then name order."""
        return sorted(self.parts.values(), key=lambda r: (r.shard, r.name))
