"""Model runner: owns the model, the KV block pool tensors and the RoPE tables; turns one
SchedulerOutput into model inputs, runs the forward pass and returns the sampling rows' logits:
one row per sampling chunk, or 1 + k rows for a chunk carrying k speculative proposals (the
target's distribution after its last real token and after each proposal).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engines.reference.config import ModelConfig, rope_inv_freq
from engines.reference.model import AttentionBatch, CausalLM, DecodeGroup, PrefillSeq
from engines.reference.profiling import NO_PROFILER, NoProfiler
from engines.reference.scheduler import ScheduledChunk

# Decode requests attended together; smaller groups pad less, larger ones call SDPA less.
_DECODE_GROUP_SIZE = 16


@dataclass(frozen=True)
class StepInputs:
    """One step's model inputs on the device (what `prepare` builds and `forward` runs)."""

    input_ids: torch.Tensor  # [T] int64
    cos: torch.Tensor  # [T, 1, D]
    sin: torch.Tensor  # [T, 1, D]
    batch: AttentionBatch
    logits_rows: torch.Tensor  # [S] int64


@dataclass(frozen=True)
class ChunkInput:
    """What the runner needs about one scheduled chunk."""

    chunk: ScheduledChunk
    token_ids: Sequence[int]  # the request's tokens (prompt + outputs)
    block_ids: Sequence[int]  # its KV blocks, in sequence order
    # Prompt logprobs: `prompt_rows` positions of the chunk from its `prompt_offset`-th also
    # need their logits; they come after every chunk's sampling rows (ModelRunner.execute).
    prompt_rows: int = 0
    prompt_offset: int = 0


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
        self.profiler: NoProfiler = NO_PROFILER  # the engine's, when it profiles
        self.block_size = block_size
        self.device = device
        # Per layer: K and V pools, [KVH, num_blocks, block_size, D]. KV heads outermost so a
        # gather of whole blocks is directly SDPA's [KVH, B, L, D] (see Attention._decode).
        shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
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

    def _decode_groups(
        self, rows: list[int], lens: list[int], tables: list[Sequence[int]]
    ) -> list[DecodeGroup]:
        """Decode requests sorted by context length and cut into groups, each padded only to
        its own longest context: with mixed lengths, one padded batch would gather and attend
        over mostly padding."""
        order = sorted(range(len(rows)), key=lens.__getitem__)
        groups = []
        for lo in range(0, len(order), _DECODE_GROUP_SIZE):
            members = order[lo : lo + _DECODE_GROUP_SIZE]
            max_len = lens[members[-1]]
            max_blocks = -(-max_len // self.block_size)
            blocks: list[int] = []
            for i in members:  # padding blocks point at block 0; the mask hides them
                blocks.extend(tables[i][:max_blocks])
                blocks.extend([0] * (max_blocks - len(tables[i])))
            context = torch.arange(max_blocks * self.block_size)  # [L]
            group_lens = torch.tensor([lens[i] for i in members])
            mask = (context[None, :] < group_lens[:, None]).view(1, len(members), 1, -1)
            groups.append(
                DecodeGroup(
                    rows=torch.tensor([rows[i] for i in members], device=self.device),
                    blocks=torch.tensor(blocks, dtype=torch.int64, device=self.device),
                    mask=mask.to(self.device),
                )
            )
        return groups

    @torch.inference_mode()
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole KV blocks (source, destination) in every layer: a forked sample's own
        copy of a partly filled prompt block (kv_cache.BlockManager.fork)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[:, dst] = k_cache[:, src]
            v_cache[:, dst] = v_cache[:, src]

    def execute(self, inputs: Sequence[ChunkInput]) -> torch.Tensor:
        """Run one step; returns logits [S + P, V] (float32): `chunk.num_logits` rows per
        chunk, in order (S = sum of them), then the `prompt_rows` of each chunk that asks, in
        order (P = sum of those; usually 0)."""
        with self.profiler.phase("build_inputs"):
            step = self.prepare(inputs)
        with self.profiler.phase("forward"):
            return self.forward(step)

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> torch.Tensor:
        """The model over prepared inputs: logits [S, V] (float32)."""
        return self.model(
            step.input_ids, step.cos, step.sin, step.batch, self.kv_caches, step.logits_rows
        )

    @torch.inference_mode()
    def prepare(self, inputs: Sequence[ChunkInput]) -> StepInputs:
        """Flatten the scheduled chunks into model inputs (separate from `forward` so a
        profile tells host-side batch building from the model's own time)."""
        dev, bs = self.device, self.block_size
        # Plain Python lists, one torch.tensor each at the end: per-request tensor ops would
        # cost more than the bookkeeping itself at large batch sizes.
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSeq] = []
        decode_rows: list[int] = []
        decode_lens: list[int] = []
        decode_tables: list[Sequence[int]] = []
        logits_rows: list[int] = []
        prompt_rows: list[int] = []  # after all sampling rows, so theirs keep their places
        row = 0
        for item in inputs:
            chunk = item.chunk
            start, n = chunk.start, chunk.num_tokens
            blocks = item.block_ids
            spec = chunk.spec_token_ids
            # Proposals follow the request's own tokens; they are not in token_ids (yet).
            input_ids.extend(item.token_ids[start : start + n - len(spec)])
            input_ids.extend(spec)
            positions.extend(range(start, start + n))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1:
                decode_rows.append(row)
                decode_lens.append(start + 1)
                decode_tables.append(blocks)
            else:
                gather = mask = None
                if start > 0:  # attend to cached history: gather the whole context
                    table = torch.tensor(blocks, dtype=torch.int64)
                    context = torch.arange(start + n)
                    gather = self._slots(table, context).to(dev)
                    queries = torch.arange(start, start + n)
                    mask = (context[None, :] <= queries[:, None]).to(dev)  # [n, L]
                prefills.append(PrefillSeq(row, n, start, gather, mask))
            # The last real token's row, then one per proposal: verification needs them all.
            logits_rows.extend(range(row + n - chunk.num_logits, row + n))
            first = row + item.prompt_offset
            prompt_rows.extend(range(first, first + item.prompt_rows))
            row += n

        groups = self._decode_groups(decode_rows, decode_lens, decode_tables)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        batch = AttentionBatch(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            decode_groups=groups,
            prefills=prefills,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            cos=self.cos[pos_t].unsqueeze(1),  # [T, 1, D]
            sin=self.sin[pos_t].unsqueeze(1),
            batch=batch,
            logits_rows=torch.tensor(logits_rows + prompt_rows, dtype=torch.int64, device=dev),
        )
