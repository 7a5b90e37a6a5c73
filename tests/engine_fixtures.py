"""Shared helpers for the reference-engine tests: tiny models built once per test session,
prompts, and the transformers greedy baseline the engine is compared against."""

from __future__ import annotations

import asyncio
import random
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from engines.api import GenerationRequest, GenerationResult, SamplingParams

# (arch, tied) -> model dir; one build per session however many modules ask.
_MODELS: dict[tuple[str, bool], Path] = {}
_BASE: list[Path] = []


def tiny_model(arch: str = "llama", tied: bool = False) -> Path:
    """A tiny random HF model of `arch`, built on first use and reused for the session."""
    key = (arch, tied)
    if key not in _MODELS:
        from engines.dev.tiny import make_tiny_model

        if not _BASE:
            _BASE.append(Path(tempfile.mkdtemp(prefix="tokenmill-engine-models-")))
        out = _BASE[0] / f"{arch}-{'tied' if tied else 'untied'}"
        _MODELS[key] = make_tiny_model(out, arch=arch, tie_word_embeddings=tied)
    return _MODELS[key]


@pytest.fixture(scope="session")
def llama_dir() -> Path:
    return tiny_model("llama")


# What torch raises where oneDNN cannot take bf16 weights (a CPU with neither AVX-512 BW/VL/DQ
# nor AVX-NE-CONVERT, e.g. an AVX2-only EPYC).
ONEDNN_BF16_REFUSAL = (
    "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, "
    "avx512vl and avx512dq"
)


def cpu_without_onednn_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this process's oneDNN refuse bf16 weights as it does on such a CPU (the same op, the
    same error), whatever CPU the test runs on; the engine's once-per-process trial of what
    the CPU takes starts afresh for the test (and its old answer comes back after)."""
    import functools

    import torch

    from engines.reference.model import linear

    real = torch.ops.mkldnn._reorder_linear_weight

    def reorder(weight, *args, **kwargs):
        if weight.dtype == torch.bfloat16:
            raise RuntimeError(ONEDNN_BF16_REFUSAL)
        return real(weight, *args, **kwargs)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", reorder)
    monkeypatch.setattr(
        linear, "_trial_refusal", functools.cache(linear._trial_refusal.__wrapped__)
    )
    monkeypatch.setattr(linear, "_log_fallback", functools.cache(linear._log_fallback.__wrapped__))


def rope_config_fields(params: dict) -> dict:
    """RoPE settings (`rope_parameters`, transformers 5's spelling) as the installed
    transformers writes them in config.json: 4.x (TensorRT-LLM 1.2 pins 4.57.1) spells them
    rope_theta + rope_scaling."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": params}
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_theta": params["rope_theta"], "rope_scaling": scaling}


def varied_prompts(
    count: int, seed: int = 0, vocab: int = 1000, shared_prefix: int = 40
) -> list[list[int]]:
    """Prompts of 1..80 tokens; every other one starts with a shared prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    prompts = []
    for i in range(count):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
        prompts.append(prefix + tail if i % 2 else tail + [rng.randrange(3, vocab)] * (i % 3))
    return prompts


def greedy_requests(prompts: Sequence[list[int]], seed: int = 1) -> list[GenerationRequest]:
    rng = random.Random(seed)
    return [
        GenerationRequest(
            list(p),
            SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0, ignore_eos=True),
            request_id=f"r{i}",
        )
        for i, p in enumerate(prompts)
    ]


def hf_greedy(
    model_dir: Path, requests: Sequence[GenerationRequest], dtype: str = "float32"
) -> list[list[int]]:
    """transformers `generate(do_sample=False)`, one prompt at a time, EOS ignored."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: run to max_new_tokens
    outputs = []
    with torch.inference_mode():
        for request in requests:
            ids = torch.tensor([request.prompt_token_ids])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=request.sampling.max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


def run_all(
    engine, requests: Sequence[GenerationRequest], stagger_s: float = 0.0
) -> list[GenerationResult]:
    """Submit every request (all at once, or `stagger_s` apart) and wait for all results."""

    async def main() -> list[GenerationResult]:
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(engine.generate(request)))
            if stagger_s:
                await asyncio.sleep(stagger_s)
        return await asyncio.gather(*tasks)

    return asyncio.run(main())


def check_speculative_run(results, expected, records, stats, variant: str) -> None:
    """What every speculative run of the equality tests must show: exactly the greedy ids of
    the run without speculation, some proposals accepted, every KV block back, step records
    that agree with the results and charge each verified position (1 + k) to its row, a
    preemption in the preempting variant, and the cost split conserved."""
    import pytest

    from pipeline.cost import split_steps

    assert [r.finish_reason for r in results] == ["length"] * len(results)
    mismatched = [
        (r.request_id, exp, r.output_token_ids)
        for r, exp in zip(results, expected, strict=True)
        if r.output_token_ids != exp
    ]
    assert not mismatched, mismatched[:2]
    accepted = sum(r.spec_accepted_tokens for r in results)
    proposed = sum(r.spec_proposed_tokens for r in results)
    assert 0 < accepted <= proposed
    assert stats.kv_blocks_used == 0  # rolled-back blocks all came back
    assert sum(sum(rec.spec_proposed_tokens.values()) for rec in records) == proposed
    assert sum(sum(rec.spec_accepted_tokens.values()) for rec in records) == accepted
    for r in results:
        decode = sum(rec.decode_tokens.get(r.request_id, 0) for rec in records)
        assert decode == r.completion_tokens + r.spec_proposed_tokens - r.spec_accepted_tokens
    if variant == "chunked-preempting":
        assert stats.num_preemptions > 0
    if variant == "default":
        # The rows share every step's time (a draft's forwards included): nothing lost.
        seconds = split_steps(records)
        busy = sum(rec.end - rec.start for rec in records)
        assert sum(seconds.values()) == pytest.approx(busy, rel=1e-9)


@dataclass
class AttentionPaths:
    """Which attention path the reference model's layers took (count_attention_paths)."""

    kernel: int = 0  # calls of the paged CPU kernel
    kernel_sinks: int = 0  # of those, with attention sinks
    kernel_window: int = 0  # of those, with a sliding window
    masked_sinks: int = 0  # calls of attend_with_sinks: the SDPA paths' sink attention


def count_attention_paths(monkeypatch: pytest.MonkeyPatch) -> AttentionPaths:
    """Count the paged kernel's calls (and which carry sinks and a window) and the masked SDPA
    sink path's, for the rest of the test: an equality test then shows which path it checked
    (the engine's step thread runs in this process, through these module attributes)."""
    from engines.reference.model import cpu_kernels, model

    paths = AttentionPaths()
    kernel, masked = cpu_kernels.paged_attention, model.attend_with_sinks

    def counted_kernel(*args, sinks=None, window=None, **kwargs) -> None:
        paths.kernel += 1
        paths.kernel_sinks += sinks is not None
        paths.kernel_window += bool(window)
        kernel(*args, sinks=sinks, window=window, **kwargs)

    def counted_masked(*args, **kwargs):
        paths.masked_sinks += 1
        return masked(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "paged_attention", counted_kernel)
    monkeypatch.setattr(model, "attend_with_sinks", counted_masked)
    return paths


def check_attention_path(arch: str, paths: AttentionPaths, kernel: bool) -> None:
    """A run's attention took the path meant: with `kernel` (CPU, kernels built) every layer's
    through the paged kernel, a GPT-OSS model's with its sinks in every layer and its window in
    the sliding ones (every other layer); else the SDPA paths, GPT-OSS's sinks through
    attend_with_sinks."""
    gpt_oss = arch == "gpt_oss"
    if kernel:
        assert paths.kernel > 0 and paths.masked_sinks == 0, paths
        assert paths.kernel_sinks == (paths.kernel if gpt_oss else 0), paths
        assert paths.kernel_window == (paths.kernel // 2 if gpt_oss else 0), paths
    else:
        assert paths.kernel == 0, paths
        assert (paths.masked_sinks > 0) == gpt_oss, paths
