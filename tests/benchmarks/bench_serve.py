"""Serving, side by side: `tokenmill serve`, the engine alone, and vLLM's OpenAI server.

    .venv/bin/python tests/benchmarks/bench_serve.py [--requests 200] [--concurrency 32]
        [--max-tokens 16] [--size tiny-hd32|tiny|small] [--threads 1]
        [--peers engine,vllm] [--one-hop] [--no-direct-ingress] [--out result.json]

Every side gets the same model (a tiny random Llama built here), the same chat prompts, the
same concurrency cap, greedy decoding, and exactly --max-tokens tokens per request
(ignore_eos), so every side does the same engine work. The HTTP sides (`tokenmill serve`, and
`vllm serve` from .venv-vllm with `--peers vllm`: `make setup-vllm`) are driven by the async
official OpenAI client over loopback with streamed chat completions, which gives time to
first token (TTFT) as well as whole-request latency. Per side: requests/s over the whole run,
latency mean/p50/p99, TTFT p50/p99 (HTTP sides) and start-up seconds (until the server
answers /v1/models). Then the ratios: tokenmill over vLLM in requests/s and TTFT, and
tokenmill over the engine alone (serving overhead).

The engine alone runs first, in this process, and is shut down; the servers run one after the
other. The client shares the cores with the server, so on a small machine part of every HTTP
number is the client's own, on both sides alike. Numbers from a busy machine are only a smoke
check; take final ones on a quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"

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
    from pipeline.engine_setup import engine_settings
    from pipeline.openai.chat import load_tokenizer, render_prompt
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


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def http_workload(base_url: str, model: str, args: argparse.Namespace) -> dict[str, float]:
    """The chats as streamed chat completions through the OpenAI client: rps, latency, TTFT."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=600)
    ttfts: list[float] = []

    def job(chat: list[dict[str, str]], record: bool = True):
        async def call() -> None:
            start = time.perf_counter()
            first = None
            tokens = 0
            stream = await client.chat.completions.create(
                model=model,
                messages=chat,
                max_tokens=args.max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - start
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            assert tokens == args.max_tokens, tokens
            if record and first is not None:
                ttfts.append(first)

        return call

    async def run() -> tuple[list[float], float]:
        chats = prompts(args.requests)
        await job(chats[0], record=False)()  # warm-up: first-call costs out of the numbers
        return await bounded(args.concurrency, [job(c) for c in chats])

    latencies, wall = asyncio.run(run())
    return {
        **summarize(latencies, wall),
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p99_s": _pct(ttfts, 0.99),
    }


def bench_serve(model_dir: Path, work: Path, args: argparse.Namespace) -> dict[str, float]:
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
        "http": {
            "cpus_per_ingress": 0.25,
            "access_log": args.access_log,
            "one_hop": args.one_hop,
            "direct_ingress": args.direct_ingress,
        },
    }
    path = work / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    started = time.perf_counter()
    server = start_server(path, {"TOKENMILL_API_KEYS": API_KEY}, [])
    startup = time.perf_counter() - started
    try:
        result = http_workload(server.api_url, "bench", args)
    finally:
        server.stop()
    return {**result, "startup_s": startup}


def bench_vllm_serve(model_dir: Path, work: Path, args: argparse.Namespace) -> dict[str, float]:
    """vLLM's own OpenAI server (its CPU build, default settings: compiled graphs) on the
    same model and limits, in its own environment."""
    import httpx

    from tests.e2e.serve_fixtures import free_port

    if not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_PYTHON} not found: `make setup-vllm` first, or drop --peers vllm")
    port = free_port()
    command = [
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        "bench",
        "--port",
        str(port),
        "--api-key",
        API_KEY,
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        str(args.concurrency),
        "--max-num-batched-tokens",
        "512",
    ]
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the tiny model needs far less
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
    }
    log = (work / "vllm-serve.log").open("w")
    started = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}/v1"
        deadline = started + 600
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"vllm serve exited ({proc.returncode}); see {log.name}")
            try:
                headers = {"Authorization": f"Bearer {API_KEY}"}
                if httpx.get(f"{base}/models", headers=headers, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() > deadline:
                raise SystemExit("vllm serve did not come up within 600 s")
            time.sleep(1)
        startup = time.perf_counter() - started
        result = http_workload(base, "bench", args)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    return {**result, "startup_s": startup}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    # tiny-hd32: vLLM's CPU attention needs a head dimension of at least 32.
    parser.add_argument("--size", choices=("tiny-hd32", "tiny", "small"), default="tiny-hd32")
    parser.add_argument(
        "--peers",
        default="engine,vllm",
        help="comma-separated sides to compare tokenmill serve with: engine (alone), vllm",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each engine")
    parser.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="keep Serve's per-request access log lines (http.access_log)",
    )
    parser.add_argument(
        "--one-hop",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run tokenmill serve with http.one_hop (the engine inside the ingress replica)",
    )
    parser.add_argument(
        "--direct-ingress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="http.direct_ingress of tokenmill serve (HAProxy straight to the replicas, the "
        "default); --no-direct-ingress: through Serve's proxy actor",
    )
    parser.add_argument("--out", type=Path, help="also write the results here as JSON")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    from engines.tiny import make_tiny_model

    peers = {p.strip() for p in args.peers.split(",") if p.strip()}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny_model(work / "model", arch="llama", size=args.size)
        engine = bench_engine(model_dir, args) if "engine" in peers else None
        served = bench_serve(model_dir, work, args)
        vllm = bench_vllm_serve(model_dir, work, args) if "vllm" in peers else None
    result: dict = {
        "settings": vars(args) | {"out": str(args.out) if args.out else None},
        "serve": served,
    }
    if engine is not None:
        result["engine"] = engine
        result["overhead_mean_s"] = served["mean_s"] - engine["mean_s"]
        result["overhead_p50_s"] = served["p50_s"] - engine["p50_s"]
        result["throughput_vs_engine"] = served["requests_per_s"] / engine["requests_per_s"]
    if vllm is not None:
        result["vllm_serve"] = vllm
        result["requests_per_s_vs_vllm"] = served["requests_per_s"] / vllm["requests_per_s"]
        result["ttft_p50_vs_vllm"] = served["ttft_p50_s"] / vllm["ttft_p50_s"]
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
