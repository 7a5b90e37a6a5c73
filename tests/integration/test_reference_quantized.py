"""Loading a ModelOpt-style FP8 export (hand-made, same layout) into the reference engine: the
quantized linears replace the plain ones, K/V scales reach attention, generation runs. The
numerics of the quantized linears are tested with engines/reference/model/quant.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engines.reference.engine import ReferenceEngine
from tests.engine_fixtures import greedy_requests, run_all, tiny_model, varied_prompts

pytestmark = pytest.mark.timeout(300)

FP8_MAX = 448.0
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fp8_export(tmp_path: Path) -> Path:
    from safetensors.torch import load_file, save_file

    src = tiny_model("llama")
    out = Path(shutil.copytree(src, tmp_path / "fp8"))
    tensors = load_file(str(src / "model.safetensors"))
    exported = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS:
            scale = tensor.abs().max() / FP8_MAX
            exported[name] = (tensor / scale).to(torch.float8_e4m3fn)
            exported[f"{module}.weight_scale"] = scale.reshape(())
            exported[f"{module}.input_scale"] = torch.tensor(4.0 / FP8_MAX)
        else:
            exported[name] = tensor
    for i in range(2):
        exported[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(8.0 / FP8_MAX)
        exported[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(8.0 / FP8_MAX)
    save_file(exported, str(out / "model.safetensors"))
    quant = {
        "quantization": {
            "quant_algo": "FP8",
            "kv_cache_quant_algo": "FP8",
            "exclude_modules": ["lm_head", "model.embed_tokens"],
        }
    }
    (out / "hf_quant_config.json").write_text(json.dumps(quant))
    return out


def test_fp8_export_loads_swaps_linears_and_sets_kv_scales(tmp_path) -> None:
    from engines.reference.model.quant import Fp8Linear

    model_dir = _fp8_export(tmp_path)
    engine = ReferenceEngine(str(model_dir), num_threads=1)
    try:
        layer = engine.model.model.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn.q_proj, Fp8Linear) and isinstance(mlp.down_proj, Fp8Linear)
        assert attn.qkv_proj is None and mlp.gate_up_proj is None  # swapped: not fused
        assert attn.k_scale == pytest.approx(8.0 / FP8_MAX)
        assert attn.v_scale == pytest.approx(8.0 / FP8_MAX)
        requests = greedy_requests(varied_prompts(6, seed=2))
        results = run_all(engine, requests)
    finally:
        engine.shutdown()
    assert [r.completion_tokens for r in results] == [r.sampling.max_tokens for r in requests]
    assert all(r.ok for r in results)

    # The unquantized model gives different greedy ids (the quantized path is really used).
    plain = ReferenceEngine(str(tiny_model("llama")), num_threads=1)
    try:
        plain_results = run_all(plain, requests)
    finally:
        plain.shutdown()
    assert [r.output_token_ids for r in results] != [r.output_token_ids for r in plain_results]
