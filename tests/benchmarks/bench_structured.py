"""What constrained decoding costs in the reference engine: output tokens/s with and without a
response_format, side by side in one run.

    .venv/bin/python tests/benchmarks/bench_structured.py [--size small] [--batch 64]
        [--max-tokens 128] [--threads 2] [--repeat 2]

The same `--batch` requests (random prompts of 16-64 tokens, temperature 0.8, seeded) run at
once, first as free text and then under each format. The formats are long on purpose, so that
every row runs to max_tokens under every format (the table shows the finish reasons) and the
batch stays `--batch` wide throughout: then the difference in tokens/s is the grammar's own
cost per token (the per-step bitmask fill for all constrained rows, masking the logits, each
matcher's advance), not a change of workload.

    free          ignore_eos: text until max_tokens
    json_schema   {"items": [at least 60 strings of up to 12 characters]}
    json_object   any JSON object (the model picks; often shorter)
    regex         60 lowercase words separated by spaces

Printed per format: output tokens, tokens/s over the generation window (first submission to
last finish, model load and the first compile excluded: one warm-up run goes first), the
overhead against free text, and the finish reasons. The fastest of --repeat runs counts.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import tempfile
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 60,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
REGEX = "[a-z]{2,8}( [a-z]{2,8}){59}"


def build_model(size: str) -> Path:
    from engines.dev.tiny import make_tiny_model

    out = Path(tempfile.gettempdir()) / f"tokenmill-bench-structured-{size}"
    if not (out / "config.json").exists():
        make_tiny_model(out, size=size)
    return out


def formats() -> dict[str, object]:
    from engines.api import ResponseFormat

    return {
        "free": None,
        "json_schema": ResponseFormat.json(SCHEMA),
        "json_object": ResponseFormat.json(),
        "regex": ResponseFormat("regex", regex=REGEX),
    }


async def run_once(engine, prompts, fmt, max_tokens: int):
    from engines.api import GenerationRequest, SamplingParams

    requests = [
        GenerationRequest(
            list(p),
            SamplingParams(
                max_tokens=max_tokens,
                temperature=0.8,
                seed=i,
                ignore_eos=fmt is None,
                response_format=fmt,
            ),
        )
        for i, p in enumerate(prompts)
    ]
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    return time.perf_counter() - start, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()

    from engines.reference.engine import ReferenceEngine

    model = build_model(args.size)
    engine = ReferenceEngine(
        str(model),
        num_threads=args.threads,
        max_batch_size=args.batch,
        max_num_tokens=4096,
        enable_prefix_caching=False,
    )
    vocab = engine.config.vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))] for _ in range(args.batch)
    ]
    rows = []
    try:
        for name, fmt in formats().items():
            asyncio.run(run_once(engine, prompts, fmt, args.max_tokens))  # warm-up, compile
            best = None
            for _ in range(args.repeat):
                seconds, results = asyncio.run(run_once(engine, prompts, fmt, args.max_tokens))
                tokens = sum(r.completion_tokens for r in results)
                if best is None or tokens / seconds > best[0]:
                    reasons = collections.Counter(r.finish_reason for r in results)
                    best = (tokens / seconds, tokens, seconds, dict(reasons))
            rows.append((name, *best))
    finally:
        engine.shutdown()

    free = rows[0][1]
    print(
        f"reference engine, {args.size} model, batch {args.batch}, max_tokens "
        f"{args.max_tokens}, {args.threads} threads"
    )
    print(f"{'format':<12} {'tokens':>7} {'tok/s':>8} {'overhead':>9}  finish reasons")
    for name, tps, tokens, _seconds, reasons in rows:
        overhead = 1 - tps / free
        print(f"{name:<12} {tokens:>7} {tps:>8.1f} {overhead:>8.1%}  {json.dumps(reasons)}")


if __name__ == "__main__":
    main()
