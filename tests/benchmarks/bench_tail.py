"""The tail of a fleet-sized job: idle engine actor-time with and without tail splitting.

    .venv/bin/python tests/benchmarks/bench_tail.py [--rows 2000000] [--actors 32]
        [--tokens-per-s 1000] [--answer 16] [--files 8]

One Parquet input of --rows short prompts, in --files files on the S3 test server (moto over
HTTP, tests/integration/s3_server.py), run twice by `tokenmill run` in a process of its own
(its own local Ray): --actors synthetic engine actors (engine.kind synthetic, fractional CPUs)
at --tokens-per-s each, so the engines, not the prompt actors, set the pace; answers of up to
--answer tokens, a third of them ending early, so shards take different times as they do on
real data. First with `resources.tail_split: false`, then with the default (true).

Printed per run, from the manifest's run events and the driver process:
- engine actor-seconds (every actor from the first hand-out to the end), idle actor-seconds
  (an actor up with no unit), and of those the ones at the tail: after the last whole shard
  was handed out (pipeline.batch.driver.occupancy); the tail's idle share of all actor-time;
- the tail splits made; the wall time; the driver's peak RSS and CPU seconds (the
  `tokenmill run` process alone, sampled every 0.5 s);
- every input id once in the committed output (checked: the run fails otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.integration.s3_server import S3Server, dummy_aws_env, running_s3_server  # noqa: E402


def write_input(server: S3Server, bucket: str, rows: int, files: int) -> str:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    per_file = -(-rows // files)
    for f in range(files):
        ids = range(f * per_file, min(rows, (f + 1) * per_file))
        table = pa.table(
            {
                "id": [f"q{i:08d}" for i in ids],
                "prompt": [f"Question {i}: what is {i % 97} plus {i % 13}?" for i in ids],
            }
        )
        buffer = io.BytesIO()
        # Small row groups: shards are runs of whole row groups, so these let the shard plan
        # size shards for the fleet (pipeline.batch.driver.shards).
        pq.write_table(table, buffer, row_group_size=500)
        server.put(f"s3://{bucket}/in/part-{f:03d}.parquet", buffer.getvalue())
    return f"s3://{bucket}/in/"


def job(args: argparse.Namespace, src: str, out: str, model: Path, endpoint: str, split: bool):
    return {
        "name": f"bench-tail-{'split' if split else 'nosplit'}",
        "input": {"uri": src, "format": "parquet", "id_column": "id", "prompt_column": "prompt"},
        "model": {"path": str(model)},
        "engine": {
            "kind": "synthetic",
            "max_batch_size": args.in_flight,
            "extra": {
                "tokens_per_s": args.tokens_per_s,
                "ttft_ms": 20.0,
                "ttft_jitter": 0.5,
                "step_interval_ms": 5.0,
                "stop_fraction": 0.33,
                "seed": 1,
            },
        },
        "sampling": {"max_tokens": args.answer, "temperature": 0.0},
        "resources": {
            "num_actors": args.actors,
            # Fractional CPUs: the actors together ask for half of this machine's cores.
            "cpus_per_actor": round(max(0.01, (os.cpu_count() or 2) / 2 / args.actors), 3),
            "batch_size": 64,
            "max_in_flight": args.in_flight,
            "prompt_actors": args.prompt_actors,
            "tail_split": split,
        },
        "output": {"uri": out, "report": False},
        "storage": {"endpoint_url": endpoint},
    }


def run(path: Path, env: dict[str, str]) -> dict:
    """`tokenmill run` on the job file; its wall time, peak RSS and CPU seconds."""
    import psutil

    started = time.monotonic()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "tokenmill"), "run", str(path), "--fresh"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    me = psutil.Process(proc.pid)
    peak, cpu = 0, 0.0
    while proc.poll() is None:
        try:
            peak = max(peak, me.memory_info().rss)
            times = me.cpu_times()
            cpu = times.user + times.system
        except psutil.Error:
            pass
        time.sleep(0.5)
    output = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        raise SystemExit(f"tokenmill run failed ({proc.returncode}):\n{output[-4000:]}")
    return {
        "wall_s": time.monotonic() - started,
        "driver_rss_mb": peak / 2**20,
        "driver_cpu_s": cpu,
    }


def check_and_summarize(server: S3Server, out: str, rows: int) -> dict:
    import pyarrow.parquet as pq
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": server.endpoint_url})
    manifest = json.loads(fs.cat(out.removeprefix("s3://") + "/_manifest.json"))
    assert manifest["status"] == "complete", manifest["status"]
    ids = []
    for part in manifest["parts"]:
        path = f"{out.removeprefix('s3://')}/{part['name']}"
        ids += pq.read_table(path, columns=["id"], filesystem=fs).column("id").to_pylist()
    assert len(ids) == rows and len(set(ids)) == rows, f"{len(ids)} ids, {len(set(ids))} unique"
    events = manifest["runs"][-1]["events"]
    occupancy = next(e for e in events if e["event"] == "occupancy")
    splits = [e for e in events if e["event"] == "tail_split"]
    return {
        "shards": len(manifest["shards"]),
        "splits": len(splits),
        "rows_split": sum(e["rows"] for e in splits),
        **{k: v for k, v in occupancy.items() if k != "event"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--actors", type=int, default=32)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--tokens-per-s", type=float, default=1000.0)
    parser.add_argument("--answer", type=int, default=16)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--prompt-actors", type=int, default=2)
    parser.add_argument("--only", choices=("split", "nosplit"), help="one run only")
    args = parser.parse_args()

    from engines.dev.tiny import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench-tail-"))
    model = Path(make_tiny_model(work / "model", arch="llama"))
    with dummy_aws_env(), running_s3_server() as server:
        bucket = server.make_bucket("tail")
        src = write_input(server, bucket, args.rows, args.files)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        print(
            f"rows={args.rows} actors={args.actors} tokens_per_s={args.tokens_per_s:g} "
            f"answer<={args.answer} cpus={os.cpu_count()}",
            flush=True,
        )
        for split in (False, True):
            name = "split" if split else "nosplit"
            if args.only and args.only != name:
                continue
            out = f"s3://{bucket}/out-{name}"
            path = work / f"{name}.yaml"
            path.write_text(yaml.safe_dump(job(args, src, out, model, server.endpoint_url, split)))
            got = {**run(path, env), **check_and_summarize(server, out, args.rows)}
            print(
                f"tail_split={split}: {got['shards']} shards, wall {got['wall_s']:.0f} s; engine "
                f"actor-s {got['engine_actor_s']:.0f}, idle {got['idle_actor_s']:.0f}, at the "
                f"tail {got['tail_idle_actor_s']:.0f} over {got['tail_s']:.0f} s = "
                f"{100 * got['tail_idle_fraction']:.1f}% of actor-time; {got['splits']} splits "
                f"({got['rows_split']} rows); driver peak RSS {got['driver_rss_mb']:.0f} MB, "
                f"CPU {got['driver_cpu_s']:.1f} s ({100 * got['driver_cpu_s'] / got['wall_s']:.1f}"
                "% of a core); every id once",
                flush=True,
            )
            print(json.dumps({"tail_split": split, **got}), flush=True)


if __name__ == "__main__":
    main()
