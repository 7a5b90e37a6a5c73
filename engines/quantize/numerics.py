"""FP8 (E4M3) and NVFP4 (E2M1 + FP8 block scales) quantize-dequantize in plain PyTorch.

One copy of the low-precision math, shared by the CPU calibration backend (so ModelOpt's
fake-quant forward runs without CUDA) and the reference engine's quantized linears (so a loaded
export computes what the fake-quantized model computed). Each function follows ModelOpt 0.47:
- FP8 per-tensor: `tensor_quant._fp8_eager` (scale = amax / 448, saturate, cast, multiply back);
- NVFP4 blocks: the Triton kernel `fp4_fake_quant_block` and its helpers in
  `kernels/quantization/common/nvfp4_quant.py` (global scale = amax / (6 * 448); per 16-element
  block an FP8-rounded scale; E2M1 rounding with ties as the kernel breaks them);
- NVFP4 unpacking: `NVFP4QTensor` (element 2i in the low nibble, 2i+1 in the high nibble).
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK_SIZE = 16
# E2M1 magnitudes by 3-bit code; bit 3 of a 4-bit code is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# ModelOpt's kernel treats a quantized block scale below this as "no scale" and uses 1.0.
_MIN_BLOCK_SCALE = 1e-5
# Same guard as `_fp8_eager`: an amax this small means an all-zero tensor.
_ZERO_AMAX = 1.0 / (1 << 24)


def fp8_qdq(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Fake-quantize `x` to FP8 E4M3 with one per-tensor scale amax / 448 (any shape)."""
    amax = amax.to(torch.float32)
    safe_amax = torch.where(amax <= _ZERO_AMAX, torch.ones_like(amax), amax)
    scale = FP8_E4M3_MAX / safe_amax
    y = (x.to(torch.float32) * scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return (y.to(torch.float8_e4m3fn).to(torch.float32) * (1 / scale)).to(x.dtype)


def fp8_qdq_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`fp8_qdq` given the exported scale (= amax / 448) instead of amax."""
    return fp8_qdq(x, scale.to(torch.float32) * FP8_E4M3_MAX)


def e2m1_round(magnitude: torch.Tensor) -> torch.Tensor:
    """Round non-negative values (already divided by their block scale) to E2M1 magnitudes.

    Ties go as in ModelOpt's kernel: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
    3.5 -> 4, 5 -> 4 (round half to even code).
    """
    m = magnitude
    return torch.where(
        m <= 0.25,
        0.0,
        torch.where(
            m < 0.75,
            0.5,
            torch.where(
                m <= 1.25,
                1.0,
                torch.where(
                    m < 1.75,
                    1.5,
                    torch.where(
                        m <= 2.5,
                        2.0,
                        torch.where(m < 3.5, 3.0, torch.where(m <= 5.0, 4.0, 6.0)),
                    ),
                ),
            ),
        ),
    ).to(magnitude.dtype)


def nvfp4_block_scales(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Per-block scales of `x` as the kernel computes them, already multiplied back to float.

    x: [..., N] with N % 16 == 0 → [..., N / 16, 1] float32.
    """
    blocks = x.to(torch.float32).unflatten(-1, (-1, NVFP4_BLOCK_SIZE))  # [..., N/16, 16]
    block_amax = blocks.abs().amax(dim=-1, keepdim=True)  # [..., N/16, 1]
    in_fp8_range = (block_amax / (E2M1_MAX * global_scale)).clamp(max=FP8_E4M3_MAX)
    scale = in_fp8_range.to(torch.float8_e4m3fn).to(torch.float32) * global_scale
    return torch.where(scale >= _MIN_BLOCK_SCALE, scale, torch.ones_like(scale))


def nvfp4_qdq(x: torch.Tensor, global_amax: torch.Tensor) -> torch.Tensor:
    """Fake-quantize `x` [..., N] to NVFP4 with dynamic 16-element blocks (N % 16 == 0).

    The global scale is global_amax / (6 * 448): each block's scale is stored in FP8 relative
    to it, exactly the two-level scheme of the exported `weight_scale` / `weight_scale_2`.
    """
    if x.shape[-1] % NVFP4_BLOCK_SIZE:
        raise ValueError(
            f"NVFP4 needs the last dimension to be a multiple of {NVFP4_BLOCK_SIZE}, "
            f"got shape {tuple(x.shape)}"
        )
    global_scale = global_amax.to(torch.float32) / (E2M1_MAX * FP8_E4M3_MAX)
    global_scale = torch.where(global_scale > 0, global_scale, torch.full_like(global_scale, 1e-12))
    blocks = x.to(torch.float32).unflatten(-1, (-1, NVFP4_BLOCK_SIZE))  # [..., N/16, 16]
    scale = nvfp4_block_scales(x, global_scale)  # [..., N/16, 1]
    q = e2m1_round(blocks.abs() / scale) * scale
    y = torch.where(blocks >= 0, q, -q)
    return y.flatten(-2).to(x.dtype)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N/2] (two codes a byte, low nibble first) → float32 [..., N] E2M1 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).long()  # [..., N]
    values = table[codes & 0x7]
    return torch.where(codes & 0x8 != 0, -values, values)


def dequantize_fp8_weight(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """Exported FP8 weight float8_e4m3fn [out, in] and scalar scale → float32 [out, in]."""
    return weight.to(torch.float32) * weight_scale.to(torch.float32)


def dequantize_nvfp4_weight(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor
) -> torch.Tensor:
    """Exported NVFP4 weight → float32 [out, in].

    weight: uint8 [out, in/2]; weight_scale: float8_e4m3fn [out, in/16]; weight_scale_2: fp32
    scalar. w[r, c] = E2M1[code] * weight_scale[r, c // 16] * weight_scale_2.
    """
    values = unpack_e2m1(weight)  # [out, in]
    block_scale = weight_scale.to(torch.float32) * weight_scale_2.to(torch.float32)
    blocks = values.unflatten(-1, (-1, NVFP4_BLOCK_SIZE))  # [out, in/16, 16]
    return (blocks * block_scale.unsqueeze(-1)).flatten(-2)
