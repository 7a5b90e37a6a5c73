"""The decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / GPT-OSS) over a
flattened token batch.

Every step runs ONE batch of T tokens drawn from many requests (prefill chunks and decode
tokens mixed): the linears see a [T, hidden] matrix, which is where batching pays. Attention
is the only per-request part. On CPU every chunk of the step is attended in one kernel call
per layer that reads the paged KV cache in place (engines.reference.model.cpu_kernels), after one
pass that applies RoPE and writes K/V into the cache. Elsewhere (CUDA, or the kernels off)
decode tokens and other short chunks (a speculative verification's 1 + k tokens) are attended
in groups against their gathered KV context, and prefill chunks go through
scaled_dot_product_attention one request at a time.

Module and parameter names match the Hugging Face checkpoints exactly
(`model.layers.{i}.self_attn.q_proj`, ...), so weights load by name and a quantized linear can
replace any projection before `fuse_projections` merges q/k/v and gate/up for speed. A
Qwen3-MoE sparse layer's MLP is engines.reference.model.moe.SparseMoeBlock, whose experts are the
same MLP as a dense layer's.

GPT-OSS's attention has a learned per-head sink (one more logit in each softmax, attending to
nothing) and, in every other layer, a sliding window (a query at position p sees keys
p - window + 1 .. p). On CPU the paged kernel takes both (the layer passes its sinks and
window with each call), so GPT-OSS attends in place like any other family. The SDPA paths
(CUDA, or the kernels off) do them with masks: the window is part of the boolean mask the
runner builds (DecodeGroup.window_mask / PrefillSeq.window_mask), and the sink is one extra
key of zeros whose additive mask entry is the sink logit, so SDPA's softmax has the sink in
its denominator while its value adds nothing (attend_with_sinks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engines.reference.model import cpu_kernels
from engines.reference.model.config import ModelConfig
from engines.reference.model.mlp import MLP
from engines.reference.model.moe import SparseMoeBlock
from engines.reference.model.norm import RMSNorm
from engines.reference.model.vision import VisionEncoder

FP8_E4M3_MAX = 448.0


@dataclass
class PrefillSeq:
    """One request's prefill (or recompute) chunk inside the flat batch."""

    token_start: int  # first row of the chunk in the flat [T, ...] batch
    num_tokens: int  # rows in the chunk (n)
    context_start: int  # position of the chunk's first token = tokens already in the cache
    gather: torch.Tensor | None  # [L] flat cache slots of the whole context; None: no history
    mask: torch.Tensor | None  # [n, L] bool, True where a query may attend; None: plain causal
    # [n, L] bool: `mask` narrowed to the sliding window (models with window layers only).
    window_mask: torch.Tensor | None = None


@dataclass
class DecodeGroup:
    """Requests of n tokens each (n = 1: decode; a few: a verification's 1 + k, a short
    prefill chunk) and similar context length, attended to together over their cached
    context, which already holds the chunk's own K/V."""

    rows: torch.Tensor  # [B * n] int64 rows of the flat batch, request by request
    blocks: torch.Tensor  # [B * NB] int64 block ids of each context, padded to NB blocks
    # True where a query may attend: real (unpadded) keys up to the query's own position.
    # [1, B, 1, L] for n = 1 (shared by the G heads); [1, B, n * G, L], query-major, for n > 1.
    mask: torch.Tensor
    num_queries: int = 1  # n
    # `mask` narrowed to the sliding window, same shape (models with window layers only).
    window_mask: torch.Tensor | None = None


@dataclass
class PagedRows:
    """The step's query rows for the CPU kernel that reads the paged cache in place
    (engines.reference.model.cpu_kernels.paged_attention): one call per layer for all of them."""

    rows: torch.Tensor  # [R] int64 rows of the flat batch
    req: torch.Tensor  # [R] int32 each row's block table in `tables`
    limit: torch.Tensor  # [R] int32 keys the row attends to: its own position + 1
    tables: torch.Tensor  # [N, max_blocks] int32 block tables, padded with block 0


@dataclass
class ImageRows:
    """The step's image-token rows and the encoder's embeddings for them (Qwen2.5-VL)."""

    rows: torch.Tensor  # [I] int64 rows of the flat batch
    embeds: torch.Tensor  # [I, hidden]


@dataclass
class AttentionBatch:
    """Where the step's tokens go in the KV cache and what each one attends to."""

    slot_mapping: torch.Tensor  # [T] int64 flat cache slot (block * block_size + offset)
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSeq] = field(default_factory=list)
    paged: PagedRows | None = None  # every chunk, when the kernel runs them (nothing else then)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def fake_quant_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Round x through float8_e4m3fn with a per-tensor scale (what an FP8 KV cache stores)."""
    q = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def attend_with_sinks(
    q: torch.Tensor,  # [..., Hq, n, D]
    k: torch.Tensor,  # [..., Hk, L, D]
    v: torch.Tensor,  # [..., Hk, L, D]
    mask: torch.Tensor,  # bool, broadcastable to [..., Hq, n, L]: True where a query may attend
    sinks: torch.Tensor,  # broadcastable to [..., Hq, n, 1]: each row's sink logit
    enable_gqa: bool = False,
) -> torch.Tensor:  # [..., Hq, n, D]
    """SDPA whose softmax also counts a sink: softmax over [q·k * scale, sink], the sink's
    share dropped (transformers' GPT-OSS eager attention). The sink rides as one more key of
    zeros (score 0) whose additive mask entry is the sink logit, with a value of zeros."""
    shape = (*q.shape[:-1], k.shape[-2])  # [..., Hq, n, L]
    bias = torch.zeros(shape, dtype=q.dtype, device=q.device)
    bias.masked_fill_(~mask.expand(shape), float("-inf"))
    sink = sinks.to(q.dtype).expand(*shape[:-1], 1)
    bias = torch.cat([bias, sink], dim=-1)  # [..., Hq, n, L + 1]
    zeros = k.new_zeros(*k.shape[:-2], 1, k.shape[-1])
    k = torch.cat([k, zeros], dim=-2)  # [..., Hk, L + 1, D]
    v = torch.cat([v, zeros], dim=-2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=enable_gqa)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # GPT-OSS: a learned logit per query head in each softmax; None elsewhere.
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.attention_sinks else None
        # This layer's window when it slides (GPT-OSS), else None: the paged kernel's
        # `window`, or which of the runner's masks the SDPA paths use.
        self.window = cfg.masked_window if index in cfg.window_layers else None
        self.qkv_proj: nn.Module | None = None  # set by fuse_projections
        # FP8 KV cache scales (ModelOpt `k_scale` / `v_scale`); None keeps K/V unrounded.
        self.k_scale: float | None = None
        self.v_scale: float | None = None

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
            q_size = self.num_heads * self.head_dim
            kv_size = self.num_kv_heads * self.head_dim
            return qkv.split([q_size, kv_size, kv_size], dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        batch: AttentionBatch,
        k_cache: torch.Tensor,  # [KVH, num_blocks, block_size, D]
        v_cache: torch.Tensor,  # [KVH, num_blocks, block_size, D]
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        if batch.paged is not None and self._fused_inputs(x):
            return self._forward_paged(x, cos, sin, batch, k_cache, v_cache)
        q, k, v = self._qkv(x)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if cpu_kernels.use_kernels(x.device):
            q, k = cpu_kernels.rope(q, cos, sin), cpu_kernels.rope(k, cos, sin)
        else:
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        if self.k_scale is not None:
            k = fake_quant_fp8(k, self.k_scale)
        if self.v_scale is not None:
            v = fake_quant_fp8(v, self.v_scale)

        k_flat = k_cache.view(self.num_kv_heads, -1, self.head_dim)  # [KVH, slots, D]
        v_flat = v_cache.view(self.num_kv_heads, -1, self.head_dim)
        k_flat.index_copy_(1, batch.slot_mapping, k.transpose(0, 1))
        v_flat.index_copy_(1, batch.slot_mapping, v.transpose(0, 1))

        out = torch.empty_like(q)  # [T, H, D]
        if batch.paged is not None:
            self._attend_paged(out, q, k_cache, v_cache, batch.paged)
        for group in batch.decode_groups:
            out[group.rows] = self._decode(q, k_cache, v_cache, group)
        for seq in batch.prefills:
            rows = slice(seq.token_start, seq.token_start + seq.num_tokens)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_flat, v_flat, seq)
        return self.o_proj(out.view(num_tokens, self.num_heads * self.head_dim))

    def _fused_inputs(self, x: torch.Tensor) -> bool:
        """Whether a step whose chunks all go to the paged kernel can also take the fused RoPE
        and cache write: q/k/v fused, and none of the steps between the projection and the
        cache that the fused kernel leaves out (FP8 K/V rounding; Qwen3's q/k norms it does
        take, where their weights are in the model dtype)."""
        return (
            self.qkv_proj is not None
            and (self.q_norm is None or self.q_norm.weight.dtype == x.dtype)
            and self.k_scale is None
            and self.v_scale is None
            and cpu_kernels.use_kernels(x.device)
        )

    def _forward_paged(self, x, cos, sin, batch: AttentionBatch, k_cache, v_cache) -> torch.Tensor:
        # (Qwen3's q/k head norms,) RoPE and the cache write in one pass over the projection,
        # then every chunk of the step attended in one kernel call reading the cache in place.
        norms = (
            (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            if self.q_norm is not None
            else None
        )
        q = cpu_kernels.rope_cache(
            self.qkv_proj(x), cos, sin, k_cache, v_cache, batch.slot_mapping, self.num_heads, norms
        )
        out = torch.empty_like(q)  # [T, H, D]
        self._attend_paged(out, q, k_cache, v_cache, batch.paged)
        return self.o_proj(out.view(x.shape[0], self.num_heads * self.head_dim))

    def _attend_paged(
        self,
        out: torch.Tensor,  # [T, H, D], written at paged.rows
        q: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,  # [KVH, num_blocks, block_size, D]
        v_cache: torch.Tensor,
        paged: PagedRows,
    ) -> None:
        """out[rows] = the kernel's attention of q[rows] over the cache in place, with this
        layer's sinks and window (GPT-OSS; None elsewhere)."""
        cpu_kernels.paged_attention(
            out,
            q,
            k_cache,
            v_cache,
            paged.rows,
            paged.req,
            paged.limit,
            paged.tables,
            self.head_dim**-0.5,
            sinks=self.sinks,
            window=self.window,
        )

    def _decode(self, q, k_cache, v_cache, group: DecodeGroup) -> torch.Tensor:
        # The n queries of a request times the G query heads sharing a KV head ride in SDPA's
        # query-length dimension (GQA without repeating K/V; the mask keeps each query causal),
        # and with KV heads outermost in the cache one index_select of whole blocks yields
        # SDPA-ready [KVH, B, L, D] K/V: (KVH, B) act as SDPA's (batch, heads), no transposed
        # copy. One SDPA call for the group, however many tokens each request verifies.
        n = group.num_queries
        num_seqs = group.rows.shape[0] // n
        per_kv = self.num_heads // self.num_kv_heads  # G
        kvh, dim = self.num_kv_heads, self.head_dim
        qd = q[group.rows].view(num_seqs, n, kvh, per_kv, dim)  # [B, n, KVH, G, D]
        qd = qd.permute(2, 0, 1, 3, 4).reshape(kvh, num_seqs, n * per_kv, dim)  # [KVH, B, nG, D]
        kd = k_cache.index_select(1, group.blocks).view(kvh, num_seqs, -1, dim)  # [KVH, B, L, D]
        vd = v_cache.index_select(1, group.blocks).view(kvh, num_seqs, -1, dim)  # [KVH, B, L, D]
        mask = group.window_mask if self.window is not None else group.mask
        if self.sinks is None:
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask)  # [KVH, B, nG, D]
        else:
            # Row (query j, head g) of KV head h carries head h * G + g's sink.
            sinks = self.sinks.view(kvh, 1, 1, per_kv).expand(kvh, 1, n, per_kv)
            od = attend_with_sinks(qd, kd, vd, mask, sinks.reshape(kvh, 1, n * per_kv, 1))
        od = od.unflatten(2, (n, per_kv)).permute(1, 2, 0, 3, 4)  # [B, n, KVH, G, D]
        return od.reshape(num_seqs * n, self.num_heads, dim)  # [B * n, H, D]

    def _prefill(self, q, k, v, k_flat, v_flat, seq: PrefillSeq) -> torch.Tensor:
        qs = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if seq.gather is None:  # no cached history: the chunk's own K/V is the whole context
            ks, vs = k.transpose(0, 1), v.transpose(0, 1)  # [KVH, n, D]
        else:
            ks = k_flat.index_select(1, seq.gather)  # [KVH, L, D]
            vs = v_flat.index_select(1, seq.gather)
        ks, vs = ks.unsqueeze(0), vs.unsqueeze(0)  # [1, KVH, L, D]
        mask = seq.window_mask if self.window is not None else seq.mask
        if self.sinks is not None:
            if mask is None:  # no history, no window: plain causal, spelled out
                n = qs.shape[2]
                mask = torch.ones(n, n, dtype=torch.bool, device=qs.device).tril()
            sinks = self.sinks.view(1, -1, 1, 1)  # [1, H, 1, 1]
            o = attend_with_sinks(qs, ks, vs, mask, sinks, enable_gqa=True)  # [1, H, n, D]
            return o.squeeze(0).transpose(0, 1)  # [n, H, D]
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=mask is None, enable_gqa=True
        )  # [1, H, n, D]
        return o.squeeze(0).transpose(0, 1)  # [n, H, D]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, index)
        self.mlp: MLP | SparseMoeBlock
        if cfg.is_moe_layer(index):
            self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.fp32_norms)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.fp32_norms)

    def forward(self, x, cos, sin, batch, k_cache, v_cache) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, batch, k_cache, v_cache)
        fused_norm = self.post_attention_layernorm.weight.dtype == x.dtype
        if fused_norm and cpu_kernels.use_kernels(x.device):
            norm = self.post_attention_layernorm
            # x += attn in place (x is this step's own residual stream), fused with the norm;
            # the MLP's residual add rides in the down projection's epilogue.
            return self.mlp.forward_add(cpu_kernels.add_rms_norm(x, attn, norm.weight, norm.eps), x)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.fp32_norms)


class CausalLM(nn.Module):
    """`model.*` and `lm_head` as in the Hugging Face checkpoints."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Qwen2.5-VL: the image encoder (`visual.*`); the runner calls it per image.
        self.visual = VisionEncoder(cfg.vision) if cfg.vision is not None else None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (K, V) block pools
        logits_rows: torch.Tensor,  # [S] int64 rows whose next-token logits are needed
        images: ImageRows | None = None,  # image tokens' embeddings, in place of their ids'
    ) -> torch.Tensor:  # [S, vocab] float32
        # Only the sampling rows need the final norm and the (vocab-sized) LM head.
        x = self.hidden_states(input_ids, cos, sin, batch, kv_caches, logits_rows, images)
        return self.lm_head(x).float()

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [T] int64
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        rows: torch.Tensor,  # [S] int64 rows whose states are needed
        images: ImageRows | None = None,
    ) -> torch.Tensor:  # [S, hidden] after the final norm, in the compute dtype
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        if images is not None:
            x.index_copy_(0, images.rows, images.embeds.to(x.dtype))
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, batch, k_cache, v_cache)
        return self.model.norm(x[rows])

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]


def _fuse_linears(parts: list[nn.Module]) -> nn.Linear | None:
    """One Linear computing all `parts` side by side, or None when any part is not a plain
    nn.Linear (a quantized replacement keeps its own forward)."""
    if not all(type(p) is nn.Linear for p in parts):
        return None
    has_bias = [p.bias is not None for p in parts]
    if any(has_bias) and not all(has_bias):
        return None
    first = parts[0]
    fused = nn.Linear(
        first.in_features,
        sum(p.out_features for p in parts),
        bias=all(has_bias),
        device=first.weight.device,
        dtype=first.weight.dtype,
    )
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts], dim=0))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts], dim=0))
    return fused


def fuse_projections(model: CausalLM) -> None:
    """Merge q/k/v and gate/up into single matmuls (fewer, larger GEMMs). Run after any
    quantized-linear swap; the separate modules are dropped to keep one copy of the weights."""
    for layer in model.model.layers:
        attn = layer.self_attn
        qkv = _fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        if qkv is not None:
            attn.qkv_proj = qkv
            del attn.q_proj, attn.k_proj, attn.v_proj
        mlps = layer.mlp.experts if isinstance(layer.mlp, SparseMoeBlock) else [layer.mlp]
        for mlp in mlps:
            if not isinstance(mlp, MLP):  # GPT-OSS experts: gate/up already one linear
                continue
            gate_up = _fuse_linears([mlp.gate_proj, mlp.up_proj])
            if gate_up is not None:
                mlp.gate_up_proj = gate_up
                del mlp.gate_proj, mlp.up_proj
