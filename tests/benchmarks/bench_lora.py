"""LoRA adapters in the reference engine: a batch spread over `--adapters` adapters against the
same batch on the base model alone, side by side in one run.

    .venv/bin/python tests/benchmarks/bench_lora.py [--size tiny|small] [--adapters 8]
        [--rank 16] [--targets qkvo|all] [--batch 64] [--prompt-tokens 128]
        [--max-tokens 64] [--threads 2] [--repeat 3] [--peer vllm]

One engine with the adapters loaded (`max_loras` = --adapters, so all stay in their slots)
runs the batch twice per repeat: every request on the base model, then request i on adapter
i mod --adapters (the same prompts and lengths). A third variant, an engine without
`lora_adapters` (its projections unwrapped), shows what merely configuring adapters costs.
Greedy, ignore_eos, exactly --max-tokens each, all submitted at once. Printed: output tokens/s
over the generation window (first submission to last finish) and the ratio to the base model
on the adapter engine. The fastest of --repeat runs counts; the repeats go round the variants
in turn, so a burst of load elsewhere on the machine hits them alike.

--peer vllm: vLLM's CPU build (.venv-vllm, `make setup-vllm`) runs the same two batches with
the same adapters (enable_lora, max_loras, max_lora_rank; one LoRARequest per prompt, eager,
fp32) in a process of its own after ours, and the table adds its rows; the share of requests
whose greedy ids equal ours under the adapters is printed too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"

TARGETS = {
    "qkvo": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}


def run_batch(
    engine, prompts: list[list[int]], max_tokens: int, adapters: list[str | None], ids=None
):
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
    if ids is not None:
        ids[:] = [r.output_token_ids for r in results]
    return sum(r.completion_tokens for r in results) / elapsed


def vllm_worker(spec_path: str, out_path: str) -> None:
    """Under .venv-vllm: the spec's batches on vLLM with the same adapters."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        enable_lora=True,
        max_loras=len(spec["adapters"]),
        max_lora_rank=spec["rank"],
        max_model_len=spec["max_len"],
        max_num_seqs=len(spec["prompts"]),
        kv_cache_memory_bytes=512 << 20,  # the default reserves most of the machine's memory
    )
    sampling = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    names = list(spec["adapters"])
    requests = [LoRARequest(n, i + 1, spec["adapters"][n]) for i, n in enumerate(names)]
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]

    def run(lora: bool) -> tuple[float, list[list[int]]]:
        chosen = [requests[i % len(requests)] for i in range(len(prompts))] if lora else None
        started = time.monotonic()
        outs = llm.generate(prompts, sampling, lora_request=chosen, use_tqdm=False)
        elapsed = time.monotonic() - started
        ids = [list(o.outputs[0].token_ids) for o in outs]
        return sum(len(i) for i in ids) / elapsed, ids

    run(True)  # warm-up: every adapter loaded
    best = {"base": 0.0, "adapters": 0.0}
    ids: list[list[int]] = []
    for _ in range(spec["repeat"]):
        best["base"] = max(best["base"], run(False)[0])
        rate, ids = run(True)
        best["adapters"] = max(best["adapters"], rate)
    Path(out_path).write_text(json.dumps({"rates": best, "ids": ids}))


def run_vllm(spec: dict, work: Path) -> dict:
    spec_path, out_path = work / "vllm.spec.json", work / "vllm.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    subprocess.run(
        [str(VLLM_PYTHON), __file__, "--vllm-worker", str(spec_path), str(out_path)],
        env=env,
        cwd=REPO,
    )
    # vLLM's CPU build sometimes aborts in its own teardown after writing: the results count.
    if not out_path.exists():
        raise RuntimeError("vLLM wrote no results")
    return json.loads(out_path.read_text())


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--vllm-worker":
        vllm_worker(sys.argv[2], sys.argv[3])
        return
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
    parser.add_argument("--peer", choices=["none", "vllm"], default="none")
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
    ours: list[list[int]] = []
    try:
        for engine, adapters in variants.values():  # warm-up: kernels, caches, adapters read
            run_batch(engine, prompts[:8], 4, adapters)
        for _ in range(args.repeat):
            for label, (engine, adapters) in variants.items():
                rate = run_batch(engine, prompts, args.max_tokens, adapters, ours)
                best[label] = max(best.get(label, 0.0), rate)
    finally:
        with_lora.shutdown()
        plain.shutdown()
    agreement = None
    if args.peer == "vllm":
        spec = {
            "model": str(model),
            "adapters": sources,
            "rank": args.rank,
            "prompts": prompts,
            "max_tokens": args.max_tokens,
            "max_len": settings["max_model_len"],
            "repeat": args.repeat,
        }
        peer = run_vllm(spec, work)
        best["vLLM CPU: base"] = peer["rates"]["base"]
        best[f"vLLM CPU: {args.adapters} adapters"] = peer["rates"]["adapters"]
        agreement = sum(a == b for a, b in zip(ours, peer["ids"], strict=True)) / len(ours)
    base = best["base, adapter engine"]
    print(
        f"model {args.size}, batch {args.batch}, prompt {args.prompt_tokens}, "
        f"output {args.max_tokens}, threads {args.threads}, best of {args.repeat}"
    )
    for label, rate in best.items():
        print(f"{label:<36} {rate:8.1f} output tok/s  {rate / base:5.2f}x")
    if agreement is not None:
        print(f"greedy ids equal to vLLM's under the adapters: {agreement:.0%} of requests")


if __name__ == "__main__":
    main()
