"""The driver's commit bookkeeping and the row statistics it keeps, without storage or Ray:
which parts commit, which are refused, when a shard is complete; histograms, timelines and
their merges; retries that stop at permanent errors and at their deadline."""

from __future__ import annotations

import datetime as dt
import math
import random

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.batch.commit.ledger import CommitLedger, Decision
from pipeline.batch.commit.parts import PartRecord
from pipeline.batch.commit.stats import Histogram, RowStats, Timeline
from pipeline.batch.stages.schema import output_schema
from pipeline.batch.units import RowRanges, Shard, ShardPlan
from pipeline.cost import RowSums
from pipeline.storage import PreconditionFailed, RetryPolicy, with_retries


def plan(*rows: int | None) -> ShardPlan:
    shards = tuple(
        Shard(i, f"f{i}", 0, "", "byte_range", 0, 0, num_rows=n) for i, n in enumerate(rows)
    )
    return ShardPlan(shards, 10)


def record(name: str, shard: int, rows: list[int], errors: int = 0, replaces: str | None = None):
    return PartRecord(
        name=name,
        shard=shard,
        run=1,
        rows=RowRanges.from_indexes(rows),
        sums=RowSums(rows=len(rows), errors=errors, completion_tokens=2 * len(rows)),
        size_bytes=1,
        version="v",
        actor_id="a",
        written_at=0.0,
        replaces=replaces,
    )


def test_parts_commit_once_and_shards_complete_when_every_row_is_in() -> None:
    ledger = CommitLedger(plan(5, None))
    assert ledger.accept(record("p0", 0, [0, 1, 2])) is Decision.ACCEPTED
    assert ledger.accept(record("p0-again", 0, [2, 3])) is Decision.DUPLICATE  # row 2 is in
    assert ledger.accept(record("p0", 0, [3])) is Decision.DUPLICATE  # same name
    assert ledger.accept(record("p9", 9, [0])) is Decision.INVALID  # no such shard
    assert ledger.accept(record("pX", 0, [7])) is Decision.INVALID  # beyond the shard's rows
    assert ledger.incomplete() == [0, 1] and ledger.missing_rows() is None
    assert ledger.selection(0).skip == RowRanges(((0, 3),))
    assert ledger.accept(record("p1", 0, [3, 4])) is Decision.ACCEPTED
    ledger.set_num_rows(1, 0)  # an empty JSONL shard: complete once read
    assert ledger.incomplete() == [] and ledger.missing_rows() == 0
    assert ledger.sums().rows == 5 and ledger.stats.sums.rows == 0  # records carried no stats
    assert [r.name for r in ledger.records()] == ["p0", "p1"]


def test_a_replacement_must_hold_the_same_rows() -> None:
    ledger = CommitLedger(plan(4))
    ledger.accept(record("old", 0, [0, 1, 2, 3], errors=2))
    assert ledger.replace(record("new", 0, [0, 1], replaces="old")) is Decision.INVALID
    assert ledger.replace(record("new", 0, [0, 1, 2, 3], replaces="gone")) is Decision.INVALID
    assert ledger.replace(record("new", 0, [0, 1, 2, 3], replaces="old")) is Decision.ACCEPTED
    assert set(ledger.parts) == {"new"} and ledger.shards[0].parts == ["new"]
    assert ledger.sums().errors == 0 and ledger.shards[0].is_complete
    assert ledger.accept(record("r", 0, [0], replaces="new")) is Decision.INVALID


# --- statistics --------------------------------------------------------------------------------


@given(st.lists(st.floats(min_value=1e-5, max_value=1e4), min_size=1, max_size=300))
def test_histogram_quantiles_are_within_a_bucket(values: list[float]) -> None:
    histogram = Histogram()
    for v in values:
        histogram.add(v)
    ordered = sorted(values)
    bucket = 10 ** (1 / 40)  # the width of one bucket, as a factor
    for q in (0.0, 0.5, 0.95, 1.0):
        rank = q * (len(ordered) - 1)
        low, high = ordered[math.floor(rank)], ordered[math.ceil(rank)]
        estimate = histogram.quantile(q)
        assert estimate is not None
        assert low / bucket <= estimate <= high * bucket


def test_stats_merge_and_subtract_like_the_rows() -> None:
    schema = output_schema()
    now = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)

    def rows(n: int, error_every: int) -> pa.Table:
        data = {
            "id": [f"r{i}" for i in range(n)],
            "finish_reason": ["error" if i % error_every == 0 else "stop" for i in range(n)],
            "error": ["ValueError: x" if i % error_every == 0 else None for i in range(n)],
            "completion_tokens": [4] * n,
            "prompt_tokens": [10] * n,
            "cached_prompt_tokens": [0] * n,
            "latency_s": [0.1 * (i + 1) for i in range(n)],
            "ttft_s": [0.01] * n,
            "decode_s": [0.05] * n,
            "gpu_seconds": [0.02] * n,
            "cost_usd": [0.001] * n,
            "list_price_usd": [0.0] * n,
            "finished_at": [now + dt.timedelta(seconds=i) for i in range(n)],
            "actor_id": ["a"] * n,
        }
        return pa.table({f.name: pa.array(data.get(f.name, [None] * n), f.type) for f in schema})

    a, b = RowStats.of_table(rows(10, 5)), RowStats.of_table(rows(6, 3))
    total = RowStats.from_json(a.to_json())
    total.merge(b)
    assert total.sums.rows == 16 and total.sums.errors == 2 + 2
    assert total.errors_by_kind == {"ValueError": 4}
    assert total.latency_s.total == 16
    assert sum(total.tokens.bins) == pytest.approx(16 * 4)  # every token lands somewhere
    total.subtract(b)
    for name, value in a.sums.to_json().items():
        assert getattr(total.sums, name) == pytest.approx(value)
    assert total.errors_by_kind == a.errors_by_kind
    assert total.latency_s.counts == a.latency_s.counts
    assert RowStats.from_json(total.to_json()).sums == total.sums


def test_timeline_keeps_its_total_while_it_coarsens() -> None:
    timeline = Timeline()
    rng = random.Random(0)
    added = 0.0
    for _ in range(500):
        start = 1_000_000 + rng.uniform(0, 5000)
        amount = rng.uniform(1, 50)
        timeline.add(start, start + rng.uniform(0, 30), amount)
        added += amount
    assert len(timeline.bins) <= 400 and timeline.width_s > 1
    assert sum(timeline.bins) == pytest.approx(added)
    other = Timeline()
    other.add(999_000, 999_001, 10.0)  # before the first bin: the origin moves back
    timeline.merge(other)
    assert sum(timeline.bins) == pytest.approx(added + 10.0)
    assert timeline.start is not None and timeline.start <= 999_000


# --- retries -----------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def __call__(self) -> float:
        return self.now


def test_transient_failures_are_retried_until_the_deadline() -> None:
    clock = Clock()
    calls = []

    def flaky() -> str:
        calls.append(clock.now)
        if len(calls) < 4:
            raise ConnectionError("reset")
        return "ok"

    policy = RetryPolicy(total_s=60, first_delay_s=1.0)
    assert with_retries(flaky, "put", policy, sleep=clock.sleep, clock=clock) == "ok"
    assert len(calls) == 4

    def always() -> None:
        calls.append(clock.now)
        raise TimeoutError("slow")

    calls.clear()
    clock.now = 0.0
    with pytest.raises(TimeoutError):
        with_retries(always, "put", RetryPolicy(total_s=30), sleep=clock.sleep, clock=clock)
    assert clock.now >= 30 and len(calls) > 3


@pytest.mark.parametrize(
    "error", [PreconditionFailed("lost"), PermissionError("denied"), FileNotFoundError("gone")]
)
def test_permanent_failures_are_not_retried(error: Exception) -> None:
    calls = []

    def fail() -> None:
        calls.append(1)
        raise error

    with pytest.raises(type(error)):
        with_retries(fail, "put", RetryPolicy(total_s=60), sleep=lambda s: None)
    assert calls == [1]


def test_speculative_counts_add_up_and_give_rates() -> None:
    """Parts of a speculative job sum their spec_* columns; the rates come from the sums
    (not an average of per-part rates), and replaced rows leave them."""
    from pipeline.batch.commit.stats import SpecCounts

    schema = output_schema(speculative=True)

    def rows(proposed: list[int], accepted: list[int], verifications: list[int]) -> pa.Table:
        n = len(proposed)
        data = {
            "id": [f"r{i}" for i in range(n)],
            "finish_reason": ["stop"] * n,
            "spec_proposed_tokens": proposed,
            "spec_accepted_tokens": accepted,
            "spec_verifications": verifications,
        }
        return pa.table({f.name: pa.array(data.get(f.name, [None] * n), f.type) for f in schema})

    a = RowStats.of_table(rows([8, 4, 0], [6, 1, 0], [2, 1, 0]))
    b = RowStats.of_table(rows([12], [3], [3]))
    assert a.spec == SpecCounts(12, 7, 3)
    total = RowStats.from_json(a.to_json())
    total.merge(b)
    assert total.spec == SpecCounts(24, 10, 6)
    assert total.spec.acceptance_rate == pytest.approx(10 / 24)
    assert total.spec.accepted_per_verification == pytest.approx(10 / 6)
    total.subtract(b)
    assert total.spec == a.spec
    plain = RowStats.of_table(rows([1], [1], [1]).drop_columns(["spec_verifications"]))
    assert plain.spec == SpecCounts(1, 1, 0) and plain.spec.accepted_per_verification is None
    assert SpecCounts().acceptance_rate is None
    assert RowStats.from_json({}).spec == SpecCounts()  # manifests written before these counts


def test_the_duplicate_pass_is_skipped_only_for_rows_read_in_one_hand_out() -> None:
    from types import SimpleNamespace

    from pipeline.batch.commit.parts import PartName
    from pipeline.batch.driver.run import _read_in_one_go

    def parts(*names: tuple[int, int, int, int]) -> list:
        return [SimpleNamespace(name=PartName(*n).name) for n in names]

    assert _read_in_one_go(parts((0, 1, 1, 0), (0, 1, 1, 1)))  # one prepare marked every repeat
    assert _read_in_one_go([])
    assert not _read_in_one_go(parts((0, 1, 1, 0), (1, 1, 1, 0))), "two shards"
    assert not _read_in_one_go(parts((0, 1, 1, 0), (0, 1, 2, 0))), "handed out again or split"
    assert not _read_in_one_go(parts((0, 1, 1, 0), (0, 2, 1, 0))), "a resume read the rest"
    assert not _read_in_one_go([SimpleNamespace(name="part-odd.parquet")])
