"""Linear layers on CPU through oneDNN, with each weight reordered once into oneDNN's blocked
layout.

Why: `nn.Linear` on CPU goes to MKL's sgemm, which on the AMD EPYC (Zen 4) machines measured
here reaches 170-240 GFLOP/s at the engine's shapes (hidden 512, 32-1024 rows, 2 threads),
while oneDNN's inner-product primitive with a pre-reordered weight reaches 400-550 GFLOP/s on
the same shapes (and vLLM's CPU build uses oneDNN for the same reason). The reorder is done at
load time, so a step pays no layout conversion. Results differ from sgemm only by summation
order (fp32: about 1e-6 relative), within what the greedy parity tests already tolerate from
the fused q/k/v and gate/up projections.

Only plain `nn.Linear` modules are swapped (a quantized replacement keeps its own forward), and
only on CPU with oneDNN available; CUDA keeps cuBLAS through `nn.Linear`.
"""

from __future__ import annotations

import torch
from torch import nn

_DTYPES = (torch.float32, torch.bfloat16)


class OneDnnLinear(nn.Module):
    """`y = x W^T + b` with W held in oneDNN's layout; the original weight is not kept."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        # An opaque oneDNN tensor: not a Parameter, so state_dict / .to() leave it alone.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`x W^T + b + residual`, the add done in the GEMM's epilogue (oneDNN's binary post-op)
        instead of as one more pass over the activations. x [T, in], residual [T, out]."""
        return torch.ops.mkldnn._linear_pointwise.binary(
            x.contiguous(), residual.contiguous(), self.packed, self.bias, "add"
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


def onednn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in _DTYPES and torch.backends.mkldnn.is_available()


def pack_linears(model: nn.Module) -> int:
    """Swap every plain `nn.Linear` of a CPU model for a OneDnnLinear; returns how many.

    Tied embeddings: the LM head gets its own packed copy and the embedding keeps its table
    (a lookup needs the row-major weight), so memory for that matrix doubles; the head is the
    largest matmul of a decode step, where the packed layout pays most."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in swaps:
        if not onednn_usable(child.weight.device, child.weight.dtype):
            continue
        setattr(parent, name, OneDnnLinear(child))
    return sum(type(getattr(p, n)) is OneDnnLinear for p, n, _ in swaps)


def linear_add(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`residual + linear(x)`: in one oneDNN call where `linear` was packed and the dtype is
    fp32, else as two ops. In bf16 the fused add skips the rounding of the product to bf16
    before the sum that transformers does, and greedy outputs drifted measurably further from
    fp32's (test_reference_bf16), so bf16 keeps the two roundings."""
    if type(linear) is OneDnnLinear and x.dtype == torch.float32:
        return linear.forward_add(x, residual)
    return residual + linear(x)
