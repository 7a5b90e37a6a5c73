"""Linear layers on CPU through oneDNN, with each weight reordered once into oneDNN's blocked
layout; the fp32 LM head through the kernels' panel micro-kernel instead (PanelLinear).

Why: `nn.Linear` on CPU goes to MKL's sgemm, which on the AMD EPYC (Zen 4) machines measured
here reaches 170-240 GFLOP/s at the engine's shapes (hidden 512, 32-1024 rows, 2 threads),
while oneDNN's inner-product primitive with a pre-reordered weight reaches 400-550 GFLOP/s on
the same shapes (and vLLM's CPU build uses oneDNN for the same reason). The reorder is done at
load time, so a step pays no layout conversion. Results differ from sgemm only by summation
order (fp32: about 1e-6 relative), within what the greedy parity tests already tolerate from
the fused q/k/v and gate/up projections.

Only plain `nn.Linear` modules are swapped (a quantized replacement keeps its own forward), and
only on CPU with oneDNN available; CUDA keeps cuBLAS through `nn.Linear`. oneDNN takes bf16
weights only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and raises elsewhere (an
AVX2-only EPYC, say): what this CPU takes is tried once per process (`onednn_refusal`), and a
dtype it refuses keeps `nn.Linear` (slower), logged once and named
in the engine's limitations (`fallback_note`).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from engines import faults
from engines.reference.model import cpu_kernels, hugepages

logger = logging.getLogger(__name__)

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


class PanelLinear(nn.Module):
    """`y = x W^T + b` in fp32 through kernels/panel_linear.cpp, W laid out once as
    [ceil(N / 16), K, 16] on huge pages; the original weight is not kept.

    Why for the LM head: it runs on the step's sampled rows only (a decode step's requests,
    the last row of each prefill), tens of rows, where oneDNN's inner product ran the `small`
    models' head at 125-150 GFLOP/s and this kernel at 140-170 with the weight coming from
    memory, as it does in a step (docs/benchmarks.md). Other linears also see prefill's
    thousands of rows, where oneDNN is 10-20% faster, and holding both layouts would double
    their weights' memory."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed = self.pack(linear.weight.detach().float())
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """[N, K] -> [ceil(N / 16), K, 16], columns past N zero."""
        out_features, in_features = weight.shape
        blocks = -(-out_features // 16)
        padded = torch.zeros(blocks * 16, in_features, dtype=weight.dtype)
        padded[:out_features] = weight
        return hugepages.copy(padded.view(blocks, 16, in_features).transpose(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        y = cpu_kernels.panel_linear(rows, self.packed, self.out_features, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, panel"


def pack_head(model: nn.Module) -> bool:
    """Swap an fp32 CPU model's plain `lm_head` for a PanelLinear where the kernels are built
    (before pack_linears, which would take it for oneDNN); whether it was swapped. A tied
    head gets its own copy, as with oneDNN."""
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear or head.weight.dtype != torch.float32:
        return False
    if not cpu_kernels.use_kernels(head.weight.device):
        return False
    model.lm_head = PanelLinear(head)
    return True


@functools.cache
def _trial_refusal(dtype: torch.dtype) -> str | None:
    """torch's error where this CPU's oneDNN cannot take `dtype` weights, else None.

    Found by doing once what a load does, on a tiny weight: reorder it, run it. The answer is
    then whatever this torch build checks (for bf16 today the CPU's AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; torch.backends.cpu.get_cpu_capability() would only approximate it)."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
        x = torch.zeros(2, 16, dtype=dtype)
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError as exc:
        return str(exc).strip().splitlines()[0]
    return None


def onednn_refusal(dtype: torch.dtype) -> str | None:
    """Why oneDNN cannot take `dtype` weights on this CPU, or None where it can."""
    if _dtype_name(dtype) in faults.onednn_refused_dtypes():
        return f"refused by the test hook {faults.ONEDNN_REFUSES_ENV}"
    return _trial_refusal(dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _onednn_applies(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in _DTYPES and torch.backends.mkldnn.is_available()


def onednn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    return _onednn_applies(device, dtype) and onednn_refusal(dtype) is None


def fallback_note(device: torch.device, dtype: torch.dtype) -> str | None:
    """One sentence for the engine's limitations where a `dtype` model on `device` would take
    the oneDNN linears but this CPU refuses them (nn.Linear runs instead); else None."""
    if not _onednn_applies(device, dtype):
        return None
    reason = onednn_refusal(dtype)
    if reason is None:
        return None
    name = _dtype_name(dtype)
    return (
        f"{name} linears run as torch's nn.Linear: oneDNN cannot take {name} weights on this "
        f"CPU ({reason}); steps of many tokens can be several times slower than with "
        "engine.dtype float32, which keeps oneDNN"
    )


@functools.cache
def _log_fallback(note: str) -> None:
    logger.warning("%s", note)  # once per process, however many models load


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
        device, dtype = child.weight.device, child.weight.dtype
        if not onednn_usable(device, dtype):
            note = fallback_note(device, dtype)
            if note is not None:
                _log_fallback(note)
            continue
        setattr(parent, name, OneDnnLinear(child))
    return sum(type(getattr(p, n)) is OneDnnLinear for p, n, _ in swaps)


def linear_add(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`residual + linear(x)`: in one oneDNN call where `linear` was packed and the dtype is
    fp32, else as two ops. In bf16 the fused add skips the rounding of the product to bf16
    before the sum that transformers does, and greedy outputs drifted measurably further from
    fp32's (test_reference_bf16), so bf16 keeps the two roundings."""
    add_after = getattr(linear, "add_after", None)
    if add_after is not None:  # a wrapper adding terms of its own (LoRA: model/lora.py)
        return add_after(x, residual)
    if type(linear) is OneDnnLinear and x.dtype == torch.float32:
        return linear.forward_add(x, residual)
    return residual + linear(x)
