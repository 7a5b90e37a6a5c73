"""Reference engine on CUDA: an FP8 export against the bf16 checkpoint it came from.

    python tests/gpu/bench_fp8_cuda.py --size small --num-requests 64 --max-tokens 128

Builds a tiny model (engines.dev.tiny), quantizes it to FP8 on the GPU (tokenmill's build step,
quality gate reported), then runs the same greedy workload through the reference engine on
both checkpoints and prints one JSON line per checkpoint: generated tokens/s, wall seconds,
and the greedy agreement of FP8 with bf16. The reference engine dequantizes FP8 weights and
computes in bf16, so this measures correctness and overhead of the FP8 path, not FP8 GEMM
speed (that is TensorRT-LLM's job). Not run in CI: no GPU is lent to the build machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path


def run_engine(model: Path, prompts: list[list[int]], max_tokens: int) -> tuple[list, float]:
    from engines import GenerationRequest, SamplingParams, load_engine

    engine = load_engine("reference", model=str(model), device="cuda", dtype="bfloat16")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def go():
        return await asyncio.gather(
            *(engine.generate(GenerationRequest(p, params)) for p in prompts)
        )

    try:
        asyncio.run(go())  # warm-up (allocator, kernels)
        started = time.perf_counter()
        results = asyncio.run(go())
        seconds = time.perf_counter() - started
    finally:
        engine.shutdown()
    return results, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from engines.dev.tiny import make_tiny_model
    from engines.quantize.artifacts import build_or_reuse
    from engines.quantize.calibration import sample_text
    from engines.quantize.config import QuantizationSpec

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    with tempfile.TemporaryDirectory() as tmp:
        bf16 = make_tiny_model(Path(tmp) / "bf16", size=args.size, torch_dtype="bfloat16")
        spec = QuantizationSpec(format="fp8", device="cuda", allow_quality_failure=True)
        fp8 = build_or_reuse(bf16, str(Path(tmp) / "fp8"), spec)
        tok = AutoTokenizer.from_pretrained(bf16)
        text = " ".join(sample_text(4000, seed=5))
        ids = tok(text).input_ids
        step = args.prompt_tokens
        prompts = [ids[i * step : (i + 1) * step] for i in range(args.num_requests)]
        outputs = {}
        for name, path in (("bf16", bf16), ("fp8", Path(fp8.uri))):
            results, seconds = run_engine(path, prompts, args.max_tokens)
            outputs[name] = [r.output_token_ids for r in results]
            tokens = sum(r.completion_tokens for r in results)
            print(
                json.dumps(
                    {
                        "checkpoint": name,
                        "gpu": torch.cuda.get_device_name(),
                        "requests": len(prompts),
                        "generated_tokens": tokens,
                        "seconds": round(seconds, 3),
                        "tokens_per_s": round(tokens / seconds, 1),
                    }
                )
            )
        same = sum(
            a == b
            for x, y in zip(outputs["bf16"], outputs["fp8"], strict=True)
            for a, b in zip(x, y, strict=True)
        )
        print(
            json.dumps(
                {
                    "fp8_vs_bf16_token_agreement": round(same / sum(map(len, outputs["bf16"])), 3),
                    "quality_gate": {k: fp8.report[k] for k in ("token_agreement", "mean_kl")},
                }
            )
        )


if __name__ == "__main__":
    main()
