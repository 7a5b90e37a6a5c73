"""Loader strictness and config variants: every checkpoint tensor is used or the load fails
naming it; attention / MLP biases and Qwen sliding windows match transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engines.api import EngineError, GenerationRequest, SamplingParams
from engines.reference.engine import ReferenceEngine
from engines.reference.model.config import load_model_config
from engines.reference.model.model import AttentionBatch, PrefillSeq
from engines.reference.model.weights import load_model
from tests.engine_fixtures import greedy_requests, hf_greedy, run_all, tiny_model, varied_prompts

pytestmark = pytest.mark.timeout(300)


def _rewrite_weights(model_dir: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _edit_config(model_dir: Path, **changes) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))


def _load(model_dir: Path):
    return load_model(model_dir, load_model_config(model_dir), torch.float32, torch.device("cpu"))


def test_an_extra_tensor_fails_naming_it(tmp_path) -> None:
    model_dir = Path(shutil.copytree(tiny_model("llama"), tmp_path / "extra"))
    _rewrite_weights(
        model_dir, lambda t: t.update({"model.layers.1.mlp.down_proj.bias": torch.zeros(64)})
    )
    with pytest.raises(EngineError, match=r"'model\.layers\.1\.mlp\.down_proj\.bias'.*mlp_bias"):
        _load(model_dir)


def test_biases_the_config_does_not_declare_are_not_dropped(tmp_path) -> None:
    # A Llama checkpoint with attention biases whose config.json lost `attention_bias`.
    src = _biased_llama(tmp_path / "src")
    model_dir = Path(shutil.copytree(src, tmp_path / "undeclared"))
    _edit_config(model_dir, attention_bias=False, mlp_bias=False)
    with pytest.raises(EngineError, match=r"o_proj\.bias") as info:
        _load(model_dir)
    assert "mlp.gate_proj.bias" in str(info.value)


def test_legitimately_unused_tensors_are_accepted(tmp_path) -> None:
    tied = Path(shutil.copytree(tiny_model("qwen3", tied=True), tmp_path / "tied"))

    def add(tensors: dict[str, torch.Tensor]) -> None:
        # An exporter that writes the tied LM head anyway, and old rotary buffers.
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone() + 1.0
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    _rewrite_weights(tied, add)
    model = _load(tied)
    # Tied means tied: the stray copy is not read (transformers ties over it too). The head may
    # hold its own (oneDNN-packed) copy, so check what it computes: the embedding table.
    x = torch.randn(3, model.model.embed_tokens.weight.shape[1])
    with torch.inference_mode():
        head = model.lm_head(x)
    torch.testing.assert_close(head, x @ model.model.embed_tokens.weight.T, rtol=1e-5, atol=1e-5)


def _biased_llama(out: Path) -> Path:
    from engines.dev.tiny import make_tiny_model

    if not (out / "config.json").exists():
        make_tiny_model(
            out, arch="llama", config_overrides={"attention_bias": True, "mlp_bias": True}
        )
    return out


def _hf_logits(model_dir: Path, ids: list[int], zero_biases: bool = False) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        if zero_biases:  # what a loader that dropped o_proj / MLP biases would compute
            for name, param in model.named_parameters():
                if name.endswith("o_proj.bias") or (".mlp." in name and name.endswith(".bias")):
                    param.zero_()
        return model(torch.tensor([ids])).logits[0].float()


def _our_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """One prefill of `ids` through the reference model, logits at every position."""
    cfg = load_model_config(model_dir)
    model = _load(model_dir)
    n, block_size = len(ids), 16
    num_blocks = -(-n // block_size)
    shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    from engines.reference.model.config import rope_inv_freq

    freqs = torch.outer(torch.arange(n).float(), rope_inv_freq(cfg.head_dim, cfg.rope))
    emb = torch.cat((freqs, freqs), dim=-1)
    batch = AttentionBatch(slot_mapping=torch.arange(n), prefills=[PrefillSeq(0, n, 0, None, None)])
    with torch.inference_mode():
        return model(
            torch.tensor(ids),
            emb.cos().unsqueeze(1),
            emb.sin().unsqueeze(1),
            batch,
            caches,
            torch.arange(n),
        )


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {"attention_bias": True, "mlp_bias": True}),
        ("qwen3", {"attention_bias": True}),
    ],
    ids=["llama-attention-mlp-bias", "qwen3-attention-bias"],
)
def test_bias_configs_match_transformers(tmp_path, arch: str, overrides: dict) -> None:
    from engines.dev.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path / arch, arch=arch, config_overrides=overrides)
    cfg = load_model_config(model_dir)
    assert cfg.attention_bias and cfg.o_proj_bias
    assert cfg.mlp_bias == overrides.get("mlp_bias", False)

    ids = varied_prompts(1, seed=5)[0][:40] + list(range(10, 30))
    ours, theirs = _our_logits(model_dir, ids), _hf_logits(model_dir, ids)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    # The biases matter: dropping them moves the logits far more than the tolerance.
    assert (ours - _hf_logits(model_dir, ids, zero_biases=True)).abs().max() > 1e-2

    requests = greedy_requests(varied_prompts(8, seed=11))
    expected = hf_greedy(model_dir, requests)
    engine = ReferenceEngine(str(model_dir), num_threads=1)
    try:
        results = run_all(engine, requests)
    finally:
        engine.shutdown()
    assert [r.output_token_ids for r in results] == expected


def test_qwen3_sliding_window_layers_serve_within_the_window(tmp_path) -> None:
    # Layer 1 slides over 48 tokens (transformers: layers from max_window_layers on).
    model_dir = Path(shutil.copytree(tiny_model("qwen3", tied=True), tmp_path / "qwen3-sw"))
    _edit_config(
        model_dir, use_sliding_window=True, sliding_window=48, max_window_layers=1, layer_types=None
    )
    assert load_model_config(model_dir).sliding_window == 48
    prompts = [p[:30] for p in varied_prompts(6, seed=4)]
    requests = [
        GenerationRequest(
            p,
            SamplingParams(max_tokens=48 - len(p), temperature=0.0, ignore_eos=True),
            request_id=f"s{i}",
        )
        for i, p in enumerate(prompts)
    ]
    expected = hf_greedy(model_dir, requests)
    engine = ReferenceEngine(str(model_dir), num_threads=1)
    try:
        assert engine.info.max_model_len == 48
        results = run_all(engine, requests)
    finally:
        engine.shutdown()
    assert [r.output_token_ids for r in results] == expected
    with pytest.raises(EngineError, match=r"sliding_window"):
        ReferenceEngine(str(model_dir), num_threads=1, max_model_len=64)
