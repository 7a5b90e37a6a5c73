"""Pick each sampling row's next token from its logits.

Greedy rows share one argmax. Random rows are sampled one by one, each from its own
torch.Generator when the request has a seed: only that request consumes it, so the same seed
gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engines.api import SamplingParams


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) over one row: [V] -> probabilities [V]."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the first always stays.
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits.softmax(-1)


def sample(
    logits: torch.Tensor,  # [S, V] float32
    params: Sequence[SamplingParams],  # one per row
    generators: Sequence[torch.Generator | None],  # one per row; None: the shared default
    default_generator: torch.Generator | None = None,
) -> list[int]:
    tokens = [0] * logits.shape[0]
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        for i, token in zip(greedy, logits[rows].argmax(-1).tolist(), strict=True):
            tokens[i] = token
    for i, p in enumerate(params):
        if p.is_greedy:
            continue
        probs = _filtered_probs(logits[i], p)
        generator = generators[i] if generators[i] is not None else default_generator
        tokens[i] = int(torch.multinomial(probs, 1, generator=generator).item())
    return tokens
