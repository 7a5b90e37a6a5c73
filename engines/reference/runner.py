"""Model runner: owns the model, the KV block pool tensors and the RoPE tables; turns one
SchedulerOutput into model inputs, runs the forward pass and returns the sampling rows' logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engines.reference.config import ModelConfig, rope_inv_freq
from engines.reference.model import AttentionBatch, CausalLM, PrefillSeq
from engines.reference.scheduler import ScheduledChunk


@dataclass(frozen=True)
class ChunkInput:
    """What the runner needs about one scheduled chunk."""

    chunk: ScheduledChunk
    token_ids: Sequence[int]  # the request's tokens (prompt + outputs)
    block_ids: Sequence[int]  # its KV blocks, in sequence order


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token across all layers."""
    return 2 * cfg.num_layers * cfg.kv_size * torch.tensor([], dtype=dtype).element_size()


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # Per layer: K and V pools, [num_blocks, block_size, KVH, D].
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(cfg.num_layers)
        ]
        # RoPE tables for every position, computed as transformers does (fp32, then cast).
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope)  # [D/2]
        positions = torch.arange(max_model_len, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)  # [max_len, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, D]
        self.cos = emb.cos().to(dtype).to(device)
        self.sin = emb.sin().to(dtype).to(device)

    def _slots(self, block_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return (
            block_ids[positions // self.block_size] * self.block_size + positions % self.block_size
        )

    @torch.inference_mode()
    def execute(self, inputs: Sequence[ChunkInput]) -> torch.Tensor:
        """Run one step; returns logits [S, V] (float32) for the sampling chunks, in order."""
        dev = self.device
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        prefills: list[PrefillSeq] = []
        decode_rows: list[int] = []
        decode_lens: list[int] = []
        decode_tables: list[Sequence[int]] = []
        logits_rows: list[int] = []
        row = 0
        for item in inputs:
            chunk = item.chunk
            start, n = chunk.start, chunk.num_tokens
            input_ids.extend(item.token_ids[start : start + n])
            pos = torch.arange(start, start + n)
            table = torch.tensor(item.block_ids, dtype=torch.int64)
            positions.append(pos)
            slots.append(self._slots(table, pos))
            if n == 1:
                decode_rows.append(row)
                decode_lens.append(start + 1)
                decode_tables.append(item.block_ids)
            else:
                gather = mask = None
                if start > 0:  # attend to cached history: gather the whole context
                    context = torch.arange(start + n)
                    gather = self._slots(table, context).to(dev)
                    mask = (context[None, :] <= pos[:, None]).to(dev)  # [n, L]
                prefills.append(PrefillSeq(row, n, start, gather, mask))
            if chunk.is_sampling:
                logits_rows.append(row + n - 1)
            row += n

        decode_rows_t = decode_gather = decode_mask = None
        if decode_rows:
            max_len = max(decode_lens)
            max_blocks = -(-max_len // self.block_size)
            tables = torch.zeros(len(decode_rows), max_blocks, dtype=torch.int64)
            for i, t in enumerate(decode_tables):
                used = min(len(t), max_blocks)
                tables[i, :used] = torch.tensor(t[:used], dtype=torch.int64)
            context = torch.arange(max_len)  # [Lmax]
            decode_gather = (
                tables[:, context // self.block_size] * self.block_size + context % self.block_size
            ).to(dev)  # [B, Lmax]
            lens = torch.tensor(decode_lens)
            decode_mask = (
                (context[None, :] < lens[:, None]).view(len(decode_rows), 1, 1, max_len).to(dev)
            )
            decode_rows_t = torch.tensor(decode_rows, dtype=torch.int64, device=dev)

        pos_t = torch.cat(positions).to(dev)
        batch = AttentionBatch(
            slot_mapping=torch.cat(slots).to(dev),
            decode_rows=decode_rows_t,
            decode_gather=decode_gather,
            decode_mask=decode_mask,
            prefills=prefills,
        )
        cos = self.cos[pos_t].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[pos_t].unsqueeze(1)
        return self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            cos,
            sin,
            batch,
            self.kv_caches,
            torch.tensor(logits_rows, dtype=torch.int64, device=dev),
        )
