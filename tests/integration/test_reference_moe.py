"""Qwen3-MoE checkpoints: both expert layouts, dense layers beside sparse ones, no top-k
renormalisation, the loader's refusals, and the expert load in the step records. Greedy ids
are compared with transformers (test_reference_equality runs the default tiny Qwen3-MoE
through every batching feature)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from engines.api import EngineError
from engines.reference.engine import ReferenceEngine
from engines.reference.model.config import load_model_config
from engines.reference.model.weights import load_model
from tests.engine_fixtures import greedy_requests, hf_greedy, run_all, tiny_model, varied_prompts

pytestmark = pytest.mark.timeout(300)


def _rewrite_weights(model_dir: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _edit_config(model_dir: Path, drop: tuple[str, ...] = (), **changes) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    for name in drop:
        config.pop(name, None)
    (model_dir / "config.json").write_text(json.dumps(config))


def _greedy(model_dir: Path, requests, **settings):
    engine = ReferenceEngine(str(model_dir), num_threads=1, **settings)
    try:
        results = run_all(engine, requests)
        records = engine.drain_step_records()
    finally:
        engine.shutdown()
    return [r.output_token_ids for r in results], records


def _stack_experts(tensors: dict[str, torch.Tensor]) -> None:
    """Per-expert tensors -> transformers 5's in-memory layout: per layer
    `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]."""
    layers = sorted({n.split(".mlp.experts.")[0] for n in tensors if ".mlp.experts." in n})
    for layer in layers:
        prefix = f"{layer}.mlp.experts."
        count = len({n for n in tensors if n.startswith(prefix) and n.endswith("down_proj.weight")})
        gate_up, down = [], []
        for e in range(count):
            gate = tensors.pop(f"{prefix}{e}.gate_proj.weight")
            up = tensors.pop(f"{prefix}{e}.up_proj.weight")
            gate_up.append(torch.cat([gate, up]))
            down.append(tensors.pop(f"{prefix}{e}.down_proj.weight"))
        tensors[f"{prefix}gate_up_proj"] = torch.stack(gate_up).contiguous()
        tensors[f"{prefix}down_proj"] = torch.stack(down).contiguous()


def test_stacked_experts_and_the_hub_config_spelling_load_the_same_model(tmp_path) -> None:
    src = tiny_model("qwen3_moe")
    requests = greedy_requests(varied_prompts(8, seed=21))
    expected = hf_greedy(src, requests)
    model_dir = Path(shutil.copytree(src, tmp_path / "stacked"))
    _rewrite_weights(model_dir, _stack_experts)
    # Hub checkpoints write `num_experts`; transformers 5 saves it as `num_local_experts`.
    num_experts = json.loads((src / "config.json").read_text())["num_local_experts"]
    _edit_config(model_dir, drop=("num_local_experts",), num_experts=num_experts)
    got, _ = _greedy(model_dir, requests)
    assert got == expected


@pytest.mark.parametrize(
    "overrides",
    [
        {"decoder_sparse_step": 2, "norm_topk_prob": False},
        {"mlp_only_layers": [1], "num_experts_per_tok": 3},
    ],
    ids=["sparse-step-2-no-renorm", "mlp-only-layer-top3"],
)
def test_dense_layers_and_routing_variants_match_transformers(tmp_path, overrides) -> None:
    from engines.dev.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "moe", arch="qwen3_moe", config_overrides=overrides)
    cfg = load_model_config(model_dir)
    assert len(cfg.moe.sparse_layers) == 1  # one dense and one sparse layer either way
    requests = greedy_requests(varied_prompts(8, seed=13))
    expected = hf_greedy(model_dir, requests)
    # Chunked, preempting steps: every path of the block sees mixed batches.
    got, _ = _greedy(
        model_dir,
        requests,
        max_num_tokens=16,
        kv_cache_tokens=112,
        block_size=8,
        max_batch_size=8,
    )
    assert got == expected


def test_the_loaded_fp32_model_runs_each_sparse_layer_in_one_fused_call(monkeypatch) -> None:
    """On CPU in fp32 with the kernels built, the loader lays every sparse layer's experts out
    for the fused kernel and drops the per-expert modules; the step then calls the kernel once
    per sparse layer (and the greedy ids stay transformers'). Without the kernels the experts
    stay modules."""
    from engines.reference.model import cpu_kernels
    from engines.reference.model.moe import SparseMoeBlock

    if not cpu_kernels.kernels_available():
        pytest.skip("CPU kernels unavailable on this machine")
    src = tiny_model("qwen3_moe")
    cfg = load_model_config(src)
    model = load_model(src, cfg, torch.float32, torch.device("cpu"))
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == len(cfg.moe.sparse_layers) > 0
    assert all(b.fused is not None and len(b.experts) == 0 for b in blocks)
    calls: list[int] = []
    real = cpu_kernels.moe_fused
    monkeypatch.setattr(
        cpu_kernels, "moe_fused", lambda x, *a: (calls.append(len(x)), real(x, *a))[1]
    )
    requests = greedy_requests(varied_prompts(6, seed=31))
    got, _ = _greedy(src, requests)
    assert got == hf_greedy(src, requests)
    assert calls and len(calls) % len(blocks) == 0
    monkeypatch.setattr(cpu_kernels, "use_kernels", lambda device: False)
    unfused = load_model(src, cfg, torch.float32, torch.device("cpu"))
    assert all(
        m.fused is None and len(m.experts) == cfg.moe.num_experts
        for m in unfused.modules()
        if isinstance(m, SparseMoeBlock)
    )


@pytest.mark.parametrize(
    ("extra", "shape"),
    [
        # An expert beyond num_experts: config.json and the weights disagree.
        ("model.layers.0.mlp.experts.8.gate_proj.weight", None),
        # Qwen2-MoE's shared expert: no part of qwen3_moe.
        ("model.layers.1.mlp.shared_expert_gate.weight", (1, 64)),
    ],
)
def test_an_unused_expert_tensor_fails_naming_it(tmp_path, extra: str, shape) -> None:
    model_dir = Path(shutil.copytree(tiny_model("qwen3_moe"), tmp_path / "extra"))

    def add(tensors):
        like = tensors["model.layers.0.mlp.experts.0.gate_proj.weight"]
        tensors[extra] = torch.zeros(shape) if shape else torch.zeros_like(like)

    _rewrite_weights(model_dir, add)
    cfg = load_model_config(model_dir)
    with pytest.raises(EngineError, match=f"'{re.escape(extra)}'.*num_experts"):
        load_model(model_dir, cfg, torch.float32, torch.device("cpu"))


def test_a_missing_expert_fails_naming_it(tmp_path) -> None:
    model_dir = Path(shutil.copytree(tiny_model("qwen3_moe"), tmp_path / "missing"))
    name = "model.layers.1.mlp.experts.7.down_proj.weight"
    _rewrite_weights(model_dir, lambda t: t.pop(name))
    with pytest.raises(EngineError, match=f"'{re.escape(name)}' is missing"):
        load_model(model_dir, load_model_config(model_dir), torch.float32, torch.device("cpu"))


def test_step_records_carry_the_expert_load() -> None:
    model_dir = tiny_model("qwen3_moe")
    moe = load_model_config(model_dir).moe
    requests = greedy_requests(varied_prompts(6, seed=3))
    engine = ReferenceEngine(str(model_dir), num_threads=1)
    try:
        results = run_all(engine, requests)
        records = engine.drain_step_records()
    finally:
        engine.shutdown()
    # Each step's mean is its rows x k / E, so the records add up to every row the model ran:
    # the uncached prompt tokens and each output token but the last, which is never fed back.
    rows = sum(
        len(q.prompt_token_ids) - r.cached_prompt_tokens + len(r.output_token_ids) - 1
        for q, r in zip(requests, results, strict=True)
    )
    means = [r.expert_tokens_mean for r in records]
    assert sum(means) * moe.num_experts / moe.num_experts_per_tok == pytest.approx(rows)
    assert all(m <= r.expert_tokens_max for m, r in zip(means, records, strict=True))
    _, dense = _greedy(tiny_model("llama"), requests[:1])
    assert all(r.expert_tokens_max is None and r.expert_tokens_mean is None for r in dense)


def test_structured_output_logprobs_and_n_samples_run_on_moe() -> None:
    """The features the contract suite checks on a dense model, once on the MoE model: a
    format constrains the text, logprobs come one per token, n samples share the prompt."""
    from engines.api import GenerationRequest, ResponseFormat, SamplingParams
    from engines.samples import fan_out, generate_all
    from pipeline.openai.response_format import conforms

    prompt = varied_prompts(1, seed=8)[0]
    choice = ResponseFormat("choice", choices=("left", "right"))
    engine = ReferenceEngine(str(tiny_model("qwen3_moe")), num_threads=1, block_size=16)
    try:
        fmt, logprobs = run_all(
            engine,
            [
                GenerationRequest(
                    prompt, SamplingParams(max_tokens=16, temperature=0.0, response_format=choice)
                ),
                GenerationRequest(
                    prompt,
                    SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3),
                ),
            ],
        )
        engine.drain_step_records()
        sampling = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
        group = fan_out(GenerationRequest(prompt, sampling, request_id="g"), 3)
        samples = asyncio.run(generate_all(engine, group))
        records = engine.drain_step_records()
    finally:
        engine.shutdown()
    assert fmt.finish_reason == "stop" and conforms(choice, fmt.text), (fmt.text, fmt.error)
    assert [lp.token_id for lp in logprobs.logprobs] == logprobs.output_token_ids
    assert all(len(lp.top) == 3 for lp in logprobs.logprobs)
    assert [r.completion_tokens for r in samples] == [8, 8, 8]
    assert {rid for rec in records for rid in rec.prefill_tokens} == {"g/0"}
