"""LoRA adapters made locally for a tiny model (engines/dev/tiny.py), in PEFT's folder format,
and the same adapter merged into a copy of the base checkpoint: what transformers runs as the
expected output of the adapter (merging is exact: W + s B A).

Random weights, drawn large enough that an adapter changes greedy output on the tiny models.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path

from engines.lora.peft import CONFIG_FILE, TARGETS, WEIGHTS_FILE

_SELF_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def _sizes(config: dict) -> dict[str, tuple[int, int]]:
    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    q = heads * head_dim
    kv = config.get("num_key_value_heads", heads) * head_dim
    inter = config["intermediate_size"]
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def _key(layer: int, target: str, half: str) -> str:
    block = "self_attn" if target in _SELF_ATTN else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{target}.lora_{half}.weight"


def make_lora_adapter(
    out: str | Path,
    model_dir: str | Path,
    *,
    rank: int = 8,
    alpha: float = 16,
    targets: Sequence[str] = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    seed: int = 0,
    std: float = 0.15,
) -> Path:
    """Write a random LoRA adapter for `model_dir`'s architecture into `out`."""
    import torch
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    sizes = _sizes(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target in targets:
            fan_in, fan_out = sizes[target]
            a = torch.randn(rank, fan_in, generator=generator) * std
            b = torch.randn(fan_out, rank, generator=generator) * std
            tensors[_key(layer, target, "A")] = a.contiguous()
            tensors[_key(layer, target, "B")] = b.contiguous()
    save_file(tensors, str(out / WEIGHTS_FILE))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "use_rslora": use_rslora,
        "use_dora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2))
    return out


def merge_lora(model_dir: str | Path, adapter_dir: str | Path, out: str | Path) -> Path:
    """A copy of `model_dir` with the adapter merged into its weights (W += s B A, in fp32)."""
    from safetensors.torch import load_file, save_file

    model_dir, adapter_dir, out = Path(model_dir), Path(adapter_dir), Path(out)
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    config = json.loads((adapter_dir / CONFIG_FILE).read_text())
    rank = config["r"]
    scale = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    lora = load_file(str(adapter_dir / WEIGHTS_FILE))
    for file in sorted(out.glob("*.safetensors")):
        weights = load_file(str(file))
        changed = False
        for name in list(weights):
            parts = name.split(".")  # model.layers.{i}.{block}.{target}.weight
            if len(parts) != 6 or parts[-1] != "weight" or parts[4] not in TARGETS:
                continue
            layer, target = int(parts[2]), parts[4]
            a = lora.get(_key(layer, target, "A"))
            if a is None:
                continue
            b = lora[_key(layer, target, "B")]
            base = weights[name]
            merged = base.float() + scale * (b.float() @ a.float())
            weights[name] = merged.to(base.dtype).contiguous()
            changed = True
        if changed:
            save_file(weights, str(file), metadata={"format": "pt"})
    return out
