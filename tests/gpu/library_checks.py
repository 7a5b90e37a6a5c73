"""TensorRT-LLM's own behaviours that the CPU stand-in copies (docs/engines.md, "TensorRT-LLM as
it behaves"), checked on the real library by tests/gpu/device_check.py:

1. Sampling under speculation: sampled rows (temperature 1, top_k 50) under n-gram speculation
   differ from the greedy rows (an Eagle-3 head or MTP layers need a trained checkpoint; the
   adapter sets allow_advanced_sampling for them and the stand-in's tests cover the rest).
2. Logprobs of sampled rows: every sampled row with top_k (what the adapter admits on 1.2)
   carries its tokens' logprobs; and how often the library itself leaves the sampled token
   out of the top 1 it returns (the reason the adapter asks for top_k of them).
3. CUDA graphs: GPU memory in use after loading with graphs captured up to the adapter's
   default (256), up to TensorRT-LLM's own batch of 2,048, and with none, with a fixed KV
   cache so the difference is the graphs', and the seconds each load took.

With the stand-in (`standin=True`, CPU) the same code runs in tests/integration, so the script
cannot rot between GPU runs; memory is then None.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from engines.api import GenerationRequest, SamplingParams

# A fixed KV cache (tokens) for the memory comparison: the fraction-based default would hand
# whatever the graphs leave to the KV cache, hiding their cost.
KV_CACHE_TOKENS = 65536
PROMPTS = [
    "The committee reviewed the proposal and",
    "Once the data arrived at the station, the crew",
    "In the long run, prices for storage",
    "She opened the notebook and wrote that",
]


def gpu_memory_mb() -> float | None:
    """Memory in use on GPU 0 as nvidia-smi reports it (the engine's workers are other
    processes, so torch's own counters would miss them); None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[0])


def _engine(model: Path, standin: bool, **settings: Any):
    from engines.trtllm import TrtllmEngine

    return TrtllmEngine(str(model), check_gpu=not standin, **settings)


def _prompts(model: Path, rows: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    return [ids[i % len(ids)] for i in range(rows)]


async def _generate(engine, prompts: list[list[int]], sampling: SamplingParams) -> list[Any]:
    return await asyncio.gather(
        *(
            engine.generate(GenerationRequest(list(p), sampling, f"r{i}"))
            for i, p in enumerate(prompts)
        )
    )


def sampling_under_speculation(
    model: Path, prompts: list[list[int]], max_tokens: int, standin: bool
):
    """Item 1: the share of rows whose sampled output differs from the greedy one."""
    engine = _engine(model, standin, speculative={"method": "ngram", "num_tokens": 4})
    try:
        greedy = asyncio.run(
            _generate(
                engine,
                prompts,
                SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            )
        )
        sampled = asyncio.run(
            _generate(
                engine,
                prompts,
                SamplingParams(max_tokens=max_tokens, temperature=1.0, top_k=50, ignore_eos=True),
            )
        )
    finally:
        engine.shutdown()
    errors = [r.error for r in greedy + sampled if r.error]
    differ = sum(
        g.output_token_ids != s.output_token_ids for g, s in zip(greedy, sampled, strict=True)
    )
    return {
        "rows": len(prompts),
        "sampled_differ_from_greedy": round(differ / len(prompts), 3),
        "errors": errors[:3],
    }


def sampled_logprobs(model: Path, prompts: list[list[int]], max_tokens: int, standin: bool):
    """Item 2: sampled rows with top_k get every token's logprob; and, asked of the library
    directly with logprobs=1 and no top_k, the share of positions whose sampled token it
    left out."""
    engine = _engine(model, standin)
    try:
        rows = asyncio.run(
            _generate(
                engine,
                prompts,
                SamplingParams(
                    max_tokens=max_tokens, temperature=1.0, top_k=20, ignore_eos=True, logprobs=1
                ),
            )
        )
        # The library as it is, past the adapter: its LLM, one logprob, plain temperature.
        import tensorrt_llm

        params = tensorrt_llm.SamplingParams(
            max_tokens=max_tokens, temperature=1.0, ignore_eos=True, logprobs=1
        )

        async def raw():
            outs = [engine._llm.generate_async(list(p), params) for p in prompts]
            return [await o.aresult() for o in outs]

        missing = positions = 0
        for out in asyncio.run(raw()):
            done = out.outputs[0]
            for token, entry in zip(done.token_ids, done.logprobs or [], strict=False):
                positions += 1
                missing += token not in entry
    finally:
        engine.shutdown()
    complete = sum(
        r.ok and r.logprobs is not None and len(r.logprobs) == r.completion_tokens for r in rows
    )
    return {
        "rows": len(rows),
        "rows_with_every_logprob": complete,
        "errors": [r.error for r in rows if r.error][:3],
        "library_sampled_token_left_out": round(missing / max(1, positions), 4),
    }


def cuda_graph_memory(model: Path, standin: bool) -> dict[str, Any]:
    """Item 3: memory in use and load seconds per CUDA graph setting, one engine at a time."""
    settings = {
        "default_256": {},
        "library_2048": {"cuda_graph_max_batch_size": 2048},
        "none": {"cuda_graphs": False},
    }
    base = gpu_memory_mb()
    out: dict[str, Any] = {"idle_mb": base}
    for name, extra in settings.items():
        started = time.monotonic()
        engine = _engine(
            model, standin, max_batch_size=2048, kv_cache_tokens=KV_CACHE_TOKENS, **extra
        )
        loaded = time.monotonic() - started
        used = gpu_memory_mb()
        engine.shutdown()
        out[name] = {"load_s": round(loaded, 1), "used_mb": used, "graphs": _graphs(extra)}
    if base is not None:
        for name in ("default_256", "library_2048"):
            out[name]["graphs_mb"] = round(out[name]["used_mb"] - out["none"]["used_mb"])
    return out


def _graphs(extra: dict[str, Any]) -> int:
    """How many batch sizes the library captures for these settings (its own generation)."""
    from tensorrt_llm.llmapi import CudaGraphConfig

    from engines.trtllm import cuda_graph_batch_size

    if extra.get("cuda_graphs") is False:
        return 0
    top = cuda_graph_batch_size(2048, extra.get("cuda_graph_max_batch_size"), 1)
    return len(CudaGraphConfig(max_batch_size=top, enable_padding=True).batch_sizes)


def run_all(model: Path, rows: int, max_tokens: int, standin: bool = False) -> dict[str, Any]:
    prompts = _prompts(model, rows)
    return {
        "sampling_under_speculation": sampling_under_speculation(
            model, prompts, max_tokens, standin
        ),
        "sampled_logprobs": sampled_logprobs(model, prompts, max_tokens, standin),
        "cuda_graph_memory": cuda_graph_memory(model, standin),
    }
