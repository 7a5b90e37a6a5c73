"""Step profiling for the reference engine: a torch.profiler trace of N engine steps with one
named range per phase, and the per-phase time table read back from such a trace.

The step loop wraps each phase in `profiler.phase(name)`. With profiling off the engine holds
`NO_PROFILER`, whose `phase` hands back one shared no-op context: no torch.profiler call, no
record_function object, nothing allocated per step. With `profile_dir` set, a `StepProfiler`
starts torch.profiler at the first step (on the step-loop thread, which is where the ops
run), marks each phase with `torch.profiler.record_function` (and an NVTX range on CUDA, so
`nsys profile` shows the same phases), and after `steps` steps writes a Chrome / Perfetto
trace JSON and switches itself off. Values a step measures besides time (a Mixture-of-Experts
model's expert load) go in as counters: `profiler.counter(name, values)` during the step, written
as Chrome counter events at the start of that step, so Perfetto draws them as a track under the
step ranges.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The phases of one engine step, in order (docs/engine.md explains each).
PHASES = ("schedule", "build_inputs", "forward", "sample", "detokenize", "deliver")
STEP = "engine_step"  # the range around a whole step: the denominator of each phase's share

_NULL = contextlib.nullcontext()


class NoProfiler:
    """Profiling off: every hook is a no-op (the shared null context is reusable)."""

    trace_path: Path | None = None

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        return _NULL

    def step(self) -> contextlib.AbstractContextManager:
        return _NULL

    def counter(self, name: str, values: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


NO_PROFILER = NoProfiler()


class StepProfiler(NoProfiler):
    """Records `steps` engine steps into `out_dir/reference-<time>-<pid>.trace.json`."""

    def __init__(self, out_dir: str | Path, steps: int, device: Any) -> None:
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"profile_steps must be an integer >= 1, got {steps!r}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.steps_left = steps
        self._cuda = getattr(device, "type", str(device)) == "cuda"
        self._profile: Any = None  # torch.profiler.profile while recording
        self._steps_begun = 0  # recorded steps begun so far
        # (recorded step index, counter name, values), written into the trace at close
        self._counters: list[tuple[int, str, dict[str, float]]] = []
        self.trace_path = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._profile is None:
            yield
            return
        import torch

        if self._cuda:
            torch.cuda.nvtx.range_push(name)
        try:
            with torch.profiler.record_function(name):
                yield
        finally:
            if self._cuda:
                torch.cuda.nvtx.range_pop()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if self.steps_left <= 0:
            yield
            return
        if self._profile is None:
            self._start()
        self._steps_begun += 1
        with self.phase(STEP):
            yield
        self.steps_left -= 1
        if self.steps_left == 0:
            self.close()

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity

        activities = [ProfilerActivity.CPU]
        if self._cuda:
            activities.append(ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.__enter__()

    def counter(self, name: str, values: dict[str, float]) -> None:
        """Values of the step being recorded (none outside a recorded step)."""
        if self._profile is not None and self._steps_begun:
            self._counters.append((self._steps_begun - 1, name, dict(values)))

    def close(self) -> None:
        """Stop and write the trace (also when the engine stops before `steps` steps)."""
        if self._profile is None:
            return
        profile, self._profile = self._profile, None
        self.steps_left = 0
        profile.__exit__(None, None, None)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = self.out_dir / f"reference-{stamp}-{os.getpid()}.trace.json"
        profile.export_chrome_trace(str(path))
        if self._counters:
            _add_counters(path, self._counters)
        self.trace_path = path


def _add_counters(path: Path, counters: list[tuple[int, str, dict[str, float]]]) -> None:
    """Write each counter as a Chrome counter event ("ph": "C") at the start of its step's
    range. torch.profiler has no counter API, and its timestamps have their own time base:
    placing them by the step ranges themselves, in order, needs neither."""
    trace = json.loads(path.read_text())
    events = trace.setdefault("traceEvents", [])
    steps = sorted(
        (
            e
            for e in events
            if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") == STEP
        ),
        key=lambda e: float(e["ts"]),
    )
    for index, name, values in counters:
        if index < len(steps):
            step = steps[index]
            events.append(
                {
                    "ph": "C",
                    "name": name,
                    "pid": step["pid"],
                    "tid": step["tid"],
                    "ts": step["ts"],
                    "args": values,
                }
            )
    path.write_text(json.dumps(trace))


@dataclass(frozen=True)
class PhaseTable:
    """Time per phase summed over the recorded steps (milliseconds)."""

    trace: str
    steps: int  # engine steps in the trace
    step_ms: float  # their total duration
    phase_ms: dict[str, float]  # phase -> exclusive time (every PHASES name, maybe 0)

    @property
    def other_ms(self) -> float:
        """Step time outside every phase (bookkeeping between phases)."""
        return max(0.0, self.step_ms - sum(self.phase_ms.values()))


def read_phase_table(trace_path: str | Path) -> PhaseTable:
    """Each phase's exclusive time in a trace written by StepProfiler: a range nested in
    another (detokenize inside deliver) counts for itself only, so shares add up to 100%."""
    events = json.loads(Path(trace_path).read_text()).get("traceEvents", [])
    by_thread: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    for event in events:
        # record_function ranges are "user_annotation" complete events; on CUDA the profiler
        # adds "gpu_user_annotation" twins on the GPU timeline, left out so nothing counts twice.
        name = event.get("name")
        if event.get("ph") != "X" or event.get("cat") != "user_annotation":
            continue
        if name in PHASES or name == STEP:
            start, dur = float(event["ts"]), float(event.get("dur", 0.0))
            by_thread.setdefault((event.get("pid"), event.get("tid")), []).append(
                (start, dur, name)
            )
    phase_us = dict.fromkeys(PHASES, 0.0)
    step_us, steps = 0.0, 0
    for ranges in by_thread.values():
        ranges.sort(key=lambda r: (r[0], -r[1]))  # parents before the children they contain
        open_phases: list[tuple[float, str]] = []  # (end, name) of the enclosing phases
        for start, dur, name in ranges:
            if name == STEP:
                step_us, steps = step_us + dur, steps + 1
                continue
            while open_phases and open_phases[-1][0] <= start:
                open_phases.pop()
            phase_us[name] += dur
            if open_phases:  # time inside a nested phase is not the parent's own
                phase_us[open_phases[-1][1]] -= dur
            open_phases.append((start + dur, name))
    return PhaseTable(
        str(trace_path),
        steps,
        step_us / 1000.0,
        {name: max(0.0, us) / 1000.0 for name, us in phase_us.items()},
    )


def format_phase_table(table: PhaseTable) -> str:
    lines = [
        f"profile: {table.steps} steps, {table.step_ms:.1f} ms in all ({table.trace})",
        f"  {'phase':14s} {'total ms':>10s} {'ms/step':>9s} {'share':>7s}",
    ]
    rows = [*table.phase_ms.items(), ("(other)", table.other_ms)]
    for name, ms in rows:
        per_step = ms / table.steps if table.steps else 0.0
        share = 100 * ms / table.step_ms if table.step_ms else 0.0
        lines.append(f"  {name:14s} {ms:10.1f} {per_step:9.2f} {share:6.1f}%")
    return "\n".join(lines)
