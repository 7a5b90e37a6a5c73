"""Logprobs in the reference engine: of the sampled tokens, and of the prompt's own tokens.

Both come from the model's raw distribution (log-softmax of the logits, before temperature,
top-k/top-p and format masks), as vLLM's default and OpenAI report them. `live` objects are the
engine's per-request state: `.request`, `.sched` (scheduler.Request) and the `.logprobs` /
`.prompt_logprobs` lists these functions append to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engines.api import TokenLogprob


def token_logprobs(
    raw: torch.Tensor, tokens: Sequence[int], alternatives: Sequence[int]
) -> list[TokenLogprob]:
    """One TokenLogprob per row of `raw` (log-softmax rows [R, V]): the logprob of the row's
    token and its `alternatives[r]` most likely tokens. One gather and one top-k for all rows,
    one host copy each."""
    index = torch.tensor(list(tokens), device=raw.device).unsqueeze(1)
    chosen = raw.gather(1, index)[:, 0].tolist()
    k = max(alternatives, default=0)
    top_ids: list[list[int]] = [[] for _ in tokens]
    top_values: list[list[float]] = [[] for _ in tokens]
    if k > 0:
        values, ids = raw.topk(min(k, raw.shape[-1]), dim=-1)
        top_ids, top_values = ids.tolist(), values.tolist()
    out = []
    for r, (token, want) in enumerate(zip(tokens, alternatives, strict=True)):
        top = tuple(zip(top_ids[r][:want], top_values[r][:want], strict=True))
        out.append(TokenLogprob(token, chosen[r], top))
    return out


def record_logprobs(raw: torch.Tensor, lives: Sequence[Any], tokens: Sequence[int]) -> None:
    """Append each request's sampled-token entry (only in steps where some request asked)."""
    wants = [live.request.sampling.logprobs or 0 for live in lives]
    for live, entry in zip(lives, token_logprobs(raw, tokens, wants), strict=True):
        live.logprobs.append(entry)


@dataclass(frozen=True, slots=True)
class RawLogprobs:
    """The raw distribution (log-softmax, [W, V]) of a step's rows whose requests want
    logprobs: row w is that of the request at `indices[w]` among the step's sampling rows."""

    indices: list[int]
    values: torch.Tensor

    def record(self, lives: Sequence[Any], emitted: Sequence[Sequence[int]]) -> None:
        """Append each wanting request's entry for the token it emitted (`lives` and
        `emitted`: all the step's sampling rows)."""
        record_logprobs(
            self.values, [lives[i] for i in self.indices], [emitted[i][0] for i in self.indices]
        )

    def row(self, index: int) -> torch.Tensor | None:
        """The row [1, V] of the request at `index`; None when it wants no logprobs."""
        if index not in self.indices:
            return None
        return self.values[self.indices.index(index)].unsqueeze(0)


def raw_logprobs(
    logits: torch.Tensor, first_rows: Sequence[int], lives: Sequence[Any]
) -> RawLogprobs | None:
    """The model's own distribution for the requests in `lives` that want logprobs (row
    `first_rows[i]` of `logits` is lives[i]'s); None when none does. Rows with logprobs never
    carry proposals: one row each. Take it before masks (which edit logits in place); it is
    without temperature or top-k/top-p."""
    wanting = [i for i, live in enumerate(lives) if live.logprobs is not None]
    if not wanting:
        return None
    raw = logits[[first_rows[i] for i in wanting]].float().log_softmax(-1)
    return RawLogprobs(wanting, raw)


def prompt_rows(live: Any, chunk: Any) -> tuple[int, int]:
    """(count, offset in the chunk) of the positions whose logits give prompt logprobs not yet
    recorded. Position p predicts token p + 1, so these are the chunk's positions before the
    prompt's last one, from the first whose token has no logprob yet: a prompt recomputed
    after a preemption is not recorded twice, and one preempted midway resumes where it was."""
    if live.prompt_logprobs is None:
        return 0, 0
    first = len(live.prompt_logprobs) - 1  # predicts the first token without a logprob
    end = min(chunk.start + chunk.num_tokens, live.sched.num_prompt_tokens - 1)
    if first < chunk.start or first >= end:
        return 0, 0
    return end - first, first - chunk.start


def record_prompt_logprobs(
    logits: torch.Tensor, inputs: Sequence[Any], lives: dict[str, Any]
) -> None:
    """Append the prompt logprobs of the positions the step's `inputs` (runner.ChunkInput)
    asked for; `logits` holds their rows, in order."""
    raw = logits.float().log_softmax(-1)
    row = 0
    for item in inputs:
        if not item.prompt_rows:
            continue
        live = lives[item.chunk.request_id]
        start = item.chunk.start + item.prompt_offset
        targets = list(item.token_ids[start + 1 : start + 1 + item.prompt_rows])
        want = live.request.sampling.prompt_logprobs or 0
        entries = token_logprobs(raw[row : row + item.prompt_rows], targets, [want] * len(targets))
        live.prompt_logprobs.extend(entries)
        row += item.prompt_rows


def take_prompt_logprobs(
    logits: torch.Tensor, num_rows: int, inputs: Sequence[Any], lives: dict[str, Any]
) -> torch.Tensor:
    """A step's sampling rows (the first `num_rows` of the runner's `logits`), after recording
    the prompt logprobs from the rows that follow them, if any were asked for."""
    if logits.shape[0] > num_rows:  # prompt logprobs asked: their rows come last
        record_prompt_logprobs(logits[num_rows:], inputs, lives)
        logits = logits[:num_rows]
    return logits
