"""The tail of a job: an idle engine actor takes the rows another has not yet started.

Two engine actors, one long shard and one short: the actor with the short one runs out of
work while the other still has most of its shard ahead. With `resources.tail_split` the
driver moves the second half of the unstarted rows over; without it, the idle actor waits.
Either way every id lands exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engines import faults
from pipeline.batch.commit.parts import PartName
from pipeline.batch.driver.run import run_job
from pipeline.spec import parse_job_spec

pytestmark = pytest.mark.timeout(300)

LONG, SHORT = 120, 8


@pytest.mark.parametrize("tail_split", [True, False], ids=["split", "no-split"])
def test_the_long_shards_unstarted_rows_go_to_the_idle_actor(
    ray_local: Any,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tail_split: bool,
) -> None:
    # 20 ms after every engine step: the long shard takes seconds on any machine, the short
    # one a fraction of that.
    for name, value in faults.step_delay_env(0.02).items():
        monkeypatch.setenv(name, value)
    ids = {"a": [f"a-{i:03d}" for i in range(LONG)], "b": [f"b-{i:03d}" for i in range(SHORT)]}
    for name, rows in ids.items():
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps({"id": i, "p": f"Name the {i} river"}) + "\n" for i in rows)
        )
    out = tmp_path / "out"
    spec = parse_job_spec(
        {
            "name": "tail",
            "input": {
                "uri": str(tmp_path / "*.jsonl"),
                "format": "jsonl",
                "id_column": "id",
                "prompt_column": "p",
                "shard_bytes": 1 << 20,  # one shard per file
            },
            "model": {"path": str(tiny_model_dir)},
            "engine": {"kind": "reference", "device": "cpu", "max_batch_size": 8},
            "sampling": {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True},
            "resources": {
                "num_actors": 2,
                "cpus_per_actor": 0.25,
                "batch_size": 4,
                "max_in_flight": 8,
                "tail_split": tail_split,
            },
            "output": {"uri": str(out), "rows_per_file": 8, "report": False},
        }
    )
    result = run_job(spec)
    assert result.status == "complete" and result.exit_code == 0

    table = pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("part-*.parquet")))
    got = table.column("id").to_pylist()
    assert len(got) == len(set(got)), "an id was written twice"
    assert sorted(got) == ids["a"] + ids["b"], "an id is missing"
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["totals"]["rows"] == LONG + SHORT
    splits = [e for e in manifest["runs"][0]["events"] if e["event"] == "tail_split"]
    long_parts = [p for p in manifest["parts"] if p["shard"] == 0]
    writers = {p["actor_id"] for p in long_parts}
    hand_outs = {PartName.parse(p["name"]).dispatch for p in long_parts}
    (occupancy,) = [e for e in manifest["runs"][0]["events"] if e["event"] == "occupancy"]
    # The books add up: idle time is part of the actors' time, the tail's part of the idle.
    assert 0 < occupancy["engine_actor_s"] <= 2 * result_wall_s(manifest)
    assert 0 <= occupancy["tail_idle_actor_s"] <= occupancy["idle_actor_s"]
    assert occupancy["idle_actor_s"] < occupancy["engine_actor_s"]
    assert 0 < occupancy["tail_s"] <= result_wall_s(manifest)
    if not tail_split:
        assert splits == [] and hand_outs == {1}
        assert len(writers) == 1, "without splits one actor runs the long shard to its end"
        return
    assert splits, "the idle actor was never given rows of the long shard"
    assert all(s["shard"] == 0 and s["rows"] >= 1 for s in splits)
    assert sum(s["rows"] for s in splits) < LONG
    assert len(writers) == 2, "both actors wrote rows of the long shard"
    assert hand_outs == {1} | {s["dispatch"] for s in splits}
    # Each hand-out's parts hold distinct rows: the split piece never repeats a kept row.
    by_row: dict[int, str] = {}
    for part in long_parts:
        for start, end in part["row_ranges"]:
            for row in range(start, end):
                assert row not in by_row, f"row {row} in {by_row.get(row)} and {part['name']}"
                by_row[row] = part["name"]
    assert sorted(by_row) == list(range(LONG))


def result_wall_s(manifest: dict) -> float:
    """The run's wall time from start to the last commit (a bound on any span within it)."""
    return manifest["runs"][0]["wall_s"]
