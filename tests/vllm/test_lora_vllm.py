"""LoRA adapters on vLLM (its CPU build, for real): the job's adapter settings become vLLM's
enable_lora / max_loras / max_lora_rank / max_cpu_loras, a request's adapter a LoRARequest,
and rows of two adapters in one batch, then the base model's, give transformers' greedy ids
with each adapter merged (and the reference engine's); an unknown adapter is that row's error.
(The reference engine mixes the base model's rows in too: test_reference_lora.py.)"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from engines import GenerationRequest, SamplingParams, load_engine
from tests.engine_fixtures import hf_greedy
from tests.vllm.test_parity import text_prompts

pytestmark = pytest.mark.vllm

# name -> (rank, alpha, targets, rslora): attention only, and every projection with rsLoRA.
ADAPTERS = {
    "attn": (8, 16, ("q_proj", "v_proj"), False),
    "all": (
        16,
        8,
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        True,
    ),
}


def test_mixed_adapters_equal_transformers_merged_and_the_reference_engine() -> None:
    from engines.dev.lora import make_lora_adapter, merge_lora
    from engines.dev.tiny import make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="tokenmill-lora-vllm-"))
    model = make_tiny_model(root / "llama", arch="llama", size="tiny-hd32")
    folders = {
        name: str(
            make_lora_adapter(
                root / name, model, rank=r, alpha=a, targets=t, use_rslora=rs, seed=30 + i
            )
        )
        for i, (name, (r, a, t, rs)) in enumerate(ADAPTERS.items())
    }
    names: list[str | None] = [None, "attn", "all"]
    prompts = text_prompts(model, 9)
    requests = [
        GenerationRequest(
            p,
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            request_id=f"r{i}",
            adapter=names[i % 3],
        )
        for i, p in enumerate(prompts)
    ]
    unknown = GenerationRequest(prompts[0], SamplingParams(max_tokens=2), adapter="nope")

    async def run(kind: str, **settings):
        engine = load_engine(
            kind,
            model=str(model),
            kv_cache_tokens=8192,
            lora_adapters=folders,
            max_loras=2,
            max_lora_rank=16,
            **settings,
        )
        try:
            # vLLM's CPU build (0.32) gets base-model rows wrong when they share a batch with
            # adapter rows (alone, or one at a time beside them, they are right): the adapters'
            # rows run together, the base model's after them (docs/engine.md).
            adapted = [r for r in requests if r.adapter is not None]
            first = await asyncio.gather(*(engine.generate(r) for r in [*adapted, unknown]))
            base = [r for r in requests if r.adapter is None]
            then = await asyncio.gather(*(engine.generate(r) for r in base))
            done = zip([*adapted, *base], [*first[:-1], *then], strict=True)
            by_id = {r.request_id: x for r, x in done}
            return [by_id[r.request_id] for r in requests] + [first[-1]]
        finally:
            engine.shutdown()

    *vllm, vllm_unknown = asyncio.run(run("vllm", enforce_eager=True))
    *reference, _ = asyncio.run(run("reference", num_threads=1))
    merged = {
        None: model,
        **{n: merge_lora(model, f, root / f"merged-{n}") for n, f in folders.items()},
    }
    want: dict[str, list[int]] = {}
    for name, folder in merged.items():
        mine = [r for r in requests if r.adapter == name]
        for request, ids in zip(mine, hf_greedy(folder, mine), strict=True):
            want[request.request_id] = ids
    for request, ours, theirs in zip(requests, reference, vllm, strict=True):
        assert theirs.finish_reason != "error", theirs.error
        assert theirs.output_token_ids == want[request.request_id], request.adapter
        assert ours.output_token_ids == want[request.request_id], request.adapter
        assert theirs.text == ours.text
    # The adapters change the answers (else equality proves nothing).
    by_adapter = {r.adapter: tuple(want[r.request_id]) for r in requests[:3]}
    assert len(set(by_adapter.values())) == 3
    assert vllm_unknown.finish_reason == "error"
    assert "'nope'" in vllm_unknown.error and "all, attn" in vllm_unknown.error


def test_vllm_lora_rank_is_rounded_up_to_a_slot_size() -> None:
    from engines.vllm import vllm_lora_rank

    assert [vllm_lora_rank(r) for r in (1, 4, 8, 12, 64, 65, 300)] == [1, 8, 8, 16, 64, 128, 320]
    with pytest.raises(Exception, match="largest LoRA rank 512"):
        vllm_lora_rank(600)
