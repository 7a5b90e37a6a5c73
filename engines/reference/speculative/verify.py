"""Speculative decoding in the reference engine: n-gram proposals and the verification of
any proposal (n-gram or draft model, engines/reference/speculative/draft.py).

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

Draft-model proposals come with the draft's distributions q (one row per proposal) they were
drawn from. Greedy rows keep the rule above (a greedy draft proposes its argmax; accepting
while it equals the target's argmax is min(1, p/q) with both one-hot). Sampled rows use the
general rule: proposal d at position i is accepted with probability min(1, p_i(d) / q_i(d));
at the first rejection the emitted token is drawn from max(0, p_i - q_i) renormalised; when
all are accepted a bonus token is drawn from p after the last one. p is the target's whole
sampling distribution (temperature, top-k, top-p: `sampler.probabilities`), so every emitted
token follows exactly what plain sampling would draw from. Such a row consumes k + 1 uniforms
of its generator per verification (k acceptance tests, one final draw) whatever the outcome:
with a seed, the same proposals give the same tokens. They are not the tokens of decoding
without speculation (no coupling of a second model's draws with the plain sampler's can be),
and since k depends on the step (max_num_tokens cuts, disable_above_batch_size), a seeded
row is reproducible for the same schedule, not whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engines.api import SamplingParams
from engines.reference.sampling.sampler import pick, probabilities, sample


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
    draft_probs: Sequence[torch.Tensor | None] | None = None,
) -> list[Verified]:
    """Each request's emitted tokens: accepted proposals, then one token of the target's.

    `draft_probs`, per request: the [k, V] distributions its k proposals were drawn from (a
    draft model), or None for a point-mass proposal (n-gram). Sampled rows with them go
    through min(1, p/q) rejection sampling; every other row through `_verify_point_mass`."""
    if draft_probs is None:
        draft_probs = [None] * len(proposals)
    with_q = [
        i
        for i, (props, p, q) in enumerate(zip(proposals, params, draft_probs, strict=True))
        if q is not None and props and not p.is_greedy
    ]
    if not with_q:
        return _verify_point_mass(logits, proposals, params, generators, default_generator)
    starts, row = [], 0
    for props in proposals:
        starts.append(row)
        row += 1 + len(props)
    if logits.shape[0] != row:
        raise ValueError(f"verify got {logits.shape[0]} logit rows for {row}")
    chosen = set(with_q)
    rest = [i for i in range(len(proposals)) if i not in chosen]
    out: list[Verified | None] = [None] * len(proposals)

    def rows_of(members: list[int]) -> torch.Tensor:
        index = [r for i in members for r in range(starts[i], starts[i] + 1 + len(proposals[i]))]
        return torch.tensor(index, dtype=torch.int64, device=logits.device)

    if rest:
        done = _verify_point_mass(
            logits[rows_of(rest)],
            [proposals[i] for i in rest],
            [params[i] for i in rest],
            [generators[i] for i in rest],
            default_generator,
        )
        for i, v in zip(rest, done, strict=True):
            out[i] = v
    done = _verify_with_draft(
        logits[rows_of(with_q)],
        [proposals[i] for i in with_q],
        [params[i] for i in with_q],
        [generators[i] for i in with_q],
        default_generator,
        [draft_probs[i] for i in with_q],
    )
    for i, v in zip(with_q, done, strict=True):
        out[i] = v
    return out  # type: ignore[return-value]  # every slot filled above


def _verify_with_draft(
    logits: torch.Tensor,  # [R, V]: for each request, its 1 + k rows in order
    proposals: Sequence[Sequence[int]],  # per request, k >= 1 proposed tokens
    params: Sequence[SamplingParams],  # per request, none greedy
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None,
    draft_probs: Sequence[torch.Tensor],  # per request, [>= k, V]: q of each proposal
) -> list[Verified]:
    """Exact rejection sampling against the draft's real distributions (see the module doc).
    Two device-to-host copies for all requests: the acceptance tests, the final tokens."""
    device = logits.device
    row_params = [
        p for props, p in zip(proposals, params, strict=True) for _ in range(len(props) + 1)
    ]
    p_all = probabilities(logits, row_params)  # [R, V]
    # k + 1 uniforms per request, in request order: k acceptance tests, then the final draw.
    u = torch.cat(
        [
            torch.rand(
                len(props) + 1, generator=g if g is not None else default_generator, device=device
            )
            for props, g in zip(proposals, generators, strict=True)
        ]
    )
    starts, row = [], 0
    prop_rows: list[int] = []
    prop_ids: list[int] = []
    for props in proposals:
        starts.append(row)
        prop_rows.extend(range(row, row + len(props)))
        prop_ids.extend(props)
        row += 1 + len(props)
    rows_t = torch.tensor(prop_rows, dtype=torch.int64, device=device)
    ids_t = torch.tensor(prop_ids, dtype=torch.int64, device=device)
    q_all = torch.cat([q[: len(props)] for q, props in zip(draft_probs, proposals, strict=True)])
    p_d = p_all[rows_t, ids_t]
    q_d = q_all[torch.arange(len(prop_ids), device=device), ids_t]
    # u < p/q, written without a division (q(d) > 0: d was drawn from q).
    accept = (u[rows_t] * q_d < p_d).tolist()
    counts: list[int] = []
    flat = 0
    for props in proposals:
        accepted = 0
        while accepted < len(props) and accept[flat + accepted]:
            accepted += 1
        flat += len(props)
        counts.append(accepted)
    # The final token's distribution: p after the last accepted proposal, less q there when
    # that proposal was rejected (a row of zeros in q_after when all were accepted).
    final_rows = [s + a for s, a in zip(starts, counts, strict=True)]
    target = p_all[torch.tensor(final_rows, dtype=torch.int64, device=device)]  # [N, V]
    q_after = torch.zeros_like(target)
    for i, (props, accepted) in enumerate(zip(proposals, counts, strict=True)):
        if accepted < len(props):
            q_after[i] = draft_probs[i][accepted]
    residual = (target - q_after).clamp_(min=0.0)
    # p == q up to rounding leaves (almost) nothing to draw from; the rejection that led
    # here then had probability ~0, and p is the residual's limit.
    final = torch.where(residual.sum(-1, keepdim=True) > 1e-6, residual, target)
    last = [s + len(p) for s, p in zip(starts, proposals, strict=True)]
    tokens = pick(final, u[torch.tensor(last, device=device)]).tolist()
    return [
        Verified([*props[:accepted], token], len(props), accepted)
        for props, accepted, token in zip(proposals, counts, tokens, strict=True)
    ]


def _verify_point_mass(
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
