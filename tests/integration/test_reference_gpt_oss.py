"""GPT-OSS checkpoints with MXFP4-packed experts (as released): the loader dequantizes them to
exactly transformers' weights and generates transformers' greedy ids; packed tensors it cannot
place are refused by name; the step records carry the expert load. The unpacked tiny GPT-OSS
runs through every batching feature in test_reference_equality and test_reference_bf16."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from engines.api import EngineError
from engines.reference.engine import ReferenceEngine
from engines.reference.model.config import load_model_config
from engines.reference.model.cpu_kernels import kernels_available
from engines.reference.model.weights import _split_gpt_oss_experts, load_model, read_tensors
from tests.engine_fixtures import (
    check_attention_path,
    count_attention_paths,
    greedy_requests,
    run_all,
    varied_prompts,
)

pytestmark = pytest.mark.timeout(300)

# Chunked, preempting steps with prefix caching (as the equality tests' chunked-preempting).
CHUNKED_PREEMPTING = {"max_num_tokens": 16, "kv_cache_tokens": 112, "block_size": 8}


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory) -> Path:
    from engines.dev.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("gpt-oss") / "mxfp4", "gpt_oss", mxfp4=True)


def _hf_dequantized(model_dir: Path):
    """transformers' own model from the packed checkpoint, dequantized on load. transformers
    5.14 keeps the dequantized experts in bf16 whatever dtype is asked for; every MXFP4 value
    is exact in bf16 and fp32 alike, so `.float()` changes no weight, only makes the experts'
    arithmetic the fp32 the engine is asked for."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    )
    return model.float().eval()


def _hf_greedy(model, requests) -> list[list[int]]:
    model.generation_config.eos_token_id = None  # like ignore_eos
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


def _rewrite_weights(model_dir: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_mxfp4_experts_load_as_transformers_dequantizes_them(mxfp4_dir: Path) -> None:
    reference = _hf_dequantized(mxfp4_dir)
    cfg = load_model_config(mxfp4_dir)
    # The loader's expert tensors before they become (oneDNN-packed) linears.
    tensors, origin = read_tensors([mxfp4_dir / "model.safetensors"])
    _split_gpt_oss_experts(tensors, origin, torch.float32)
    for layer in range(cfg.num_layers):
        experts = reference.model.layers[layer].mlp.experts
        for e in range(cfg.moe.num_experts):
            prefix = f"model.layers.{layer}.mlp.experts.{e}"
            gate_up = experts.gate_up_proj[e].t()  # [2I, H], gate/up interleaved
            assert torch.equal(
                tensors[f"{prefix}.gate_up_proj.weight"], torch.cat([gate_up[0::2], gate_up[1::2]])
            )
            assert torch.equal(tensors[f"{prefix}.down_proj.weight"], experts.down_proj[e].t())


def test_mxfp4_greedy_ids_match_transformers(
    mxfp4_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = greedy_requests(varied_prompts(12, seed=5))
    expected = _hf_greedy(_hf_dequantized(mxfp4_dir), requests)
    paths = count_attention_paths(monkeypatch)
    engine = ReferenceEngine(str(mxfp4_dir), num_threads=1, **CHUNKED_PREEMPTING)
    try:
        results = run_all(engine, requests)
        stats = engine.stats()
        records = engine.drain_step_records()
    finally:
        engine.shutdown()
    assert [r.output_token_ids for r in results] == expected
    check_attention_path("gpt_oss", paths, kernel=kernels_available())
    assert stats.num_preemptions > 0 and sum(r.cached_prompt_tokens for r in results) > 0
    # Every step ran the experts: its records say how evenly (as for Qwen3-MoE).
    assert all(r.expert_tokens_max is not None and r.expert_tokens_mean > 0 for r in records)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        # Scales without their blocks.
        (
            lambda t: t.pop("model.layers.1.mlp.experts.down_proj_blocks"),
            "'model.layers.1.mlp.experts.down_proj_scales' has no "
            "'model.layers.1.mlp.experts.down_proj_blocks'",
        ),
        # Blocks without their scales cannot be dequantized.
        (
            lambda t: t.pop("model.layers.0.mlp.experts.gate_up_proj_scales"),
            "'model.layers.0.mlp.experts.gate_up_proj_blocks' has no "
            "'model.layers.0.mlp.experts.gate_up_proj_scales'",
        ),
        # A tensor of another family (Qwen3's q/k norm).
        (
            lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}),
            "not used by the gpt_oss model.*'model.layers.0.self_attn.q_norm.weight'",
        ),
    ],
    ids=["scales-without-blocks", "blocks-without-scales", "foreign-tensor"],
)
def test_tensors_the_loader_cannot_place_are_refused_by_name(
    mxfp4_dir: Path, tmp_path: Path, change, words: str
) -> None:
    model_dir = Path(shutil.copytree(mxfp4_dir, tmp_path / "changed"))
    _rewrite_weights(model_dir, change)
    with pytest.raises(EngineError, match=words):
        load_model(model_dir, load_model_config(model_dir), torch.float32, torch.device("cpu"))


def test_a_missing_expert_bias_fails_naming_it(mxfp4_dir: Path, tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(mxfp4_dir, tmp_path / "no-bias"))
    _rewrite_weights(model_dir, lambda t: t.pop("model.layers.1.mlp.experts.down_proj_bias"))
    with pytest.raises(EngineError, match=re.escape("no down_proj_bias")):
        load_model(model_dir, load_model_config(model_dir), torch.float32, torch.device("cpu"))
