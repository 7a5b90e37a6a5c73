"""Stand-in for `tensorrt_llm.executor.result` (1.2): the logprob types of CompletionOutput.

CompletionOutput.logprobs is TokenLogprobs, one {token id: Logprob} per output token (the
top-k by rank, and the chosen token), or in some paths a list[float] of the chosen tokens'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias


@dataclass(slots=True)
class Logprob:
    """Holds logprob and vocab rank for a token (rank 1: the most likely)."""

    logprob: float
    rank: int | None = None


TokenLogprobs: TypeAlias = list[dict[int, Logprob]]

__all__ = ["Logprob", "TokenLogprobs"]
