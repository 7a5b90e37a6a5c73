"""Step profiling: `profile_dir` writes a Chrome / Perfetto trace with every phase range, and
`tokenmill bench --profile DIR` prints the per-phase table read back from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engines.api import GenerationRequest, SamplingParams
from engines.reference.engine import ReferenceEngine
from engines.reference.runtime.profiling import NO_PROFILER, PHASES, STEP, read_phase_table
from pipeline.cli import app
from tests.engine_fixtures import run_all, tiny_model, varied_prompts

pytestmark = pytest.mark.timeout(300)


def _phase_durations(trace: Path) -> dict[str, list[float]]:
    """name -> durations (us) of the CPU-side range events, straight from the JSON."""
    events = json.loads(trace.read_text())["traceEvents"]
    found: dict[str, list[float]] = {}
    for event in events:
        if event.get("ph") == "X" and event.get("cat") == "user_annotation":
            found.setdefault(event["name"], []).append(float(event["dur"]))
    return found


def test_engine_writes_a_trace_with_every_phase(tmp_path) -> None:
    engine = ReferenceEngine(
        str(tiny_model("llama")), num_threads=1, profile_dir=str(tmp_path), profile_steps=6
    )
    requests = [
        # A stop string makes the engine detokenize as it goes; temperature samples for real.
        GenerationRequest(
            p,
            SamplingParams(max_tokens=10, temperature=0.8, seed=i, stop=("never-in-text",)),
            request_id=f"p{i}",
        )
        for i, p in enumerate(varied_prompts(6, seed=3))
    ]
    try:
        results = run_all(engine, requests)
    finally:
        engine.shutdown()
    assert all(r.ok for r in results)
    trace = engine.profile_trace
    assert trace is not None and trace.parent == tmp_path and trace.exists()
    assert list(tmp_path.iterdir()) == [trace]

    durations = _phase_durations(trace)
    for name in (*PHASES, STEP):
        assert name in durations, f"phase {name!r} missing from the trace"
        assert all(d > 0 for d in durations[name]), name
    assert len(durations[STEP]) == 6  # exactly profile_steps steps recorded

    table = read_phase_table(trace)
    assert table.steps == 6 and table.step_ms > 0
    assert set(table.phase_ms) == set(PHASES)
    assert all(ms > 0 for ms in table.phase_ms.values()), table.phase_ms
    # Exclusive times: the phases never add up to more than the steps they are in.
    assert sum(table.phase_ms.values()) <= table.step_ms * 1.001


def test_a_run_shorter_than_profile_steps_still_leaves_its_trace(tmp_path) -> None:
    engine = ReferenceEngine(
        str(tiny_model("llama")), num_threads=1, profile_dir=str(tmp_path), profile_steps=10_000
    )
    try:
        run_all(engine, [GenerationRequest([5, 6, 7], SamplingParams(max_tokens=3))])
    finally:
        engine.shutdown()
    assert engine.profile_trace is not None
    assert read_phase_table(engine.profile_trace).steps == 3


def test_profiling_off_uses_the_no_op_profiler(tmp_path) -> None:
    engine = ReferenceEngine(str(tiny_model("llama")), num_threads=1)
    try:
        assert engine._profiler is NO_PROFILER and engine.runner.profiler is NO_PROFILER
        # The same shared null context every time: nothing is built per phase or per step.
        assert NO_PROFILER.phase("forward") is NO_PROFILER.phase("sample")
        run_all(engine, [GenerationRequest([5, 6, 7], SamplingParams(max_tokens=2))])
    finally:
        engine.shutdown()
    assert engine.profile_trace is None


def test_bench_profile_prints_the_phase_table_from_its_trace(tmp_path) -> None:
    profile_dir, out = tmp_path / "profile", tmp_path / "bench.json"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--model",
            str(tiny_model("llama")),
            "--num-prompts",
            "6",
            "--min-prompt-len",
            "4",
            "--max-prompt-len",
            "24",
            "--min-max-tokens",
            "2",
            "--max-max-tokens",
            "8",
            "--threads",
            "1",
            "--modes",
            "reference",
            "--profile",
            str(profile_dir),
            "--profile-steps",
            "5",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    traces = list(profile_dir.glob("*.trace.json"))
    assert len(traces) == 1
    durations = _phase_durations(traces[0])
    # The bench asks for greedy ids only (no detokenization in its steps); every other phase.
    for name in ("schedule", "build_inputs", "forward", "sample", "deliver", STEP):
        assert name in durations and all(d > 0 for d in durations[name]), name
    for name in PHASES:
        assert f"  {name} " in result.output  # the table has a row per phase
    profile = json.loads(out.read_text())["results"][0]["profile"]
    assert profile["steps"] == 5 and profile["trace"] == str(traces[0])
    assert profile["phase_ms"]["forward"] > 0


def test_a_moe_trace_has_the_expert_load_of_each_step(tmp_path) -> None:
    engine = ReferenceEngine(
        str(tiny_model("qwen3_moe")), num_threads=1, profile_dir=str(tmp_path), profile_steps=5
    )
    requests = [
        GenerationRequest(p, SamplingParams(max_tokens=8), request_id=f"p{i}")
        for i, p in enumerate(varied_prompts(4, seed=2))
    ]
    try:
        run_all(engine, requests)
        records = engine.drain_step_records()
    finally:
        engine.shutdown()
    events = json.loads(engine.profile_trace.read_text())["traceEvents"]
    steps = sorted(
        (e for e in events if e.get("name") == STEP and e.get("ph") == "X"),
        key=lambda e: float(e["ts"]),
    )
    counters = [e for e in events if e.get("ph") == "C" and e["name"] == "expert_load"]
    assert len(steps) == 5 and len(counters) == 5
    # One per recorded step, at its start, with that step's record's figures.
    assert [c["ts"] for c in counters] == [s["ts"] for s in steps]
    assert [(c["args"]["max_tokens"], c["args"]["mean_tokens"]) for c in counters] == [
        (r.expert_tokens_max, r.expert_tokens_mean) for r in records[:5]
    ]
    assert all(c["args"]["max_tokens"] >= c["args"]["mean_tokens"] > 0 for c in counters)
