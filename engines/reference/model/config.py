"""Model shape read from a Hugging Face `config.json`: the few facts the reference model needs.

Supported families are decoder-only Llama (optional attention / MLP biases), Mistral, Qwen2
(q/k/v bias), Qwen3 (per-head q/k RMSNorm, optional attention bias), Qwen3-MoE (Qwen3's
attention, a routed Mixture-of-Experts MLP in the sparse layers) and GPT-OSS (attention sinks,
alternating sliding-window and full layers, YaRN RoPE, biased experts with a clamped SwiGLU,
optionally MXFP4-packed) and Qwen2.5-VL (Qwen2's decoder with multimodal rotary positions,
behind a vision encoder: engines.reference.model.vision). Anything else is refused with the
list of what is supported, so a job fails at load time instead of producing garbage.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.api import EngineError
from engines.reference.model.vision import VisionConfig
from engines.requests import context_length, eos_token_ids, read_config


@dataclass(frozen=True)
class Family:
    """How one model family maps config.json onto the shared decoder.

    A bias flag of None means "as config.json says" (`attention_bias` / `mlp_bias`, default
    False); True / False means transformers hard-codes it for the family whatever the config
    holds, so the engine must too (or it would expect tensors the checkpoint never has).
    """

    architecture: str  # the `architectures` class name
    qkv_bias: bool | None  # q/k/v projections carry a bias
    o_bias: bool | None  # o_proj carries a bias
    mlp_bias: bool | None  # gate/up/down projections carry a bias
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE
    # "none": no sliding window; "all": every layer slides (Mistral); "per_layer": Qwen2/3's
    # `use_sliding_window` + `layer_types` / `max_window_layers`; "masked": GPT-OSS's
    # `layer_types`, attended within a window over the full context (see
    # ModelConfig.window_layers).
    sliding: str
    is_moe: bool = False  # routed experts in the layers the config makes sparse (MoeConfig)
    default_attention_bias: bool = False  # `attention_bias` when config.json omits it


SUPPORTED_FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", None, None, None, qk_norm=False, sliding="none"),
    "mistral": Family("MistralForCausalLM", False, False, False, qk_norm=False, sliding="all"),
    "qwen2": Family("Qwen2ForCausalLM", True, False, False, qk_norm=False, sliding="per_layer"),
    "qwen3": Family("Qwen3ForCausalLM", None, None, False, qk_norm=True, sliding="per_layer"),
    "qwen3_moe": Family(
        "Qwen3MoeForCausalLM", None, None, False, qk_norm=True, sliding="per_layer", is_moe=True
    ),
    # GPT-OSS's expert biases live in the expert tensors (MoeConfig.style), not `mlp_bias`.
    "gpt_oss": Family(
        "GptOssForCausalLM",
        None,
        None,
        False,
        qk_norm=False,
        sliding="masked",
        is_moe=True,
        default_attention_bias=True,
    ),
    # Qwen2's decoder; the vision encoder and mrope come from ModelConfig.vision / .mrope.
    "qwen2_5_vl": Family(
        "Qwen2_5_VLForConditionalGeneration", True, False, False, qk_norm=False, sliding="per_layer"
    ),
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings (`rope_theta` or transformers-5 `rope_parameters`)."""

    theta: float  # base of the inverse frequencies
    rope_type: str = "default"  # "default", "llama3" or "yarn"
    factor: float = 1.0  # llama3 / yarn: context extension factor
    low_freq_factor: float = 1.0  # llama3: wavelengths above original/low_freq_factor are scaled
    high_freq_factor: float = 4.0  # llama3: wavelengths below original/high_freq_factor are kept
    original_max_position_embeddings: int = 8192  # llama3 / yarn: context the model was trained on
    beta_fast: float = 32.0  # yarn: rotations above which a dimension is extrapolated (kept)
    beta_slow: float = 1.0  # yarn: rotations below which a dimension is interpolated (scaled)
    truncate: bool = True  # yarn: round the correction range outwards to whole dimensions
    # yarn: multiplies cos and sin ("mscale"); from `attention_factor`, else from factor.
    attention_factor: float = 1.0


@dataclass(frozen=True)
class MoeConfig:
    """The routed Mixture-of-Experts MLP of Qwen3-MoE (transformers' Qwen3MoeConfig fields).

    Qwen3-MoE has no shared expert: every token's MLP output is the routing-weighted sum of
    its top `num_experts_per_tok` experts' outputs. GPT-OSS (style "gpt_oss") differs in the
    router (biased, softmax over the k chosen logits only) and the experts (biased, clamped
    SwiGLU; see engines.reference.model.moe)."""

    num_experts: int  # `num_experts` (saved by transformers 5 as `num_local_experts`)
    num_experts_per_tok: int  # k: experts each token is routed to
    intermediate_size: int  # `moe_intermediate_size` (GPT-OSS: `intermediate_size`)
    norm_topk_prob: bool  # renormalise the k routing probabilities to sum to 1
    sparse_layers: tuple[int, ...]  # layers whose MLP is the expert block; the rest are dense
    style: str = "qwen3_moe"  # "qwen3_moe" | "gpt_oss": router and expert arithmetic


@dataclass(frozen=True)
class ModelConfig:
    """What the reference model is built from; every field comes from config.json."""

    model_type: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "qwen3_moe" | "gpt_oss"
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's width (Qwen3-MoE: its dense layers' only)
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when fewer than num_heads)
    head_dim: int  # from config when given, else hidden_size // num_heads
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2; Llama/Qwen3 attention_bias)
    o_proj_bias: bool  # o_proj carries a bias (Llama/Qwen3 attention_bias)
    mlp_bias: bool  # gate/up/down carry a bias (Llama mlp_bias)
    qk_norm: bool  # RMSNorm over each q and k head before RoPE (Qwen3)
    tie_word_embeddings: bool  # the LM head reuses the input embedding
    eos_token_ids: tuple[int, ...]
    # Window of the layers that slide (Mistral: all; Qwen2/3: per layer_types), None when no
    # layer does. The engine serves such a model within the window (see resources), where
    # sliding and full attention are the same computation.
    sliding_window: int | None
    torch_dtype: str | None  # dtype the checkpoint was saved in, if stated
    moe: MoeConfig | None = None  # the expert MLP of the sparse layers; None: every layer dense
    # GPT-OSS: its window is far shorter than its context, so instead of capping the context
    # (sliding_window above) the layers listed here attend within a window (the paged CPU
    # kernel's `window`; a window mask on the SDPA paths): a query at position p sees keys at
    # positions p - masked_window + 1 .. p. Their KV cache still keeps every position
    # (correctness first: no per-layer ring buffers).
    masked_window: int | None = None
    window_layers: tuple[int, ...] = ()
    attention_sinks: bool = False  # a learned per-head logit in each softmax (GPT-OSS `sinks`)
    # transformers keeps GPT-OSS's norm weights in fp32 in a bf16 model and rounds after the
    # weight multiply; the engine does the same so bf16 runs round alike.
    fp32_norms: bool = False
    # Qwen2.5-VL: the image encoder, the prompt's image placeholder id, and how the head's
    # rotary pairs split among (time, row, column) positions (`mrope_section`). None: text.
    vision: VisionConfig | None = None
    image_token_id: int | None = None
    mrope_section: tuple[int, int, int] | None = None

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.sparse_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _detect_model_type(raw: dict[str, Any], path: Path) -> str:
    model_type = raw.get("model_type")
    if model_type in SUPPORTED_FAMILIES:
        return model_type
    by_arch = {f.architecture: mt for mt, f in SUPPORTED_FAMILIES.items()}
    for arch in raw.get("architectures") or []:
        if arch in by_arch:
            return by_arch[arch]
    supported = ", ".join(f"{f.architecture} ({mt})" for mt, f in SUPPORTED_FAMILIES.items())
    raise EngineError(
        f"{path}: unsupported model (model_type={model_type!r}, "
        f"architectures={raw.get('architectures')!r}); the reference engine supports "
        f"{supported}"
    )


def _rope_config(raw: dict[str, Any], default_theta: float = 10000.0) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; 4.x wrote `rope_theta` plus `rope_scaling`.
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "mrope":  # Qwen2-VL's 4.x spelling: default frequencies, 3D positions
        rope_type = "default"
    if rope_type not in ("default", "llama3", "yarn"):
        raise EngineError(
            f"rope_type {rope_type!r} is not supported by the reference engine; "
            "supported: default, llama3, yarn"
        )
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if rope_type == "yarn":
        return _yarn_config(raw, params, float(theta))
    return RopeConfig(
        theta=float(theta),
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _yarn_config(raw: dict[str, Any], params: dict[str, Any], theta: float) -> RopeConfig:
    """YaRN settings with transformers' defaults (_compute_yarn_parameters)."""
    original = int(params.get("original_max_position_embeddings") or context_length(raw))
    factor = params.get("factor")
    factor = float(factor) if factor is not None else context_length(raw) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return RopeConfig(
        theta=theta,
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention_factor),
    )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _flag(fixed: bool | None, from_config: bool) -> bool:
    return from_config if fixed is None else fixed


def _sliding_window(raw: dict[str, Any], family: Family, num_layers: int, path: Path) -> int | None:
    """The window of the layers that slide, or None when every layer attends fully.

    Mirrors transformers: Mistral slides every layer when `sliding_window` is set. Qwen2/3
    ignore `sliding_window` unless `use_sliding_window` is true (many real configs carry a
    window with the flag off), and then slide the layers `layer_types` marks
    "sliding_attention"; without `layer_types`, the layers from `max_window_layers` on.
    """
    window = raw.get("sliding_window")
    if family.sliding in ("none", "masked") or not window:
        return None
    if family.sliding == "all":
        return int(window)
    if not raw.get("use_sliding_window", False):
        return None
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first = int(raw.get("max_window_layers", num_layers))
        layer_types = [
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        ]
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise EngineError(
            f"{path}: layer_types {unknown} are not supported by the reference engine; "
            "supported: full_attention, sliding_attention"
        )
    return int(window) if "sliding_attention" in layer_types else None


def _window_layers(raw: dict[str, Any], num_layers: int, path: Path) -> tuple[int | None, tuple]:
    """GPT-OSS's window and the layers that slide, as GptOssConfig reads them: `layer_types`,
    else even layers sliding and odd ones full; no `sliding_window`: none slides."""
    window = raw.get("sliding_window")
    if not window:
        return None, ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise EngineError(f"{path}: sliding_window must be a positive integer, got {window!r}")
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
    ]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise EngineError(
            f"{path}: layer_types must list one type per layer ({num_layers}), got {layer_types!r}"
        )
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise EngineError(
            f"{path}: layer_types {unknown} are not supported by the reference engine; "
            "supported: full_attention, sliding_attention"
        )
    return window, tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")


def _gpt_oss_moe(raw: dict[str, Any], num_layers: int, path: Path) -> MoeConfig:
    """GPT-OSS's experts (GptOssConfig): every layer sparse, `intermediate_size` wide."""
    name = "num_local_experts" if "num_local_experts" in raw else "num_experts"
    num_experts = _int_field(raw, name, path, 128)
    if num_experts < 1:
        raise EngineError(f"{path}: {name} must be >= 1, got {num_experts}")
    top_k = _int_field(raw, "num_experts_per_tok", path, 4)
    if not 1 <= top_k <= num_experts:
        raise EngineError(
            f"{path}: num_experts_per_tok must be between 1 and {name} ({num_experts}), got {top_k}"
        )
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        intermediate_size=_int_field(raw, "intermediate_size", path),
        norm_topk_prob=False,
        sparse_layers=tuple(range(num_layers)),
        style="gpt_oss",
    )


def _int_field(raw: dict[str, Any], name: str, path: Path, default: Any = None) -> int:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise EngineError(f"{path}: {name} must be an integer, got {value!r}")
    return value


def _moe_config(raw: dict[str, Any], num_layers: int, path: Path) -> MoeConfig | None:
    """Qwen3-MoE's expert settings, as transformers' Qwen3MoeConfig reads them, or None when
    the config has no experts (transformers then builds every layer dense).

    A layer is sparse unless it is in `mlp_only_layers`, and only every `decoder_sparse_step`-th
    layer is (layer i where (i + 1) % step == 0)."""
    # transformers 5 saves `num_experts` under its attribute-map name `num_local_experts`.
    name = "num_experts" if "num_experts" in raw else "num_local_experts"
    num_experts = _int_field(raw, name, path, 128)
    if num_experts < 0:
        raise EngineError(f"{path}: {name} must be >= 0, got {num_experts}")
    if num_experts == 0:
        return None
    for field_name in ("shared_expert_intermediate_size", "n_shared_experts"):
        if raw.get(field_name):
            raise EngineError(
                f"{path}: {field_name}={raw[field_name]!r}: shared experts are not part of "
                "qwen3_moe (transformers' Qwen3MoeConfig has none); the reference engine "
                "does not support them"
            )
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise EngineError(
            f"{path}: hidden_act {hidden_act!r} is not supported by the reference engine's "
            "qwen3_moe; supported: silu"
        )
    top_k = _int_field(raw, "num_experts_per_tok", path, 8)
    if not 1 <= top_k <= num_experts:
        raise EngineError(
            f"{path}: num_experts_per_tok must be between 1 and {name} ({num_experts}), got {top_k}"
        )
    step = _int_field(raw, "decoder_sparse_step", path, 1)
    if step < 1:
        raise EngineError(f"{path}: decoder_sparse_step must be >= 1, got {step}")
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in dense
    ):
        raise EngineError(f"{path}: mlp_only_layers must be a list of layer indices, got {dense!r}")
    norm_topk_prob = raw.get("norm_topk_prob", False)
    if not isinstance(norm_topk_prob, bool):
        raise EngineError(f"{path}: norm_topk_prob must be true or false, got {norm_topk_prob!r}")
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        intermediate_size=_int_field(raw, "moe_intermediate_size", path, 768),
        norm_topk_prob=norm_topk_prob,
        sparse_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
    )


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read and check `model_dir/config.json`; errors name the file and the field."""
    path = Path(model_dir) / "config.json"
    raw = read_config(model_dir)
    wrapper = _read_wrapper(path)
    if "vision_config" in wrapper:
        # A vision-language wrapper: transformers 5 nests the decoder's fields in
        # `text_config`; its ids (EOS, image placeholder) are the wrapper's.
        raw = {**raw, **{k: v for k, v in wrapper.items() if k != "text_config"}}
    model_type = _detect_model_type(raw, path)
    family = SUPPORTED_FAMILIES[model_type]
    try:
        num_heads = int(raw["num_attention_heads"])
        hidden_size = int(raw["hidden_size"])
        num_layers = int(raw["num_hidden_layers"])
        head_dim = raw.get("head_dim") or hidden_size // num_heads
        attention_bias = bool(raw.get("attention_bias", family.default_attention_bias))
        is_gpt_oss = model_type == "gpt_oss"
        window, window_layers = (
            _window_layers(raw, num_layers, path) if family.sliding == "masked" else (None, ())
        )
        if is_gpt_oss:
            moe = _gpt_oss_moe(raw, num_layers, path)
        else:
            moe = _moe_config(raw, num_layers, path) if family.is_moe else None
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=context_length(raw),
            # GptOssConfig.default_theta when config.json names no theta.
            rope=_rope_config(raw, 150000.0 if is_gpt_oss else 10000.0),
            attention_bias=_flag(family.qkv_bias, attention_bias),
            o_proj_bias=_flag(family.o_bias, attention_bias),
            mlp_bias=_flag(family.mlp_bias, bool(raw.get("mlp_bias", False))),
            qk_norm=family.qk_norm,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_token_ids(raw, model_dir),
            sliding_window=_sliding_window(raw, family, num_layers, path),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            moe=moe,
            masked_window=window,
            window_layers=window_layers,
            attention_sinks=is_gpt_oss,
            fp32_norms=is_gpt_oss,
            **_vision_fields(raw, model_type, head_dim, path),
        )
    except KeyError as exc:
        raise EngineError(f"{path}: required field {exc.args[0]!r} is missing") from exc


def _read_wrapper(path: Path) -> dict[str, Any]:
    """config.json as written (read_config already checked it exists and parses)."""
    return json.loads(path.read_text())


def _vision_fields(raw: dict[str, Any], model_type: str, head_dim: int, path: Path) -> dict:
    """ModelConfig's vision fields: empty for a text model."""
    if model_type != "qwen2_5_vl":
        return {}
    if "vision_config" not in raw or "image_token_id" not in raw:
        raise EngineError(f"{path}: a Qwen2.5-VL config needs vision_config and image_token_id")
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    section = tuple(int(x) for x in params.get("mrope_section") or ())
    if len(section) != 3 or sum(section) * 2 != head_dim:
        raise EngineError(
            f"{path}: rope mrope_section {list(section)} must be three numbers summing to "
            f"head_dim / 2 = {head_dim // 2}"
        )
    return {
        "vision": VisionConfig.from_json(raw["vision_config"]),
        "image_token_id": int(raw["image_token_id"]),
        "mrope_section": section,
    }


def rope_inv_freq(head_dim: int, rope: RopeConfig):
    """Inverse frequencies [head_dim // 2], computed as transformers does (fp32)."""
    import torch

    inv_freq = 1.0 / (
        rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, rope)
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


def _yarn_inv_freq(head_dim: int, rope: RopeConfig):
    """YaRN: low-frequency dimensions interpolated (divided by `factor`), high-frequency ones
    kept, a linear ramp between (transformers' _compute_yarn_parameters, same op order)."""
    import torch

    def correction_dim(num_rotations: float) -> float:
        return (
            head_dim
            * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))
        ) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)
    dims = torch.arange(head_dim // 2, dtype=torch.float32)
    ramp = torch.clamp((dims - low) / (high - low), 0, 1)
    keep = 1 - ramp  # share of each dimension's extrapolated (unscaled) frequency
    return interpolation * (1 - keep) + extrapolation * keep


def rope_scaling_factor(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise)."""
    return rope.attention_factor if rope.rope_type == "yarn" else 1.0
