"""GPT-OSS decode speed in the reference engine on CPU: its attention (sinks, sliding window)
through the paged kernel against the masked SDPA paths it took before the kernel had them, side
by side in one run.

    .venv/bin/python tests/benchmarks/bench_gpt_oss_attention.py [--size small|tiny]
        [--batches 1,16,64] [--prompt-len 256] [--max-tokens 64] [--dtype float32|bfloat16]
        [--threads 1] [--repeat 3] [--variants kernel,masked]

The model is engines.dev.tiny's GPT-OSS of --size (`small`: 8 layers, hidden 512, 8 query and
2 KV heads of 64, a window of 8 keys in every other layer, 8 experts top-2), built once into
~/.cache/tokenmill/bench/gpt_oss-<size> (where `tokenmill bench --arch gpt_oss` builds it).
For each batch size all requests are submitted at once: random prompts of --prompt-len ids,
greedy, ignore_eos, exactly --max-tokens tokens each, prefix caching off (every run computes
the same work). Variants, on one engine, switched between runs:
- kernel: the engine as it is: every chunk through the paged CPU kernel, with each layer's
  sinks and window;
- masked: the runner's paged kernel off (ModelRunner._paged_kernel), so attention takes the
  SDPA paths: decode groups over gathered blocks and SDPA per prefill chunk, the window as a
  mask and the sinks through attend_with_sinks. That is the path GPT-OSS took on CPU before
  the kernel took sinks and windows (the other CPU kernels, norms, RoPE, SiLU, stay on in
  both). `--variants masked` run against a checkout from before then measures that code
  itself (there the switch is already off for GPT-OSS).
Reported per batch size and variant: decode tokens/s (tokens of the steps with no prefill over
those steps' summed time, from the step records), output tokens/s over the whole run and per
CPU second of the process (prefill included; on a shared machine the least moved by other
load), and the kernel / masked ratios of decode tokens/s and of output tokens per CPU second.
Each figure is the best of --repeat runs (the repeats go round the variants in turn, so a
burst of load elsewhere hits both alike); a warm-up run of each variant goes first. Also
printed: the share of generated tokens on which the variants agree. The two paths round
differently in the last bits of fp32 and a random model's layers amplify that, so near-ties
part some greedy sequences; the equality tests hold both paths to transformers' ids.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path

VARIANTS = ("kernel", "masked")


@dataclass(frozen=True)
class Run:
    decode_tokens_per_s: float  # pure-decode steps only
    output_tokens_per_s: float  # first submission to last finish
    # Output tokens per CPU second of this process over the run: what other load on a shared
    # machine moves least (with one thread, waiting for a core is not counted).
    output_tokens_per_cpu_s: float
    outputs: list[list[int]]


def build_model(size: str) -> Path:
    from engines.dev.tiny import make_tiny_model

    out = Path.home() / ".cache" / "tokenmill" / "bench" / f"gpt_oss-{size}"
    if not (out / "config.json").exists():
        make_tiny_model(out, arch="gpt_oss", size=size)  # type: ignore[arg-type]
    return out


def workload(count: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(count)]


def set_variant(engine, variant: str) -> None:
    """Between runs (the engine idle): the runner reads the switch as it prepares each step."""
    from engines.reference.model.cpu_kernels import use_kernels

    engine.runner._paged_kernel = variant == "kernel" and use_kernels(engine.runner.device)


def run_once(engine, prompts: list[list[int]], max_tokens: int) -> Run:
    from engines.api import GenerationRequest, SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = [GenerationRequest(list(p), sampling) for p in prompts]

    async def generate_all():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    engine.drain_step_records()  # only this run's steps
    start, cpu_start = time.monotonic(), time.process_time()
    results = asyncio.run(generate_all())
    seconds, cpu_seconds = time.monotonic() - start, time.process_time() - cpu_start
    records = engine.drain_step_records()
    if any(not r.ok or r.completion_tokens != max_tokens for r in results):
        raise RuntimeError("a request failed or stopped early")
    decode = [rec for rec in records if not rec.prefill_tokens and rec.decode_tokens]
    decode_s = sum(rec.end - rec.start for rec in decode)
    decode_tokens = sum(sum(rec.decode_tokens.values()) for rec in decode)
    output_tokens = sum(r.completion_tokens for r in results)
    return Run(
        decode_tokens_per_s=decode_tokens / decode_s if decode_s else 0.0,
        output_tokens_per_s=output_tokens / seconds,
        output_tokens_per_cpu_s=output_tokens / cpu_seconds,
        outputs=[r.output_token_ids for r in results],
    )


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(sum(x == y for x, y in zip(p, q, strict=True)) for p, q in zip(a, b, strict=True))
    return same / max(1, sum(len(p) for p in a))


def best_of(runs: list[Run]) -> Run:
    """Each figure's best over the runs (a burst of other load slows a run, never speeds it)."""
    return Run(
        decode_tokens_per_s=max(r.decode_tokens_per_s for r in runs),
        output_tokens_per_s=max(r.output_tokens_per_s for r in runs),
        output_tokens_per_cpu_s=max(r.output_tokens_per_cpu_s for r in runs),
        outputs=runs[0].outputs,
    )


def bench_batch(engine, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Run]:
    runs: dict[str, list[Run]] = {variant: [] for variant in args.variants}
    for _ in range(args.repeat):
        for variant in args.variants:
            set_variant(engine, variant)
            runs[variant].append(run_once(engine, prompts, args.max_tokens))
    return {variant: best_of(found) for variant, found in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="of: kernel, masked")
    args = parser.parse_args()
    args.variants = args.variants.split(",")
    if not set(args.variants) <= set(VARIANTS):
        parser.error(f"--variants: choose from {', '.join(VARIANTS)}")

    import json

    import torch

    from engines.reference.engine import ReferenceEngine
    from engines.reference.model.cpu_kernels import kernels_available

    torch.set_num_threads(args.threads)
    if not kernels_available():
        raise SystemExit("the CPU kernels cannot be built here: nothing to compare")
    model = build_model(args.size)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    batches = [int(b) for b in args.batches.split(",")]
    engine = ReferenceEngine(
        str(model),
        dtype=args.dtype,
        num_threads=args.threads,
        max_batch_size=max(batches),
        kv_cache_tokens=max(batches) * (args.prompt_len + args.max_tokens + 16),
        enable_prefix_caching=False,
    )
    print(
        f"gpt_oss-{args.size} {args.dtype}, {args.threads} thread(s), prompts of "
        f"{args.prompt_len} ids, {args.max_tokens} tokens each, best of {args.repeat}"
    )
    try:
        warm = workload(2, 32, vocab, seed=99)
        for variant in args.variants:
            set_variant(engine, variant)
            run_once(engine, warm, 4)
        for batch in batches:
            best = bench_batch(engine, workload(batch, args.prompt_len, vocab), args)
            for variant, run in best.items():
                print(
                    f"batch {batch:3d} {variant:6s}: decode {run.decode_tokens_per_s:8.1f} tok/s, "
                    f"output {run.output_tokens_per_s:8.1f} tok/s, "
                    f"{run.output_tokens_per_cpu_s:8.1f} tok/CPU-s"
                )
            if len(best) == len(VARIANTS):
                kernel, masked = best["kernel"], best["masked"]
                ratio = kernel.decode_tokens_per_s / masked.decode_tokens_per_s
                cpu_ratio = kernel.output_tokens_per_cpu_s / masked.output_tokens_per_cpu_s
                same = agreement(kernel.outputs, masked.outputs)
                print(
                    f"batch {batch:3d} kernel / masked: decode {ratio:.2f}x, output per CPU-s "
                    f"{cpu_ratio:.2f}x (ids agree {same:.1%})"
                )
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
