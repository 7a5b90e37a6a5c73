"""Does the batch path scale with rows? The real pipeline at 10k, 100k and 1M rows.

    .venv/bin/python tests/benchmarks/bench_scale.py [--sizes 10000,100000,1000000]
        [--max-tokens 1] [--resume-at 0.5] [--set resources.batch_size=512 ...] [--json out.json]

Each size runs `tokenmill run` on a job with the default settings except what a benchmark must
say (the tiny model, short prompts, max_tokens, a local output), as a user would, in its own
process with its own local Ray. While it runs, every process of the run is sampled (every
0.25 s) for CPU time and memory and grouped by stage: the driver, the engine actor, the prompt
actor, Ray's own processes. Printed per size:

- rows/s end to end (wall time of the command, Ray start and model load included) and steady
  rows/s (all rows over the time from the first row entering an engine to the last part);
- the driver's peak RSS and CPU seconds, and its CPU as a share of the wall time;
- CPU seconds per stage (the busiest process should be the engine actor);
- the ratio steady rows/s of the largest size over the smallest (target >= 0.9), and the
  driver's RSS growth from the smallest to the largest (target < 300 MB).

`--resume-at F` adds a resume check at the largest size: the driver (and its local Ray) is
killed once a fraction F of the rows is committed, the same command is run again, and the
script counts the rows the rerun generated against the rows of the shards that were unfinished
at the kill, and checks that every id is in the output exactly once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
ROLES = (
    ("engine actor", "EngineWorker"),
    ("prompt actor", "PromptWorker"),
    ("raylet", "raylet"),
    ("gcs", "gcs_server"),
)
WORDS = "river bridge cluster shard token engine actor prompt answer night".split()


def write_input(path: Path, rows: int) -> Path:
    if path.exists():
        return path
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as fh:
        for i in range(rows):
            words = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(6))
            fh.write(json.dumps({"id": f"r{i:08d}", "prompt": f"Q{i}: {words}?"}) + "\n")
    tmp.rename(path)
    return path


def job_file(work: Path, src: Path, model: Path, out: Path, max_tokens: int) -> Path:
    job = {
        "name": "bench-scale",
        "input": {"uri": str(src), "format": "jsonl", "id_column": "id", "prompt_column": "prompt"},
        "model": {"path": str(model)},
        "engine": {"device": "cpu"},
        "sampling": {"max_tokens": max_tokens},
        "output": {"uri": str(out)},
    }
    path = work / f"job-{src.stem}.json"
    path.write_text(json.dumps(job))  # JSON is YAML
    return path


def role_of(proc: psutil.Process, driver: int) -> str:
    """The stage a process belongs to. Ray workers carry their actor class in their title
    (`ray::EngineWorker...`) once they run one, so the role is looked up on every sample."""
    if proc.pid == driver:
        return "driver"
    try:
        line = " ".join(proc.cmdline())
    except psutil.Error:
        return "other"
    if line.startswith("ray::"):
        title = line.split()[0]
        for role, marker in ROLES:
            if marker in title:
                return role
        return "idle ray worker"
    for role, marker in ROLES:
        if marker in line:
            return role
    return "other ray"


@dataclass
class Sample:
    """What the sampler saw of one run."""

    driver_peak_rss_mb: float = 0.0
    driver_cpu_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # role -> CPU seconds
    busiest: str = ""


def sample_run(proc: subprocess.Popen[bytes], stop_when: object = None) -> Sample:
    """Poll the run's processes until it exits (or `stop_when()` is true)."""
    driver = psutil.Process(proc.pid)
    seen: dict[int, tuple[str, float]] = {}  # pid -> (role, last CPU seconds)
    sample = Sample()
    while proc.poll() is None:
        try:
            procs = [driver, *driver.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in procs:
            try:
                times = p.cpu_times()
                role = role_of(p, proc.pid)
                if role in ("other", "idle ray worker") and p.pid in seen:
                    role = seen[p.pid][0]  # gone, or back to idle: keep what it was doing
                seen[p.pid] = (role, times.user + times.system)
                if p.pid == proc.pid:
                    sample.driver_peak_rss_mb = max(
                        sample.driver_peak_rss_mb, p.memory_info().rss / 1e6
                    )
            except psutil.Error:
                continue
        if stop_when is not None and stop_when():  # type: ignore[operator]
            break
        time.sleep(0.25)
    totals: dict[str, float] = defaultdict(float)
    for role, cpu in seen.values():
        totals[role] += cpu
    sample.cpu_s = dict(sorted(totals.items(), key=lambda kv: -kv[1]))
    sample.driver_cpu_s = totals.get("driver", 0.0)
    per_process = sorted(seen.values(), key=lambda rc: -rc[1])
    sample.busiest = per_process[0][0] if per_process else ""
    return sample


def committed_rows(out: Path) -> int:
    try:
        manifest = json.loads((out / "_manifest.json").read_text())
    except (OSError, ValueError):
        return 0
    return sum(p["rows"] for p in manifest.get("parts", []))


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.pop("RAY_ADDRESS", None)
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def start_run(job: Path, extra: list[str]) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "pipeline.cli", "run", str(job), *extra]
    return subprocess.Popen(
        args,
        cwd=ROOT,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def kill_tree(pid: int) -> None:
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


@dataclass
class SizeResult:
    rows: int
    wall_s: float
    rows_per_s: float
    steady_rows_per_s: float
    driver_peak_rss_mb: float
    driver_cpu_s: float
    driver_cpu_share: float
    cpu_s: dict[str, float]
    busiest_process: str
    exit_code: int


def steady_rate(out: Path) -> float:
    """Rows per second while generating: all rows over the time from the first row entering
    an engine (the manifest's busy spans) to the last part written. Ray start-up and model
    load are left out, so sizes compare on the pipeline's own speed."""
    manifest = json.loads((out / "_manifest.json").read_text())
    starts = [s for spans in manifest["stats"]["busy"].values() for s, _ in spans]
    last = max(p["written_at"] for p in manifest["parts"])
    rows = sum(p["rows"] for p in manifest["parts"])
    span = last - min(starts) if starts else 0.0
    return rows / span if span > 0 else 0.0


def run_size(work: Path, model: Path, rows: int, args: argparse.Namespace) -> SizeResult:
    src = write_input(work / f"in-{rows}.jsonl", rows)
    out = work / f"out-{rows}"
    job = job_file(work, src, model, out, args.max_tokens)
    extra = ["--fresh", *(x for s in args.set for x in ("--set", s))]
    started = time.monotonic()
    proc = start_run(job, extra)
    sample = sample_run(proc)
    _, stderr = proc.communicate()
    wall = time.monotonic() - started
    if proc.returncode != 0:
        print(stderr.decode()[-3000:], file=sys.stderr)
    done = committed_rows(out)
    return SizeResult(
        rows=done,
        wall_s=wall,
        rows_per_s=done / wall,
        steady_rows_per_s=steady_rate(out),
        driver_peak_rss_mb=sample.driver_peak_rss_mb,
        driver_cpu_s=sample.driver_cpu_s,
        driver_cpu_share=sample.driver_cpu_s / wall,
        cpu_s=sample.cpu_s,
        busiest_process=sample.busiest,
        exit_code=proc.returncode or 0,
    )


def resume_check(work: Path, model: Path, rows: int, at: float, args: argparse.Namespace) -> dict:
    """Kill the driver at `at` of the rows, rerun, count what the rerun generated."""
    src = write_input(work / f"in-{rows}.jsonl", rows)
    out = work / f"out-{rows}-resume"
    job = job_file(work, src, model, out, args.max_tokens)
    sets = [x for s in args.set for x in ("--set", s)]
    first = start_run(job, ["--fresh", *sets])
    sample_run(first, stop_when=lambda: committed_rows(out) >= at * rows)
    kill_tree(first.pid)
    first.wait()
    time.sleep(1.0)
    manifest = json.loads((out / "_manifest.json").read_text())
    recorded = sum(p["rows"] for p in manifest["parts"])
    on_disk = len(list(out.glob("part-*.parquet")))
    unfinished = [s for s in manifest["shards"] if not s["complete"]]
    unfinished_ids = {s["index"] for s in unfinished}
    committed_in_unfinished = sum(
        p["rows"] for p in manifest["parts"] if p["shard"] in unfinished_ids
    )
    # JSONL shards learn their row count when read: the unfinished ones hold every row that
    # is not in a finished shard.
    in_finished = sum(p["rows"] for p in manifest["parts"] if p["shard"] not in unfinished_ids)
    started = time.monotonic()
    second = start_run(job, sets)
    _, stderr = second.communicate()
    wall = time.monotonic() - started
    final = json.loads((out / "_manifest.json").read_text())
    rerun = final["runs"][-1]
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    parts = sorted(out.glob("part-*.parquet"))
    ids = pa.concat_tables(pq.read_table(p, columns=["id"]) for p in parts).column("id")
    return {
        "rows": rows,
        "killed_at_committed_rows": recorded,
        "part_files_at_kill": on_disk,
        "adopted_parts": [e for e in rerun.get("events", []) if e.get("event") == "adopted_parts"],
        "unfinished_shards_at_kill": len(unfinished),
        "rows_of_unfinished_shards": rows - in_finished,
        "rows_committed_in_them": committed_in_unfinished,
        "rows_generated_by_rerun": rerun["rows"],
        "rerun_wall_s": round(wall, 1),
        "rerun_exit_code": second.returncode,
        "output_rows": len(ids),
        "distinct_ids": pc.count_distinct(ids).as_py(),
        "stderr_tail": stderr.decode()[-500:] if second.returncode else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], help="job overrides")
    parser.add_argument("--resume-at", type=float, default=None)
    parser.add_argument("--work", default=None, help="keep inputs here between runs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not (model / "config.json").exists():
        from engines.dev.tiny import make_tiny_model

        make_tiny_model(model, arch="llama")
    sizes = [int(s) for s in args.sizes.split(",")]
    results = []
    for rows in sizes:
        result = run_size(work, model, rows, args)
        results.append(result)
        top = ", ".join(f"{k} {v:.0f}" for k, v in list(result.cpu_s.items())[:5])
        print(
            f"{rows:>9,} rows | {result.wall_s:7.1f} s | {result.rows_per_s:7.0f} rows/s end to "
            f"end | {result.steady_rows_per_s:7.0f} rows/s steady | driver RSS "
            f"{result.driver_peak_rss_mb:5.0f} MB, CPU {result.driver_cpu_s:5.1f} s "
            f"({result.driver_cpu_share:.1%} of wall) | busiest: {result.busiest_process} | "
            f"CPU s: {top} | exit {result.exit_code}",
            flush=True,
        )
    small, large = results[0], results[-1]
    summary = {
        "steady_ratio_largest_over_smallest": large.steady_rows_per_s / small.steady_rows_per_s
        if small.steady_rows_per_s
        else None,
        "end_to_end_ratio_largest_over_smallest": large.rows_per_s / small.rows_per_s,
        "driver_rss_growth_mb": large.driver_peak_rss_mb - small.driver_peak_rss_mb,
        "driver_cpu_share_at_largest": large.driver_cpu_share,
    }
    print(json.dumps(summary, indent=2))
    resume = None
    if args.resume_at is not None:
        resume = resume_check(work, model, sizes[-1], args.resume_at, args)
        print(json.dumps(resume, indent=2))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"sizes": [asdict(r) for r in results], "summary": summary, "resume": resume},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
