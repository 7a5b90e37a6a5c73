"""MXFP4 expert weights (GPT-OSS checkpoints): the packed `*_blocks` / `*_scales` layout,
dequantized once at load into the compute dtype, and the packing for tiny test checkpoints.

Layout (what transformers' integrations/mxfp4.py reads): a weight of R output rows and C input
columns is stored row by row in groups of 32 columns.
- `*_blocks` uint8 [..., R, C / 32, 16]: each byte holds two E2M1 (FP4) codes, the lower nibble
  the even column, the upper nibble the odd one. Code bit 3 is the sign, bits 0-2 index
  0, 0.5, 1, 1.5, 2, 3, 4, 6.
- `*_scales` uint8 [..., R, C / 32]: one power-of-two scale per group, E8M0 with bias 127.
value = FP4[code] * 2 ** (scale - 127): every value is exact in bf16 and fp32, so dequantizing
into either dtype gives the same numbers as transformers' own dequantization.

GPT-OSS stores `gate_up_proj_blocks` as [E, 2I, H / 32, 16] (rows: gate/up outputs) and
`down_proj_blocks` as [E, H, I / 32, 16]; dequantized and transposed they are the model's
`gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H].
"""

from __future__ import annotations

import torch

_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = (*_MAGNITUDES, *(-m for m in _MAGNITUDES))  # code -> value; bit 3 is the sign
GROUP = 32  # columns per scale
SCALE_BIAS = 127
_ROWS_PER_CHUNK = 4096  # weight rows dequantized at a time


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., R, G, 16] uint8 codes and [..., R, G] uint8 scales -> [..., R, G * 32] in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.shape[-1] != GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: "
            f"expected blocks [..., G, {GROUP // 2}] and scales [..., G]"
        )
    # Each byte's two values at once: one gather from a [256, 2] table per byte; each scale
    # one gather from the 256 powers of two. Products of the two are exact in bf16 and fp32.
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    pairs = torch.stack([lut.repeat(16), lut.repeat_interleave(16)], dim=-1).to(dtype)  # [256, 2]
    powers = torch.ldexp(torch.ones(256), torch.arange(256) - SCALE_BIAS).to(dtype)  # [256]
    rows = blocks.reshape(-1, blocks.shape[-2], GROUP // 2)  # [N, G, 16]
    row_scales = scales.reshape(-1, scales.shape[-1])  # [N, G]
    out = torch.empty(rows.shape[0], rows.shape[1], GROUP, dtype=dtype)  # [N, G, 32]
    # In chunks of rows: the intermediates of a whole expert tensor of a released checkpoint
    # would take several times its dequantized size.
    for start in range(0, rows.shape[0], _ROWS_PER_CHUNK):
        chunk = slice(start, start + _ROWS_PER_CHUNK)
        values = pairs[rows[chunk].int()].flatten(-2)  # [n, G, 32]
        torch.mul(values, powers[row_scales[chunk].int()].unsqueeze(-1), out=out[chunk])
    return out.view(*blocks.shape[:-2], -1)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., R, C] float -> (blocks [..., R, C / 32, 16], scales [..., R, C / 32]) uint8: each
    group's scale is the power of two that brings its largest magnitude into FP4's range
    (<= 6), each value the nearest FP4 code. For building test checkpoints, not for quality."""
    if weight.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs a multiple of {GROUP} columns, got {weight.shape[-1]}")
    groups = weight.float().unflatten(-1, (-1, GROUP))  # [..., R, G, 32]
    amax = groups.abs().amax(-1).clamp(min=2.0**-100)  # [..., R, G]
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    magnitudes = torch.tensor(_MAGNITUDES)
    index = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)  # [..., R, G, 32]
    codes = (index | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., R, G, 16]
    return blocks, (exponent + SCALE_BIAS).to(torch.uint8)
