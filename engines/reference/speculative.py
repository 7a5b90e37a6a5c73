"""Speculative decoding in the reference engine: n-gram proposals and their verification.

Propose (prompt lookup): a request's last n tokens (n from prompt_lookup_max down to
prompt_lookup_min) are looked up in its own prompt + output; the tokens that followed the most
recent earlier occurrence are the proposal. Each request keeps an index from n-gram to where it
last ended, grown by the tokens appended since the previous step, so a lookup costs O(n)
however long the context is.

Verify: the target model scores the last real token plus the k proposed ones in one forward
pass (k + 1 logit rows). Row i is sampled exactly as a plain decode step would sample it (same
sampler, same per-request uniform stream), and proposal i is accepted while it equals that
sample. The emitted tokens are the samples up to and including the first mismatch, so:

- greedy rows emit exactly what decoding without speculation emits (the argmax of each row);
- sampled rows are exact rejection sampling for a point-mass draft: draft t is accepted with
  probability p(t) (the chance the sample is t), and on rejection the emitted token is the
  sample conditioned on not being t, i.e. drawn from p with t removed and renormalised. This
  is the coupling of the standard min(1, p/q) rule with q = 1 at t; the output distribution is
  the target model's at every position;
- a seeded request consumes one uniform per emitted token, as without speculation, so its
  tokens are the same with speculation on or off and whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engines.api import SamplingParams
from engines.reference.sampler import sample


@dataclass
class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of one request's tokens last ended."""

    min_n: int
    max_n: int
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end (exclusive)
    indexed: int = 0  # n-grams ending at positions <= this are in `ends`

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        of `tokens` (at least min_n long) that occurred before; [] when none did."""
        length = len(tokens)
        # Index n-grams ending before the last position: the suffix must not match itself.
        for end in range(max(self.indexed + 1, self.min_n), length):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, length - 1)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self.ends.get(tuple(tokens[length - n :]))
            if end is not None:
                # Past the end of the context the copy continues from its own proposal, so a
                # repeating span shorter than k still proposes k tokens (period extension).
                out: list[int] = []
                for j in range(k):
                    pos = end + j
                    out.append(tokens[pos] if pos < length else out[pos - length])
                return out
        return []


@dataclass(frozen=True)
class Verified:
    """One request's outcome of a verification step."""

    tokens: list[int]  # emitted tokens: accepted proposals, then the target's own next token
    num_proposed: int
    num_accepted: int


def verify(
    logits: torch.Tensor,  # [R, V] float32: for each request, its 1 + k rows in order
    proposals: Sequence[Sequence[int]],  # per request, its k proposed tokens (k may be 0)
    params: Sequence[SamplingParams],  # per request
    generators: Sequence[torch.Generator | None],  # per request; None: the shared default
    default_generator: torch.Generator | None = None,
) -> list[Verified]:
    """Sample every row, accept each request's longest matching prefix of proposals.

    One sampler call for all rows (one device-to-host copy). A seeded generator is wound back
    and advanced by the number of tokens actually emitted, so its stream stays aligned with
    decoding without speculation (sampler draws are one torch.rand(1) per row, in row order)."""
    row_params: list[SamplingParams] = []
    row_generators: list[torch.Generator | None] = []
    saved: dict[int, torch.Tensor] = {}
    for i, (props, p, g) in enumerate(zip(proposals, params, generators, strict=True)):
        rows = 1 + len(props)
        row_params.extend([p] * rows)
        row_generators.extend([g] * rows)
        if g is not None and props and not p.is_greedy:
            saved[i] = g.get_state()
    if logits.shape[0] != len(row_params):
        raise ValueError(f"verify got {logits.shape[0]} logit rows for {len(row_params)}")
    sampled = sample(logits, row_params, row_generators, default_generator)
    out: list[Verified] = []
    row = 0
    for i, props in enumerate(proposals):
        targets = sampled[row : row + 1 + len(props)]
        row += 1 + len(props)
        accepted = 0
        while accepted < len(props) and props[accepted] == targets[accepted]:
            accepted += 1
        emitted = targets[: accepted + 1]
        if i in saved:
            generator = generators[i]
            generator.set_state(saved[i])
            for _ in emitted:  # the draws the emitted tokens used, nothing more
                torch.rand(1, generator=generator, device=logits.device)
        out.append(Verified(emitted, len(props), accepted))
    return out
