"""The driver's scheduler at fleet scale, alone: no Ray, no engines (tests/unit/sim_runtime.py).

Shards are planned by the real planner from real Parquet footers, then handed out by the real
`Scheduler` to a simulated fleet, and committed by the real `CommitLedger`. Each test checks
that every row of every shard is committed exactly once, and that the scheduler never handed
rows to a second actor while a live one still owed them. The slow test runs the issue's full
size (10,000 engine slots, 10^8 rows) and reports the driver's CPU and memory per shard.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.batch.commit.ledger import CommitLedger, Decision
from pipeline.batch.commit.parts import PartName, PartWritten
from pipeline.batch.commit.stats import RowStats
from pipeline.batch.driver.scheduler import UNITS_PER_ACTOR, Scheduler, SchedulerResult
from pipeline.batch.driver.shards import plan_shards, target_shards
from pipeline.batch.units import ShardPlan, WorkUnit
from pipeline.spec import JobSpec, parse_job_spec
from pipeline.storage import list_input_files
from tests.unit.sim_runtime import Fleet, SimCluster

ROW_GROUP_ROWS = 500  # small row groups, so the planner can cut shards of any fleet's size
FILE_ROWS = 1_000_000

T = TypeVar("T")


# --- inputs and plans --------------------------------------------------------------------------


def _write_input(folder: Path, num_rows: int, shard_rows: int | None = None) -> JobSpec:
    """Parquet files of `num_rows` rows in all (one null column: the planner reads footers only)."""
    folder.mkdir(parents=True, exist_ok=True)
    for index, start in enumerate(range(0, num_rows, FILE_ROWS)):
        rows = min(FILE_ROWS, num_rows - start)
        table = pa.table({"q": pa.nulls(rows, pa.string())})
        pq.write_table(table, folder / f"in-{index:04d}.parquet", row_group_size=ROW_GROUP_ROWS)
    return parse_job_spec(
        {
            "name": "scale",
            "input": {
                "uri": str(folder / "*.parquet"),
                "format": "parquet",
                "prompt_column": "q",
                "shard_rows": shard_rows,
            },
            "model": {"path": "/unused"},
            "output": {"uri": str(folder / "out")},
        }
    )


@dataclass
class Measured:
    """One phase's CPU (the simulation's own taken off) and resident memory."""

    cpu_s: float
    peak_bytes: int  # peak RSS during the phase, above the RSS it started at
    kept_bytes: int  # RSS at its end, above the start: what the phase leaves behind
    wall_s: float


@dataclass
class Outcome:
    result: SchedulerResult
    ledger: CommitLedger
    cluster: SimCluster
    decisions: Counter[Decision]
    ticks: int
    measured: Measured | None = None


def _plan(spec: JobSpec, slots: int) -> ShardPlan:
    return plan_shards(spec, list_input_files(spec), slots)


def _rss() -> tuple[int, int]:
    """(current, peak) resident bytes of this process (Linux)."""
    status = Path("/proc/self/status").read_text()
    kib = {
        line.split(":")[0]: int(line.split()[1])
        for line in status.splitlines()
        if line.startswith(("VmRSS:", "VmHWM:"))
    }
    return 1024 * kib["VmRSS"], 1024 * kib["VmHWM"]


def _measure(fn: Callable[[], T]) -> tuple[T, Measured]:
    """Run `fn`; its CPU and wall time, and RSS (Python objects, Arrow buffers, all of it)."""
    try:  # the peak from here on (Linux: reset VmHWM to the current RSS)
        Path("/proc/self/clear_refs").write_text("5")
        has_peak = True
    except OSError:  # the peak is the process's own: only the end is known
        has_peak = False
    before, _ = _rss()
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    after, peak = _rss()
    peak = peak if has_peak else after
    return value, Measured(cpu, max(peak - before, 0), max(after - before, 0), wall)


# --- the run -----------------------------------------------------------------------------------


def run_fleet(
    plan: ShardPlan,
    cluster: SimCluster,
    *,
    tail_split: bool = True,
    stop_after_parts: int | None = None,
) -> Outcome:
    """The scheduler over the whole plan on the simulated fleet, as pipeline.batch.driver.run wires
    it: the ledger decides each part, the tick is where the manifest would be saved."""
    decisions: Counter[Decision] = Counter()
    stop = threading.Event()
    ticks = 0
    # Every event is one tick; far more than a run's events means the loop spins.
    max_ticks = 40 * len(plan) + 20 * (len(cluster.engines) + len(cluster.prompters))

    def on_tick() -> None:
        nonlocal ticks
        ticks += 1
        assert ticks < max_ticks, f"the scheduler made no progress in {ticks} ticks"

    def schedule() -> tuple[SchedulerResult, CommitLedger]:
        ledger = CommitLedger(plan)

        def on_part(event: PartWritten) -> None:
            decisions[ledger.accept(event.record)] += 1
            if stop_after_parts is not None and sum(decisions.values()) >= stop_after_parts:
                stop.set()

        units = [WorkUnit(s.shard, 1, 1, ledger.selection(s.shard.index)) for s in ledger.shards]
        scheduler = Scheduler(
            engines=cluster.engines,
            prompters=cluster.prompters,
            units=units,
            ledger=ledger,
            on_part=on_part,
            on_tick=on_tick,
            stop=stop,
            max_unit_retries=3,
            tail_split=tail_split,
            runtime=cluster.runtime,
        )
        return scheduler.run(), ledger

    sim_cpu = cluster.runtime.cpu_s
    (result, ledger), measured = _measure(schedule)
    measured.cpu_s -= cluster.runtime.cpu_s - sim_cpu
    return Outcome(result, ledger, cluster, decisions, ticks, measured)


def assert_exactly_once(outcome: Outcome) -> None:
    ledger, cluster = outcome.ledger, outcome.cluster
    assert cluster.overlaps == [], cluster.overlaps[:5]
    refused = {d: n for d, n in outcome.decisions.items() if d is not Decision.ACCEPTED}
    assert refused == {}, f"parts refused: {refused}"
    assert ledger.incomplete() == [], f"{len(ledger.incomplete())} shard(s) left incomplete"
    assert ledger.missing_rows() == 0
    for state in ledger.shards:
        rows = sum(ledger.parts[name].sums.rows for name in state.parts)
        assert rows == state.num_rows, f"shard {state.shard.index}: {rows} of {state.num_rows}"
    total = sum(s.num_rows or 0 for s in ledger.shards)
    assert ledger.sums().rows == total == cluster.rows_generated, "a row was generated twice"


def _report(name: str, planning: Measured | None, outcome: Outcome) -> str:
    """The figures for docs/benchmarks.md ("The scheduler alone")."""
    shards = len(outcome.ledger.shards)
    lines = [f"{name}: {shards} shards"]
    for phase, m in (("planning", planning), ("scheduling", outcome.measured)):
        if m is None:
            continue
        memory = ""
        if m.peak_bytes:
            memory = (
                f", peak {m.peak_bytes / 2**20:.1f} MiB "
                f"({m.peak_bytes / shards / 1024:.2f} KiB/shard), "
                f"kept {m.kept_bytes / 2**20:.1f} MiB"
            )
        lines.append(
            f"  {phase}: {m.cpu_s:.2f} CPU s ({1e3 * m.cpu_s / shards:.3f} ms/shard){memory}, "
            f"{m.wall_s:.1f} s wall"
        )
    assert outcome.measured is not None
    runtime = outcome.cluster.runtime
    lines.append(
        f"  {outcome.ticks} scheduler loops ({1e6 * outcome.measured.cpu_s / outcome.ticks:.0f} "
        f"us of CPU each), {runtime.cpu_s:.1f} CPU s in the simulation (not counted), "
        f"{len(outcome.result.splits)} tail splits, {runtime.now:.0f} simulated seconds"
    )
    return "\n".join(lines)


def _dispatch(part: str) -> int:
    name = PartName.parse(part)
    assert name is not None, part
    return name.dispatch


def _part_stats() -> RowStats:
    """RowStats like a real part's (histograms, timeline, busy spans), kept with each record."""
    rng = random.Random(7)
    stats = RowStats()
    for _ in range(200):
        latency = rng.uniform(0.2, 4.0)
        stats.latency_s.add(latency)
        stats.ttft_s.add(latency / 8)
        stats.gpu_seconds.add(latency / 50)
        stats.tokens.add(1000.0, 1000.0 + latency, 16.0)
    stats.busy = {"engine": [(1000.0, 1004.0)]}
    return stats


# --- fast tests --------------------------------------------------------------------------------

FAST_ENGINES = 500  # x UNITS_PER_ACTOR = 1,000 slots
FAST_ROWS = 10_000_000


@pytest.fixture(scope="module")
def fast_spec(tmp_path_factory: pytest.TempPathFactory) -> JobSpec:
    return _write_input(tmp_path_factory.mktemp("scale") / "input", FAST_ROWS)


@pytest.fixture(scope="module")
def fast_plan(fast_spec: JobSpec) -> ShardPlan:
    return _plan(fast_spec, FAST_ENGINES * UNITS_PER_ACTOR)


def test_a_thousand_slots_commit_ten_million_rows_exactly_once(fast_plan: ShardPlan) -> None:
    slots = FAST_ENGINES * UNITS_PER_ACTOR
    assert len(fast_plan) == target_shards(slots), "the planner aims for the fleet's size"
    cluster = SimCluster.start(FAST_ENGINES, FAST_ENGINES // 10)
    outcome = run_fleet(fast_plan, cluster)
    assert_exactly_once(outcome)
    assert outcome.result.losses == []
    assert cluster.handed == len(fast_plan) + len(outcome.result.splits)
    # Each shard is one part here: the ledger accepted one record per shard and per split.
    assert outcome.decisions[Decision.ACCEPTED] == cluster.handed
    assert outcome.measured is not None
    print("\n" + _report("1,000 slots, 10^7 rows", None, outcome))


SMALL_ENGINES = 100  # 200 slots
SMALL_ROWS = 2_000_000


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory: pytest.TempPathFactory) -> ShardPlan:
    spec = _write_input(tmp_path_factory.mktemp("small") / "input", SMALL_ROWS)
    return _plan(spec, SMALL_ENGINES * UNITS_PER_ACTOR)


def test_lost_engine_actors_hand_their_shards_out_again_exactly_once(
    small_plan: ShardPlan,
) -> None:
    # Parts of 500 rows, so a lost unit has committed some of its shard already.
    fleet = Fleet(rows_per_part=500, restart_s=5.0, seed=1)
    cluster = SimCluster.start(SMALL_ENGINES, SMALL_ENGINES // 10, fleet)
    rng = random.Random(3)
    victims = rng.sample(cluster.engines, 10)
    # Mid-unit: once every actor is up and has work, while the queue is still long.
    up = max(engine.load_s for engine in cluster.engines)
    for engine in victims:
        engine.kill(at=up + rng.uniform(1.0, 8.0))
    again = victims[0]  # and one of them a second time, once it is back at work
    again.kill(at=again.deaths[0] + fleet.restart_s + 3.0)
    outcome = run_fleet(small_plan, cluster)
    assert_exactly_once(outcome)
    losses = outcome.result.losses
    assert {loss.actor for loss in losses} == {e.name for e in victims}
    assert len(losses) == len(victims) + 1
    requeued = [shard for loss in losses for shard in loss.shards]
    assert requeued, "the lost actors' shards were handed out again"
    dispatches = {s: {_dispatch(n) for n in outcome.ledger.shards[s].parts} for s in requeued}
    kept = [shard for shard, seen in dispatches.items() if 1 in seen and len(seen) > 1]
    assert kept, "rows committed before the actor died stay; the new hand-out adds the rest"
    assert all(loss.recovered_after_s is not None for loss in losses if loss.shards)
    # Both incarnations of each lost actor are in the books: the dead one's last account too.
    accounts = set(outcome.result.accounts)
    assert {f"{e.name}/{i}" for e in victims for i in (0, 1)} <= accounts


def test_the_tail_is_split_among_idle_actors(tmp_path: Path) -> None:
    # 64 engine actors, 160 shards of 20,000 rows at rates that differ by up to 50%: the last
    # shards run long after most actors ran out of work, unless their unfed rows are handed
    # to the idle ones.
    spec = _write_input(tmp_path / "input", 3_200_000, shard_rows=20_000)
    plan = _plan(spec, 128)
    assert len(plan) == 160
    fleet = Fleet(seconds_per_row=0.001, jitter=0.5, seed=2)
    makespan: dict[bool, float] = {}
    for tail_split in (False, True):
        cluster = SimCluster.start(64, 8, fleet)
        outcome = run_fleet(plan, cluster, tail_split=tail_split)
        assert_exactly_once(outcome)
        makespan[tail_split] = cluster.runtime.now
    assert outcome.result.splits, "idle actors got rows of the running shards"
    splits = outcome.result.splits
    assert cluster.handed == len(plan) + len(splits)
    for split in splits:  # the pieces' parts sit beside the rest of their shard
        assert len(outcome.ledger.shards[split.shard].parts) >= 2
    assert makespan[True] < 0.9 * makespan[False], makespan
    print(f"\ntail: {len(splits)} splits; job {makespan[False]:.0f}s -> {makespan[True]:.0f}s")


def test_stopping_ends_every_unit_and_commits_only_what_was_written(
    small_plan: ShardPlan,
) -> None:
    cluster = SimCluster.start(SMALL_ENGINES, SMALL_ENGINES // 10, Fleet(rows_per_part=500))
    outcome = run_fleet(small_plan, cluster, stop_after_parts=1_000)
    ledger = outcome.ledger
    assert cluster.overlaps == []
    assert set(outcome.decisions) == {Decision.ACCEPTED}
    assert 0 < ledger.sums().rows < SMALL_ROWS and ledger.incomplete()
    assert ledger.sums().rows == cluster.rows_generated
    assert all(not e.streams for e in cluster.engines), "every stream ran to its end"


# --- the size --------------------------------------------------------------------------

FULL_ENGINES = 5_000  # x UNITS_PER_ACTOR = 10,000 slots
FULL_ROWS = 100_000_000


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_ten_thousand_slots_plan_and_hand_out_a_hundred_million_rows(
    tmp_path: Path,
) -> None:
    slots = FULL_ENGINES * UNITS_PER_ACTOR
    spec = _write_input(tmp_path / "input", FULL_ROWS)
    plan, planning = _measure(lambda: _plan(spec, slots))
    assert isinstance(plan, ShardPlan) and len(plan) == target_shards(slots)
    cluster = SimCluster.start(FULL_ENGINES, FULL_ENGINES // 10, Fleet(stats=_part_stats()))
    outcome = run_fleet(plan, cluster)
    assert_exactly_once(outcome)
    scheduling = outcome.measured
    assert scheduling is not None
    shards = len(plan)
    print("\n" + _report("10,000 slots, 10^8 rows", planning, outcome))
    # Loose bounds: they catch a driver that grows with rows, not a slow machine.
    assert planning.peak_bytes / shards < 16 * 1024
    assert scheduling.peak_bytes / shards < 64 * 1024
    assert planning.cpu_s / shards < 0.005
    assert scheduling.cpu_s / shards < 0.1


def test_rows_released_by_a_unit_that_ends_before_the_answer_is_read_are_not_lost(
    tmp_path: Path,
) -> None:
    # The actor cuts the rows at once, then finishes the half it kept (64 rows in its engine
    # and half of what was left: here tens of milliseconds) before the driver reads the
    # answer (a 200 ms round trip here; at fleet scale, a driver loop busy with thousands of
    # other events). The scheduler finds the unit gone: the released spans still go out as a
    # piece of their own, or no actor would generate them and the job would end incomplete.
    spec = _write_input(tmp_path / "input", 40_000, shard_rows=10_000)
    plan = _plan(spec, 4)
    fleet = Fleet(seconds_per_row=0.0005, latency_s=0.2, jitter=0.5, seed=4)
    cluster = SimCluster.start(3, 1, fleet)
    outcome = run_fleet(plan, cluster)
    assert_exactly_once(outcome)
