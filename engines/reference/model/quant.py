"""Quantized linear layers for ModelOpt exports (unified HF layout), and the loader hook.

The reference engine computes in high precision: it dequantizes the exported weights once at
load and applies ModelOpt's activation quantize-dequantize at run time, so its outputs equal the
fake-quantized model that the quality gate scored (a check that the export is read right, not a
fast kernel; fast low-precision GEMMs are TensorRT-LLM's job).

- FP8: weight float8_e4m3fn [out, in] * weight_scale (scalar); input fake-quantized to FP8 with
  the per-tensor input_scale.
- NVFP4: weight uint8 [out, in/2] (E2M1 pairs) * weight_scale (FP8 [out, in/16]) *
  weight_scale_2 (scalar); input fake-quantized to NVFP4 in dynamic 16-element blocks whose
  FP8 scales are relative to the global input_scale (= input amax / (6 * 448)).
- FP8 KV cache: `k_scale` / `v_scale` (scalars, saved under k_proj / v_proj) are set on the
  attention module; the engine fake-quantizes K (after RoPE) and V with them when it writes
  the cache.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from engines.quantize.numerics import (
    E2M1_MAX,
    FP8_E4M3_MAX,
    dequantize_fp8_weight,
    dequantize_nvfp4_weight,
    fp8_qdq_scale,
    nvfp4_qdq,
)

QUANT_ALGOS = ("FP8", "NVFP4")


class _DequantizedLinear(nn.Module):
    """Holds the dequantized weight [out, in] and bias; subclasses quantize the input."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def _params(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The loader builds the model on the meta device and casts only plain parameters, so
        # the buffers may still be float32 in a bfloat16 model: follow the activations (once;
        # a model computes in one dtype).
        if self.weight.dtype != dtype:
            self.weight = self.weight.to(dtype)
            if self.bias is not None:
                self.bias = self.bias.to(dtype)
        return self.weight, self.bias


class Fp8Linear(_DequantizedLinear):
    """y = fp8_qdq(x; input_scale) @ (weight * weight_scale)^T + bias."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"FP8 weight must be float8_e4m3fn, got {weight.dtype}")
        # weight: [out, in] in the compute dtype.
        self.register_buffer("weight", dequantize_fp8_weight(weight, weight_scale).to(dtype))
        self.register_buffer("input_scale", input_scale.reshape(()).to(torch.float32))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] → [..., out]
        return F.linear(fp8_qdq_scale(x, self.input_scale), *self._params(x.dtype))


class Nvfp4Linear(_DequantizedLinear):
    """y = nvfp4_qdq(x; input_scale) @ dequant(weight)^T + bias."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_scale_2: torch.Tensor,
        input_scale: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if weight.dtype != torch.uint8:
            raise ValueError(f"NVFP4 weight must be packed uint8, got {weight.dtype}")
        dequant = dequantize_nvfp4_weight(weight, weight_scale, weight_scale_2)  # [out, in]
        self.register_buffer("weight", dequant.to(dtype))
        # The activation quantizer's global amax; ModelOpt exports it as amax / (6 * 448).
        amax = input_scale.reshape(()).to(torch.float32) * (E2M1_MAX * FP8_E4M3_MAX)
        self.register_buffer("input_amax", amax)
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        self.in_features, self.out_features = dequant.shape[1], dequant.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] → [..., out]
        return F.linear(nvfp4_qdq(x, self.input_amax), *self._params(x.dtype))


def quant_algo(quant_config: dict[str, Any]) -> tuple[str, str | None]:
    """(quant_algo, kv_cache_quant_algo) from hf_quant_config.json (whole file or its
    `quantization` section) or config.json's `quantization_config`."""
    section = quant_config.get("quantization", quant_config)
    algo = section.get("quant_algo")
    if algo not in QUANT_ALGOS:
        raise ValueError(
            f"quant_algo {algo!r} is not supported by the reference engine; "
            f"supported: {', '.join(QUANT_ALGOS)}"
        )
    return algo, section.get("kv_cache_quant_algo")


def apply_quantized_checkpoint(
    model: nn.Module, tensors: dict[str, torch.Tensor], quant_config: dict[str, Any]
) -> None:
    """Swap the model's quantized projections for Fp8Linear / Nvfp4Linear, in place.

    `tensors` maps checkpoint names (model.layers.0.self_attn.q_proj.weight, ...) to tensors;
    the entries used here (weight, weight_scale, weight_scale_2, input_scale, bias, k_scale,
    v_scale of quantized layers) are removed from it, so the caller loads what remains (norms,
    embeddings, lm_head) as usual. Module names must match the checkpoint names. Raises
    ValueError naming the tensors if the export holds quantized layers the model lacks.
    """
    algo, kv_algo = quant_algo(quant_config)
    modules = dict(model.named_modules())
    quantized_names = sorted(
        name.removesuffix(".weight_scale") for name in tensors if name.endswith(".weight_scale")
    )
    missing = [name for name in quantized_names if not isinstance(modules.get(name), nn.Linear)]
    if missing:
        raise ValueError(
            f"quantized layers {missing[:4]}{'...' if len(missing) > 4 else ''} have no matching "
            "nn.Linear module in the model; the checkpoint's layer names must match the model's"
        )
    for name in quantized_names:
        linear = modules[name]
        # A model built on the meta device has no real dtype yet: keep float32 then.
        dtype = torch.float32 if linear.weight.is_meta else linear.weight.dtype
        take = lambda suffix, name=name: tensors.pop(f"{name}.{suffix}", None)  # noqa: E731
        weight, weight_scale = take("weight"), take("weight_scale")
        input_scale, bias = take("input_scale"), take("bias")
        if weight is None or input_scale is None:
            raise ValueError(f"{name}: the export lacks weight or input_scale")
        if algo == "FP8":
            new: nn.Module = Fp8Linear(weight, weight_scale, input_scale, bias, dtype)
        else:
            weight_scale_2 = take("weight_scale_2")
            if weight_scale_2 is None:
                raise ValueError(f"{name}: an NVFP4 export needs weight_scale_2")
            new = Nvfp4Linear(weight, weight_scale, weight_scale_2, input_scale, bias, dtype)
        if (new.out_features, new.in_features) != (linear.out_features, linear.in_features):
            raise ValueError(
                f"{name}: export shape [{new.out_features}, {new.in_features}] != model "
                f"[{linear.out_features}, {linear.in_features}]"
            )
        parent_name, _, child = name.rpartition(".")
        if not linear.weight.is_meta:
            new = new.to(linear.weight.device)
        setattr(modules[parent_name] if parent_name else model, child, new)
    if kv_algo is not None:
        _apply_kv_scales(model, modules, tensors, kv_algo)


def _apply_kv_scales(
    model: nn.Module, modules: dict[str, nn.Module], tensors: dict[str, torch.Tensor], algo: str
) -> None:
    if algo != "FP8":
        raise ValueError(f"kv_cache_quant_algo {algo!r} is not supported; supported: FP8")
    names = sorted(n for n in tensors if n.endswith((".k_proj.k_scale", ".v_proj.v_scale")))
    if not names:
        raise ValueError("kv_cache_quant_algo is FP8 but the export has no k_scale / v_scale")
    for name in names:
        attention_name = name.rsplit(".", 2)[0]  # model.layers.N.self_attn
        attention = modules.get(attention_name)
        if attention is None:
            raise ValueError(f"{name}: no attention module {attention_name!r} in the model")
        attr = name.rsplit(".", 1)[1]  # k_scale | v_scale
        setattr(attention, attr, float(tensors.pop(name).float().item()))
