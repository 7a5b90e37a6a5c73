"""The SwiGLU MLP: a dense layer's MLP, and each expert of a Mixture-of-Experts layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.reference.model import cpu_kernels
from engines.reference.model.linear import linear_add


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.gate_up_proj: nn.Module | None = None  # set by model.fuse_projections

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        if self.gate_up_proj is not None and cpu_kernels.use_kernels(x.device):
            return self.down_proj(cpu_kernels.silu_mul(self.gate_up_proj(x)))
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # 2 x [T, intermediate]
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + MLP(x) on the CPU kernels' path (gate/up fused)."""
        if self.gate_up_proj is None:
            return residual + self(x)
        return linear_add(self.down_proj, cpu_kernels.silu_mul(self.gate_up_proj(x)), residual)
