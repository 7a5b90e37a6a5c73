"""What cost accounting adds to a job's wall time (target: under 2%).

The reference engine serves a batch of concurrent requests on CPU; the CostMeter then replays
exactly the calls an engine actor makes for that run (on_submit, add_steps, on_finish,
is_final, pop_row_seconds, account) and the two times are compared. A second measurement
feeds the meter a long synthetic stream of GPU-sized batches to give the cost per step.

Run with output: `OMP_NUM_THREADS=1 .venv/bin/pytest -s tests/integration/test_cost_overhead.py`
(numbers taken on a busy machine are only indicative).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from engines.api import GenerationRequest, SamplingParams, StepRecord
from pipeline.cost import CostMeter

NUM_REQUESTS = 32
MAX_TOKENS = 24


def _replay(meter: CostMeter, results, steps, chunk: int = 8) -> float:
    """Seconds the meter spends on one run's calls (steps drained `chunk` at a time)."""
    began = time.perf_counter()
    for r in results:
        meter.on_submit(r.request_id, r.metrics.arrival_time)
    by_last_step: dict[int, list] = {}
    last_step = {}
    for i, step in enumerate(steps):
        for rid in step.request_ids:
            last_step[rid] = i
    for r in results:
        by_last_step.setdefault(last_step.get(r.request_id, -1), []).append(r)
    for r in by_last_step.pop(-1, []):
        meter.on_finish(r)
    for i in range(0, len(steps), chunk):
        meter.add_steps(steps[i : i + chunk])
        for j in range(i, min(i + chunk, len(steps))):
            for r in by_last_step.get(j, []):
                meter.on_finish(r)
                assert meter.is_final(r.request_id)
                meter.pop_row_seconds(r.request_id)
        meter.account(steps[min(i + chunk, len(steps)) - 1].end)
    return time.perf_counter() - began


def test_meter_overhead_on_a_reference_engine_run(tiny_model_dir):
    from engines import load_engine

    engine = load_engine(
        "reference",
        model=str(tiny_model_dir),
        device="cpu",
        max_batch_size=NUM_REQUESTS,
        kv_cache_tokens=8192,
    )
    try:
        vocab_ids = list(range(10, 400))
        requests = [
            GenerationRequest(
                prompt_token_ids=[vocab_ids[(i * 7 + k) % len(vocab_ids)] for k in range(16 + i)],
                sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
            )
            for i in range(NUM_REQUESTS)
        ]

        async def serve_all():
            return await asyncio.gather(*(engine.generate(r) for r in requests))

        began = time.perf_counter()
        results = asyncio.run(serve_all())
        engine_wall = time.perf_counter() - began
        steps = engine.drain_step_records()
    finally:
        engine.shutdown()
    assert steps and all(r.ok for r in results)
    start = min(r.metrics.arrival_time for r in results)
    meter = CostMeter(1, start=start)
    meter_s = min(_replay(CostMeter(1, start=start), results, steps) for _ in range(3))
    _replay(meter, results, steps)
    acc = meter.account(steps[-1].end)
    assert acc.num_rows == NUM_REQUESTS and acc.pending_s == pytest.approx(0.0, abs=1e-9)
    overhead = meter_s / engine_wall
    print(
        f"\nreference engine: {NUM_REQUESTS} requests, {len(steps)} steps in {engine_wall:.3f} s;"
        f" meter {meter_s * 1e3:.3f} ms = {overhead:.4%} of the engine's wall time"
    )
    assert overhead < 0.02


def test_meter_cost_per_step_at_gpu_batch_sizes():
    """A 128-request batch per step, 20k steps: the per-step cost of the meter must stay far
    below a GPU step (tens of ms) — under 2% of a 10 ms step."""
    batch = 128
    rids = [f"r{i}" for i in range(batch)]
    steps = [
        StepRecord(k * 0.01, k * 0.01 + 0.009, {}, dict.fromkeys(rids, 1)) for k in range(20_000)
    ]
    meter = CostMeter(8, start=-1.0)
    for rid in rids:
        meter.on_submit(rid, -0.5)
    began = time.perf_counter()
    for i in range(0, len(steps), 16):
        meter.add_steps(steps[i : i + 16])
    per_step = (time.perf_counter() - began) / len(steps)
    print(f"\nmeter: {per_step * 1e6:.1f} µs per step of {batch} requests")
    assert per_step < 0.02 * 0.010
