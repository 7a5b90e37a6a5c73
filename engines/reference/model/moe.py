"""The Mixture-of-Experts MLP of Qwen3-MoE and GPT-OSS: a router picks k experts per token, each
expert is a SwiGLU MLP, and the token's output is the routing-weighted sum of its experts'
outputs.

Tokens are grouped by expert rather than each token visiting its experts: the step's T * k
(token, expert) pairs are sorted by expert, so each active expert runs ONE matmul over all of
its rows through the same linears as the dense MLP (oneDNN on CPU, fused gate/up), and the
weighted outputs go back to their tokens in one index_add. Experts no token chose cost nothing.

On CPU in fp32 (SwiGLU experts, the CPU kernels built), the whole layer after the router is
one call (kernels/moe_fused.cpp): routing, grouping, both projections, SiLU·up, the weights and
the combine, over the experts' weights laid out at load in the order its micro-kernels read
them (`fuse_experts`), on huge pages. A decode step's expert GEMMs have a few rows each and are
bound by reading the weights; a general GEMM reads them at half the memory's speed or less.
The per-expert modules are dropped then: one copy of the weights.

Elsewhere (bf16, GPT-OSS's biased experts, quantized experts, CUDA), with several CPU threads a
step whose experts each get few rows (decode) runs its experts side by side instead of one
after another (kernels/moe_experts.cpp): a GEMM of a few rows does not spread over threads (it
streams the expert's weights, on one thread as fast as on two), so each intra-op thread takes a
share of the experts and runs them single-threaded. Same calls per expert, same combine: the
outputs are the same (to the last bits where oneDNN would split a GEMM's reduction over
threads; it splits rows and columns at these sizes).

Module and parameter names match the checkpoints (`mlp.gate.weight`,
`mlp.experts.{e}.gate_proj.weight`, ...), so weights load by name like the dense model's.
GPT-OSS's router is `mlp.router` (with a bias) and its stacked expert tensors are split by the
loader into `mlp.experts.{e}.gate_up_proj` / `down_proj` linears (GptOssExpert).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engines.reference.model import cpu_kernels, hugepages
from engines.reference.model.config import MoeConfig
from engines.reference.model.linear import OneDnnLinear
from engines.reference.model.mlp import MLP

# GPT-OSS's clamped SwiGLU (GptOssExperts: alpha and limit are constants of the model).
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


def route(
    logits: torch.Tensor,  # [T, E] router logits, in the compute dtype
    top_k: int,
    norm_topk_prob: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [T, k] (compute dtype) and expert ids [T, k] (int64), as transformers'
    Qwen3MoeTopKRouter: softmax in fp32 over all experts, the top k, optionally renormalised
    to sum to 1, then cast back."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def route_top_logits(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's routing (GptOssTopKRouter): the k largest logits, softmax over those k only,
    in the logits' dtype. Weights [T, k], expert ids [T, k] (int64)."""
    top, experts = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype), experts


class GptOssExpert(nn.Module):
    """One GPT-OSS expert: gate/up in one biased linear, the clamped SwiGLU
    `(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)` with g = clamp(gate, max=limit), then a
    biased down projection. The checkpoint interleaves gate and up columns (gate at even,
    up at odd); the loader stores the rows as [gate | up] so each half is one contiguous
    slice (same numbers, no strided reads)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=True)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # 2 x [T, intermediate]
        gate = gate.clamp(max=GPT_OSS_LIMIT)
        up = up.clamp(min=-GPT_OSS_LIMIT, max=GPT_OSS_LIMIT)
        glu = gate * torch.sigmoid(gate * GPT_OSS_ALPHA)
        return self.down_proj((up + 1) * glu)


# Above this many rows per active expert, the experts run one after another on all threads:
# their GEMMs are big enough to spread over the threads themselves.
SIDE_BY_SIDE_MAX_ROWS = 384


def balance(spans: list[tuple[int, int, int]], count: int) -> list[list[tuple[int, int, int]]]:
    """`spans` (expert, first row, rows) in at most `count` shares of about equal rows: the
    largest span first to the share with the fewest rows so far; no empty share."""
    shares: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]
    rows = [0] * count
    for span in sorted(spans, key=lambda s: -s[2]):
        i = rows.index(min(rows))
        shares[i].append(span)
        rows[i] += span[2]
    return [share for share in shares if share]


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        self.num_experts = moe.num_experts
        self.top_k = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.style = moe.style
        self.experts: nn.ModuleList
        if moe.style == "gpt_oss":
            self.router = nn.Linear(hidden_size, moe.num_experts, bias=True)
            self.experts = nn.ModuleList(
                GptOssExpert(hidden_size, moe.intermediate_size) for _ in range(moe.num_experts)
            )
        else:
            self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)  # the router
            self.experts = nn.ModuleList(
                MLP(hidden_size, moe.intermediate_size, bias=False) for _ in range(moe.num_experts)
            )
        # Tokens each expert computed in the last forward ([E] int64), for the step's expert
        # load figures; read after the step (ModelRunner.expert_load), never inside it.
        self.last_counts: torch.Tensor | None = None
        # The experts' packed weights for the side-by-side kernel, found on first use after
        # the load has fused and packed them.
        self._packed: tuple[list, list] | None = None
        # Every expert's weights in the fused kernel's layout (fuse_experts), else None.
        self.fused: FusedExperts | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self._combine(x, torch.zeros_like(x))

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + MoE(x). In fp32 the experts' outputs are added into the residual stream
        itself (this step's own tensor, as on the dense path): no zero-filled buffer and no
        second pass over [T, hidden]. In bf16 the sum is rounded once before the residual
        add, as transformers does (see linear.linear_add for why bf16 keeps that order)."""
        if x.dtype == torch.float32:
            return self._combine(x, residual)
        return residual + self(x)

    def _combine(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Adds each token's weighted expert outputs into `out` [T, hidden], returns it."""
        if self.fused is not None:
            self.last_counts = cpu_kernels.moe_fused(
                x.contiguous(),
                out,
                self.gate(x).contiguous(),
                self.top_k,
                self.norm_topk_prob,
                self.fused.gate_up,
                self.fused.down,
            )
            return out
        if self.style == "gpt_oss":
            weights, experts = route_top_logits(self.router(x), self.top_k)  # [T, k] each
        else:
            weights, experts = route(self.gate(x), self.top_k, self.norm_topk_prob)
        flat = experts.reshape(-1)  # [T * k] expert of each (token, slot) pair
        order = flat.argsort(stable=True)  # pairs grouped by expert, tokens in order inside
        rows = order // self.top_k  # [T * k] token row of each grouped pair
        counts = torch.bincount(flat, minlength=self.num_experts)  # [E]
        self.last_counts = counts
        grouped = x.index_select(0, rows)  # [T * k, hidden]
        pair_weights = weights.reshape(-1, 1).index_select(0, order)  # [T * k, 1]
        outputs = torch.empty_like(grouped)  # [T * k, hidden]
        # One host sync per layer to size the groups; every later op is a plain matmul.
        spans: list[tuple[int, int, int]] = []  # (expert, first row, rows) of active experts
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count:
                spans.append((expert, start, count))
            start += count
        threads = torch.get_num_threads()
        packed = self._packed_experts(x)
        if (
            packed is not None
            and threads > 1
            and len(spans) > 1
            and start <= SIDE_BY_SIDE_MAX_ROWS * len(spans)
        ):
            shares = balance(spans, threads)
            listed = [span for share in shares for span in share]
            share_starts = [0]
            for share in shares:
                share_starts.append(share_starts[-1] + len(share))
            cpu_kernels.moe_experts(
                grouped,
                outputs,
                pair_weights,
                [first for _, first, _ in listed],
                [count for _, _, count in listed],
                share_starts,
                [packed[0][e] for e, _, _ in listed],
                [packed[1][e] for e, _, _ in listed],
            )
        else:
            for expert, first, count in spans:
                span = slice(first, first + count)
                outputs[span] = self.experts[expert](grouped[span]) * pair_weights[span]
        return out.index_add_(0, rows, outputs)

    def _packed_experts(self, x: torch.Tensor) -> tuple[list, list] | None:
        """Every expert's packed gate/up and down weights, where the side-by-side kernel can
        run them (CPU kernels; SwiGLU experts whose fused gate/up and down are bias-free
        OneDnnLinears); else None."""
        if not cpu_kernels.use_kernels(x.device):
            return None
        if self._packed is None:  # found once the load has fused and packed them
            if not all(
                isinstance(e, MLP)
                and isinstance(e.gate_up_proj, OneDnnLinear)
                and isinstance(e.down_proj, OneDnnLinear)
                and e.gate_up_proj.bias is None
                and e.down_proj.bias is None
                for e in self.experts
            ):
                return None
            self._packed = (
                [e.gate_up_proj.packed for e in self.experts],
                [e.down_proj.packed for e in self.experts],
            )
        return self._packed


@dataclass(frozen=True)
class FusedExperts:
    """A layer's expert weights in the order kernels/moe_fused.cpp reads them: each micro-kernel
    call streams one contiguous run of weights, once for all of the expert's rows.

    gate_up [I8 / 8, E, hidden, 16]: for 8 intermediate columns, per expert and hidden index,
      those columns' 8 gate then 8 up weights (SiLU(gate) * up is then formed in registers).
    down [H16 / 16, E, I8, 16]: for 16 hidden columns, per expert and intermediate index, those
      columns' weights.
    Columns outermost: the kernel shares work out by columns, so a thread's share is one run
    through memory over every expert, and its rows are a share of every expert's rows.
    I8 and H16 are the intermediate and hidden sizes rounded up to 8 and 16 with zero weights,
    which add nothing (SiLU(0) * 0 = 0; padded hidden columns are not written)."""

    gate_up: torch.Tensor
    down: torch.Tensor

    @staticmethod
    def pack(gate_up: torch.Tensor, down: torch.Tensor) -> FusedExperts:
        """From the stacked linears' weights: gate_up [E, 2I, hidden] (gate rows, then up),
        down [E, hidden, I]."""
        experts, hidden, inter = down.shape
        inter8, hidden16 = -(-inter // 8) * 8, -(-hidden // 16) * 16
        pad = nn.functional.pad
        gate = pad(gate_up[:, :inter], (0, 0, 0, inter8 - inter))  # [E, I8, hidden]
        up = pad(gate_up[:, inter:], (0, 0, 0, inter8 - inter))
        blocks = (experts, inter8 // 8, 8, hidden)
        packed_gate_up = torch.cat(
            [gate.reshape(blocks).transpose(2, 3), up.reshape(blocks).transpose(2, 3)], dim=3
        ).transpose(0, 1)
        packed_down = (
            pad(down, (0, inter8 - inter, 0, hidden16 - hidden))
            .reshape(experts, hidden16 // 16, 16, inter8)
            .permute(1, 0, 3, 2)
        )
        return FusedExperts(hugepages.copy(packed_gate_up), hugepages.copy(packed_down))


def fuse_experts(model: nn.Module) -> int:
    """Give every SparseMoeBlock the fused kernel's weights where it can run them (CPU, fp32,
    the kernels built, bias-free SwiGLU experts whose gate/up are fused into one plain
    linear: after model.fuse_projections, before linear.pack_linears), dropping the experts'
    own modules. Returns how many blocks were fused."""
    fused = 0
    for block in model.modules():
        if not isinstance(block, SparseMoeBlock) or block.style != "qwen3_moe":
            continue
        experts = list(block.experts)
        if not (experts and all(_plain_swiglu(e) for e in experts)):
            continue
        weight = experts[0].gate_up_proj.weight
        if weight.dtype != torch.float32 or not cpu_kernels.use_kernels(weight.device):
            continue
        block.fused = FusedExperts.pack(
            torch.stack([e.gate_up_proj.weight for e in experts]),
            torch.stack([e.down_proj.weight for e in experts]),
        )
        block.experts = nn.ModuleList()  # one copy of the weights: the fused one
        fused += 1
    return fused


def _plain_swiglu(expert: nn.Module) -> bool:
    return (
        isinstance(expert, MLP)
        and type(getattr(expert, "gate_up_proj", None)) is nn.Linear
        and type(expert.down_proj) is nn.Linear
        and expert.gate_up_proj.bias is None
        and expert.down_proj.bias is None
    )
