"""LoRA in the reference model: each adapted projection adds, for the rows of each adapter in
the step, `x A^T (s B)^T` to the base projection's output (rows of the base model add nothing).

The adapters of a step sit in a fixed number of slots (`max_loras`); every wrapped projection
holds one A and one B per slot, zero-padded to `max_lora_rank`. A step's rows are grouped by
slot (runtime/adapters.py assigns them) and each group costs two small matmuls per projection,
the way punica's segmented kernels group rows by adapter, in torch ops here.

Fused projections (q/k/v, gate/up: model.fuse_projections) hold their parts' A matrices stacked
([parts x rank, in]) and B block-diagonal ([out, parts x rank]), so one pair of matmuls covers
all parts; a part the adapter does not target stays zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engines.lora.peft import LoraAdapter
from engines.reference.model import cpu_kernels
from engines.reference.model.linear import linear_add
from engines.reference.model.mlp import MLP


@dataclass(frozen=True)
class LoraRows:
    """The rows of one step that use the adapter in `slot`."""

    slot: int
    rows: torch.Tensor  # [n] int64 row indices into the step's flat tokens


class LoraStepState:
    """What every wrapped projection reads during one forward: the step's row groups, and
    each row's slot (-1: the model itself) for the CPU kernel."""

    def __init__(self) -> None:
        self.groups: Sequence[LoraRows] = ()
        self.slots: torch.Tensor | None = None  # [T] int64


class LoraLinear(nn.Module):
    """A projection plus the LoRA terms of the slots' adapters. `parts`: (target, out size) of
    each projection fused into `base`, in output order."""

    def __init__(
        self,
        base: nn.Module,
        state: LoraStepState,
        layer: int,
        parts: Sequence[tuple[str, int]],
        in_features: int,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.state = state
        self.layer = layer
        self.parts = tuple(parts)
        self.in_features = in_features
        self.out_features = sum(size for _, size in parts)
        width = len(parts) * max_rank
        self.register_buffer(
            "lora_a", torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
        )
        self.register_buffer(
            "lora_b",
            torch.zeros(num_slots, self.out_features, width, dtype=dtype, device=device),
        )
        self.width = [0] * num_slots  # columns of slot s in use: parts x the adapter's rank
        self.register_buffer("widths", torch.zeros(num_slots, dtype=torch.int64))

    def load(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Put `adapter`'s terms for this projection into `slot` (None: clear it)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.width[slot] = 0
        self.widths[slot] = 0
        if adapter is None:
            return
        rank, scale = adapter.config.rank, adapter.config.scale
        row = 0
        any_part = False
        for p, (target, size) in enumerate(self.parts):
            pair = adapter.weights.get((self.layer, target))
            if pair is not None:
                a, b = pair
                cols = slice(p * rank, (p + 1) * rank)
                self.lora_a[slot, cols] = a.to(self.lora_a.dtype)
                self.lora_b[slot, row : row + size, cols] = (b.float() * scale).to(
                    self.lora_b.dtype
                )
                any_part = True
            row += size
        self.width[slot] = len(self.parts) * rank if any_part else 0
        self.widths[slot] = self.width[slot]

    def _add_terms(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        slots = self.state.slots
        if slots is not None and cpu_kernels.use_kernels(x.device):
            cpu_kernels.lora_add(y, x.contiguous(), self.lora_a, self.lora_b, slots, self.widths)
            return y
        for group in self.state.groups:
            k = self.width[group.slot]
            if k == 0:
                continue
            xs = x.index_select(0, group.rows)
            delta = (xs @ self.lora_a[group.slot, :k].T) @ self.lora_b[group.slot, :, :k].T
            y.index_add_(0, group.rows, delta)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.state.groups:
            return y
        return self._add_terms(x.reshape(-1, self.in_features), y.view(-1, self.out_features))

    def add_after(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + self(x)`, the base's part fused as linear_add does it."""
        y = linear_add(self.base, x, residual)
        if not self.state.groups:
            return y
        return self._add_terms(x, y)

    def extra_repr(self) -> str:
        names = "+".join(t for t, _ in self.parts)
        return f"layer={self.layer}, {names}, slots={self.lora_a.shape[0]}"


def attach_lora(
    model: nn.Module, num_slots: int, max_rank: int, state: LoraStepState
) -> list[LoraLinear]:
    """Wrap every projection an adapter can target (after fuse_projections and any linear
    swap); MoE layers' experts are left alone. Returns the wrapped projections."""
    cfg = model.config
    first = next(model.parameters())
    dtype, device = first.dtype, first.device
    wrapped: list[LoraLinear] = []

    def wrap(owner: nn.Module, attr: str, layer: int, parts, in_features: int) -> None:
        module = LoraLinear(
            getattr(owner, attr),
            state,
            layer,
            parts,
            in_features,
            num_slots,
            max_rank,
            dtype,
            device,
        )
        setattr(owner, attr, module)
        wrapped.append(module)

    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if attn.qkv_proj is not None:
            wrap(attn, "qkv_proj", i, [("q_proj", q), ("k_proj", kv), ("v_proj", kv)], h)
        else:
            for name, size in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                wrap(attn, name, i, [(name, size)], h)
        wrap(attn, "o_proj", i, [("o_proj", h)], q)
        mlp = layer.mlp
        if not isinstance(mlp, MLP):
            continue
        inter = cfg.intermediate_size
        if mlp.gate_up_proj is not None:
            wrap(mlp, "gate_up_proj", i, [("gate_proj", inter), ("up_proj", inter)], h)
        else:
            wrap(mlp, "gate_proj", i, [("gate_proj", inter)], h)
            wrap(mlp, "up_proj", i, [("up_proj", inter)], h)
        wrap(mlp, "down_proj", i, [("down_proj", h)], inter)
    return wrapped
