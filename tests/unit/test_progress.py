"""The progress line's row total: exact when every shard's count is known, estimated from
bytes (and marked `~`) for JSONL shards not read yet, unknown (`?`) where neither works."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.batch.commit.parts import PartRecord
from pipeline.batch.driver.progress import Progress, RowTotal, estimate_total, sample_bytes_per_line
from pipeline.batch.driver.shards import plan_shards
from pipeline.batch.stages.read import read_shard
from pipeline.batch.units import RowRanges, RowSelection, WorkUnit
from pipeline.cost import RowSums
from pipeline.spec import JobSpec, parse_job_spec
from pipeline.storage import list_input_files

ROWS = 500


def _spec(path: Path) -> JobSpec:
    return parse_job_spec(
        {
            "name": "progress",
            "input": {"uri": str(path), "format": "jsonl", "prompt_column": "q"},
            "model": {"path": "/nonexistent"},
            "output": {"uri": "/tmp/unused-out"},
        }
    )


def _jsonl(tmp_path: Path, rows: int = ROWS) -> Path:
    path = tmp_path / "in.jsonl"
    # Lines of varying length, so the estimate is an estimate.
    path.write_text("".join(json.dumps({"q": "x" * (10 + i % 37)}) + "\n" for i in range(rows)))
    return path


def _units(spec: JobSpec, shard_bytes: int) -> list[WorkUnit]:
    spec = spec.model_copy(
        update={"input": spec.input.model_copy(update={"shard_bytes": shard_bytes})}
    )
    plan = plan_shards(spec, list_input_files(spec))
    return [WorkUnit(s, 1, 1, RowSelection()) for s in plan.shards]


def test_jsonl_total_is_estimated_from_bytes_then_exact_once_read(tmp_path: Path) -> None:
    spec = _spec(_jsonl(tmp_path))
    units = _units(spec, 4096)
    assert len(units) > 2
    known: dict[int, int] = {}
    per_line = sample_bytes_per_line(spec, units, known.get)
    assert per_line is not None and per_line > 10

    estimate = estimate_total(units, known.get, per_line)
    assert not estimate.exact and estimate.rows is not None
    assert abs(estimate.rows - ROWS) <= 0.05 * ROWS
    assert estimate.text() == f"~{estimate.rows}"

    # Shards read one by one: still an estimate until the last is.
    for unit in units[:-1]:
        known[unit.shard.index] = read_shard(spec, unit.shard, unit.selection).num_rows
        assert not estimate_total(units, known.get, per_line).exact
    last = units[-1]
    known[last.shard.index] = read_shard(spec, last.shard, last.selection).num_rows
    assert estimate_total(units, known.get, per_line) == RowTotal(ROWS, exact=True)


def test_committed_rows_are_not_counted_again(tmp_path: Path) -> None:
    spec = _spec(_jsonl(tmp_path))
    unit = _units(spec, 1 << 20)[0]
    resumed = WorkUnit(unit.shard, 2, 1, RowSelection(skip=RowRanges.full(100)))
    assert estimate_total([resumed], {unit.shard.index: ROWS}.get, None) == RowTotal(ROWS - 100)


def test_unknown_without_an_estimate(tmp_path: Path) -> None:
    spec = _spec(_jsonl(tmp_path))
    units = _units(spec, 4096)
    total = estimate_total(units, {}.get, None)
    assert total.rows is None and total.text() == "?"


def _record(rows: int, errors: int = 0, tokens: int = 0) -> PartRecord:
    return PartRecord(
        name="part-000000-00001-01-0000.parquet",
        shard=0,
        run=1,
        rows=RowRanges.full(rows),
        sums=RowSums(rows=rows, errors=errors, completion_tokens=tokens),
        size_bytes=1,
        version="v",
        actor_id=None,
        written_at=0.0,
    )


def test_line_marks_an_estimate_and_follows_it() -> None:
    totals = [RowTotal(5000, exact=False)]
    progress = Progress(total=lambda: totals[-1], started=0.0)
    progress.add(_record(1200, errors=3, tokens=600))
    assert progress.line(now=10.0).startswith("rows 1200/~5000 (~24%) | 60.0 tok/s | errors 3")
    totals.append(RowTotal(1000, exact=False))  # an estimate below what is done: capped
    assert progress.line(now=10.0).startswith("rows 1200/~1000 (~100%)")
    totals.append(RowTotal(4800))
    assert progress.line(now=10.0).startswith("rows 1200/4800 (25%)")
    totals.append(RowTotal(None, exact=False))
    assert progress.line(now=10.0).startswith("rows 1200/? |")


def test_a_failing_total_does_not_fail_the_line() -> None:
    def broken() -> RowTotal:
        raise OSError("input gone")

    assert Progress(total=broken, started=0.0).line(now=1.0).startswith("rows 0/? |")
