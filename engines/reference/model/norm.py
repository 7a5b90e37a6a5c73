"""RMSNorm as transformers computes it, shared by the decoder and the vision encoder."""

from __future__ import annotations

import torch
from torch import nn

from engines.reference.model import cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, fp32_weight: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps
        # GPT-OSS: the weight stays fp32 in a bf16 model (the loader reads `param_dtype`) and
        # the product is rounded once, after the multiply, as transformers' GptOssRMSNorm.
        self.param_dtype = torch.float32 if fp32_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype != x.dtype:
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (self.weight * x32).to(x.dtype)
        if cpu_kernels.use_kernels(x.device):
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        # Same order of operations as transformers (fp32 statistics) so greedy ids match.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
