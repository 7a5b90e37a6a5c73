"""Checkpoint variants the loader must read: sharded bf16 weights, the Mistral family, Llama 3
RoPE scaling. Each compares greedy ids with transformers on a few prompts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engines.reference.engine import ReferenceEngine
from tests.engine_fixtures import (
    greedy_requests,
    hf_greedy,
    rope_config_fields,
    run_all,
    tiny_model,
    varied_prompts,
)

pytestmark = pytest.mark.timeout(300)


def _assert_matches_transformers(model_dir: Path, **settings) -> None:
    requests = greedy_requests(varied_prompts(8, seed=11))
    expected = hf_greedy(model_dir, requests)
    engine = ReferenceEngine(str(model_dir), num_threads=1, **settings)
    try:
        results = run_all(engine, requests)
    finally:
        engine.shutdown()
    assert [r.output_token_ids for r in results] == expected


def _edit_config(model_dir: Path, **changes) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))


def test_sharded_bf16_checkpoint(tmp_path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tiny_model("qwen2")
    out = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="100KB")
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    assert (out / "model.safetensors.index.json").exists()
    assert len(list(out.glob("model-*.safetensors"))) > 1
    # transformers reads bf16 weights into fp32 like the engine does (dtype=float32 compute).
    _edit_config(out, dtype="float32")
    _assert_matches_transformers(out, dtype="float32")


def test_mistral_family(tmp_path) -> None:
    model_dir = Path(shutil.copytree(tiny_model("llama"), tmp_path / "mistral"))
    _edit_config(
        model_dir,
        model_type="mistral",
        architectures=["MistralForCausalLM"],
        sliding_window=None,
        head_dim=16,
    )
    _assert_matches_transformers(model_dir)


def test_llama3_rope_scaling(tmp_path) -> None:
    model_dir = Path(shutil.copytree(tiny_model("llama"), tmp_path / "llama3"))
    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    _edit_config(model_dir, **rope_config_fields(params))
    _assert_matches_transformers(model_dir)


def test_mistral_sliding_window_caps_the_context(tmp_path) -> None:
    model_dir = Path(shutil.copytree(tiny_model("llama"), tmp_path / "mistral-sw"))
    _edit_config(
        model_dir, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=128
    )
    engine = ReferenceEngine(str(model_dir), num_threads=1)
    try:
        assert engine.info.max_model_len == 128
    finally:
        engine.shutdown()
