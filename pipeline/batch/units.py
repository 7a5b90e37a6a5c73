"""What the driver hands to workers and what they send back (small, picklable, no rows): the
shard geometry (RowRanges, RowSelection, Shard, ShardPlan), work units and their results, and
the budget's messages (RowAdmission, RowSpend).

    driver ──WorkUnit──▶ prompt actor ──(PreparedInfo, rows table ref)──▶ driver
    driver ──WorkUnit + rows ref──▶ engine actor ──PartWritten* , UnitEnd──▶ driver

The rows themselves go from the prompt actor to the engine actor through Ray's object store;
the driver only passes the reference on.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import pyarrow as pa


@dataclass(frozen=True)
class RowAdmission:
    """One row asking to enter an engine."""

    row_id: str
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class RowSpend:
    """One admitted row that left the engine."""

    row_id: str
    cost_usd: float  # the row's cost_usd column
    tokens: int  # prompt + completion tokens it processed


ShardKind = Literal["row_groups", "byte_range", "whole_file"]


@dataclass(frozen=True)
class RowRanges:
    """A set of row indexes as sorted, disjoint, non-adjacent [start, end) ranges."""

    spans: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, spans: Iterable[Sequence[int]]) -> RowRanges:
        merged: list[list[int]] = []
        for start, end in sorted((int(s), int(e)) for s, e in spans if int(e) > int(s)):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return cls(tuple((s, e) for s, e in merged))

    @classmethod
    def from_indexes(cls, indexes: Iterable[int]) -> RowRanges:
        """Ranges covering exactly the given indexes (any order, duplicates ignored)."""
        spans: list[tuple[int, int]] = []
        for index in sorted(set(int(i) for i in indexes)):
            if spans and spans[-1][1] == index:
                spans[-1] = (spans[-1][0], index + 1)
            else:
                spans.append((index, index + 1))
        return cls(tuple(spans))

    @classmethod
    def full(cls, num_rows: int) -> RowRanges:
        return cls(((0, num_rows),) if num_rows > 0 else ())

    def __len__(self) -> int:
        return sum(end - start for start, end in self.spans)

    def __bool__(self) -> bool:
        return bool(self.spans)

    def __iter__(self) -> Iterator[int]:
        for start, end in self.spans:
            yield from range(start, end)

    def union(self, other: RowRanges) -> RowRanges:
        return RowRanges.of([*self.spans, *other.spans])

    def intersection(self, other: RowRanges) -> RowRanges:
        out: list[tuple[int, int]] = []
        i = j = 0
        a, b = self.spans, other.spans
        while i < len(a) and j < len(b):
            start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
            if start < end:
                out.append((start, end))
            if a[i][1] < b[j][1]:
                i += 1
            else:
                j += 1
        return RowRanges(tuple(out))

    def difference(self, other: RowRanges) -> RowRanges:
        out: list[tuple[int, int]] = []
        j = 0
        b = other.spans
        for start, end in self.spans:
            cursor = start
            while j < len(b) and b[j][1] <= cursor:
                j += 1
            k = j
            while k < len(b) and b[k][0] < end:
                if b[k][0] > cursor:
                    out.append((cursor, b[k][0]))
                cursor = max(cursor, b[k][1])
                k += 1
            if cursor < end:
                out.append((cursor, end))
        return RowRanges(tuple(out))

    def overlaps(self, other: RowRanges) -> bool:
        return bool(self.intersection(other))

    def covers(self, num_rows: int) -> bool:
        """Whether every index in [0, num_rows) is in the set."""
        return num_rows == 0 or self.spans == ((0, num_rows),)

    def to_json(self) -> list[list[int]]:
        return [[s, e] for s, e in self.spans]

    @classmethod
    def from_json(cls, data: Iterable[Sequence[int]]) -> RowRanges:
        return cls.of(data)


@dataclass(frozen=True)
class RowSelection:
    """Which rows of a shard a run generates: all but `skip`, or only `only` (retry-errors)."""

    skip: RowRanges = field(default_factory=RowRanges)  # committed: never read again
    only: RowRanges | None = None  # when set, just these rows (minus skip)

    def wants(self, row: int) -> bool:
        if self.only is not None and not _contains(self.only, row):
            return False
        return not _contains(self.skip, row)


def _contains(ranges: RowRanges, row: int) -> bool:
    from bisect import bisect_right

    spans = ranges.spans
    i = bisect_right(spans, (row, math.inf)) - 1
    return i >= 0 and spans[i][0] <= row < spans[i][1]


@dataclass(frozen=True)
class Shard:
    """One slice of one input file (see the module docstring)."""

    index: int  # position in the plan, 0..n-1
    uri: str  # the input file
    file_size: int
    file_version: str
    kind: ShardKind
    start: int  # row_groups: first file row; byte_range: first byte; whole_file: 0
    end: int  # exclusive; whole_file: the file size
    row_groups: tuple[int, ...] = ()  # row_groups: the Parquet row groups read
    num_rows: int | None = None  # known before reading for Parquet; None for JSONL
    max_rows: int | None = None  # input.limit reached inside this shard: read at most this

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["row_groups"] = list(self.row_groups)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Shard:
        return cls(**{**data, "row_groups": tuple(data.get("row_groups") or ())})

    def describe(self) -> str:
        unit = "rows" if self.kind == "row_groups" else "bytes"
        return f"shard {self.index} ({self.uri} {unit} {self.start}-{self.end})"


@dataclass(frozen=True)
class ShardPlan:
    shards: tuple[Shard, ...]
    target: int  # rows (Parquet) or bytes (JSONL) per shard the plan aimed for
    parquet_schemas: tuple[pa.Schema, ...] | None = None  # every input file's (Parquet)
    slots: int | None = None  # engine slots it was sized for (None: TARGET_SHARDS alone)

    @property
    def digest(self) -> str:
        text = json.dumps([s.to_json() for s in self.shards], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def known_rows(self) -> int | None:
        """Total rows when every shard's count is known before reading (Parquet)."""
        counts = [s.num_rows for s in self.shards]
        return None if any(c is None for c in counts) else sum(counts)  # type: ignore[misc]

    def __len__(self) -> int:
        return len(self.shards)


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
class UnitEnd:
    """An engine actor finished a unit (all its rows written, or some left out)."""

    shard: int
    rows_written: int
    rows_refused: int  # not admitted by the budget, or left when the run stopped
    stopped: bool  # the run asked the actor to stop
    account: dict[str, Any]
