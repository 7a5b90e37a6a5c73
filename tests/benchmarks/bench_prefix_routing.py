"""Prefix-aware routing, measured: the share of prompt tokens served from the prefix cache
with `replicas.routing: prefix` and with Serve's load-only routing, same requests.

    .venv/bin/python tests/benchmarks/bench_prefix_routing.py [--replicas 2] [--prefixes 4]
        [--per-prefix 16] [--concurrency 8] [--out result.json]

Each of --prefixes system prompts (about 100 tokens, distinct from the first token) is shared
by --per-prefix chats with a short distinct user message, sent in a shuffled order at
--concurrency through the official OpenAI client to one `tokenmill serve` with --replicas
engine replicas of a tiny model. Per routing mode: cached tokens / prompt tokens (from each
response's usage), requests/s, and how many replicas each prefix touched (x-tokenmill-replica).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

API_KEY = "bench-key"
WORDS = ("river", "bridge", "market", "harbour", "letter", "garden", "window", "story")


def chats(prefixes: int, per_prefix: int, seed: int = 0) -> list[tuple[int, list[dict]]]:
    rng = random.Random(seed)
    out = []
    for p in range(prefixes):
        system = f"System {p}. " + " ".join(rng.choice(WORDS) for _ in range(60))
        for i in range(per_prefix):
            user = f"Question {i}: the {WORDS[(i + p) % len(WORDS)]}?"
            out.append(
                (p, [{"role": "system", "content": system}, {"role": "user", "content": user}])
            )
    rng.shuffle(out)
    return out


def run_mode(model_dir: Path, work: Path, routing: str, args: argparse.Namespace) -> dict:
    import openai

    from tests.e2e.serve_fixtures import start_server

    config = {
        "models": [
            {
                "name": "bench",
                "model": {"path": str(model_dir)},
                "engine": {
                    "kind": "reference",
                    "device": "cpu",
                    "max_batch_size": 16,
                    "max_model_len": 512,
                    "extra": {"num_threads": 1},
                },
                "replicas": {
                    "cpus_per_replica": 0.25,
                    "min_replicas": args.replicas,
                    "max_replicas": args.replicas,
                    "routing": routing,
                },
            }
        ],
        "http": {"cpus_per_ingress": 0.25},
    }
    path = work / f"serve-{routing}.yaml"
    path.write_text(yaml.safe_dump(config))
    server = start_server(path, {"TOKENMILL_API_KEYS": API_KEY}, [])
    try:
        client = openai.AsyncOpenAI(base_url=server.api_url, api_key=API_KEY, max_retries=0)
        gate = asyncio.Semaphore(args.concurrency)
        replicas_of: dict[int, set[str]] = {}
        totals = {"prompt": 0, "cached": 0}

        async def one(prefix: int, messages: list[dict]) -> None:
            async with gate:
                raw = await client.chat.completions.with_raw_response.create(
                    model="bench", messages=messages, max_tokens=4, temperature=0
                )
                reply = raw.parse()
                replicas_of.setdefault(prefix, set()).add(raw.headers["x-tokenmill-replica"])
                totals["prompt"] += reply.usage.prompt_tokens
                totals["cached"] += reply.usage.prompt_tokens_details.cached_tokens or 0

        async def run() -> float:
            work_items = chats(args.prefixes, args.per_prefix)
            start = time.perf_counter()
            await asyncio.gather(*(one(p, m) for p, m in work_items))
            return time.perf_counter() - start

        wall = asyncio.run(run())
    finally:
        server.stop()
    requests = args.prefixes * args.per_prefix
    return {
        "cached_share": totals["cached"] / totals["prompt"],
        "requests_per_s": requests / wall,
        "replicas_per_prefix": sum(len(v) for v in replicas_of.values()) / len(replicas_of),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--per-prefix", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from engines.dev.tiny import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny_model(work / "model", arch="llama")
        result = {
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "prefix": run_mode(model_dir, work, "prefix", args),
            "load": run_mode(model_dir, work, "load", args),
        }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
