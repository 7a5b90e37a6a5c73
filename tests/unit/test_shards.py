"""Shards and row ranges: set algebra against Python sets, and shard plans that give every
input row to exactly one shard, wherever the cuts fall."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.batch.driver.shards import (
    MAX_SHARD_ROWS,
    MIN_SHARD_ROWS,
    SHARDS_PER_SLOT,
    TARGET_SHARDS,
    plan_shards,
)
from pipeline.batch.stages.read import read_shard
from pipeline.batch.units import RowRanges, RowSelection
from pipeline.spec import parse_job_spec
from pipeline.storage import list_input_files

index_sets = st.sets(st.integers(min_value=0, max_value=200), max_size=60)


@given(index_sets, index_sets)
def test_row_ranges_behave_like_sets(a: set[int], b: set[int]) -> None:
    ra, rb = RowRanges.from_indexes(a), RowRanges.from_indexes(b)
    assert set(ra) == a and len(ra) == len(a)
    assert set(ra.union(rb)) == a | b
    assert set(ra.intersection(rb)) == a & b
    assert set(ra.difference(rb)) == a - b
    assert ra.overlaps(rb) == bool(a & b)
    for spans in (ra.spans, ra.union(rb).spans, ra.difference(rb).spans):
        # sorted, disjoint and not touching: one canonical form per set
        assert all(s < e for s, e in spans)
        assert all(e1 < s2 for (_, e1), (s2, _) in itertools.pairwise(spans))
    assert RowRanges.from_json(ra.to_json()) == ra


@given(index_sets, st.integers(min_value=0, max_value=210))
def test_selection_and_coverage(committed: set[int], num_rows: int) -> None:
    ranges = RowRanges.from_indexes(i for i in committed if i < num_rows)
    selection = RowSelection(skip=ranges)
    wanted = [i for i in range(num_rows) if selection.wants(i)]
    assert wanted == [i for i in range(num_rows) if i not in committed]
    assert ranges.covers(num_rows) == (not wanted)
    only = RowSelection(skip=ranges, only=RowRanges.full(5))
    assert [i for i in range(num_rows) if only.wants(i)] == [i for i in wanted if i < 5]


def _spec(uri: Path, fmt: str = "jsonl", **inp: object) -> object:
    return parse_job_spec(
        {
            "name": "shards",
            "input": {"uri": str(uri), "format": fmt, "prompt_column": "q", **inp},
            "model": {"path": "/unused"},
            "output": {"uri": "/unused"},
        }
    )


@settings(max_examples=25, deadline=None)
@given(
    lines=st.lists(
        st.one_of(
            st.text(alphabet="abc é", min_size=0, max_size=40).map(lambda t: {"q": t}),
            st.just(None),  # a blank line
        ),
        min_size=0,
        max_size=40,
    ),
    shard_bytes=st.integers(min_value=1024, max_value=4096),
)
def test_every_jsonl_line_lands_in_exactly_one_shard(
    tmp_path_factory: pytest.TempPathFactory, lines: list[dict | None], shard_bytes: int
) -> None:
    path = tmp_path_factory.mktemp("jsonl") / "in.jsonl"
    # Long lines so that cuts fall inside them at these shard sizes.
    text = "".join(
        "\n" if line is None else json.dumps({"q": line["q"] * 30}) + "\n" for line in lines
    )
    path.write_text(text)
    spec = _spec(path, shard_bytes=shard_bytes)
    plan = plan_shards(spec, list_input_files(spec))
    assert [s.index for s in plan.shards] == list(range(len(plan)))
    assert plan.shards[0].start == 0 and plan.shards[-1].end == path.stat().st_size
    got = []
    for shard in plan.shards:
        rows = read_shard(spec, shard)
        assert rows.table.num_rows == rows.num_rows
        assert rows.table.column("_row").to_pylist() == list(range(rows.num_rows))
        got += rows.table.column("prompt").to_pylist()
    assert got == [line["q"] * 30 for line in lines if line is not None]
    assert plan_shards(spec, list_input_files(spec)).digest == plan.digest  # deterministic


def test_parquet_shards_are_whole_row_groups_and_respect_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"q": [f"q{i}" for i in range(100)]}), path, row_group_size=10)
    spec = _spec(path, "parquet", shard_rows=25)
    plan = plan_shards(spec, list_input_files(spec))
    assert [(s.start, s.end, s.row_groups) for s in plan.shards][:2] == [
        (0, 20, (0, 1)),
        (20, 40, (2, 3)),
    ]
    assert sum(s.num_rows or 0 for s in plan.shards) == 100 == plan.known_rows
    limited = _spec(path, "parquet", shard_rows=25, limit=33)
    plan = plan_shards(limited, list_input_files(limited))
    assert plan.known_rows == 33 and plan.shards[-1].end == 33
    rows = [
        r for s in plan.shards for r in read_shard(limited, s).table.column("prompt").to_pylist()
    ]
    assert rows == [f"q{i}" for i in range(33)]


def test_auto_shard_size_aims_for_many_shards_within_bounds(tmp_path: Path) -> None:
    small = tmp_path / "small.parquet"
    pq.write_table(pa.table({"q": ["x"] * 500}), small, row_group_size=1)
    spec = _spec(small, "parquet")
    plan = plan_shards(spec, list_input_files(spec))
    assert plan.target == MIN_SHARD_ROWS and len(plan) == 8
    big = tmp_path / "big.parquet"
    pq.write_table(pa.table({"q": ["x"] * 60_000}), big, row_group_size=1000)
    spec = _spec(big, "parquet")
    plan = plan_shards(spec, list_input_files(spec))
    assert MIN_SHARD_ROWS <= plan.target <= MAX_SHARD_ROWS and len(plan) == 60


def test_a_fleet_gets_several_shards_per_slot(tmp_path: Path) -> None:
    # 1,000 actors x 2 shards in flight: 256 shards would leave most slots without work.
    path = tmp_path / "fleet.parquet"
    pq.write_table(pa.table({"q": ["x"] * 1_000_000}), path, row_group_size=100)
    spec = _spec(path, "parquet")
    files = list_input_files(spec)
    slots = 2_000
    plan = plan_shards(spec, files, slots)
    assert plan.slots == slots
    assert len(plan) >= SHARDS_PER_SLOT * slots, "every slot gets several shards"
    assert MIN_SHARD_ROWS <= plan.target <= 1_000_000 // (SHARDS_PER_SLOT * slots)
    assert sum(s.num_rows or 0 for s in plan.shards) == 1_000_000
    # A small pool keeps the plan it always had (and with it, older outputs' fingerprints).
    assert plan_shards(spec, files, 4).digest == plan_shards(spec, files).digest
    assert TARGET_SHARDS // 2 <= len(plan_shards(spec, files, 4)) <= 2 * TARGET_SHARDS


def test_a_fleet_sized_jsonl_plan_cuts_byte_ranges_per_slot(tmp_path: Path) -> None:
    path = tmp_path / "fleet.jsonl"  # 100,000 lines of ~200 bytes
    line = "question {:06d} " + "x" * 176
    path.write_text("".join(json.dumps({"q": line.format(i)}) + "\n" for i in range(100_000)))
    spec = _spec(path)
    files = list_input_files(spec)
    assert len(plan_shards(spec, files)) <= 2 * TARGET_SHARDS
    plan = plan_shards(spec, files, 250)
    assert len(plan) >= SHARDS_PER_SLOT * 250
    assert plan.shards[0].start == 0 and plan.shards[-1].end == path.stat().st_size
    assert all(a.end == b.start for a, b in zip(plan.shards, plan.shards[1:], strict=False))


def test_compressed_jsonl_is_one_shard(tmp_path: Path) -> None:
    import gzip

    path = tmp_path / "in.jsonl.gz"
    path.write_bytes(gzip.compress(b"".join(b'{"q": "a"}\n' for _ in range(50))))
    spec = _spec(path, shard_bytes=1024)
    plan = plan_shards(spec, list_input_files(spec))
    assert [s.kind for s in plan.shards] == ["whole_file"]
    assert read_shard(spec, plan.shards[0]).num_rows == 50


def test_a_resume_plans_for_the_slots_its_first_run_planned_for(tmp_path: Path) -> None:
    from pipeline.batch.commit.manifest import Manifest
    from pipeline.batch.commit.parts import MANIFEST_NAME
    from pipeline.batch.driver.run import _shard_slots
    from pipeline.batch.driver.scheduler import UNITS_PER_ACTOR
    from pipeline.storage import OutputDir

    spec = parse_job_spec(
        {
            "name": "slots",
            "input": {"uri": str(tmp_path / "in.jsonl"), "prompt_column": "q"},
            "model": {"path": "/unused"},
            "resources": {"num_actors": None, "min_actors": 2, "max_actors": 300},
            "output": {"uri": str(tmp_path / "out")},
        }
    )
    out = OutputDir(spec.output.uri, spec.storage)
    pool = 300 * UNITS_PER_ACTOR  # the autoscaling maximum's slots
    assert _shard_slots(spec, out, fresh=False) == pool  # nothing committed yet

    def manifest(slots: int | None) -> None:
        first = Manifest("slots", "incomplete", {}, {}, [], [], [], [], shard_slots=slots)
        out.put(MANIFEST_NAME, first.to_json().encode())

    manifest(64)  # the first run had a smaller pool
    assert _shard_slots(spec, out, fresh=False) == 64, "the same shards as the first run"
    assert _shard_slots(spec, out, fresh=True) == pool, "--fresh plans for this pool"
    manifest(None)  # written before plans recorded their slots
    assert _shard_slots(spec, out, fresh=False) is None
