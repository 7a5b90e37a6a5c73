"""Model shape read from a Hugging Face `config.json`: the few facts the reference model needs.

Supported families are decoder-only Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head
q/k RMSNorm). Anything else is refused with the list of what is supported, so a job fails at
load time instead of producing garbage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.api import EngineError
from engines.requests import context_length, eos_token_ids, read_config

# model_type -> (architectures class name, q/k/v bias by default, per-head q/k norm)
SUPPORTED_MODEL_TYPES: dict[str, tuple[str, bool, bool]] = {
    "llama": ("LlamaForCausalLM", False, False),
    "mistral": ("MistralForCausalLM", False, False),
    "qwen2": ("Qwen2ForCausalLM", True, False),
    "qwen3": ("Qwen3ForCausalLM", False, True),
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings (`rope_theta` or transformers-5 `rope_parameters`)."""

    theta: float  # base of the inverse frequencies
    rope_type: str = "default"  # "default" or "llama3"
    factor: float = 1.0  # llama3: context extension factor
    low_freq_factor: float = 1.0  # llama3: wavelengths above original/low_freq_factor are scaled
    high_freq_factor: float = 4.0  # llama3: wavelengths below original/high_freq_factor are kept
    original_max_position_embeddings: int = 8192  # llama3: context the model was trained on


@dataclass(frozen=True)
class ModelConfig:
    """What the reference model is built from; every field comes from config.json."""

    model_type: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when fewer than num_heads)
    head_dim: int  # from config when given, else hidden_size // num_heads
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # RMSNorm over each q and k head before RoPE (Qwen3)
    tie_word_embeddings: bool  # the LM head reuses the input embedding
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None  # Mistral v0.1 style window; caps the usable context
    torch_dtype: str | None  # dtype the checkpoint was saved in, if stated

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _detect_model_type(raw: dict[str, Any], path: Path) -> str:
    model_type = raw.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        return model_type
    by_arch = {arch: mt for mt, (arch, _, _) in SUPPORTED_MODEL_TYPES.items()}
    for arch in raw.get("architectures") or []:
        if arch in by_arch:
            return by_arch[arch]
    supported = ", ".join(f"{a} ({mt})" for mt, (a, _, _) in SUPPORTED_MODEL_TYPES.items())
    raise EngineError(
        f"{path}: unsupported model (model_type={model_type!r}, "
        f"architectures={raw.get('architectures')!r}); the reference engine supports "
        f"{supported}"
    )


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; 4.x wrote `rope_theta` plus `rope_scaling`.
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "llama3"):
        raise EngineError(
            f"rope_type {rope_type!r} is not supported by the reference engine; "
            "supported: default, llama3"
        )
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    return RopeConfig(
        theta=float(theta),
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read and check `model_dir/config.json`; errors name the file and the field."""
    path = Path(model_dir) / "config.json"
    raw = read_config(model_dir)
    model_type = _detect_model_type(raw, path)
    _, default_bias, qk_norm = SUPPORTED_MODEL_TYPES[model_type]
    try:
        num_heads = int(raw["num_attention_heads"])
        hidden_size = int(raw["hidden_size"])
        head_dim = raw.get("head_dim") or hidden_size // num_heads
        sliding = raw.get("sliding_window")
        if model_type == "qwen2" and not raw.get("use_sliding_window", False):
            sliding = None
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=context_length(raw),
            rope=_rope_config(raw),
            attention_bias=bool(raw.get("attention_bias", default_bias)),
            qk_norm=qk_norm,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_token_ids(raw, model_dir),
            sliding_window=int(sliding) if sliding else None,
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )
    except KeyError as exc:
        raise EngineError(f"{path}: required field {exc.args[0]!r} is missing") from exc


def rope_inv_freq(head_dim: int, rope: RopeConfig):
    """Inverse frequencies [head_dim // 2], computed as transformers does (fp32)."""
    import torch

    inv_freq = 1.0 / (
        rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    if rope.rope_type != "llama3":
        return inv_freq
    # Llama 3.1 context extension: long wavelengths divided by `factor`, short ones kept,
    # a smooth blend between (same formula as transformers' _compute_llama3_parameters).
    low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
