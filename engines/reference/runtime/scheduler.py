"""In-flight batching scheduler: which tokens of which requests the next step computes.

Plain Python (no torch), testable with no model.

There is no prefill phase or decode phase: each request just has tokens to catch up on —
`num_tokens - num_computed_tokens` (the whole prompt at first, one token per step while
decoding, prompt + outputs again after a preemption). Each step, running requests are served
first in admission order, then waiting requests are admitted first-come first-served, until
the step's token budget (`max_num_tokens`) or the batch size (`max_batch_size`) is used up.
A request whose catch-up is complete after the step samples its next token.

Chunked prefill (on by default) lets a long prompt take whatever budget is left and finish in
later steps. With it off, a prompt is computed in one step, so the engine refuses prompts
longer than `max_num_tokens` up front (like TensorRT-LLM); the one exception is recomputing a
preempted request, whose prompt + outputs may exceed the budget and is then chunked anyway.

Speculative decoding: the engine may set `spec_token_ids` (proposed next tokens) on a running
request that is decoding. The request's chunk then holds its last real token plus the
proposals, KV blocks are allocated for all of them and they count against `max_num_tokens`
(proposals are cut to fit the budget, and dropped rather than cause a preemption). After the
step, `update_from_output` keeps the KV of the accepted proposals only: rejected positions are
not computed, blocks that hold none of the computed tokens go back to the pool, and prefix-cache
hashes cover computed (accepted) tokens only.

Preemption by recompute: when a running request needs a block and none is free, the most
recently admitted running request is evicted (blocks freed, progress dropped) and requeued at
the front of the waiting queue. A request that could not fit in the whole pool alone is
refused at admission, so eviction always makes progress: no crash, no deadlock.

LoRA adapters: a request with an adapter is admitted only with a slot for it (AdapterSlots:
runtime/adapters.py); when every slot holds another adapter in use, it is passed over and
keeps its place while others are admitted. Its prefix-cache hashes are rooted in the adapter's
name, so KV computed under one adapter is never reused under another or the base model.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from engines.lora.peft import LoraAdapter
from engines.reference.runtime.adapters import AdapterSlots
from engines.reference.runtime.kv_cache import BlockManager
from engines.reference.runtime.media import PromptMedia


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """Scheduling state of one request."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int  # output tokens allowed (already capped by the model's context)
    token_ids: list[int] = field(default_factory=list)  # prompt + outputs so far
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # Proposed next tokens for the coming step (speculative decoding); set by the engine.
    spec_token_ids: list[int] = field(default_factory=list)
    # False: compute the whole prompt even where the prefix cache holds it (prompt logprobs
    # need every position's logits, which cached blocks do not keep).
    use_prefix_cache: bool = True
    # The LoRA adapter it runs with (read and checked already); None: the base model.
    adapter: LoraAdapter | None = None
    # The prompt's images (placeholders, pixels, mrope positions); None: a text prompt.
    media: PromptMedia | None = None

    @property
    def hash_ids(self) -> list[int]:
        """The tokens as the prefix cache hashes them: each image keyed by its content."""
        return self.token_ids if self.media is None else self.media.hash_ids(self.token_ids)

    @property
    def adapter_name(self) -> str | None:
        return None if self.adapter is None else self.adapter.name

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def drop_last_tokens(self, count: int) -> None:
        """Forget the last `count` outputs (emitted after a stop, when the request finishes)."""
        if count > 0:
            del self.token_ids[-count:]
            self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)

    @property
    def is_decoding(self) -> bool:
        """All but the last token are in the KV cache: the next step decodes one token."""
        return (
            self.num_tokens > self.num_prompt_tokens
            and self.num_computed_tokens == self.num_tokens - 1
        )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_tokens: int = 2048  # tokens computed per step, all requests together
    max_batch_size: int = 64  # requests running (holding KV blocks) at once
    enable_chunked_prefill: bool = True  # a prompt may be split across steps


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of one request, computed in this step."""

    request_id: str
    start: int  # tokens already in the KV cache = position of the chunk's first token
    num_tokens: int
    is_sampling: bool  # the chunk completes the request's catch-up: sample its next token
    num_prefill_tokens: int  # prompt (or recomputed) tokens; 0 for a plain decode token
    # Proposed tokens appended after the request's own tokens (the last num_tokens positions
    # of a decode chunk); each needs its logits, as does the last real token.
    spec_token_ids: tuple[int, ...] = ()

    @property
    def num_logits(self) -> int:
        """Positions whose next-token logits this chunk needs (0 when it does not sample)."""
        return 1 + len(self.spec_token_ids) if self.is_sampling else 0


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # in flat-batch order
    preempted: list[str]  # request ids evicted this step (requeued at the front)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        adapters: AdapterSlots | None = None,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        # LoRA slots (None: the engine serves the base model only).
        self.adapters = adapters
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- admission -----------------------------------------------------------------------
    def admission_error(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request can never run here, or None. Checked before add_request."""
        if (
            not self.config.enable_chunked_prefill
            and num_prompt_tokens > self.config.max_num_tokens
        ):
            return (
                f"prompt has {num_prompt_tokens} tokens but max_num_tokens is "
                f"{self.config.max_num_tokens} and chunked prefill is off; raise "
                "max_num_tokens or enable chunked prefill"
            )
        bm = self.block_manager
        needed = bm.blocks_needed(num_prompt_tokens + max_tokens)
        if needed > bm.num_blocks:
            return (
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs "
                f"{needed} KV blocks of {bm.block_size} tokens but the pool has only "
                f"{bm.num_blocks}; raise kv_cache_tokens or lower max_tokens"
            )
        return None

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            catch_up = req.num_tokens - req.num_computed_tokens
            spec = req.spec_token_ids[: max(0, budget - catch_up)] if req.is_decoding else []
            if spec and not bm.can_append(req.request_id, req.num_tokens + len(spec)):
                spec = []  # proposals never evict anyone
            req.spec_token_ids = spec
            num_new = min(catch_up + len(spec), budget)
            target = req.num_computed_tokens + num_new
            while not bm.can_append(req.request_id, target):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req evicted itself: everything after it is gone too
            bm.append(req.request_id, target)
            chunks.append(self._chunk(req, num_new))
            budget -= num_new
            i += 1

        # Admitting new work while evicting would only evict it again. A request whose
        # adapter finds every LoRA slot in use is passed over, keeping its place in line.
        passed: list[Request] = []
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_batch_size
        ):
            req = self.waiting[0]
            name = req.adapter_name
            if name is not None and not self._adapters().can_acquire(name):
                passed.append(self.waiting.popleft())
                continue
            cached = bm.find_cached_prefix(req.hash_ids, name) if req.use_prefix_cache else []
            num_cached = len(cached) * bm.block_size
            num_new = req.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill and req.num_preemptions == 0:
                    break  # whole prompt in one step: wait for a step with room (FCFS)
                num_new = budget
            if not bm.can_allocate(num_cached + num_new, cached):
                break
            if req.adapter is not None:
                self._adapters().acquire(req.request_id, req.adapter)
            bm.allocate(req.request_id, num_cached + num_new, cached)
            self.waiting.popleft()
            self.running.append(req)
            req.spec_token_ids = []  # a request being admitted computes its own tokens first
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens is None:
                req.num_cached_tokens = min(num_cached, req.num_prompt_tokens)
            chunks.append(self._chunk(req, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(passed))

        return SchedulerOutput(chunks=chunks, preempted=preempted)

    def _adapters(self) -> AdapterSlots:
        if self.adapters is None:
            raise RuntimeError("a request with a LoRA adapter reached an engine without slots")
        return self.adapters

    def _chunk(self, req: Request, num_new: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        spec = tuple(req.spec_token_ids) if req.status is RequestStatus.RUNNING else ()
        num_real = num_new - len(spec)
        is_decode = num_real == 1 and start >= req.num_prompt_tokens
        return ScheduledChunk(
            request_id=req.request_id,
            start=start,
            num_tokens=num_new,
            is_sampling=start + num_real == req.num_tokens,
            num_prefill_tokens=0 if is_decode else num_new,
            spec_token_ids=spec,
        )

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req.request_id)
        if self.adapters is not None:
            self.adapters.release(req.request_id)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the step ------------------------------------------------------------------
    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, int | list[int]]
    ) -> None:
        """Advance each scheduled request by its chunk and append its sampled token(s): one
        token, or for a chunk with proposals the accepted proposals and then the model's own
        next token. Rejected proposals' positions stay uncomputed and blocks holding only them
        are freed. The KV of the computed tokens is written, so their full blocks join the
        prefix cache."""
        for chunk in output.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # finished or aborted while the step ran
            req.spec_token_ids = []
            tokens = sampled.get(chunk.request_id, [])
            if isinstance(tokens, int):
                tokens = [tokens]
            # Emitted tokens are the accepted proposals plus one: the rest were rejected.
            rejected = len(chunk.spec_token_ids) - max(len(tokens) - 1, 0)
            req.num_computed_tokens = chunk.start + chunk.num_tokens - rejected
            if rejected:
                self.block_manager.truncate(req.request_id, req.num_computed_tokens)
            req.token_ids.extend(tokens)
            self.block_manager.cache_full_blocks(
                req.request_id, req.hash_ids, req.num_computed_tokens, req.adapter_name
            )

    def can_fork(self, parent: Request) -> bool:
        """Whether a sibling of `parent` can start running now from its computed tokens."""
        return len(self.running) < self.config.max_batch_size and self.block_manager.can_fork(
            parent.num_computed_tokens
        )

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """Start `child` (same prompt, not yet admitted) running from `parent`'s computed
        prompt KV: it joins the running requests with those tokens already computed, as if
        they had all been a prefix-cache hit. Returns the KV block pair to copy, if any (see
        BlockManager.fork). The caller appends the child's first token afterwards."""
        if child.prompt_token_ids != parent.prompt_token_ids:
            raise ValueError(f"{child.request_id!r} does not share {parent.request_id!r}'s prompt")
        computed = parent.num_computed_tokens
        if computed > parent.num_prompt_tokens:
            raise ValueError(f"{parent.request_id!r} is past its prompt: too late to fork")
        if child.adapter_name != parent.adapter_name:
            raise ValueError(f"{child.request_id!r} does not share {parent.request_id!r}'s adapter")
        if child.adapter is not None:  # resident: the parent holds its slot
            self._adapters().acquire(child.request_id, child.adapter)
        copy = self.block_manager.fork(parent.request_id, child.request_id, computed)
        child.num_computed_tokens = computed
        child.num_cached_tokens = computed
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        self.running.append(child)
        return copy

    def finish_request(self, request_id: str) -> Request | None:
        """Remove a request (finished, failed or aborted) and free its blocks."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self.block_manager.free(request_id)
        if self.adapters is not None:
            self.adapters.release(request_id)
        req.status = RequestStatus.FINISHED
        return req
