"""Embedding throughput, side by side: the reference engine's embed requests and vLLM's pooling
runner on the same model and the same token ids.

    .venv/bin/python tests/benchmarks/bench_embed.py [--size small] [--prompts 400]
        [--min-len 32] [--max-len 160] [--threads 2] [--rounds 3] [--max-num-tokens 2048]
        [--peers vllm,vllm-eager] [--out r.json]

Embedding is prefill only, so the figure is prompt tokens per second. Each side runs in its own
subprocess with the same torch thread count (vLLM's CPU worker bound to the same cores) and the
same per-forward token budget (`max_num_tokens`, vLLM's `max_num_batched_tokens`); every prompt
is submitted at once and the clock runs from the first submit to the last embedding, after the
model is loaded and one warm-up forward. Both sides pool the same way (last token, normalised:
vLLM's default for a decoder-only model and the reference engine's), and the run checks that
the two agree (largest difference of any value) so the work compared is the same work. vLLM
runs compiled (its default) and eager (`enforce_eager`); the peer is the faster. Rounds rotate
the order; the result is the median ratio of the rounds. vLLM comes from .venv-vllm
(`make setup-vllm`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def make_prompts(count: int, min_len: int, max_len: int, vocab: int) -> list[list[int]]:
    """Distinct random token ids (nothing for a prefix cache to reuse), lengths spread evenly."""
    rng = random.Random(0)
    return [
        [rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(count)
    ]


# ---- sides (each in its own subprocess) -------------------------------------------------------
def run_reference(spec: dict) -> dict:
    import asyncio

    from engines.api import EmbedParams, GenerationRequest
    from engines.reference.engine import ReferenceEngine

    engine = ReferenceEngine(
        spec["model"],
        num_threads=spec["threads"],
        dtype="float32",
        max_num_tokens=spec["max_num_tokens"],
    )
    params = EmbedParams(pooling="last", normalize=True)

    async def embed(prompts):
        return await asyncio.gather(
            *(engine.generate(GenerationRequest(p, embed=params)) for p in prompts)
        )

    try:
        asyncio.run(embed(spec["prompts"][:4]))  # warm-up
        start = time.monotonic()
        results = asyncio.run(embed(spec["prompts"]))
        wall = time.monotonic() - start
    finally:
        engine.shutdown()
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} embed requests failed: {bad[0]}")
    return {"wall_s": wall, "embeddings": [r.embedding for r in results[:8]]}


def run_vllm(spec: dict) -> dict:
    from vllm import LLM

    llm = LLM(
        model=spec["model"],
        runner="pooling",
        dtype="float32",
        enforce_eager=spec["eager"],
        max_model_len=spec["max_len"] + 16,
        max_num_batched_tokens=spec["max_num_tokens"],
        max_num_seqs=len(spec["prompts"]),
        kv_cache_memory_bytes=256 << 20,  # the default reserves most of the machine's memory
    )
    inputs = [{"prompt_token_ids": p} for p in spec["prompts"]]
    llm.embed(inputs[:4], use_tqdm=False)  # warm-up
    start = time.monotonic()
    outputs = llm.embed(inputs, use_tqdm=False)  # its default: last token, normalised
    wall = time.monotonic() - start
    return {"wall_s": wall, "embeddings": [list(o.outputs.embedding) for o in outputs[:8]]}


SIDES = {"reference": run_reference, "vllm": run_vllm, "vllm-eager": run_vllm}


def worker(side: str, spec_path: str, out_path: str) -> None:
    import torch

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    spec["eager"] = side == "vllm-eager"
    Path(out_path).write_text(json.dumps(SIDES[side](spec)))


# ---- driver -----------------------------------------------------------------------------------
def run_side(side: str, spec: dict, workdir: Path) -> dict:
    spec_path, out_path = workdir / f"{side}.spec.json", workdir / f"{side}.out.json"
    spec_path.write_text(json.dumps(spec))
    python = sys.executable if side == "reference" else str(VLLM_PYTHON)
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{spec['threads'] - 1}", "PYTHONPATH": str(REPO)}
    out_path.unlink(missing_ok=True)
    proc = subprocess.run(
        [python, __file__, "--worker", side, str(spec_path), str(out_path)],
        env={**os.environ, **env},
        cwd=REPO,
    )
    # vLLM's CPU build sometimes aborts in its own teardown after the results are written:
    # the results count, a side that wrote none does not.
    if not out_path.exists():
        raise RuntimeError(f"{side} wrote no results (exit status {proc.returncode})")
    return json.loads(out_path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", help="tiny-model preset (engines.dev.tiny)")
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=160)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-tokens", type=int, default=2048)
    parser.add_argument("--peers", default="vllm,vllm-eager")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--worker", nargs=3, metavar=("SIDE", "SPEC", "OUT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return

    from engines.dev.tiny import make_tiny_model

    workdir = Path(tempfile.mkdtemp(prefix="tokenmill-bench-embed-"))
    model = make_tiny_model(workdir / "model", arch="llama", size=args.size)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.prompts, args.min_len, args.max_len, vocab)
    tokens = sum(len(p) for p in prompts)
    spec = {
        "model": str(model),
        "prompts": prompts,
        "threads": args.threads,
        "max_num_tokens": args.max_num_tokens,
        "max_len": args.max_len,
    }
    sides = ["reference", *[p for p in args.peers.split(",") if p]]
    rounds: list[dict[str, float]] = []
    agreement: dict[str, float] = {}
    for r in range(args.rounds):
        order = sides[r % len(sides) :] + sides[: r % len(sides)]
        figures: dict[str, float] = {}
        outs = {}
        for side in order:
            outs[side] = run_side(side, spec, workdir)
            figures[side] = tokens / outs[side]["wall_s"]
            print(f"round {r + 1} {side}: {figures[side]:,.0f} prompt tokens/s", flush=True)
        for side in sides[1:]:
            diff = max(
                abs(a - b)
                for x, y in zip(
                    outs["reference"]["embeddings"], outs[side]["embeddings"], strict=True
                )
                for a, b in zip(x, y, strict=True)
            )
            agreement[side] = max(agreement.get(side, 0.0), diff)
        rounds.append(figures)

    peers = sides[1:]
    ratios = [f["reference"] / max(f[p] for p in peers) for f in rounds] if peers else []
    medians = {s: statistics.median(f[s] for f in rounds) for s in sides}
    print(
        f"\n{args.size}, {len(prompts)} prompts, {tokens:,} prompt tokens, {args.threads} threads"
    )
    for side in sides:
        print(f"  {side:12s} {medians[side]:10,.0f} prompt tokens/s (median of {args.rounds})")
    if ratios:
        print(
            f"  reference / best vLLM: {statistics.median(ratios):.2f}x "
            f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)}); largest difference of any "
            f"embedding value: {max(agreement.values()):.1e}"
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "size": args.size,
                    "prompts": len(prompts),
                    "prompt_tokens": tokens,
                    "threads": args.threads,
                    "rounds": rounds,
                    "median_tokens_per_s": medians,
                    "ratios": ratios,
                    "max_abs_difference": agreement,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
