"""Pipeline capacity: rows/s one engine actor moves when the engine is not the bottleneck.

    .venv/bin/python tests/benchmarks/bench_pipeline_capacity.py [--rows 50000]
        [--answers 1,64] [--in-flight 1024] [--batch-size 256] [--prompt-actors 1]
        [--tokens-per-s 1e7] [--ttft-ms 5] [--step-interval-ms 1] [--model DIR]

The engine is `engine.kind: synthetic` (random tokens at --tokens-per-s, far above what one
GPU does, so the engine never limits), on a local Ray, over a generated Parquet input of
--rows short prompts, tokenized by the pipeline's own prompt actors with a tiny model's
tokenizer. One job per answer length in --answers (every row generates exactly that many
tokens: ignore_eos).

Printed per job:
- rows/s per engine actor over the generation window: from the first row's arrival in the
  engine to the last row's finish (the rows' `finished_at` and `latency_s`), so Ray start-up,
  actor start and the final commit are left out; and end to end (run_job's whole time);
- CPU seconds per 1,000 rows in that window of each process role: the prompt actor(s), the
  engine actor, other Ray workers (read tasks), Ray's daemons (raylet, GCS) and the driver,
  and each role's share of one core (100% = one core busy).

CPU is read from /proc by psutil, every --sample-s, for every process below the driver (with
address="local" Ray's daemons and workers are all its descendants), and interpolated to the
window's edges. The sampling thread's own CPU is taken out of the driver's figure. Numbers
from a machine shared with other work are only indicative; run it on an idle one to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import threading
import time
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# Ray starts workers at niceness 15; on a shared machine that would measure the machine's load.
os.environ.setdefault("RAY_worker_niceness", "0")

ROLES = ("prompt actor", "engine actor", "other Ray workers", "Ray daemons", "driver")


# Ray's own helper processes (agents, monitors), whatever their title looks like.
_DAEMONS = ("DashboardAgent", "RuntimeEnvAgent", "dashboard", "log_monitor", "monitor.py")


def role_of(title: str, name: str) -> str | None:
    """The role of a process from its title (Ray sets `ray::<Class>.<method>` on workers)."""
    if "PromptWorker" in title:
        return "prompt actor"
    if "EngineWorker" in title:
        return "engine actor"
    if name in ("raylet", "gcs_server") or any(d in title for d in _DAEMONS):
        return "Ray daemons"
    if title.startswith("ray::"):
        return "other Ray workers"
    return None


@dataclass
class Series:
    """One process's CPU seconds over wall time, sampled."""

    role: str
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def at(self, t: float) -> float:
        """CPU seconds used by wall time t (linear between samples; flat outside them)."""
        if not self.times or t <= self.times[0]:
            return self.cpu[0] if self.cpu and t >= self.times[0] else 0.0
        if t >= self.times[-1]:
            return self.cpu[-1]
        i = bisect_left(self.times, t)
        t0, t1, c0, c1 = self.times[i - 1], self.times[i], self.cpu[i - 1], self.cpu[i]
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0)


class CpuSampler:
    """Samples the CPU time of the driver and every process below it, in a thread."""

    def __init__(self, interval_s: float) -> None:
        import psutil

        self._psutil = psutil
        self.interval_s = interval_s
        self.series: dict[int, Series] = {}
        self.driver = Series("driver")
        self._self_cpu = Series("sampler")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        me = self._psutil.Process()
        while not self._stop.is_set():
            self.sample(me)
            self._stop.wait(self.interval_s)
        self.sample(me)

    def sample(self, me) -> None:
        now = time.time()
        for proc in me.children(recursive=True):
            try:
                with proc.oneshot():
                    cpu = proc.cpu_times()
                    title = " ".join(proc.cmdline())
                    name = proc.name()
            except (self._psutil.NoSuchProcess, self._psutil.AccessDenied):
                continue
            role = role_of(title, name)
            series = self.series.get(proc.pid)
            if series is None:
                if role is None:
                    continue
                series = self.series[proc.pid] = Series(role)
            elif role is not None and role != "other Ray workers":
                series.role = role  # an idle worker became an actor
            series.times.append(now)
            series.cpu.append(cpu.user + cpu.system)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.driver.times.append(now)
        self.driver.cpu.append(usage.ru_utime + usage.ru_stime)
        self._self_cpu.times.append(now)
        self._self_cpu.cpu.append(time.thread_time())

    def cpu_between(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds per role between two wall times (the sampler's own taken out)."""
        out: dict[str, float] = defaultdict(float)
        for series in self.series.values():
            out[series.role] += series.at(end) - series.at(start)
        sampler = self._self_cpu.at(end) - self._self_cpu.at(start)
        out["driver"] = self.driver.at(end) - self.driver.at(start) - sampler
        return out


def write_input(path: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = [
        f"Question {i}: what is {i % 97} plus {i % 13}? Answer briefly." for i in range(rows)
    ]
    table = pa.table({"id": [f"q{i:07d}" for i in range(rows)], "prompt": prompts})
    pq.write_table(table, path, row_group_size=2000)


def job_dict(src: Path, model: Path, out: Path, answer: int, args: argparse.Namespace) -> dict:
    return {
        "name": f"bench-capacity-{answer}",
        "input": {
            "uri": str(src),
            "format": "parquet",
            "id_column": "id",
            "prompt_column": "prompt",
        },
        "model": {"path": str(model)},
        "engine": {
            "kind": "synthetic",
            "max_batch_size": args.in_flight,
            "extra": {
                "tokens_per_s": args.tokens_per_s,
                "ttft_ms": args.ttft_ms,
                "step_interval_ms": args.step_interval_ms,
                "seed": 1,
            },
        },
        "sampling": {"max_tokens": answer, "temperature": 0.0, "ignore_eos": True},
        "resources": {
            "num_actors": 1,
            "cpus_per_actor": 0.5,
            "batch_size": args.batch_size,
            "max_in_flight": args.in_flight,
            "prompt_actors": args.prompt_actors,
        },
        "output": {"uri": str(out), "rows_per_file": 20000, "report": False},
    }


def run(spec, sampler_interval: float) -> dict:
    """One job: its window, rows, and CPU seconds per role in the window."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from pipeline.batch.driver.run import run_job

    started = time.time()
    with CpuSampler(sampler_interval) as sampler:
        result = run_job(spec, fresh=True)
    end_to_end = time.time() - started
    assert result.status == "complete", result.message
    table = pq.read_table(spec.output.uri)
    finished = pc.cast(table.column("finished_at"), "int64").to_numpy() / 1e3  # ms → s
    arrived = finished - table.column("latency_s").to_numpy()
    start, end = float(arrived.min()), float(finished.max())
    errors = pc.sum(pc.equal(table.column("finish_reason"), "error")).as_py() or 0
    assert errors == 0, f"{errors} error rows"
    return {
        "rows": table.num_rows,
        "tokens": int(pc.sum(table.column("completion_tokens")).as_py()),
        "window_s": end - start,
        "end_to_end_s": end_to_end,
        "cpu": sampler.cpu_between(start, end),
    }


def report(answer: int, got: dict) -> None:
    rows, window = got["rows"], got["window_s"]
    print(
        f"answer {answer} token(s): {rows} rows, {got['tokens']} tokens; window {window:.2f} s "
        f"-> {rows / window:,.0f} rows/s per engine actor ({got['tokens'] / window:,.0f} "
        f"tokens/s); end to end {got['end_to_end_s']:.1f} s ({rows / got['end_to_end_s']:,.0f} "
        "rows/s incl. Ray and actor start-up, reading and the final commit)"
    )
    for role in ROLES:
        seconds = got["cpu"].get(role, 0.0)
        print(
            f"    {role:<18} {1000 * seconds / rows:7.3f} CPU s / 1k rows  "
            f"{100 * seconds / window:5.1f}% of a core"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=50000)
    parser.add_argument("--answers", default="1,64", help="answer lengths, comma-separated")
    parser.add_argument("--in-flight", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--prompt-actors", type=int, default=1)
    parser.add_argument("--tokens-per-s", type=float, default=1e7)
    parser.add_argument("--ttft-ms", type=float, default=5.0)
    # Short steps: a 64-token answer takes 64 steps, and the step cadence, not the pipeline,
    # would bound rows/s at 1024 in flight with a GPU-like 5-10 ms.
    parser.add_argument("--step-interval-ms", type=float, default=1.0)
    parser.add_argument("--sample-s", type=float, default=0.25)
    parser.add_argument("--model", type=Path, help="model dir (default: a new tiny Llama)")
    args = parser.parse_args()

    import ray

    from pipeline.spec import parse_job_spec

    work = Path(tempfile.mkdtemp(prefix="bench-capacity-"))
    model = args.model
    if model is None:
        from engines.dev.tiny import make_tiny_model

        model = Path(make_tiny_model(work / "model", arch="llama"))
    src = work / "prompts.parquet"
    write_input(src, args.rows)
    print(
        f"rows={args.rows} in_flight={args.in_flight} batch_size={args.batch_size} "
        f"prompt_actors={args.prompt_actors} tokens_per_s={args.tokens_per_s:g} "
        f"ttft_ms={args.ttft_ms} step_interval_ms={args.step_interval_ms} cpus={os.cpu_count()}"
    )
    for answer in (int(a) for a in args.answers.split(",")):
        spec = parse_job_spec(job_dict(src, model, work / f"out-{answer}", answer, args))
        ray.init(
            address="local",
            num_cpus=os.cpu_count(),
            include_dashboard=False,
            object_store_memory=500 * 1024**2,
            log_to_driver=False,
        )
        try:
            got = run(spec, args.sample_s)
        finally:
            ray.shutdown()
        report(answer, got)
        print(json.dumps({"answer_tokens": answer, **got}, default=float))


if __name__ == "__main__":
    main()
