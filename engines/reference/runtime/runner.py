"""Model runner: owns the model, the KV block pool tensors and the RoPE tables; turns one
SchedulerOutput into model inputs, runs the forward pass and returns the sampling rows' logits:
one row per sampling chunk, or 1 + k rows for a chunk carrying k speculative proposals (the
target's distribution after its last real token and after each proposal).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from engines.reference.model import cpu_kernels, hugepages
from engines.reference.model.config import ModelConfig, rope_inv_freq, rope_scaling_factor
from engines.reference.model.lora import LoraRows, LoraStepState
from engines.reference.model.model import (
    AttentionBatch,
    CausalLM,
    DecodeGroup,
    ImageRows,
    PagedRows,
    PrefillSeq,
)
from engines.reference.model.mrope import section_rows
from engines.reference.runtime.media import PromptMedia
from engines.reference.runtime.profiling import NO_PROFILER, NoProfiler
from engines.reference.runtime.scheduler import ScheduledChunk

# Without the CPU kernel (CUDA, or the kernels off), which takes every chunk of a step:
# decode requests attended together; smaller groups pad less, larger ones call SDPA less.
_DECODE_GROUP_SIZE = 16
# Chunks of up to this many tokens (a decode token, a verification chunk of 1 + k) attend in
# decode groups; longer ones (prefill) one request at a time (see Attention._prefill).
_MAX_GROUPED_QUERIES = 8
# Below this many multiply-adds per decoder layer a step runs its forward on one thread. Every
# op that goes parallel wakes the step thread's OpenMP workers, which sleep between ops: 25-120
# us each on the step thread, against a few us of work in a small step. A verification chunk
# paid it ~10 times per step (its 1 + k row matmuls take a threaded GEMM where one decode row
# takes a single-threaded GEMV), which made it cost ~3 decode steps. Measured on 2 shared CPU
# cores: one thread won every decode batch of the `tiny` model (up to ~4M at 64 requests) and
# about tied at ~24M (`small`, 8 requests); two won from ~48M (`small`, 16 requests).
_PARALLEL_MIN_LAYER_MACS = 1 << 25


@dataclass(frozen=True)
class StepInputs:
    """One step's model inputs on the device (what `prepare` builds and `forward` runs)."""

    input_ids: torch.Tensor  # [T] int64
    cos: torch.Tensor  # [T, 1, D]
    sin: torch.Tensor  # [T, 1, D]
    batch: AttentionBatch
    logits_rows: torch.Tensor  # [S] int64
    layer_macs: int  # multiply-adds of one decoder layer (estimate): picks the thread count
    lora: tuple[LoraRows, ...] = ()  # the rows of each LoRA slot in use this step
    lora_slots: torch.Tensor | None = None  # [T] int64 each row's LoRA slot (-1: none)
    images: ImageRows | None = None  # image tokens' encoder embeddings (vision models)


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
    adapter_slot: int = -1  # the LoRA slot its rows use (runtime/adapters.py); -1: base model
    media: PromptMedia | None = None  # the request's images; None: a text prompt


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token across all layers."""
    return 2 * cfg.num_layers * cfg.kv_size * torch.tensor([], dtype=dtype).element_size()


def linear_macs_per_token(cfg: ModelConfig) -> int:
    """Multiply-adds of one decoder layer's projections for one token (averaged over the
    layers where Mixture-of-Experts layers differ: a token computes only its k experts and
    the router)."""
    attention = cfg.hidden_size * (2 * cfg.q_size + 2 * cfg.kv_size)  # q, k, v, o
    dense = 3 * cfg.hidden_size * cfg.intermediate_size  # gate, up, down
    if cfg.moe is None:
        return attention + dense
    moe = cfg.moe
    sparse = cfg.hidden_size * (
        moe.num_experts + 3 * moe.num_experts_per_tok * moe.intermediate_size
    )
    num_sparse = len(moe.sparse_layers)
    mlp = (num_sparse * sparse + (cfg.num_layers - num_sparse) * dense) // cfg.num_layers
    return attention + mlp


@dataclass(frozen=True)
class ExpertLoad:
    """Tokens per expert in one step, over the Mixture-of-Experts layers: how evenly the
    router spread the step's work (max / mean = 1 is perfectly even)."""

    max_tokens: int  # the busiest expert of any layer
    mean_tokens: float  # tokens x k / experts: the same in every layer


@contextlib.contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """Run the body on at most `count` intra-op threads, then restore the thread's setting."""
    current = torch.get_num_threads()
    if count >= current:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(current)


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
        # What the model's LoRA projections read each step (set where the engine attached
        # them: model/lora.py); None: no adapters.
        self.lora: LoraStepState | None = None
        self.block_size = block_size
        self.device = device
        self._per_kv_head = cfg.num_heads // cfg.num_kv_heads  # G query heads per KV head
        self._linear_macs = linear_macs_per_token(cfg)
        self._moe_blocks = model.moe_blocks()  # empty for a dense model
        self._attention_macs = 2 * cfg.q_size  # per (query, key) pair: q·k, then p·v
        # Every chunk's attention through the CPU kernel, reading the cache in place (GPT-OSS's
        # sinks and windows included: each layer passes its own).
        self._paged_kernel = cpu_kernels.use_kernels(device)
        # Sliding-window layers' window (GPT-OSS), for the SDPA paths' masks; None: no such
        # layers. The kernel needs no mask: it takes the window itself.
        self._window = cfg.masked_window if cfg.window_layers else None
        # Per layer: K and V pools, [KVH, num_blocks, block_size, D]. KV heads outermost so a
        # gather of whole blocks is directly SDPA's [KVH, B, L, D] (see Attention._decode).
        # On huge pages where the OS allows: decode walks blocks scattered over the pool.
        shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
        self.kv_caches = [
            (hugepages.zeros(shape, dtype, device), hugepages.zeros(shape, dtype, device))
            for _ in range(cfg.num_layers)
        ]
        # RoPE tables for every position, computed as transformers does (fp32, then cast).
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope)  # [D/2]
        positions = torch.arange(max_model_len, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)  # [max_len, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, D]
        scaling = rope_scaling_factor(cfg.rope)  # YaRN's attention factor, applied in fp32
        self.cos = (emb.cos() * scaling).to(dtype).to(device)
        self.sin = (emb.sin() * scaling).to(dtype).to(device)
        # Qwen2.5-VL: which position row rotates each head dimension (model/mrope.py).
        self._mrope = (
            section_rows(cfg.head_dim, cfg.mrope_section).to(device)
            if cfg.mrope_section is not None
            else None
        )

    def _slots(self, block_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return (
            block_ids[positions // self.block_size] * self.block_size + positions % self.block_size
        )

    def _decode_groups(
        self,
        num_queries: int,
        rows: list[int],
        lens: list[int],
        tables: list[Sequence[int]],
    ) -> list[DecodeGroup]:
        """Requests with `num_queries` tokens each (first flat row `rows[i]`, context length
        `lens[i]` including those tokens), sorted by context length and cut into groups, each
        padded only to its own longest context: with mixed lengths, one padded batch would
        gather and attend over mostly padding."""
        n, per_kv = num_queries, self._per_kv_head
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
            # Keys each query row may see: query j of a request sees its context up to and
            # including its own position. A lone query's limit broadcasts over its G heads;
            # n > 1 queries ride with their G heads in one dimension, so each row needs its own.
            heads = 1 if n == 1 else per_kv
            limits = [lens[i] - n + 1 + j for i in members for j in range(n) for _ in range(heads)]
            context = torch.arange(max_blocks * self.block_size)  # [L]
            limit_t = torch.tensor(limits)[:, None]
            mask = context[None, :] < limit_t  # [B * n * heads, L]
            window_mask = None
            if self._window is not None:  # query at limit - 1 sees keys from limit - window on
                window_mask = mask & (context[None, :] >= limit_t - self._window)
                window_mask = self._upload(window_mask.view(1, len(members), n * heads, -1))
            groups.append(
                DecodeGroup(
                    rows=self._upload(
                        torch.tensor([rows[i] + j for i in members for j in range(n)])
                    ),
                    blocks=self._upload(torch.tensor(blocks, dtype=torch.int64)),
                    mask=self._upload(mask.view(1, len(members), n * heads, -1)),
                    num_queries=n,
                    window_mask=window_mask,
                )
            )
        return groups

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """A step input built on the host, on the model's device. On CUDA it is staged in
        pinned memory (torch's caching host allocator keeps those pages from step to step) and
        copied asynchronously on the stream: a pageable copy would block the step thread on
        every input of every step. On CPU it is the tensor itself."""
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _paged_rows(self, chunks: list[tuple[int, int, int, Sequence[int]]]) -> PagedRows:
        """Every chunk's query rows for the kernel. A chunk (first flat row, n tokens, context
        length including them, block table): its query j attends to keys up to its own
        position, length - n + 1 + j of them."""
        rows: list[int] = []
        req: list[int] = []
        limit: list[int] = []
        tables: list[Sequence[int]] = []
        for first, n, length, blocks in chunks:
            rows.extend(range(first, first + n))
            req.extend([len(tables)] * n)
            limit.extend(range(length - n + 1, length + 1))
            tables.append(blocks)
        width = max(len(t) for t in tables)
        padding = [0] * width
        flat: list[int] = []  # one flat list: torch.tensor of nested lists is several x slower
        for t in tables:
            flat.extend(t)
            flat.extend(padding[: width - len(t)])
        return PagedRows(
            rows=torch.tensor(rows, dtype=torch.int64),
            req=torch.tensor(req, dtype=torch.int32),
            limit=torch.tensor(limit, dtype=torch.int32),
            tables=torch.tensor(flat, dtype=torch.int32).view(len(tables), width),
        )

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

    def expert_load(self) -> ExpertLoad | None:
        """The last step's expert load, or None for a dense model. One host read of E counts
        per layer, taken after the step's forward (where the step has synchronised anyway)."""
        blocks = self._moe_blocks
        if not blocks or blocks[0].last_counts is None:
            return None
        counts = torch.stack([b.last_counts for b in blocks])  # [MoE layers, E]
        return ExpertLoad(
            max_tokens=int(counts.max()), mean_tokens=float(counts[0].sum()) / counts.shape[1]
        )

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> torch.Tensor:
        """The model over prepared inputs: logits [S, V] (float32)."""
        small = step.layer_macs < _PARALLEL_MIN_LAYER_MACS  # see _PARALLEL_MIN_LAYER_MACS
        if step.lora and self.lora is None:
            raise RuntimeError("a step with LoRA rows on a runner without LoRA slots")
        if self.lora is not None:
            self.lora.groups = step.lora
            self.lora.slots = step.lora_slots
        try:
            with intra_op_threads(1) if small else contextlib.nullcontext():
                return self.model(
                    step.input_ids,
                    step.cos,
                    step.sin,
                    step.batch,
                    self.kv_caches,
                    step.logits_rows,
                    step.images,
                )
        finally:
            if self.lora is not None:
                self.lora.groups = ()
                self.lora.slots = None

    @torch.inference_mode()
    def embed_hidden(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of whole prompts, back to back (T = their
        tokens together), for embeddings.

        A causal forward over the prompts, apart from generation: their K/V go to a scratch
        pool made for this call and dropped after it, so the shared pool, its prefix cache
        and the requests generating alongside are untouched, and an embedding never depends on
        what happened to be cached. On CPU every prompt is attended in one call of the paged
        kernel (each prompt in whole blocks of its own in the scratch pool), as generation's
        prefills are; elsewhere each prompt is one SDPA call over its own K/V."""
        input_ids: list[int] = []
        positions: list[int] = []
        prefills: list[PrefillSeq] = []
        chunks: list[tuple[int, int, int, Sequence[int]]] = []  # for the paged kernel
        slots: list[int] = []
        bs = self.block_size if self._paged_kernel else 1
        num_blocks = 0
        for prompt in prompts:
            n = len(prompt)
            blocks = range(num_blocks, num_blocks + -(-n // bs))
            if self._paged_kernel:
                chunks.append((len(input_ids), n, n, blocks))
            else:
                # No history: each prompt attends causally to its own K/V (Attention._prefill),
                # within the sliding window in the layers that have one, as in generation.
                window_mask = self._prefill_window_mask(0, n)
                prefills.append(PrefillSeq(len(input_ids), n, 0, None, None, window_mask))
            slots.extend(range(num_blocks * bs, num_blocks * bs + n))
            num_blocks += len(blocks)
            input_ids.extend(prompt)
            positions.extend(range(n))
        k_cache, v_cache = self.kv_caches[0]
        shape = (k_cache.shape[0], num_blocks, bs, k_cache.shape[-1])  # [KVH, blocks, bs, D]
        scratch = [
            (
                torch.empty(shape, dtype=k_cache.dtype, device=self.device),
                torch.empty(shape, dtype=v_cache.dtype, device=self.device),
            )
            for _ in self.kv_caches
        ]
        pos_t = self._upload(torch.tensor(positions, dtype=torch.int64))
        batch = AttentionBatch(
            slot_mapping=self._upload(torch.tensor(slots, dtype=torch.int64)),
            prefills=prefills,
            paged=self._paged_rows(chunks) if chunks else None,
        )
        return self.model.hidden_states(
            self._upload(torch.tensor(input_ids, dtype=torch.int64)),
            self.cos[pos_t].unsqueeze(1),  # [T, 1, D]
            self.sin[pos_t].unsqueeze(1),
            batch,
            scratch,
            self._upload(torch.arange(len(input_ids), dtype=torch.int64)),
        )

    def _prefill_window_mask(self, start: int, n: int) -> torch.Tensor | None:
        """[n, start + n] bool: the keys within the sliding window of each query of a chunk
        at positions start .. start + n - 1 (models with window layers), else None."""
        if self._window is None:
            return None
        context = torch.arange(start + n)
        queries = torch.arange(start, start + n)
        keep = context[None, :] <= queries[:, None]
        keep &= context[None, :] > queries[:, None] - self._window
        return self._upload(keep)

    @torch.inference_mode()
    def prepare(self, inputs: Sequence[ChunkInput]) -> StepInputs:
        """Flatten the scheduled chunks into model inputs (separate from `forward` so a
        profile tells host-side batch building from the model's own time)."""
        bs = self.block_size
        # Plain Python lists, one torch.tensor each at the end: per-request tensor ops would
        # cost more than the bookkeeping itself at large batch sizes.
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSeq] = []
        # Short chunks by token count: first row, context length, block table of each.
        short: dict[int, tuple[list[int], list[int], list[Sequence[int]]]] = {}
        # With the CPU kernel, every chunk instead: first row, n, context length, block table.
        paged: list[tuple[int, int, int, Sequence[int]]] = []
        logits_rows: list[int] = []
        prompt_rows: list[int] = []  # after all sampling rows, so theirs keep their places
        lora_rows: dict[int, list[int]] = {}  # LoRA slot -> its rows
        media: list[tuple[int, ChunkInput]] = []  # chunks of prompts with images, by first row
        attended = 0  # (query, key) pairs over all chunks (causal ones counted whole)
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
            attended += n * (start + n)
            if self._paged_kernel:  # every chunk, short or long: the kernel reads the cache
                paged.append((row, n, start + n, blocks))
            elif n <= _MAX_GROUPED_QUERIES:
                rows, lens, tables = short.setdefault(n, ([], [], []))
                rows.append(row)
                lens.append(start + n)
                tables.append(blocks)
            else:
                gather = mask = None
                if start > 0:  # attend to cached history: gather the whole context
                    context = torch.arange(start + n)
                    queries = torch.arange(start, start + n)
                    table = torch.tensor(blocks, dtype=torch.int64)
                    gather = self._upload(self._slots(table, context))
                    mask = self._upload(context[None, :] <= queries[:, None])  # [n, L]
                window_mask = self._prefill_window_mask(start, n)
                prefills.append(PrefillSeq(row, n, start, gather, mask, window_mask))
            # The last real token's row, then one per proposal: verification needs them all.
            logits_rows.extend(range(row + n - chunk.num_logits, row + n))
            first = row + item.prompt_offset
            prompt_rows.extend(range(first, first + item.prompt_rows))
            if item.adapter_slot >= 0:
                lora_rows.setdefault(item.adapter_slot, []).extend(range(row, row + n))
            if item.media is not None:
                media.append((row, item))
            row += n

        groups = [g for n, members in short.items() for g in self._decode_groups(n, *members)]
        pos_t = self._upload(torch.tensor(positions, dtype=torch.int64))
        cos, sin = self._rotary(pos_t, media)
        batch = AttentionBatch(
            slot_mapping=self._upload(torch.tensor(slots, dtype=torch.int64)),
            decode_groups=groups,
            prefills=prefills,
            paged=self._paged_rows(paged) if paged else None,
        )
        return StepInputs(
            input_ids=self._upload(torch.tensor(input_ids, dtype=torch.int64)),
            cos=cos,
            sin=sin,
            batch=batch,
            logits_rows=self._upload(torch.tensor(logits_rows + prompt_rows, dtype=torch.int64)),
            layer_macs=row * self._linear_macs + attended * self._attention_macs,
            lora=tuple(
                LoraRows(slot, self._upload(torch.tensor(rows, dtype=torch.int64)))
                for slot, rows in lora_rows.items()
            ),
            lora_slots=self._row_slots(row, lora_rows) if lora_rows else None,
            images=self._image_rows(media) if media else None,
        )

    def _rotary(
        self, positions: torch.Tensor, media: list[tuple[int, ChunkInput]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] of the step's rows. Rows of prompts with images rotate by
        their three mrope positions (model/mrope.py); every other row's three positions are
        its index, where mrope equals the plain table lookup, so text-only steps take that."""
        if not media or self._mrope is None:
            return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        rows = positions.unsqueeze(0).repeat(3, 1)  # [3, T]
        for first, item in media:
            start, n = item.chunk.start, item.chunk.num_tokens
            info = item.media
            prompt_len = info.positions.shape[1]
            cut = max(start, min(start + n, prompt_len))
            at = first
            if start < cut:  # the chunk's prompt tokens: their own three rows
                rows[:, at : at + cut - start] = info.positions[:, start:cut].to(rows.device)
                at += cut - start
            if cut < start + n:  # generated tokens: index + delta in every row
                rows[:, at : first + n] = positions[at : first + n] + info.delta
        index = rows[self._mrope].T  # [T, D]: each dimension's position
        return (
            torch.gather(self.cos, 0, index).unsqueeze(1),
            torch.gather(self.sin, 0, index).unsqueeze(1),
        )

    def _image_rows(self, media: list[tuple[int, ChunkInput]]) -> ImageRows | None:
        """The encoder's embeddings for the image tokens among the step's rows. Each image is
        encoded when a chunk first reaches it and kept until the chunk that takes its last
        token (runtime/media.py)."""
        rows: list[torch.Tensor] = []
        embeds: list[torch.Tensor] = []
        for first, item in media:
            start, end = item.chunk.start, item.chunk.start + item.chunk.num_tokens
            for image in item.media.images:
                lo, hi = max(start, image.start), min(end, image.end)
                if lo >= hi:
                    continue
                if image.embeds is None:
                    pixels = image.pixels.to(self.device)
                    image.embeds = self.model.visual(pixels, image.grid)
                embeds.append(image.embeds[lo - image.start : hi - image.start])
                rows.append(torch.arange(first + lo - start, first + hi - start))
                if hi == image.end:
                    image.embeds = None  # its last tokens run in this step
        if not rows:
            return None
        return ImageRows(self._upload(torch.cat(rows)), torch.cat(embeds))

    def _row_slots(self, num_rows: int, lora_rows: dict[int, list[int]]) -> torch.Tensor:
        slots = torch.full((num_rows,), -1, dtype=torch.int64)
        for slot, rows in lora_rows.items():
            slots[rows] = slot
        return self._upload(slots)
