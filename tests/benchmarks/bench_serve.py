"""Serving overhead: the same requests through `tokenmill serve` (HTTP, OpenAI client) and
through the engine alone.

    .venv/bin/python tests/benchmarks/bench_serve.py [--requests 200] [--concurrency 32]
        [--max-tokens 16] [--size tiny|small] [--threads 1] [--out result.json]

Both sides use the same tiny model, engine settings, chat prompts and concurrency cap; every
request generates exactly --max-tokens tokens (ignore_eos), so both do the same engine work.
The engine runs first, alone in this process, then is shut down; then one `tokenmill serve`
(one ingress, one engine replica) takes the same requests over loopback HTTP from the async
OpenAI client. Per side: requests/s over the whole run, p50/p99 latency; then the serving
overhead per request: the difference of mean and p50 latencies (serve minus engine).

The client runs on the same cores as the server, so on a small machine part of the overhead
is the client's own. Numbers from a busy machine are only a smoke check; take final ones on a
quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

API_KEY = "bench-key"
WORDS = ("river", "bridge", "market", "harbour", "letter", "garden", "window", "story")


def prompts(n: int) -> list[list[dict[str, str]]]:
    """n distinct short chats (distinct so the prefix cache cannot make later ones free)."""
    return [
        [{"role": "user", "content": f"Request {i}: tell me about the {WORDS[i % len(WORDS)]}."}]
        for i in range(n)
    ]


def engine_section(args: argparse.Namespace) -> dict:
    return {
        "kind": "reference",
        "device": "cpu",
        "max_batch_size": args.concurrency,
        "max_num_tokens": 512,
        "max_model_len": 512,
        "extra": {"num_threads": args.threads},
    }


def summarize(latencies: list[float], wall_s: float) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "requests": len(ordered),
        "requests_per_s": len(ordered) / wall_s,
        "wall_s": wall_s,
        "mean_s": statistics.fmean(ordered),
        "p50_s": ordered[len(ordered) // 2],
        "p99_s": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
    }


async def bounded(concurrency: int, jobs) -> tuple[list[float], float]:
    """Run the coroutine factories `jobs` at most `concurrency` at a time; latencies, wall."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(job) -> None:
        async with gate:
            start = time.perf_counter()
            await job()
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(one(job) for job in jobs))
    return latencies, time.perf_counter() - start


def bench_engine(model_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    from engines import GenerationRequest, SamplingParams, load_engine
    from pipeline.batch.prompts import load_tokenizer, render_prompt
    from pipeline.engine_setup import engine_settings
    from pipeline.spec import EngineSpec, ModelSpec, PromptSpec, StorageSpec

    spec = EngineSpec.model_validate(engine_section(args))
    tokenizer = load_tokenizer(ModelSpec(path=str(model_dir)), StorageSpec())
    ids = [render_prompt(tokenizer, PromptSpec(), messages=chat) for chat in prompts(args.requests)]
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine = load_engine("reference", model=str(model_dir), **engine_settings(spec))
    try:

        async def run() -> tuple[list[float], float]:
            def job(prompt_ids: list[int]):
                async def call() -> None:
                    result = await engine.generate(GenerationRequest(prompt_ids, sampling))
                    assert result.completion_tokens == args.max_tokens, result

                return call

            # One warm-up request so neither side pays first-call costs in its numbers.
            await job(ids[0])()
            return await bounded(args.concurrency, [job(p) for p in ids])

        latencies, wall = asyncio.run(run())
    finally:
        engine.shutdown()
    return summarize(latencies, wall)


def bench_serve(model_dir: Path, work: Path, args: argparse.Namespace) -> dict[str, float]:
    import openai

    from tests.e2e.serve_fixtures import start_server

    config = {
        "models": [
            {
                "name": "bench",
                "model": {"path": str(model_dir)},
                "engine": engine_section(args),
                "replicas": {
                    "cpus_per_replica": 0.5,
                    "max_ongoing_requests": args.concurrency,
                    "max_queued_requests": args.requests,
                },
                "limits": {"max_tokens": args.max_tokens, "default_max_tokens": args.max_tokens},
            }
        ],
        "http": {"cpus_per_ingress": 0.25, "access_log": args.access_log},
    }
    path = work / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    server = start_server(path, {"TOKENMILL_API_KEYS": API_KEY}, [])
    try:
        client = openai.AsyncOpenAI(
            base_url=server.api_url, api_key=API_KEY, max_retries=0, timeout=600
        )

        async def run() -> tuple[list[float], float]:
            def job(chat: list[dict[str, str]]):
                async def call() -> None:
                    response = await client.chat.completions.create(
                        model="bench",
                        messages=chat,
                        max_tokens=args.max_tokens,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    assert response.usage.completion_tokens == args.max_tokens, response

                return call

            chats = prompts(args.requests)
            await job(chats[0])()
            return await bounded(args.concurrency, [job(c) for c in chats])

        latencies, wall = asyncio.run(run())
    finally:
        server.stop()
    return summarize(latencies, wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--size", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each engine")
    parser.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="keep Serve's per-request access log lines (http.access_log)",
    )
    parser.add_argument("--out", type=Path, help="also write the results here as JSON")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    from engines.tiny import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny_model(work / "model", arch="llama", size=args.size)
        engine = bench_engine(model_dir, args)
        served = bench_serve(model_dir, work, args)
    result = {
        "settings": vars(args) | {"out": str(args.out) if args.out else None},
        "engine": engine,
        "serve": served,
        "overhead_mean_s": served["mean_s"] - engine["mean_s"],
        "overhead_p50_s": served["p50_s"] - engine["p50_s"],
        "throughput_ratio": served["requests_per_s"] / engine["requests_per_s"],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
