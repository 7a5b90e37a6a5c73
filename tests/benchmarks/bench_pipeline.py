"""Pipeline overhead: the same prompts through the whole pipeline and through the engine alone.

    .venv/bin/python tests/benchmarks/bench_pipeline.py [--rows 256] [--max-tokens 32]
        [--size small|tiny] [--in-flight 64] [--batch-size 16] [--engine-threads 1] [--repeat 1]

Both sides use the same model, engine settings, prompts (tokenized by the pipeline's own prompt
stage code) and in-flight cap; one engine actor vs one engine in this process. Every row
generates exactly --max-tokens tokens (ignore_eos), so both produce the same token count.

Throughput is output tokens / generation window. The window of the engine alone runs from the
first request's submission to the last request's finish. The pipeline's runs from the first
row's arrival in the engine to the last row's finish (from the rows' `finished_at` and
`latency_s`), so actor start-up and model load are left out (they are one-off, reported as
load time in the manifest) but any moment the engine starves for rows counts against it.
The runs alternate: engine alone, pipeline, engine alone, pipeline, ..., engine alone; each
pipeline run is compared with the faster of the two engine-alone runs beside it, so a burst of
load from elsewhere on the machine does not flatter the ratio. Printed per pipeline run: both
throughputs, the ratio (target >= 0.85) and the end-to-end time; with --repeat > 1 also the
median and worst ratio. Numbers from a busy machine are only a smoke check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

# Ray starts workers at niceness 15; on a machine shared with other work that measures the
# machine's load, not the pipeline. The engine alone runs at the shell's priority: match it.
os.environ.setdefault("RAY_worker_niceness", "0")


def job_dict(src: Path, model: Path, out: Path, args: argparse.Namespace) -> dict:
    return {
        "name": "bench-pipeline",
        "input": {"uri": str(src), "format": "jsonl", "id_column": "id", "prompt_column": "p"},
        "model": {"path": str(model)},
        "engine": {
            "kind": "reference",
            "device": "cpu",
            "max_batch_size": args.in_flight,
            "extra": {"num_threads": args.engine_threads},
        },
        "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True},
        "resources": {
            "num_actors": 1,
            "cpus_per_actor": 0.5,
            "batch_size": args.batch_size,
            "max_in_flight": args.in_flight,
        },
        "output": {"uri": str(out), "rows_per_file": 1000, "report": False},
    }


async def engine_alone(spec, rows: list[dict]) -> tuple[int, float]:
    """(output tokens, window seconds) for the rows through a bare engine."""
    from engines import GenerationRequest, SamplingParams
    from pipeline.batch.stages.prompts import PromptStage
    from pipeline.engine_setup import open_engine

    stage = PromptStage(spec)
    prompts = [
        stage.process_row({"id": r["id"], "prompt": r["p"]})["prompt_token_ids"] for r in rows
    ]
    engine = open_engine(spec.model, spec.engine, spec.storage)
    sampling = SamplingParams(max_tokens=spec.sampling.max_tokens, temperature=0.0, ignore_eos=True)
    slots = asyncio.Semaphore(spec.resources.max_in_flight)

    async def one(ids: list[int]) -> int:
        async with slots:
            result = await engine.generate(
                GenerationRequest(prompt_token_ids=ids, sampling=sampling)
            )
            return result.completion_tokens

    try:
        start = time.monotonic()
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        return tokens, time.monotonic() - start
    finally:
        engine.shutdown()


def pipeline(spec) -> tuple[int, float, float]:
    """(output tokens, generation window seconds, end-to-end seconds) through run_job."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from pipeline.batch.driver.run import run_job

    start = time.monotonic()
    result = run_job(spec, fresh=True)
    end_to_end = time.monotonic() - start
    assert result.status == "complete", result.message
    table = pq.read_table(spec.output.uri)
    finished = pc.cast(table.column("finished_at"), "int64").to_numpy() / 1e3  # ms → s
    arrived = finished - table.column("latency_s").to_numpy()
    tokens = int(pc.sum(table.column("completion_tokens")).as_py())
    return tokens, float(finished.max() - arrived.min()), end_to_end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    # One engine thread leaves the other cores to read/tokenize/write, as on a GPU node where
    # the engine does not compute on the CPU; with all cores the ratio also measures how much
    # CPU the pipeline's own processes take from a CPU engine.
    parser.add_argument("--engine-threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1, help="pipeline runs (alternating)")
    args = parser.parse_args()

    import ray

    from engines.dev.tiny import make_tiny_model
    from engines.quantize.calibration import sample_text
    from pipeline.spec import parse_job_spec

    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    model = Path(make_tiny_model(work / "model", arch="llama", size=args.size))
    text = sample_text(args.rows)
    rows = [{"id": f"b{i:05d}", "p": text[i]} for i in range(args.rows)]
    src = work / "prompts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = parse_job_spec(job_dict(src, model, work / "out", args))

    print(
        f"rows={args.rows} max_tokens={args.max_tokens} in_flight={args.in_flight} "
        f"batch_size={args.batch_size} model={args.size} engine_threads={args.engine_threads}"
    )
    alone = [asyncio.run(engine_alone(spec, rows))]
    ratios = []
    for run in range(args.repeat):
        # A Ray instance per pipeline run, down while the engine runs alone: its idle daemons
        # would slow the engine alone and flatter the ratio.
        ray.init(
            address="local",
            num_cpus=os.cpu_count(),
            include_dashboard=False,
            object_store_memory=500 * 1024**2,
            log_to_driver=False,
        )
        try:
            pipe_tokens, pipe_s, e2e_s = pipeline(spec)
        finally:
            ray.shutdown()
        alone.append(asyncio.run(engine_alone(spec, rows)))
        alone_tokens, alone_s = min(alone[-2:], key=lambda r: r[1])
        alone_tps, pipe_tps = alone_tokens / alone_s, pipe_tokens / pipe_s
        ratios.append(pipe_tps / alone_tps)
        print(
            f"run {run + 1}: engine alone {alone_tps:.1f} tok/s "
            f"(best of {alone[-2][1]:.2f}s, {alone[-1][1]:.2f}s for {alone_tokens} tokens); "
            f"pipeline {pipe_tps:.1f} tok/s ({pipe_tokens} tokens in {pipe_s:.2f}s, end to "
            f"end {e2e_s:.1f}s incl. Ray start and model load); ratio {ratios[-1]:.3f}"
        )
    summary = f"ratio pipeline/engine = {statistics.median(ratios):.3f}"
    if len(ratios) > 1:
        summary += f" (median of {len(ratios)}; worst {min(ratios):.3f})"
    print(summary + " (target >= 0.85)")


if __name__ == "__main__":
    main()
