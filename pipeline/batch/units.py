"""What the driver hands to workers and what they send back (small, picklable, no rows).

    driver ──WorkUnit──▶ prompt actor ──(PreparedInfo, rows table ref)──▶ driver
    driver ──WorkUnit + rows ref──▶ engine actor ──PartWritten* , UnitEnd──▶ driver

The rows themselves go from the prompt actor to the engine actor through Ray's object store;
the driver only passes the reference on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.batch.commit.parts import PartRecord
from pipeline.batch.shards import RowSelection, Shard


@dataclass(frozen=True)
class WorkUnit:
    """One hand-out of one shard."""

    shard: Shard
    run: int  # the run's attempt number (part names carry it)
    dispatch: int  # 1.. : how often this run has handed the shard out
    selection: RowSelection  # the rows to generate
    replace_parts: tuple[str, ...] = ()  # --retry-errors: parts whose error rows are redone
    # Set once preparing the shard killed prompt actors too often: its rows are read but not
    # tokenized, each becomes an error row with this message (the scheduler says why).
    failed: str | None = None

    @property
    def key(self) -> str:
        return f"shard {self.shard.index} (dispatch {self.dispatch})"


@dataclass(frozen=True)
class PreparedInfo:
    """What the driver learns from preparing a unit (the rows stay in the object store)."""

    shard: int
    num_rows: int  # rows in the whole shard
    num_selected: int  # rows prepared for generation
    num_read_errors: int  # of which already error rows (bad line, too long, ...)


@dataclass(frozen=True)
class PartWritten:
    """An engine actor wrote a part; the driver decides whether it is committed."""

    record: PartRecord
    account: dict[str, Any]  # the actor's cost account at that time (pipeline.cost)


@dataclass(frozen=True)
class UnitEnd:
    """An engine actor finished a unit (all its rows written, or some left out)."""

    shard: int
    rows_written: int
    rows_refused: int  # not admitted by the budget, or left when the run stopped
    stopped: bool  # the run asked the actor to stop
    account: dict[str, Any]
