"""Load a Hugging Face checkpoint (safetensors, single file or sharded) into CausalLM.

Order: build the model on the meta device (no memory, no random init) → read every tensor →
split stacked Mixture-of-Experts tensors into the per-expert names the model uses (GPT-OSS's
MXFP4-packed experts dequantized first, engines.reference.model.mxfp4) → if
`hf_quant_config.json` exists, hand the model and tensors to
`engines.reference.model.quant.apply_quantized_checkpoint`, which swaps linears for quantized ones
and consumes their scale tensors → fill every parameter still on meta from the tensor of the
same dotted name (cast to the compute dtype) → FP8 KV scales left in the checkpoint become
`Attention.k_scale` / `v_scale` → any tensor left unread is an error naming it (a dropped
bias or norm would otherwise load "fine" and generate garbage) → move to the device → fuse
q/k/v and gate/up.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engines.api import EngineError
from engines.reference.model import mxfp4
from engines.reference.model.config import ModelConfig
from engines.reference.model.linear import pack_head, pack_linears
from engines.reference.model.model import CausalLM, fuse_projections
from engines.reference.model.moe import fuse_experts


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards named by the index, or the one file."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise EngineError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = [model_dir / "model.safetensors"]
        if not files[0].exists():
            files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise EngineError(
            f"{model_dir}: no model.safetensors or model.safetensors.index.json; "
            "the reference engine loads safetensors checkpoints only"
        )
    for path in files:
        if not path.exists():
            raise EngineError(f"{path} is missing (named by the checkpoint index)")
    return files


def read_tensors(files: list[Path]) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """All tensors by name, and the file each came from (for error messages)."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensors[name] = handle.get_tensor(name)
                    origin[name] = path
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise EngineError(f"{path}: cannot read safetensors file ({exc})") from exc
    return tensors, origin


def _rename_wrapped(tensors: dict[str, torch.Tensor], origin: dict[str, Path]) -> None:
    """Qwen2.5-VL checkpoints as transformers 4.5x saved them (`model.language_model.*`,
    `model.visual.*`) under the released checkpoints' names (`model.*`, `visual.*`)."""
    for old in [n for n in tensors if n.startswith(("model.language_model.", "model.visual."))]:
        new = old.replace("model.language_model.", "model.", 1)
        new = new.replace("model.visual.", "visual.", 1)
        tensors[new] = tensors.pop(old)
        origin[new] = origin.pop(old)


def _split_fused_experts(tensors: dict[str, torch.Tensor], origin: dict[str, Path]) -> None:
    """Qwen3-MoE experts as per-expert tensors, in place.

    Hub checkpoints (and transformers' own save_pretrained, which converts back) store each
    expert's projections: `mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`. The
    transformers 5 model holds them stacked, `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows
    first, then up) and `mlp.experts.down_proj` [E, H, I], and a checkpoint written from that
    layout without conversion keeps it; those are split here into the per-expert names."""
    for name in [n for n in tensors if n.endswith(".mlp.experts.gate_up_proj")]:
        prefix = name.removesuffix("gate_up_proj")
        fused = tensors.pop(name)  # [E, 2I, H]
        path = origin.pop(name)
        if fused.dim() != 3 or fused.shape[1] % 2:
            raise EngineError(
                f"{path}: tensor {name!r} has shape {tuple(fused.shape)}; expected "
                "[num_experts, 2 * moe_intermediate_size, hidden_size]"
            )
        gate, up = fused.chunk(2, dim=1)  # [E, I, H] each
        for expert in range(fused.shape[0]):
            for proj, weight in (("gate_proj", gate), ("up_proj", up)):
                split = f"{prefix}{expert}.{proj}.weight"
                tensors[split], origin[split] = weight[expert], path
    for name in [n for n in tensors if n.endswith(".mlp.experts.down_proj")]:
        prefix = name.removesuffix("down_proj")
        fused = tensors.pop(name)  # [E, H, I]
        path = origin.pop(name)
        for expert in range(fused.shape[0]):
            split = f"{prefix}{expert}.down_proj.weight"
            tensors[split], origin[split] = fused[expert], path


_MXFP4_BLOCKS = (".mlp.experts.gate_up_proj_blocks", ".mlp.experts.down_proj_blocks")
_MXFP4_SCALES = (".mlp.experts.gate_up_proj_scales", ".mlp.experts.down_proj_scales")


def _split_gpt_oss_experts(
    tensors: dict[str, torch.Tensor], origin: dict[str, Path], dtype: torch.dtype
) -> None:
    """GPT-OSS experts as per-expert linears (GptOssExpert), in place.

    Checkpoints hold per layer `mlp.experts.gate_up_proj` [E, H, 2I] (x @ W layout, gate and up
    columns interleaved) with `gate_up_proj_bias` [E, 2I], and `down_proj` [E, I, H] with
    `down_proj_bias` [E, H]; the released ones store the two weights MXFP4-packed instead
    (`*_blocks` / `*_scales`), dequantized here into `dtype`. Each expert becomes
    `mlp.experts.{e}.gate_up_proj` ([gate | up] rows, [2I, H]) and `down_proj` ([H, I])."""
    for name in [n for n in tensors if n.endswith(_MXFP4_BLOCKS)]:
        stem = name.removesuffix("_blocks")
        path = origin.pop(name)
        blocks = tensors.pop(name)
        scales = tensors.pop(f"{stem}_scales", None)
        origin.pop(f"{stem}_scales", None)
        if scales is None:
            raise EngineError(f"{path}: {name!r} has no {stem + '_scales'!r} beside it")
        try:
            weight = mxfp4.dequantize(blocks, scales, dtype)  # [E, R, C]
        except ValueError as exc:
            raise EngineError(f"{path}: {name!r}: {exc}") from exc
        tensors[stem], origin[stem] = weight.transpose(1, 2), path  # [E, C, R]
    for name in [n for n in tensors if n.endswith(_MXFP4_SCALES)]:
        blocks = name.removesuffix("_scales") + "_blocks"
        raise EngineError(f"{origin[name]}: {name!r} has no {blocks!r} beside it")
    for name in [n for n in tensors if n.endswith(".mlp.experts.gate_up_proj")]:
        prefix = name.removesuffix("gate_up_proj")
        path = origin.pop(name)
        weight = tensors.pop(name)  # [E, H, 2I]
        bias = tensors.pop(f"{name}_bias", None)  # [E, 2I]
        origin.pop(f"{name}_bias", None)
        if weight.dim() != 3 or weight.shape[2] % 2 or bias is None:
            raise EngineError(
                f"{path}: tensor {name!r} has shape {tuple(weight.shape)}"
                f"{'' if bias is not None else ' and no gate_up_proj_bias'}; expected "
                "[num_local_experts, hidden_size, 2 * intermediate_size] and its bias"
            )
        for expert in range(weight.shape[0]):
            rows = weight[expert].t()  # [2I, H], gate at even rows, up at odd
            split = f"{prefix}{expert}.gate_up_proj"
            tensors[f"{split}.weight"] = torch.cat([rows[0::2], rows[1::2]])
            tensors[f"{split}.bias"] = torch.cat([bias[expert, 0::2], bias[expert, 1::2]])
            origin[f"{split}.weight"] = origin[f"{split}.bias"] = path
    for name in [n for n in tensors if n.endswith(".mlp.experts.down_proj")]:
        prefix = name.removesuffix("down_proj")
        path = origin.pop(name)
        weight = tensors.pop(name)  # [E, I, H]
        bias = tensors.pop(f"{name}_bias", None)  # [E, H]
        origin.pop(f"{name}_bias", None)
        if weight.dim() != 3 or bias is None:
            raise EngineError(
                f"{path}: tensor {name!r} has shape {tuple(weight.shape)}"
                f"{'' if bias is not None else ' and no down_proj_bias'}; expected "
                "[num_local_experts, intermediate_size, hidden_size] and its bias"
            )
        for expert in range(weight.shape[0]):
            split = f"{prefix}{expert}.down_proj"
            tensors[f"{split}.weight"] = weight[expert].t()
            tensors[f"{split}.bias"] = bias[expert]
            origin[f"{split}.weight"] = origin[f"{split}.bias"] = path


def _apply_quantization(model: CausalLM, tensors: dict[str, torch.Tensor], model_dir: Path):
    quant_path = model_dir / "hf_quant_config.json"
    if not quant_path.exists():
        return
    try:
        quant_config = json.loads(quant_path.read_text())
    except json.JSONDecodeError as exc:
        raise EngineError(f"{quant_path} is not valid JSON: {exc}") from exc
    try:
        # optional: quantized checkpoints need torchao/modelopt pieces (ImportError says which)
        from engines.reference.model.quant import apply_quantized_checkpoint
    except ImportError as exc:
        raise EngineError(
            f"{model_dir} is a quantized checkpoint ({quant_path.name}); "
            "quantized checkpoints need engines.reference.model.quant"
        ) from exc
    try:
        apply_quantized_checkpoint(model, tensors, quant_config)
    except (ValueError, KeyError) as exc:
        raise EngineError(f"{model_dir}: cannot load the quantized checkpoint: {exc}") from exc


def _apply_kv_scales(model: CausalLM, tensors: dict[str, torch.Tensor]) -> None:
    # ModelOpt stores the FP8 KV scales on the k/v projections; attention applies them.
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        for kind in ("k", "v"):
            name = f"model.layers.{i}.self_attn.{kind}_proj.{kind}_scale"
            if name in tensors and getattr(attn, f"{kind}_scale") is None:
                setattr(attn, f"{kind}_scale", float(tensors.pop(name).float().item()))


def _fill_meta(
    model: CausalLM,
    tensors: dict[str, torch.Tensor],
    origin: dict[str, Path],
    dtype: torch.dtype,
    model_dir: Path,
) -> set[str]:
    """Fill the meta parameters and buffers by name; returns the checkpoint names read."""
    used: set[str] = set()
    filled: dict[int, torch.Tensor] = {}  # id(meta tensor) -> loaded; keeps tied weights tied
    for module_name, module in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for local, value in list(getattr(module, kind).items()):
                if value is None or value.device.type != "meta":
                    continue
                if id(value) in filled:
                    getattr(module, kind)[local] = filled[id(value)]
                    continue
                name = f"{module_name}.{local}" if module_name else local
                if name not in tensors:
                    raise EngineError(
                        f"{model_dir}: tensor {name!r} is missing from the checkpoint "
                        f"({', '.join(sorted({p.name for p in origin.values()})) or 'no files'})"
                    )
                tensor = tensors[name]
                used.add(name)
                if tuple(tensor.shape) != tuple(value.shape):
                    raise EngineError(
                        f"{origin[name]}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"config.json implies {tuple(value.shape)}"
                    )
                if tensor.is_floating_point():
                    # A module may pin its parameters' dtype (GPT-OSS's fp32 norm weights).
                    tensor = tensor.to(getattr(module, "param_dtype", None) or dtype)
                if kind == "_parameters":
                    tensor = torch.nn.Parameter(tensor, requires_grad=False)
                filled[id(value)] = tensor
                getattr(module, kind)[local] = tensor
    return used


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    """Checkpoint tensors that are legitimately left unread (transformers skips them too)."""
    # Rotary inverse frequencies some older exports saved as buffers: the engine derives them
    # from config.json (rope_theta / rope_parameters), which is what the model was run with.
    if name.endswith(".rotary_emb.inv_freq"):
        return True
    # Tied embeddings: the LM head IS embed_tokens; an exporter may still write the copy.
    # transformers ties over it too, so reading it would diverge from the reference.
    return cfg.tie_word_embeddings and name == "lm_head.weight"


def _check_all_used(
    tensors: dict[str, torch.Tensor],
    used: set[str],
    origin: dict[str, Path],
    cfg: ModelConfig,
    model_dir: Path,
) -> None:
    # Quantization scales and FP8 KV scales are not in this check by construction: quant.py
    # and _apply_kv_scales pop what they consume, so a scale still here had no home either.
    unused = sorted(n for n in tensors if n not in used and not _ignorable(n, cfg))
    if not unused:
        return
    files = sorted({origin[n].name for n in unused if n in origin})
    shown = ", ".join(repr(n) for n in unused[:8])
    more = f" and {len(unused) - 8} more" if len(unused) > 8 else ""
    raise EngineError(
        f"{model_dir}: {len(unused)} checkpoint tensor(s) are not used by the "
        f"{cfg.model_type} model that config.json describes: {shown}{more} "
        f"(in {', '.join(files)}); config.json and the weights disagree (e.g. a bias flag such "
        "as attention_bias / mlp_bias, tie_word_embeddings, num_hidden_layers, or "
        "num_experts / num_local_experts / mlp_only_layers / decoder_sparse_step)"
    )


def load_model(
    model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
) -> CausalLM:
    """Build CausalLM from `model_dir`'s weights in `dtype` on `device`, ready for inference."""
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    tensors, origin = read_tensors(files)
    if cfg.vision is not None:
        _rename_wrapped(tensors, origin)
    if cfg.moe is not None and cfg.moe.style == "gpt_oss":
        _split_gpt_oss_experts(tensors, origin, dtype)
    elif cfg.moe is not None:
        _split_fused_experts(tensors, origin)
    with torch.device("meta"):
        model = CausalLM(cfg)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _apply_quantization(model, tensors, model_dir)
    _apply_kv_scales(model, tensors)
    used = _fill_meta(model, tensors, origin, dtype, model_dir)
    _check_all_used(tensors, used, origin, cfg, model_dir)
    model = model.to(device).eval().requires_grad_(False)
    fuse_projections(model)
    fuse_experts(model)  # takes the experts' fused gate/up before pack_linears reorders them
    pack_head(model)
    pack_linears(model)  # after fusing: the fused matmuls are the ones to reorder
    return model
