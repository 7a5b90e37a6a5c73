"""Reference engine on a GPU against transformers (and vLLM when installed), at a real model size.

    python tests/gpu/bench_reference_cuda.py --shape qwen2-0.5b
    python tests/gpu/bench_reference_cuda.py --shape llama-8b --num-requests 256
    python tests/gpu/bench_reference_cuda.py --shape tiny --device cpu --dtype float32  # smoke

Builds a model of the chosen shape with random weights (on the device, in seconds; no download),
saves it as a Hugging Face checkpoint, and runs one seeded greedy workload (prompts of
--prompt-len tokens, max_tokens drawn from --max-tokens, EOS ignored) through:
- the reference engine (engine.kind reference), every request at once;
- transformers `generate`, batches of --hf-batch left-padded prompts (each batch runs to its
  longest max_tokens; only each request's own max_tokens count as useful tokens);
- vLLM through engine.kind vllm, when `vllm` imports (skipped otherwise, and said so).
Prints one JSON line per side (useful tokens/s, wall seconds, start-up seconds), the ratios, and
greedy parity with transformers on the first --parity-requests prompts run one at a time
(exact-equal share, equal first token share, share of tokens before the first divergence).
In bfloat16 parity is not exact (docs/engine.md, "bf16 parity"); in float32 it should be 1.0.
Not run in CI: no GPU is lent to the build machines; tests/integration runs the smoke shape on
CPU so that the script itself stays working.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from engines.dev.tiny import TinyModelSize

# Public model shapes (their config.json values; context capped at 8192), random weights:
# (arch, shape).
SHAPES: dict[str, tuple[str, TinyModelSize]] = {
    "tiny": ("llama", TinyModelSize(64, 176, 2, 4, 2, 1024, 8192)),
    "qwen2-0.5b": ("qwen2", TinyModelSize(896, 4864, 24, 14, 2, 151936, 8192)),
    "llama-1b": ("llama", TinyModelSize(2048, 8192, 16, 32, 8, 128256, 8192)),
    "qwen2-7b": ("qwen2", TinyModelSize(3584, 18944, 28, 28, 4, 152064, 8192)),
    "llama-8b": ("llama", TinyModelSize(4096, 14336, 32, 32, 8, 128256, 8192)),
}


@dataclass
class Side:
    side: str
    useful_tokens: int
    seconds: float
    load_seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds


def build_model(
    arch: str, shape: TinyModelSize, out: Path, device: str, dtype: str, seed: int = 0
) -> Path:
    """A random `arch` model of `shape` saved as a checkpoint in `out` (weights in `dtype`)."""
    import torch
    import transformers

    from engines.dev.tiny import shape_fields, train_tokenizer

    tokenizer = train_tokenizer(min(shape.vocab_size, 8192), seed)
    common = dict(
        vocab_size=max(shape.vocab_size, len(tokenizer)),
        **shape_fields(shape),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    if arch == "qwen2":
        config = transformers.Qwen2Config(**common, rope_theta=1000000.0)
        model_cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.LlamaConfig(**common, rope_theta=500000.0)
        model_cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    # Built on the device in the target dtype: an 8B model initialises in seconds on a GPU
    # where the CPU would take minutes and twice the memory.
    with torch.device(device):
        model = model_cls(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def workload(
    num: int, prompt_len: tuple[int, int], max_tokens: tuple[int, int], vocab: int, seed: int
) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(num)
    ]
    return prompts, [rng.randint(*max_tokens) for _ in range(num)]


def run_engine(
    kind: str, model: Path, prompts: list[list[int]], max_tokens: list[int], **settings
) -> tuple[Side, list[list[int]]]:
    from engines import GenerationRequest, SamplingParams, load_engine

    def requests(count: int | None = None):
        pairs = list(zip(prompts, max_tokens, strict=True))[:count]
        return [
            GenerationRequest(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
            for p, m in pairs
        ]

    async def run():
        # Loaded inside the loop: vLLM's engine binds to the loop it first runs on.
        engine = load_engine(kind, model=str(model), **settings)
        try:
            await asyncio.gather(*(engine.generate(r) for r in requests(8)))  # warm-up
            started = time.perf_counter()
            results = await asyncio.gather(*(engine.generate(r) for r in requests()))
            return engine.info.load_seconds, time.perf_counter() - started, results
        finally:
            engine.shutdown()

    load_s, seconds, results = asyncio.run(run())
    ids = [r.output_token_ids for r in results]
    useful = sum(len(i) for i in ids)
    return Side(kind, useful, seconds, load_s), ids


def load_hf(model: Path, device: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device)
    hf.generation_config.eos_token_id = None  # ignore EOS, like the engines
    return hf.eval(), time.perf_counter() - started


def run_hf(hf, load_s: float, prompts, max_tokens, batch: int, device: str) -> Side:
    import torch

    def go(count: int | None = None) -> int:
        useful = 0
        todo = list(zip(prompts, max_tokens, strict=True))[:count]
        for lo in range(0, len(todo), batch):
            part = todo[lo : lo + batch]
            width = max(len(p) for p, _ in part)
            ids = torch.zeros(len(part), width, dtype=torch.int64)
            mask = torch.zeros(len(part), width, dtype=torch.int64)
            for row, (p, _) in enumerate(part):  # left padding, as generate wants
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            hf.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max(m for _, m in part),
                do_sample=False,
                pad_token_id=0,
            )
            useful += sum(m for _, m in part)
        return useful

    with torch.inference_mode():
        go(min(batch, 8))  # warm-up
        _sync(device)
        started = time.perf_counter()
        useful = go()
        _sync(device)
    return Side("transformers", useful, time.perf_counter() - started, load_s)


def hf_greedy_one_by_one(hf, prompts, max_tokens, device: str) -> list[list[int]]:
    import torch

    out = []
    with torch.inference_mode():
        for p, m in zip(prompts, max_tokens, strict=True):
            ids = torch.tensor([p], device=device)
            gen = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=m,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(gen[0, len(p) :].tolist())
    return out


def parity(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, float]:
    prefix = total = 0
    for a, b in zip(ours, theirs, strict=True):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefix, total = prefix + k, total + len(b)
    n = len(theirs)
    return {
        "exact_share": sum(a == b for a, b in zip(ours, theirs, strict=True)) / n,
        "first_token_share": sum(a[:1] == b[:1] for a, b in zip(ours, theirs, strict=True)) / n,
        "prefix_token_share": prefix / total,
    }


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(64, 1024))
    parser.add_argument("--max-tokens", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument(
        "--max-num-tokens", type=int, default=8192, help="tokens per engine step, both engines"
    )
    parser.add_argument("--parity-requests", type=int, default=16)
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM even if installed")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu for a smoke run")
    arch, shape = SHAPES[args.shape]
    report: dict = {"shape": args.shape, "arch": arch, **asdict(shape), "dtype": args.dtype}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory(prefix="tokenmill-gpu-bench-") as tmp:
        model = build_model(arch, shape, Path(tmp) / args.shape, args.device, args.dtype, args.seed)
        prompts, max_tokens = workload(
            args.num_requests, args.prompt_len, args.max_tokens, shape.vocab_size, args.seed
        )
        context = max(args.prompt_len) + max(args.max_tokens)
        pool = sum(len(p) + m for p, m in zip(prompts, max_tokens, strict=True)) + 4096
        # The same caps for both engines: every request may run at once.
        limits = dict(
            max_model_len=context,
            max_batch_size=args.num_requests,
            max_num_tokens=args.max_num_tokens,
            dtype=args.dtype,
        )
        sides = []
        ref, ref_ids = run_engine(
            "reference",
            model,
            prompts,
            max_tokens,
            device=args.device,
            kv_cache_tokens=pool,
            **limits,
        )
        sides.append(ref)
        if not args.no_vllm and _vllm_available():
            vllm_side, _ = run_engine("vllm", model, prompts, max_tokens, **limits)
            sides.append(vllm_side)
        else:
            report["vllm"] = "not installed (or --no-vllm): skipped"
        hf, hf_load_s = load_hf(model, args.device, args.dtype)
        sides.append(run_hf(hf, hf_load_s, prompts, max_tokens, args.hf_batch, args.device))
        k = args.parity_requests
        theirs = hf_greedy_one_by_one(hf, prompts[:k], max_tokens[:k], args.device)
        report["parity_with_transformers"] = parity(ref_ids[:k], theirs)
    report["sides"] = {
        s.side: {
            "tokens_per_s": round(s.tokens_per_s, 1),
            "seconds": round(s.seconds, 3),
            "useful_tokens": s.useful_tokens,
            "load_seconds": round(s.load_seconds, 2),
        }
        for s in sides
    }
    report["reference_vs"] = {
        s.side: round(ref.tokens_per_s / s.tokens_per_s, 3) for s in sides if s is not ref
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main()
