"""Interval-based cost on the batch actor's real code path:
pipeline.batch.stages.generate.EngineWorker serving shards through the TensorRT-LLM adapter
(engines/trtllm.py) backed by the CPU stand-in package (tests/standins/tensorrt_llm). No Ray: the
actor's coroutines are driven directly."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.cost import split_intervals
from pipeline.spec import parse_job_spec

STANDINS = Path(__file__).resolve().parents[1] / "standins"


@pytest.fixture
def trt_stage(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    import torch

    import pipeline.batch.stages.generate as generate

    monkeypatch.syspath_prepend(str(STANDINS))
    for name in [n for n in sys.modules if n.split(".")[0] == "tensorrt_llm"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    monkeypatch.setattr(generate, "current_actor_id", lambda: "actor-trt")
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "max_position_embeddings": 256,
                "vocab_size": 256,
            }
        )
    )
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    spec = parse_job_spec(
        {
            "name": "trt-cost",
            "input": {"uri": "unused.jsonl", "format": "jsonl", "prompt_column": "p"},
            "model": {"path": str(model)},
            "engine": {
                "kind": "trtllm",
                "max_batch_size": 8,
                "kv_cache_tokens": 4096,
                # Two devices: the books pay for both (resources.devices_per_actor).
                "extra": {"tensor_parallel_size": 2},
            },
            "sampling": {"max_tokens": 12},
            "resources": {"devices_per_actor": 2, "max_in_flight": 6},
            "output": {"uri": str(tmp_path / "out")},
            "cost": {"device_hour_usd": 3.5},
        }
    )
    from pipeline.batch.stages.rows import GenerateConfig
    from pipeline.batch.stages.schema import output_schema

    config = GenerateConfig.from_spec(spec, output_schema())
    stage = generate.EngineWorker(config)
    yield stage
    stage.engine.shutdown()
    for name in [n for n in sys.modules if n.split(".")[0] == "tensorrt_llm"]:
        monkeypatch.delitem(sys.modules, name)


def _batch(start: int, n: int) -> pa.Table:
    rows = [
        {
            "_row": i - start,
            "id": f"r{i}",
            "prompt_token_ids": [10 + (i * 3 + k) % 40 for k in range(4 + i % 5)],
            "prompt_tokens": 4 + i % 5,
            "max_tokens": 3 + i % 9,
            "error": None,
        }
        for i in range(start, start + n)
    ]
    return pa.Table.from_pylist(rows)


def test_interval_engine_rows_are_final_and_books_balance(trt_stage):
    stage = trt_stage
    assert not stage.engine.info.has_step_records

    async def run(k: int) -> list:
        from pipeline.batch.units import RowSelection, Shard, WorkUnit

        shard = Shard(k, "unused.jsonl", 0, "", "byte_range", 0, 0)
        unit = WorkUnit(shard, run=1, dispatch=1, selection=RowSelection())
        return [event async for event in stage.run_unit(unit, _batch(k * 7, 7))]

    async def serve():
        # Three overlapping shards, more rows than max_in_flight: requests queue, overlap and
        # finish out of order, so rows wait on the finality rule before they are priced.
        return await asyncio.gather(*(run(k) for k in range(3)))

    from pipeline.batch.commit.parts import PartWritten, read_part

    events = [e for unit in asyncio.run(serve()) for e in unit]
    names = [e.record.name for e in events if isinstance(e, PartWritten)]
    rows = pa.concat_tables(read_part(stage.out, n) for n in names).to_pylist()
    assert sorted(r["id"] for r in rows) == sorted(f"r{i}" for i in range(21))
    assert all(r["finish_reason"] != "error" for r in rows), rows
    assert all(r["gpu_seconds"] >= 0 and math.isfinite(r["gpu_seconds"]) for r in rows)
    last = max((e.account for e in events), key=lambda a: a["lifetime_s"])
    assert last["devices"] == 2 and last["has_step_records"] is False
    assert last["pending_s"] == pytest.approx(0.0, abs=1e-9)
    assert last["num_rows"] == 21
    paid = last["devices"] * last["lifetime_s"]
    books = math.fsum(r["gpu_seconds"] for r in rows) + last["idle_s"] + last["load_s"]
    assert books == pytest.approx(paid, rel=1e-6)


def test_meter_shares_match_the_sweep_over_adapter_intervals(trt_stage):
    """The meter's interval shares equal split_intervals over the adapter's own timestamps."""
    from engines.api import GenerationRequest, SamplingParams
    from pipeline.cost import CostMeter

    engine = trt_stage.engine
    meter = CostMeter(1, start=0.0, has_step_records=False)
    results = []

    async def one(i: int):
        await asyncio.sleep(0.001 * (i % 3))
        request = GenerationRequest([11 + i, 12, 13], SamplingParams(max_tokens=2 + i % 6))
        meter.on_submit(request.request_id, time.monotonic())
        result = await engine.generate(request)
        meter.on_finish(result)
        results.append(result)

    async def run():
        await asyncio.gather(*(one(i) for i in range(12)))

    asyncio.run(run())
    assert all(meter.is_final(r.request_id) for r in results)
    shares = {r.request_id: meter.pop_row_seconds(r.request_id) for r in results}
    expected = split_intervals(
        {r.request_id: (r.metrics.first_scheduled_time, r.metrics.finish_time) for r in results}
    )
    for rid, seconds in shares.items():
        assert seconds == pytest.approx(expected[rid], rel=1e-6, abs=1e-9)
