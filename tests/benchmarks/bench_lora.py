"""LoRA adapters in the reference engine: a batch spread over `--adapters` adapters against the
same batch on the base model alone, side by side in one run.

    .venv/bin/python tests/benchmarks/bench_lora.py [--size tiny|small] [--adapters 8]
        [--rank 16] [--targets qkvo|all] [--batch 64] [--prompt-tokens 128]
        [--max-tokens 64] [--threads 2] [--repeat 3]

One engine with the adapters loaded (`max_loras` = --adapters, so all stay in their slots)
runs the batch twice per repeat: every request on the base model, then request i on adapter
i mod --adapters (the same prompts and lengths). A third variant, an engine without
`lora_adapters` (its projections unwrapped), shows what merely configuring adapters costs.
Greedy, ignore_eos, exactly --max-tokens each, all submitted at once. Printed: output tokens/s
over the generation window (first submission to last finish) and the ratio to the base model
on the adapter engine. The fastest of --repeat runs counts; the repeats go round the variants
in turn, so a burst of load elsewhere on the machine hits them alike.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

TARGETS = {
    "qkvo": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}


def run_batch(engine, prompts: list[list[int]], max_tokens: int, adapters: list[str | None]):
    from engines.api import GenerationRequest, SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = [
        GenerationRequest(p, sampling, request_id=f"r{i}", adapter=adapters[i % len(adapters)])
        for i, p in enumerate(prompts)
    ]

    async def go():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    started = time.monotonic()
    results = asyncio.run(go())
    elapsed = time.monotonic() - started
    bad = [r.error for r in results if not r.ok]
    assert not bad, bad[:2]
    return sum(r.completion_tokens for r in results) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", choices=sorted(TARGETS), default="qkvo")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from engines.dev.lora import make_lora_adapter
    from engines.dev.tiny import make_tiny_model
    from engines.reference.engine import ReferenceEngine

    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    model = make_tiny_model(work / "model", arch="llama", size=args.size)
    names = [f"a{i}" for i in range(args.adapters)]
    sources = {
        name: str(
            make_lora_adapter(
                work / name, model, rank=args.rank, targets=TARGETS[args.targets], seed=i
            )
        )
        for i, name in enumerate(names)
    }
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, 1000) for _ in range(args.prompt_tokens)] for _ in range(args.batch)
    ]
    settings = {
        "num_threads": args.threads,
        "max_batch_size": args.batch,
        "max_model_len": args.prompt_tokens + args.max_tokens + 8,
        "enable_prefix_caching": False,
    }
    with_lora = ReferenceEngine(
        str(model),
        lora_adapters=sources,
        max_loras=args.adapters,
        max_lora_rank=args.rank,
        **settings,
    )
    plain = ReferenceEngine(str(model), **settings)
    variants = {
        "base, no adapters configured": (plain, [None]),
        "base, adapter engine": (with_lora, [None]),
        f"{args.adapters} adapters, r={args.rank} {args.targets}": (with_lora, names),
    }
    best: dict[str, float] = {}
    try:
        for engine, adapters in variants.values():  # warm-up: kernels, caches, adapters read
            run_batch(engine, prompts[:8], 4, adapters)
        for _ in range(args.repeat):
            for label, (engine, adapters) in variants.items():
                rate = run_batch(engine, prompts, args.max_tokens, adapters)
                best[label] = max(best.get(label, 0.0), rate)
    finally:
        with_lora.shutdown()
        plain.shutdown()
    base = best["base, adapter engine"]
    print(
        f"model {args.size}, batch {args.batch}, prompt {args.prompt_tokens}, "
        f"output {args.max_tokens}, threads {args.threads}, best of {args.repeat}"
    )
    for label, rate in best.items():
        print(f"{label:<36} {rate:8.1f} output tok/s  {rate / base:5.2f}x")


if __name__ == "__main__":
    main()
