"""What the synthetic engine will do with one request, decided when it arrives.

Everything random about a request (its time to first token, whether it fails or stops early,
its token ids) comes from one generator seeded by the engine's seed, the prompt and the
request's own seed (or its id when sampling unseeded), so a request's output never depends on
what runs beside it: greedy requests with the same prompt agree, seeded ones reproduce.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from engines.api import GenerationRequest, TokenLogprob
from engines.synthetic.settings import SyntheticSettings

# stop: the model ends it (its last token is the EOS token, where the model has one).
Ending = Literal["length", "stop", "error"]

# The made-up log probability of every chosen token, and the step down to each alternative.
_CHOSEN_LOGPROB = -0.25
_ALTERNATIVE_STEP = 1.0


_MASK64 = (1 << 64) - 1


class SplitMix64:
    """A tiny seeded generator (SplitMix64). Seeding random.Random (Mersenne Twister) costs
    more than everything else the engine does for a 1-token request; this costs nothing."""

    __slots__ = ("state",)

    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK64

    def next64(self) -> int:
        self.state = z = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def random(self) -> float:
        """Uniform in [0, 1)."""
        return (self.next64() >> 11) * (1.0 / (1 << 53))

    def randint(self, low: int, high: int) -> int:
        """Uniform in [low, high] (the modulo bias is far below what a test tool notices)."""
        return low + self.next64() % (high - low + 1)


@dataclass
class RequestPlan:
    """A request's fate: when its first token comes, how many tokens it gets, how it ends."""

    ttft_s: float
    num_tokens: int  # output tokens before it ends (the EOS token included for "stop")
    ending: Ending
    rng: SplitMix64  # draws its token ids, one per step


def plan_request(
    request: GenerationRequest,
    budget: int,
    settings: SyntheticSettings,
    script_len: int | None = None,
) -> RequestPlan:
    """The plan for `request`, which may generate `budget` tokens (max_tokens clipped to the
    context by admission). `script_len`: the scripted output's tokens (settings.script), its
    end-of-sequence token included."""
    s = request.sampling
    if s.is_greedy:
        stream_key = 0
    elif s.seed is not None:
        stream_key = s.seed + 1
    else:  # unseeded sampling: a stream per request, still reproducible under the engine seed
        stream_key = -1 - zlib.crc32(request.request_id.encode())
    # hash() of a tuple of ints is the same in every process (only str hashing is salted).
    rng = SplitMix64(hash((settings.seed, stream_key, tuple(request.prompt_token_ids))))
    jitter = settings.ttft_jitter * (2.0 * rng.random() - 1.0)
    ttft_s = max(0.0, settings.ttft_ms * (1.0 + jitter)) / 1000.0
    fails = rng.random() < settings.error_fraction
    wanted = settings.output_tokens or budget
    if rng.random() < settings.stop_fraction:
        wanted = rng.randint(1, wanted)
    if fails:
        return RequestPlan(ttft_s, 0, "error", rng)
    if script_len is not None:
        # The script's end-of-sequence token may be the last one max_tokens allows.
        if s.ignore_eos or script_len > budget:
            return RequestPlan(ttft_s, budget, "length", rng)
        return RequestPlan(ttft_s, script_len, "stop", rng)
    if s.ignore_eos or wanted >= budget:
        return RequestPlan(ttft_s, budget, "length", rng)
    return RequestPlan(ttft_s, wanted, "stop", rng)


class TokenTable:
    """The ids the synthetic model draws from: tokens that decode to text on their own (no
    special tokens, no byte pieces of a longer character), so any sequence of them decodes
    cleanly and stop strings and streamed text behave as with a real model."""

    def __init__(self, ids: Sequence[int]) -> None:
        if not ids:
            raise ValueError("no token of the vocabulary decodes to text")
        self.ids = tuple(ids)

    def draw(self, rng: SplitMix64) -> int:
        return self.ids[int(rng.random() * len(self.ids))]


def logprobs_for(token_id: int, k: int, table: TokenTable) -> TokenLogprob:
    """A made-up but well-formed entry: the chosen token is the most likely, then k - 1
    alternatives, each less likely than the one before."""
    top = [(token_id, _CHOSEN_LOGPROB)]
    for j, alt in enumerate(a for a in table.ids[: k + 1] if a != token_id):
        if len(top) >= k:
            break
        top.append((alt, _CHOSEN_LOGPROB - _ALTERNATIVE_STEP * (j + 1)))
    return TokenLogprob(token_id, _CHOSEN_LOGPROB, tuple(top[:k]))


def prompt_logprobs_for(prompt: Sequence[int], k: int, table: TokenTable) -> list:
    """One made-up entry per prompt token after the first (None for the first), depending on
    the prompt only, so the same prompt scores the same every time."""
    return [None] + [logprobs_for(t, k, table) for t in prompt[1:]]
