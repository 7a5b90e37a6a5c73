"""Per-request state of the reference engine's step loop, and the results it hands back."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engines.api import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    RequestMetrics,
    TokenLogprob,
)
from engines.sinks import Sink

if TYPE_CHECKING:
    from engines.reference.runtime.scheduler import ScheduledChunk


@dataclass
class Live:
    """Step-loop state of one admitted request."""

    request: GenerationRequest
    sched: Any  # scheduler.Request
    sink: Sink
    metrics: RequestMetrics
    is_stream: bool
    detok: Any = None  # IncrementalDetokenizer when text is needed as it grows
    generator: Any = None  # torch.Generator for seeded sampling
    grammar: Any = None  # compiled grammar of the request's response_format
    matcher: Any = None  # its xgrammar matcher, advanced token by token
    logprobs: list[TokenLogprob] | None = None  # one per output token, when requested
    # One per prompt token computed so far (None first), when prompt logprobs are requested.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    sent_tokens: int = 0  # output tokens already streamed
    sent_chars: int = 0  # text characters already streamed
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    ngram: Any = None  # speculative.NgramIndex when the request may speculate
    is_drafting: bool = False  # may speculate with draft-model proposals (method draft)
    draft_probs: Any = None  # torch.Tensor [k, V]: q of its pending draft proposals
    spec_proposed: int = 0  # proposed tokens verified so far
    spec_accepted: int = 0  # of them, accepted
    spec_verifications: int = 0  # steps that verified proposals for it


@dataclass(slots=True)
class SamplingRows:
    """A step's sampling chunks in logits-row order, their requests, and the row where each
    chunk's logits start (1 + k rows for a chunk carrying k proposals, else one)."""

    chunks: list[ScheduledChunk]
    lives: list[Live]
    first_rows: list[int]
    speculating: bool  # some chunk carries proposals: the step verifies them

    @classmethod
    def of(cls, chunks: list[ScheduledChunk], live: dict[str, Live]) -> SamplingRows:
        sampling = [c for c in chunks if c.is_sampling]
        first_rows: list[int] = []
        next_row = 0
        for c in sampling:
            first_rows.append(next_row)
            next_row += c.num_logits
        speculating = any(c.spec_token_ids for c in sampling)
        return cls(sampling, [live[c.request_id] for c in sampling], first_rows, speculating)


@dataclass
class Embedding:
    """An embed request waiting for its dense forward (never enters the scheduler)."""

    request: GenerationRequest
    sink: Sink
    metrics: RequestMetrics
    is_stream: bool


def take_embed_batch(queue: deque[Any], max_num_tokens: int) -> list[Any]:
    """Embed requests for one forward, first come first: as many as fit `max_num_tokens`
    prompt tokens together, and always at least one (a longer prompt runs alone)."""
    batch: list[Any] = []
    num_tokens = 0
    while queue:
        n = len(queue[0].request.prompt_token_ids)
        if batch and num_tokens + n > max_num_tokens:
            break
        batch.append(queue.popleft())
        num_tokens += n
    return batch


def result_of(
    request: GenerationRequest,
    output_ids: list[int],
    text: str,
    reason: FinishReason,
    metrics: RequestMetrics,
    *,
    error: str | None = None,
    stop_reason: str | int | None = None,
    cached: int = 0,
    preemptions: int = 0,
    logprobs: list[TokenLogprob] | None = None,
    prompt_logprobs: list[TokenLogprob | None] | None = None,
    spec_proposed: int = 0,
    spec_accepted: int = 0,
    spec_verifications: int = 0,
) -> GenerationResult:
    return GenerationResult(
        request_id=request.request_id,
        output_token_ids=output_ids,
        text=text,
        finish_reason=reason,
        prompt_tokens=len(request.prompt_token_ids),
        completion_tokens=len(output_ids),
        cached_prompt_tokens=cached,
        error=error,
        stop_reason=stop_reason,
        num_preemptions=preemptions,
        metrics=metrics,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        spec_proposed_tokens=spec_proposed,
        spec_accepted_tokens=spec_accepted,
        spec_verifications=spec_verifications,
    )
