"""Row statistics that add up: what totals and the report need, computed once per part.

When a part is written, the worker that wrote it computes its `RowStats` from the rows it
holds; the driver adds them up as parts commit and keeps the sum in the manifest. Finishing a
job, `tokenmill report` and the summary then read the manifest only, never the rows:

- sums: rows, error rows, tokens, device-seconds, cost, list price;
- histograms on fixed logarithmic buckets (latency, TTFT, device-seconds per row), from
  which quantiles are read to within one bucket (about 6%);
- error rows by kind;
- a timeline of output tokens per second: each row's tokens spread over its decode interval
  (first token → finish), so throughput is drawn when tokens were made, not when rows ended;
- per actor, the spans when it had rows in its engine;
- speculative decoding: tokens proposed, accepted, and verification steps (jobs with
  engine.speculative), whence the acceptance rate and accepted tokens per verification;
- LoRA adapters: the sums of each adapter's rows (jobs with model.adapters), whence rows,
  tokens, device-seconds and dollars per adapter.

All of it merges by addition; histograms and counters also subtract (a row replaced by
`--retry-errors` leaves the sums).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.cost import RowSums, row_sums

# Histogram buckets: BUCKETS_PER_DECADE per factor of 10, from MIN_VALUE up.
BUCKETS_PER_DECADE = 40
MIN_VALUE = 1e-7
# A timeline keeps at most this many bins; past it, neighbouring bins are merged in pairs.
MAX_TIMELINE_BINS = 400
FIRST_BIN_S = 0.25
# Busy spans of one actor closer than this are drawn as one.
SPAN_GAP_S = 0.5
MAX_SPANS_PER_ACTOR = 500


def error_kind(message: str | None) -> str:
    """A short, stable label for an error message (its exception type or leading phrase): the
    key of `RowStats.errors_by_kind`, counted when a part is written."""
    if not message:
        return "unknown"
    # "row 'x': ..." prefixes name the row, not the kind: drop them first.
    text = re.sub(r"^row\s+\S+?:\s*", "", message.strip())
    # "<file> line 3: ..." / "<file> row 7: ..." / "<file> byte 99: ..." name the place: drop it.
    text = re.sub(r"^\S+ (line|row|byte) \d+(?: \(byte \d+\))?:\s*", "", text)
    head = re.split(r"[:(\n]", text, maxsplit=1)[0].strip()
    return (head or text)[:48]


@dataclass
class Histogram:
    """Counts of positive values on logarithmic buckets, plus a count of zeros."""

    counts: Counter[int] = field(default_factory=Counter)
    zeros: int = 0

    @staticmethod
    def bucket(value: float) -> int:
        return max(0, math.floor(math.log10(value / MIN_VALUE) * BUCKETS_PER_DECADE))

    @staticmethod
    def bounds(bucket: int) -> tuple[float, float]:
        low = MIN_VALUE * 10 ** (bucket / BUCKETS_PER_DECADE)
        return low, low * 10 ** (1 / BUCKETS_PER_DECADE)

    def add(self, value: float | None) -> None:
        if value is None or not math.isfinite(value) or value < 0:
            return
        if value <= 0:
            self.zeros += 1
        else:
            self.counts[self.bucket(value)] += 1

    @property
    def total(self) -> int:
        return self.zeros + sum(self.counts.values())

    def merge(self, other: Histogram) -> None:
        self.counts.update(other.counts)
        self.zeros += other.zeros

    def subtract(self, other: Histogram) -> None:
        self.counts.subtract(other.counts)
        self.counts = Counter({k: v for k, v in self.counts.items() if v > 0})
        self.zeros = max(self.zeros - other.zeros, 0)

    def quantile(self, q: float) -> float | None:
        """The q-quantile, interpolated geometrically inside its bucket (None: empty)."""
        total = self.total
        if total == 0:
            return None
        rank = q * (total - 1)
        if rank < self.zeros:
            return 0.0
        seen = self.zeros
        for bucket in sorted(self.counts):
            n = self.counts[bucket]
            if rank < seen + n:
                low, high = self.bounds(bucket)
                share = (rank - seen + 0.5) / n
                return low * (high / low) ** share
            seen += n
        return self.bounds(max(self.counts))[1]

    def items(self) -> list[tuple[float, float, int]]:
        """(low, high, count) per non-empty bucket, ascending; zeros as (0, 0, n)."""
        out = [(0.0, 0.0, self.zeros)] if self.zeros else []
        out += [(*self.bounds(b), self.counts[b]) for b in sorted(self.counts)]
        return out

    def to_json(self) -> dict[str, Any]:
        return {"zeros": self.zeros, "counts": {str(k): v for k, v in sorted(self.counts.items())}}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Histogram:
        data = data or {}
        return cls(
            Counter({int(k): int(v) for k, v in data.get("counts", {}).items()}),
            int(data.get("zeros", 0)),
        )


@dataclass
class SpecCounts:
    """Speculative decoding over a set of rows: sums of the spec_* output columns."""

    proposed: int = 0  # tokens proposed and verified
    accepted: int = 0  # of them, accepted by the model
    verifications: int = 0  # engine steps that verified proposals (0 where not counted)

    def add(self, other: SpecCounts, sign: int = 1) -> None:
        self.proposed += sign * other.proposed
        self.accepted += sign * other.accepted
        self.verifications += sign * other.verifications

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / proposed; None when nothing was proposed."""
        return self.accepted / self.proposed if self.proposed else None

    @property
    def accepted_per_verification(self) -> float | None:
        """Mean accepted tokens per verification step (each also emits one token of the
        model's own on top); None where the engine does not count verifications."""
        return self.accepted / self.verifications if self.verifications else None

    def to_json(self) -> dict[str, int]:
        return {
            "proposed": self.proposed,
            "accepted": self.accepted,
            "verifications": self.verifications,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> SpecCounts:
        data = data or {}
        return cls(
            int(data.get("proposed", 0)),
            int(data.get("accepted", 0)),
            int(data.get("verifications", 0)),
        )

    @classmethod
    def of_table(cls, table: pa.Table) -> SpecCounts:
        def total(name: str) -> int:
            if name not in table.column_names:
                return 0
            return int(pc.sum(table.column(name)).as_py() or 0)

        return cls(
            total("spec_proposed_tokens"),
            total("spec_accepted_tokens"),
            total("spec_verifications"),
        )


@dataclass
class Timeline:
    """An amount (tokens) spread over wall-clock time in equal bins from `start` (epoch s)."""

    start: float | None = None
    width_s: float = FIRST_BIN_S
    bins: list[float] = field(default_factory=list)

    def _coarsen(self) -> None:
        self.bins = [sum(self.bins[i : i + 2]) for i in range(0, len(self.bins), 2)]
        self.width_s *= 2

    def _extend_to(self, t: float) -> None:
        assert self.start is not None
        while t < self.start:  # earlier than the first bin: move the origin back by whole bins
            shift = math.ceil((self.start - t) / self.width_s)
            self.bins = [0.0] * shift + self.bins
            self.start -= shift * self.width_s
            while len(self.bins) > MAX_TIMELINE_BINS:
                self._coarsen()
        needed = int((t - self.start) / self.width_s) + 1
        while needed > MAX_TIMELINE_BINS:
            self._coarsen()
            needed = int((t - self.start) / self.width_s) + 1
        if needed > len(self.bins):
            self.bins += [0.0] * (needed - len(self.bins))

    def add(self, begin: float, end: float, amount: float) -> None:
        """Spread `amount` uniformly over [begin, end] (all in the bin of `end` if empty)."""
        if amount <= 0 or not (math.isfinite(begin) and math.isfinite(end)):
            return
        begin = min(begin, end)
        if self.start is None:
            self.start = math.floor(begin / FIRST_BIN_S) * FIRST_BIN_S
        self._extend_to(begin)
        self._extend_to(end)
        assert self.start is not None
        if end - begin <= 0:
            self.bins[int((end - self.start) / self.width_s)] += amount
            return
        rate = amount / (end - begin)
        first = int((begin - self.start) / self.width_s)
        last = int((end - self.start) / self.width_s)
        for i in range(first, last + 1):
            low = self.start + i * self.width_s
            overlap = min(end, low + self.width_s) - max(begin, low)
            if overlap > 0:
                self.bins[i] += rate * overlap

    def merge(self, other: Timeline) -> None:
        if other.start is None:
            return
        for i, amount in enumerate(other.bins):
            if amount:
                low = other.start + i * other.width_s
                self.add(low, low + other.width_s, amount)

    def rates(self) -> list[tuple[float, float]]:
        """(bin start epoch s, amount per second) per bin."""
        if self.start is None:
            return []
        return [(self.start + i * self.width_s, b / self.width_s) for i, b in enumerate(self.bins)]

    def to_json(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "width_s": self.width_s,
            "bins": [round(b, 3) for b in self.bins],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Timeline:
        data = data or {}
        return cls(
            data.get("start"), float(data.get("width_s", FIRST_BIN_S)), list(data.get("bins", []))
        )


def merge_spans(
    spans: list[tuple[float, float]], gap: float = SPAN_GAP_S
) -> list[tuple[float, float]]:
    """Union of [start, end] spans, joining those closer than `gap`; at most
    MAX_SPANS_PER_ACTOR (the smallest gaps are closed first when there are more)."""
    merged: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1] + gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    while len(merged) > MAX_SPANS_PER_ACTOR:
        gaps = sorted(range(len(merged) - 1), key=lambda i: merged[i + 1][0] - merged[i][1])
        i = gaps[0]
        merged[i : i + 2] = [(merged[i][0], merged[i + 1][1])]
    return merged


@dataclass
class RowStats:
    """Everything the totals and the report need from a set of rows (see the module doc)."""

    sums: RowSums = field(default_factory=RowSums)
    latency_s: Histogram = field(default_factory=Histogram)
    ttft_s: Histogram = field(default_factory=Histogram)
    gpu_seconds: Histogram = field(default_factory=Histogram)  # per row
    errors_by_kind: Counter[str] = field(default_factory=Counter)
    tokens: Timeline = field(default_factory=Timeline)  # output tokens over wall time
    busy: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # actor -> spans
    spec: SpecCounts = field(default_factory=SpecCounts)
    # Jobs with model.adapters: the sums of each adapter's rows (BASE: the model itself).
    by_adapter: dict[str, RowSums] = field(default_factory=dict)

    def _add_adapters(self, other: RowStats, sign: int) -> None:
        for name, sums in other.by_adapter.items():
            self.by_adapter.setdefault(name, RowSums()).add(sums, sign=sign)
        self.by_adapter = {k: v for k, v in self.by_adapter.items() if v.rows != 0}

    def merge(self, other: RowStats) -> None:
        self.sums.add(other.sums)
        self.spec.add(other.spec)
        self._add_adapters(other, 1)
        self.latency_s.merge(other.latency_s)
        self.ttft_s.merge(other.ttft_s)
        self.gpu_seconds.merge(other.gpu_seconds)
        self.errors_by_kind.update(other.errors_by_kind)
        self.tokens.merge(other.tokens)
        for actor, spans in other.busy.items():
            self.busy[actor] = merge_spans([*self.busy.get(actor, []), *spans])

    def subtract(self, other: RowStats) -> None:
        """Remove rows that were replaced (their tokens and busy time stay: they happened)."""
        self.sums.add(other.sums, sign=-1)
        self.spec.add(other.spec, sign=-1)
        self._add_adapters(other, -1)
        self.latency_s.subtract(other.latency_s)
        self.ttft_s.subtract(other.ttft_s)
        self.gpu_seconds.subtract(other.gpu_seconds)
        self.errors_by_kind.subtract(other.errors_by_kind)
        self.errors_by_kind = Counter({k: v for k, v in self.errors_by_kind.items() if v > 0})

    def to_json(self) -> dict[str, Any]:
        return {
            "sums": self.sums.to_json(),
            "latency_s": self.latency_s.to_json(),
            "ttft_s": self.ttft_s.to_json(),
            "gpu_seconds": self.gpu_seconds.to_json(),
            "errors_by_kind": dict(self.errors_by_kind.most_common()),
            "tokens": self.tokens.to_json(),
            "busy": {a: [[round(s, 3), round(e, 3)] for s, e in v] for a, v in self.busy.items()},
            "spec": self.spec.to_json(),
            **(
                {"by_adapter": {k: v.to_json() for k, v in sorted(self.by_adapter.items())}}
                if self.by_adapter
                else {}
            ),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> RowStats:
        data = data or {}
        return cls(
            sums=RowSums.from_json(data.get("sums", {})),
            latency_s=Histogram.from_json(data.get("latency_s")),
            ttft_s=Histogram.from_json(data.get("ttft_s")),
            gpu_seconds=Histogram.from_json(data.get("gpu_seconds")),
            errors_by_kind=Counter(data.get("errors_by_kind", {})),
            tokens=Timeline.from_json(data.get("tokens")),
            busy={a: [(float(s), float(e)) for s, e in v] for a, v in data.get("busy", {}).items()},
            spec=SpecCounts.from_json(data.get("spec")),
            by_adapter={k: RowSums.from_json(v) for k, v in data.get("by_adapter", {}).items()},
        )

    @classmethod
    def of_table(cls, table: pa.Table) -> RowStats:
        """The stats of output rows (columns of pipeline.batch.stages.schema.RESULT_FIELDS)."""
        stats = cls()
        n = table.num_rows
        if n == 0:
            return stats
        is_error = pc.fill_null(pc.equal(table.column("finish_reason"), "error"), False)

        def total(name: str) -> float:
            return pc.sum(table.column(name)).as_py() or 0

        stats.sums = RowSums(
            rows=n,
            errors=int(pc.sum(is_error).as_py() or 0),
            prompt_tokens=int(total("prompt_tokens")),
            cached_prompt_tokens=int(total("cached_prompt_tokens")),
            completion_tokens=int(total("completion_tokens")),
            gpu_seconds=float(total("gpu_seconds")),
            cost_usd=float(total("cost_usd")),
            list_price_usd=float(total("list_price_usd")),
        )
        latency = table.column("latency_s").to_pylist()
        ttft = table.column("ttft_s").to_pylist()
        decode = table.column("decode_s").to_pylist()
        gpu = table.column("gpu_seconds").to_pylist()
        tokens = table.column("completion_tokens").to_pylist()
        finished = table.column("finished_at").cast(pa.int64()).to_pylist()  # ms since epoch
        actors = table.column("actor_id").to_pylist()
        spans: dict[str, list[tuple[float, float]]] = {}
        for i in range(n):
            stats.latency_s.add(latency[i])
            stats.ttft_s.add(ttft[i])
            stats.gpu_seconds.add(gpu[i])
            if finished[i] is None:
                continue
            end = finished[i] / 1000.0
            if decode[i] is not None and tokens[i]:
                stats.tokens.add(end - decode[i], end, float(tokens[i]))
            if actors[i] is not None and latency[i] is not None:
                spans.setdefault(actors[i], []).append((end - latency[i], end))
        for message in table.filter(is_error).column("error").to_pylist():
            stats.errors_by_kind[error_kind(message)] += 1
        stats.busy = {a: merge_spans(s) for a, s in spans.items()}
        stats.spec = SpecCounts.of_table(table)
        stats.by_adapter = sums_by_adapter(table)
        return stats


# The by_adapter key of rows that ran on the model itself.
BASE = ""


def sums_by_adapter(table: pa.Table) -> dict[str, RowSums]:
    """The sums of each adapter's rows of a job with model.adapters (an `adapter` column);
    {} for other jobs."""
    if "adapter" not in table.column_names:
        return {}
    names = [n or BASE for n in table.column("adapter").to_pylist()]
    return {
        key: row_sums(table.filter(pa.array([n == key for n in names], type=pa.bool_())))
        for key in sorted(set(names))
    }
