"""Qwen2.5-VL's vision encoder: pixels of one image in, one embedding per image token out.

The image processor (transformers' Qwen2VLImageProcessor, run in the prompt stage) cuts an
image into 14x14 patches (two identical frames deep: the encoder is shared with video) and
lays them out block-major, each `spatial_merge_size`^2 block of neighbours consecutive. The
encoder embeds each patch (a Conv3d whose stride is its kernel: one matmul per patch), runs
`depth` pre-norm blocks with 2D rotary attention, and the merger folds each block of
neighbours into one token of the language model's width.

Blocks attend within windows of `window_size` pixels, except those in
`fullatt_block_indexes`, which attend over the whole image. Windows are contiguous runs once
the merged blocks are put in window order, so the encoder reorders its rows once at the
start and back once at the end (as transformers does), and a windowed block is SDPA per run.

The engine encodes one image at a time (each image's attention is its own anyway), when the
first prefill chunk that reaches its tokens is built; module names match the checkpoints'
`visual.*` tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engines.reference.model.mlp import MLP
from engines.reference.model.norm import RMSNorm


@dataclass(frozen=True)
class VisionConfig:
    """The `vision_config` of a Qwen2.5-VL config.json."""

    depth: int  # encoder blocks
    hidden_size: int  # the encoder's width
    intermediate_size: int  # its SwiGLU MLP's width
    num_heads: int
    out_hidden_size: int  # the merger's output: the language model's hidden size
    patch_size: int  # pixels per patch side (14)
    spatial_merge_size: int  # patches per merged token side (2)
    temporal_patch_size: int  # frames per patch (2; an image is repeated to fill them)
    window_size: int  # window side in pixels for the windowed blocks
    fullatt_block_indexes: tuple[int, ...]  # blocks that attend over the whole image
    in_channels: int = 3

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> VisionConfig:
        return cls(
            depth=int(raw["depth"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_heads=int(raw["num_heads"]),
            out_hidden_size=int(raw["out_hidden_size"]),
            patch_size=int(raw.get("patch_size", 14)),
            spatial_merge_size=int(raw.get("spatial_merge_size", 2)),
            temporal_patch_size=int(raw.get("temporal_patch_size", 2)),
            window_size=int(raw.get("window_size", 112)),
            fullatt_block_indexes=tuple(int(i) for i in raw.get("fullatt_block_indexes", ())),
            in_channels=int(raw.get("in_channels", 3)),
        )

    @property
    def patch_dim(self) -> int:
        """Values per patch row of `pixel_values`: channels x frames x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """Image tokens (placeholders in the prompt) for an image of patch grid (t, h, w)."""
        t, h, w = grid_thw
        return t * h * w // self.spatial_merge_size**2


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, stride=kernel, bias=False)
        self.shape = (cfg.in_channels, *kernel)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, patch_dim] -> [N, hidden]
        x = pixels.to(self.proj.weight.dtype).view(-1, *self.shape)
        return self.proj(x).view(x.shape[0], -1)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]
        cos: torch.Tensor,  # [N, 1, head_dim] fp32
        sin: torch.Tensor,
        runs: list[int],  # lengths of the contiguous runs that attend among themselves
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # 3 x [N, H, D]
        # Rotated in fp32 and rounded back, as transformers' apply_rotary_pos_emb_vision.
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [H, N, D]
        if len(runs) == 1:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            parts = zip(q.split(runs, 1), k.split(runs, 1), v.split(runs, 1), strict=True)
            out = torch.cat([F.scaled_dot_product_attention(*p) for p in parts], dim=1)
        return self.proj(out.transpose(0, 1).reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, 1e-6)
        self.norm2 = RMSNorm(cfg.hidden_size, 1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, bias=True)

    def forward(self, x, cos, sin, runs: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, runs)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size, 1e-6)
        # Indexes 0 and 2 as the checkpoints' `merger.mlp.0` / `merger.mlp.2` (1 is the GELU).
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, cfg.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionEncoder(nn.Module):
    """`visual.*`: patch embedding, blocks, merger."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        # Rows and columns each rotate a quarter of a head's dimensions (half of its pairs).
        self.rotary = cfg.hidden_size // cfg.num_heads // 2

    @torch.inference_mode()
    def forward(
        self, pixels: torch.Tensor, grid_thw: tuple[int, int, int]
    ) -> torch.Tensor:  # [t*h*w, patch_dim] -> [tokens, out_hidden]
        cfg = self.cfg
        t, h, w = grid_thw
        unit = cfg.spatial_merge_size**2
        if pixels.shape != (t * h * w, cfg.patch_dim):
            raise ValueError(
                f"pixel_values of shape {tuple(pixels.shape)} do not match the grid {grid_thw} "
                f"({t * h * w} patches of {cfg.patch_dim} values)"
            )
        order, windows = window_order(grid_thw, cfg)
        x = self.patch_embed(pixels)  # [N, hidden], block-major
        x = x.view(-1, unit, x.shape[-1])[order].view(x.shape[0], -1)
        freqs = self._rotary(grid_thw).view(-1, unit, self.rotary)[order]
        emb = torch.cat([freqs, freqs], dim=-1).view(x.shape[0], 1, -1)
        cos, sin = emb.cos(), emb.sin()
        for i, block in enumerate(self.blocks):
            runs = [x.shape[0]] if i in cfg.fullatt_block_indexes else windows
            x = block(x, cos, sin, runs)
        merged = self.merger(x)  # [tokens, out_hidden], window order
        return merged[torch.argsort(order)]

    def _rotary(self, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """Each patch's (row, column) angles, [N, rotary] fp32, block-major like the pixels."""
        t, h, w = grid_thw
        m = self.cfg.spatial_merge_size
        rows = torch.arange(h).view(h, 1).expand(h, w)
        cols = torch.arange(w).view(1, w).expand(h, w)
        rows = rows.reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
        cols = cols.reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
        steps = torch.arange(0, self.rotary, 2, dtype=torch.float)
        inv = 1.0 / (10000.0 ** (steps / self.rotary))  # [rotary / 2], as transformers
        angles = torch.cat([rows[:, None] * inv, cols[:, None] * inv], dim=-1)  # [h*w, rotary]
        return angles.repeat(t, 1)


def window_order(
    grid_thw: tuple[int, int, int], cfg: VisionConfig
) -> tuple[torch.Tensor, list[int]]:
    """The merged blocks in window order, and each window's length in patches (rows of the
    reordered sequence). Windows tile the merged grid from its top-left corner; edge windows
    are smaller."""
    t, h, w = grid_thw
    m = cfg.spatial_merge_size
    side = cfg.window_size // m // cfg.patch_size  # merged blocks per window side
    gh, gw = h // m, w // m
    index = torch.arange(t * gh * gw).view(t, gh, gw)
    order: list[torch.Tensor] = []
    runs: list[int] = []
    for frame in range(t):
        for top in range(0, gh, side):
            for left in range(0, gw, side):
                window = index[frame, top : top + side, left : left + side].flatten()
                order.append(window)
                runs.append(window.numel() * m * m)
    return torch.cat(order), runs


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
