"""GPU capability checks for low-precision checkpoints, before any engine touches the GPU.

TensorRT-LLM's own failure on the wrong GPU is an obscure CUTLASS error deep in loading; this
module says which GPU was found, what it supports, and what the checkpoint needs:
- FP8 weights/activations and an FP8 KV cache need compute capability >= 8.9 (Ada, Hopper, ...);
- NVFP4 needs >= 10.0 (Blackwell: B200 is 10.0, RTX Blackwell 12.0).
The checkpoint's needs come from hf_quant_config.json (ModelOpt's unified HF export).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engines.api import EngineError

# quant algo (hf_quant_config.json spelling) -> (minimum compute capability, GPUs that have it)
REQUIREMENTS: dict[str, tuple[tuple[int, int], str]] = {
    "FP8": ((8, 9), "Ada (L4, L40S), Hopper (H100, H200) or newer"),
    "NVFP4": ((10, 0), "Blackwell (B200, GB200, RTX PRO 6000) or newer"),
}


@dataclass(frozen=True)
class DeviceCapability:
    name: str  # e.g. "NVIDIA H200"
    major: int
    minor: int

    @property
    def version(self) -> tuple[int, int]:
        return (self.major, self.minor)

    def __str__(self) -> str:
        return f"{self.name} (compute capability {self.major}.{self.minor})"


@dataclass(frozen=True)
class CheckpointQuantization:
    quant_algo: str | None  # "FP8" | "NVFP4" | None (not quantized)
    kv_cache_quant_algo: str | None  # "FP8" | None


def read_checkpoint_quantization(model_dir: str | Path) -> CheckpointQuantization:
    """What a checkpoint directory is quantized to (None, None for a plain HF checkpoint)."""
    model_dir = Path(model_dir)
    path = model_dir / "hf_quant_config.json"
    if path.is_file():
        try:
            section = json.loads(path.read_text()).get("quantization", {})
        except json.JSONDecodeError as exc:
            raise EngineError(f"{path} is not valid JSON: {exc}") from exc
        return CheckpointQuantization(section.get("quant_algo"), section.get("kv_cache_quant_algo"))
    return CheckpointQuantization(None, None)


def current_device(index: int = 0) -> DeviceCapability:
    """The CUDA device `index`, or an EngineError when no CUDA device is visible."""
    import torch

    if not torch.cuda.is_available():
        raise EngineError(
            "no CUDA device is visible (torch.cuda.is_available() is False); the TensorRT-LLM "
            "engine needs an NVIDIA GPU — use engine.kind: reference on CPU machines"
        )
    major, minor = torch.cuda.get_device_capability(index)
    return DeviceCapability(torch.cuda.get_device_name(index), major, minor)


def required_capability(quant: CheckpointQuantization) -> list[tuple[str, str]]:
    """[(what, algo)] the run needs: the weights' algo and the KV cache's."""
    needs = []
    if quant.quant_algo is not None:
        if quant.quant_algo not in REQUIREMENTS:
            raise EngineError(
                f"checkpoint quant_algo {quant.quant_algo!r} is not supported; "
                f"supported: {', '.join(REQUIREMENTS)}"
            )
        needs.append((f"{quant.quant_algo} weights", quant.quant_algo))
    if quant.kv_cache_quant_algo == "FP8":
        needs.append(("an FP8 KV cache", "FP8"))
    return needs


def check_quantization_support(
    model_dir: str | Path,
    kv_cache_dtype: str = "auto",
    device: DeviceCapability | None = None,
) -> DeviceCapability:
    """Raise EngineError unless the GPU can run the checkpoint's low-precision formats."""
    quant = read_checkpoint_quantization(model_dir)
    if kv_cache_dtype == "fp8" and quant.kv_cache_quant_algo != "FP8":
        raise EngineError(
            f"engine.kv_cache_dtype is fp8 but {model_dir} has no FP8 KV cache scales "
            "(kv_cache_quant_algo in hf_quant_config.json); build it with "
            "`tokenmill quantize ... --kv-cache fp8` or set kv_cache_dtype: auto"
        )
    return check_capability(quant, str(model_dir), device)


def check_capability(
    quant: CheckpointQuantization, source: str, device: DeviceCapability | None = None
) -> DeviceCapability:
    """Raise EngineError unless `device` (default: CUDA device 0) supports `quant`."""
    device = device or current_device()
    for what, algo in required_capability(quant):
        minimum, gpus = REQUIREMENTS[algo]
        if device.version < minimum:
            raise EngineError(
                f"{source} needs {what}, which needs compute capability >= "
                f"{minimum[0]}.{minimum[1]} ({gpus}); this GPU is {device}. Use a checkpoint "
                f"quantized for this GPU (FP8 needs 8.9+, NVFP4 10.0+) or the unquantized one"
            )
    return device
