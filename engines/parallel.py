"""How many devices an engine's parallel settings span, per engine kind (no heavy imports).

Used twice: when a job spec is parsed (the product must equal resources.devices_per_actor, so a
mismatch fails before any GPU is reserved) and by the adapters (EngineInfo.num_devices).

- trtllm: tensor_parallel_size x pipeline_parallel_size x context_parallel_size. TensorRT-LLM
  maps its MoE sizes and attention data parallel onto the tensor-parallel ranks (its Mapping:
  moe_tp x moe_ep x moe_cluster == tp), so those add no devices; when set, their product must
  equal tensor_parallel_size.
- vllm: tensor_parallel_size x pipeline_parallel_size x data_parallel_size (expert parallel
  reuses the tp x dp ranks).
- reference: one device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from engines.api import EngineError

# The settings whose product is the engine's device count, per kind.
DEVICE_FACTORS: dict[str, tuple[str, ...]] = {
    "trtllm": ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size"),
    "vllm": ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"),
    "reference": (),
}
# TensorRT-LLM's MoE sizes: when set, they split the tensor-parallel ranks among themselves.
TRTLLM_MOE_FACTORS = (
    "moe_tensor_parallel_size",
    "moe_expert_parallel_size",
    "moe_cluster_parallel_size",
)


def _size(settings: Mapping[str, Any], name: str) -> int:
    value = settings.get(name)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EngineError(f"engine.extra.{name} must be a whole number >= 1, got {value!r}")
    return value


def engine_devices(kind: str, settings: Mapping[str, Any]) -> int:
    """Devices an engine of `kind` spans with these settings (engine.extra); raises EngineError
    naming the field when a size is not a positive whole number or the MoE sizes do not fit."""
    factors = DEVICE_FACTORS.get(kind, ())
    devices = math.prod(_size(settings, name) for name in factors)
    if kind == "trtllm":
        tp = _size(settings, "tensor_parallel_size")
        moe = {n: settings[n] for n in TRTLLM_MOE_FACTORS if settings.get(n) not in (None, -1)}
        if moe:
            product = math.prod(_size(moe, n) for n in moe)
            if product != tp:
                sizes = " x ".join(f"engine.extra.{n} {v}" for n, v in moe.items())
                raise EngineError(
                    f"{sizes} = {product}, but TensorRT-LLM splits the tensor-parallel ranks "
                    f"among them: the product must equal engine.extra.tensor_parallel_size {tp}"
                )
    return devices
