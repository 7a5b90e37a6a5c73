"""Draft-model proposals for speculative decoding in the reference engine.

A small model with the target's tokenizer proposes each speculating request's next k tokens,
which the target then verifies in its own forward pass (engines/reference/speculative/verify.py).
The draft has its own paged KV cache: a second BlockManager (with prefix caching when the
engine has it) and a second ModelRunner over the draft's weights.

Each engine step, before the target's schedule, for all speculating requests together:

1. Sync: each request's draft KV is cut back to the longest prefix of the tokens it wrote
   that the request's tokens still agree with. This is the rollback of rejected proposals:
   the draft wrote KV for its proposals, the target kept some of them (or none), and blocks
   holding only the rest go back to the draft's pool.
2. Catch up and propose: draft step 1 is one forward over every request's tokens the draft
   has not seen (the whole prompt at first, then the accepted proposals and the target's own
   token: usually 1-2 tokens), with the logits of each request's last token; steps 2..k are
   one forward each, one token per request still proposing. So the draft runs k forwards per
   engine step, whatever the batch. Blocks for the catch-up and the k - 1 proposals whose KV
   the draft writes are allocated before step 1 (the k-th proposal's KV is never needed: if
   accepted, it is caught up next step with the target's token).
3. Each draft step samples every row from the draft's distribution q (greedy rows: its
   argmax) with the request's sampling parameters and generator; q of every proposal goes
   with it to verification (exact rejection sampling needs it).

Catch-up is cut to `max_num_tokens` tokens per step, all requests together, like the
target's own steps: a request whose catch-up does not fit computes part of it and proposes
from the next step on. A request whose catch-up and proposals do not fit in the draft's pool
does not speculate in that step (it decodes one token, correctly); nothing is evicted for
the draft. Draft blocks are freed when the request finishes, is aborted or is preempted.

Pool size (`draft_pool_blocks`): as many tokens as the target's pool, plus room for the
proposals of every request that may speculate at once. The draft holds a subset of the
requests the target holds, each at most num_tokens - 1 positions ahead of it, and with prefix
caching on both sides shares prompts as the target does, so it rarely runs out before the
target. Its memory is that many tokens times the draft's own KV bytes per token, a fraction
of the target's for a small draft.

The bookkeeping (`DraftBook`) is plain Python, testable with no model; `Drafter` holds the
tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.api import EngineError, SamplingParams
from engines.reference.model.config import load_model_config
from engines.reference.runtime.kv_cache import BlockManager
from engines.reference.runtime.resources import load_tokenizer, resolve_max_model_len
from engines.reference.runtime.scheduler import ScheduledChunk


def draft_pool_blocks(
    target_blocks: int, block_size: int, num_tokens: int, max_speculating: int
) -> int:
    """Blocks of the draft's KV pool: the target pool's tokens, plus num_tokens positions of
    proposals (rounded up to blocks, one more for a block boundary) for each of the at most
    `max_speculating` requests that speculate in one step."""
    per_request = -(-num_tokens // block_size) + 1
    return target_blocks + max_speculating * per_request


@dataclass(frozen=True)
class DraftChunk:
    """What draft step 1 computes for one request: tokens [start, start + num_tokens) of
    its tokens, and then, when the catch-up is complete, num_proposals draft steps."""

    request_id: str
    start: int  # tokens whose KV the draft already holds
    num_tokens: int  # tokens caught up in step 1 (>= 1)
    num_proposals: int  # tokens proposed after it; 0: catch-up only (budget), no proposal


@dataclass
class _DraftSeq:
    written: list[int]  # tokens whose KV is in the draft's cache, positions 0..len-1
    num_real: int  # of them, the leading ones known to be the request's own tokens


class DraftBook:
    """Which tokens of each request the draft's KV cache holds (plain Python, no torch)."""

    def __init__(self, block_manager: BlockManager, max_len: int) -> None:
        self.block_manager = block_manager
        self.max_len = max_len  # positions the draft can compute (its RoPE table)
        self._seqs: dict[str, _DraftSeq] = {}

    def has(self, request_id: str) -> bool:
        return request_id in self._seqs

    def written(self, request_id: str) -> list[int]:
        return self._seqs[request_id].written

    def sync(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Cut the request's draft KV back to the longest prefix of what it wrote that
        `token_ids` agree with (at most all but the last token, whose logits are needed);
        returns its length. Rejected proposals' blocks go back to the pool."""
        seq = self._seqs[request_id]
        limit = min(len(seq.written), len(token_ids) - 1)
        valid = min(seq.num_real, limit)
        while valid < limit and seq.written[valid] == token_ids[valid]:
            valid += 1
        del seq.written[valid:]
        seq.num_real = valid
        self.block_manager.truncate(request_id, valid)
        return valid

    def plan(
        self, request_id: str, token_ids: Sequence[int], num_proposals: int, budget: int
    ) -> DraftChunk | None:
        """Sync the request, allocate blocks for its catch-up (within `budget` tokens) and,
        when the catch-up completes, for its proposals; None when it cannot run this step
        (no budget, past the draft's context, or no room in the pool)."""
        bm = self.block_manager
        num = len(token_ids)
        # Proposal j's KV (j < k) is written at position num + j - 1: all must be < max_len.
        num_proposals = min(num_proposals, self.max_len - num + 1)
        if budget < 1 or num_proposals < 1:
            return None
        if request_id in self._seqs:
            start = self.sync(request_id, token_ids)
            cached: list[int] = []
        else:
            cached = bm.find_cached_prefix(token_ids)
            start = len(cached) * bm.block_size
        catch_up = min(num - start, budget)
        if catch_up < num - start:
            num_proposals = 0
        total = start + catch_up + max(num_proposals - 1, 0)
        if request_id in self._seqs:
            if not bm.can_append(request_id, total):
                return None
            bm.append(request_id, total)
        else:
            if not bm.can_allocate(total, cached):
                return None
            bm.allocate(request_id, total, cached)
            self._seqs[request_id] = _DraftSeq(list(token_ids[:start]), start)
        return DraftChunk(request_id, start, catch_up, num_proposals)

    def caught_up(self, chunk: DraftChunk, token_ids: Sequence[int]) -> None:
        """Record step 1's catch-up as computed; its full blocks join the prefix cache."""
        seq = self._seqs[chunk.request_id]
        end = chunk.start + chunk.num_tokens
        seq.written.extend(token_ids[chunk.start : end])
        seq.num_real = end
        self.block_manager.cache_full_blocks(chunk.request_id, token_ids, end)

    def proposed(self, request_id: str, token: int) -> None:
        """Record a proposal whose KV the next draft step writes."""
        self._seqs[request_id].written.append(token)

    def free(self, request_id: str) -> None:
        """Release the request's draft blocks (finished, aborted or preempted)."""
        if self._seqs.pop(request_id, None) is not None:
            self.block_manager.free(request_id)


@dataclass(frozen=True)
class DraftRequest:
    """One speculating request, as the drafter needs it."""

    request_id: str
    token_ids: Sequence[int]  # prompt + outputs so far (the last one not yet in any KV)
    num_proposals: int  # k for this request (already capped by max_tokens)
    sampling: SamplingParams
    generator: Any  # torch.Generator of a seeded request; None: the engine's default


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]  # proposed next tokens, in order
    probs: Any  # torch.Tensor [len(tokens), V]: q each was drawn from; None for greedy rows


def check_same_vocabulary(
    target_dir: Path, draft_dir: Path, target_cfg: Any, draft_cfg: Any, target_tok, draft_tok
) -> None:
    """EngineError unless the draft's token ids mean what the target's do: the same vocab
    size and, when both directories have a tokenizer, the same token -> id map."""
    fix = "a draft model must use the target model's tokenizer"
    if target_cfg.vocab_size != draft_cfg.vocab_size:
        raise EngineError(
            f"engine.speculative.model: the draft model {draft_dir} has vocab_size "
            f"{draft_cfg.vocab_size} but the model {target_dir} has {target_cfg.vocab_size}; {fix}"
        )
    if target_tok is None or draft_tok is None:
        return
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(
            set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda item: item[1]
        )
        example = ", ".join(f"{t!r}: {i}" for t, i in differing[:3])
        raise EngineError(
            f"engine.speculative.model: the draft model {draft_dir} has a different tokenizer "
            f"from the model {target_dir} ({len(differing)} token/id pairs differ, e.g. "
            f"{example}); {fix}"
        )


class Drafter:
    """The draft model, its KV pool and runner; proposes for a step's speculating requests."""

    def __init__(
        self,
        draft_dir: str,
        target_dir: str,
        target_cfg: Any,
        target_tokenizer: Any,
        *,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        max_len: int,
        dtype: Any,
        device: Any,
    ) -> None:
        # torch: the draft's model loads with it, when method draft is used
        from engines.reference.model.weights import load_model
        from engines.reference.runtime.runner import ModelRunner

        path = Path(draft_dir)
        if not (path / "config.json").exists():
            raise EngineError(
                f"engine.speculative.model: {draft_dir} is not a model directory (no "
                "config.json); give a local Hugging Face directory of the draft model"
            )
        self.config = load_model_config(path)
        check_same_vocabulary(
            Path(target_dir),
            path,
            target_cfg,
            self.config,
            target_tokenizer,
            load_tokenizer(path),
        )
        max_len = min(max_len, resolve_max_model_len(self.config, None))
        self.model = load_model(path, self.config, dtype, device)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.book = DraftBook(self.block_manager, max_len)
        self.runner = ModelRunner(
            self.model, self.config, num_blocks, block_size, max_len, dtype, device
        )

    def free(self, request_id: str) -> None:
        self.book.free(request_id)

    def close(self) -> None:
        self.runner.kv_caches = []
        self.runner.model = None
        self.model = None

    def propose(
        self, requests: Sequence[DraftRequest], budget: int, default_generator: Any
    ) -> dict[str, Proposal]:
        """Proposals for the requests that fit this step (see the module doc), by id."""
        # torch: imported where the draft runs, as the rest of this module does
        from engines.reference.runtime.runner import ChunkInput

        by_id = {r.request_id: r for r in requests}
        plans: list[DraftChunk] = []
        for r in requests:
            plan = self.book.plan(r.request_id, r.token_ids, r.num_proposals, budget)
            if plan is not None:
                plans.append(plan)
                budget -= plan.num_tokens
        if not plans:
            return {}
        inputs = [
            ChunkInput(
                ScheduledChunk(
                    request_id=p.request_id,
                    start=p.start,
                    num_tokens=p.num_tokens,
                    is_sampling=p.num_proposals > 0,
                    num_prefill_tokens=p.num_tokens,
                ),
                by_id[p.request_id].token_ids,
                self.block_manager.block_ids(p.request_id),
            )
            for p in plans
        ]
        logits = self.runner.execute(inputs)  # [S, V]: one row per proposing request
        for p in plans:
            self.book.caught_up(p, by_id[p.request_id].token_ids)
        active = [p for p in plans if p.num_proposals > 0]
        tokens: dict[str, list[int]] = {p.request_id: [] for p in active}
        probs: dict[str, list[Any]] = {p.request_id: [] for p in active}
        for step in range(max((p.num_proposals for p in active), default=0)):
            if step > 0:
                inputs = []
                for p in active:
                    rid = p.request_id
                    sequence = [*by_id[rid].token_ids, *tokens[rid]]
                    chunk = ScheduledChunk(
                        request_id=rid,
                        start=len(sequence) - 1,
                        num_tokens=1,
                        is_sampling=True,
                        num_prefill_tokens=0,
                    )
                    inputs.append(ChunkInput(chunk, sequence, self.block_manager.block_ids(rid)))
                logits = self.runner.execute(inputs)
            drawn, q = _draw(
                logits,
                [by_id[p.request_id] for p in active],
                default_generator,
            )
            for row, p in enumerate(active):
                tokens[p.request_id].append(drawn[row])
                probs[p.request_id].append(None if q is None else q[row])
                if step + 1 < p.num_proposals:
                    self.book.proposed(p.request_id, drawn[row])
            active = [p for p in active if p.num_proposals > step + 1]
        return {rid: _proposal(tokens[rid], probs[rid], by_id[rid].sampling) for rid in tokens}


def _draw(
    logits: Any, requests: Sequence[DraftRequest], default_generator: Any
) -> tuple[list[int], Any]:
    """One token per row from the draft's logits [R, V], and q ([R, V]; None when every
    row is greedy): greedy rows take the argmax, the others are drawn from q with one uniform
    of the request's generator (or the engine's default)."""
    import torch

    # torch: imported where the draft runs, as the rest of this module does
    from engines.reference.sampling.sampler import pick, probabilities

    params = [r.sampling for r in requests]
    if all(p.is_greedy for p in params):
        return logits.argmax(-1).tolist(), None
    q = probabilities(logits, params)  # greedy rows: one-hot at the argmax, any u picks it
    u = torch.zeros(len(requests), device=logits.device)
    for row, r in enumerate(requests):
        if not r.sampling.is_greedy:
            generator = r.generator if r.generator is not None else default_generator
            u[row] = torch.rand(1, generator=generator, device=logits.device)[0]
    return pick(q, u).tolist(), q


def _proposal(tokens: list[int], probs: list[Any], sampling: SamplingParams) -> Proposal:
    if sampling.is_greedy:
        return Proposal(tokens, None)
    import torch

    return Proposal(tokens, torch.stack(probs))
