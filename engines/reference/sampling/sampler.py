"""Pick each sampling row's next token from its logits, all rows at once.

One step costs a few batched tensor ops and ONE device-to-host copy (the final token ids):
greedy rows take the argmax; random rows go through temperature, min_p, top-k, top-p and
inverse-CDF sampling as [R, V] tensor ops with per-row parameters. (Penalties, logit bias,
min_tokens and bad words edit the raw logits before this: processing.py.)

How a random row is drawn, and why: each random row consumes exactly one uniform number per
step, from its own torch.Generator when the request has a seed (else from the engine's shared
one), and picks the first token whose cumulative probability exceeds u * total. The other
classic, an exponential race (argmax(probs / Exp(1) noise), the Gumbel-max trick), is just as
vectorised but needs V random numbers per row per step, drawn row by row from each seeded
row's generator: 64 rows x 150k vocab is ~10M draws a step, more than the sort top-p needs
anyway. Inverse-CDF needs one draw per row, plus a cumsum and a searchsorted.

Reproducibility whatever else is in the batch (on CPU): a row's token depends only on its
logits, its parameters and its own uniform. Every op used (topk, sort, softmax, cumsum,
searchsorted) works on each row independently, and how a row is computed depends on its own
parameters only: rows are grouped by candidate width (`_width`), never padded to a neighbour's.

Cost, 64 rows on 2 CPU threads: a full-vocabulary sort is by far the largest part (~20 ms at
V=8k, ~0.4 s at V=150k), so it is avoided where possible: top-k rows take torch.topk (k
candidates), unfiltered rows a softmax and a cumsum in token order, and top-p-only rows on CPU
first try the top 256 tokens (enough when they hold p of the mass, the usual case).
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


# top-p-only rows on CPU: candidates tried before a full-vocabulary sort (see _draw).
_NUCLEUS_CANDIDATES = 256


def _width(params: SamplingParams, vocab: int) -> int | None:
    """How many candidates a random row needs, from its own parameters only (so that the
    way a row is computed never depends on its neighbours): None for the whole vocabulary in
    token order (no filter, no sort), k for top-k (torch.topk, not a full sort), the whole
    vocabulary sorted for top-p alone (the nucleus can be anywhere up to V tokens)."""
    if 0 < params.top_k < vocab:
        return params.top_k
    if params.top_p < 1.0:
        return vocab
    return None


def _uniforms(
    rows: list[int],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """One uniform in [0, 1) per row in `rows` (as a [R] tensor on `device`): a seeded row's
    from its own generator, so it never depends on which other rows are present; the rest
    from the default generator in one call."""
    seeded = [i for i in rows if generators[i] is not None]
    unseeded = [i for i in rows if generators[i] is None]
    u = torch.empty(len(rows), device=device)
    position = {row: k for k, row in enumerate(rows)}
    if unseeded:
        draws = torch.rand(len(unseeded), generator=default_generator, device=device)
        u[torch.tensor([position[i] for i in unseeded], device=device)] = draws
    for i in seeded:
        u[position[i]] = torch.rand(1, generator=generators[i], device=device)[0]
    return u


def _pick(
    probs: torch.Tensor,  # [R, W] probabilities of the candidates, most likely first if top_p
    ids: torch.Tensor | None,  # [R, W] their token ids; None: W is the vocabulary in order
    top_p: torch.Tensor | None,  # [R] nucleus mass (> 1 keeps all); None: no top-p
    u: torch.Tensor,  # [R] uniforms in [0, 1)
) -> torch.Tensor:  # [R] int64 token ids
    if top_p is not None:
        # The shortest prefix whose mass reaches p: a token is dropped when the mass before
        # it already does (the first always stays).
        probs = torch.where((probs.cumsum(-1) - probs) < top_p[:, None], probs, 0.0)
    cdf = probs.cumsum(-1)  # [R, W], non-decreasing; the last column is the kept mass
    total = cdf[:, -1:]
    # u * total < total, but rounding may reach it; the largest float below total still
    # lands on a token with mass (cdf > target there), never on a dropped one.
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)  # [R, 1]
    if ids is not None:
        index = ids.gather(1, index)
    return index.squeeze(1)


def _sorted_pick(scaled: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    # Stable: equal logits keep token order, so the kept prefix is deterministic.
    values, ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    return _pick(values.softmax(-1), ids, top_p, u)


def _min_p(
    scaled: torch.Tensor,  # [R, V] logits after temperature
    params: list[SamplingParams],
) -> torch.Tensor:  # [R, V], tokens below min_p x the top probability at -inf
    """min_p after temperature and before top-k / top-p, as vLLM orders them. Rows without it
    come out unchanged (a zero threshold drops nothing), and a batch where no row uses it
    pays nothing."""
    if not any(p.min_p for p in params):
        return scaled
    min_p = torch.tensor([p.min_p for p in params], device=scaled.device)
    probs = scaled.softmax(-1)
    threshold = min_p[:, None] * probs.amax(-1, keepdim=True)
    return scaled.masked_fill(probs < threshold, -torch.inf)


def _draw(
    logits: torch.Tensor,  # [R, V] float32
    params: list[SamplingParams],  # R rows, all non-greedy, all of the same _width
    u: torch.Tensor,  # [R] uniforms in [0, 1)
    width: int | None,  # see _width
) -> torch.Tensor:  # [R] int64 token ids
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], device=device)
    scaled = _min_p(logits / temperature[:, None], params)
    if width is None:
        return _pick(scaled.softmax(-1), None, None, u)
    # top_p = 1 keeps all (a cumsum rounding to 1.0 must not drop a tiny tail).
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], device=device)
    if width < vocab:
        # Exactly k candidates (ties at the k-th value included), largest first; top-p then
        # works on their renormalised mass.
        values, ids = torch.topk(scaled, width, dim=-1)
        return _pick(values.softmax(-1), ids, top_p, u)
    if device.type != "cpu" or vocab <= _NUCLEUS_CANDIDATES:
        # On an accelerator the sort is cheap and the fast path's row split would cost a sync.
        return _sorted_pick(scaled, top_p, u)
    # top-p alone: the nucleus usually lies within the few hundred most likely tokens. A row
    # whose top _NUCLEUS_CANDIDATES already hold p of the (full-vocabulary) mass samples from
    # them; the rest pay the full sort. Which path a row takes depends on its own logits only.
    values, ids = torch.topk(scaled, _NUCLEUS_CANDIDATES, dim=-1)
    probs = (values - scaled.logsumexp(-1, keepdim=True)).exp()  # [R, C], full-vocab mass
    fits = probs.cumsum(-1)[:, -1] >= top_p
    tokens = torch.empty(len(params), dtype=torch.int64, device=device)
    fast, slow = fits.nonzero().squeeze(1), (~fits).nonzero().squeeze(1)
    if fast.numel():
        tokens[fast] = _pick(probs[fast], ids[fast], top_p[fast], u[fast])
    if slow.numel():
        tokens[slow] = _sorted_pick(scaled[slow], top_p[slow], u[slow])
    return tokens


def sample(
    logits: torch.Tensor,  # [S, V] float32
    params: Sequence[SamplingParams],  # one per row
    generators: Sequence[torch.Generator | None],  # one per row; None: the shared default
    default_generator: torch.Generator | None = None,
) -> list[int]:
    """Next token of every row; one device-to-host sync (the returned list)."""
    vocab = logits.shape[-1]
    tokens = logits.argmax(-1)  # [S] greedy for all; random rows overwrite theirs
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if random_rows:
        u = _uniforms(random_rows, generators, default_generator, logits.device)
        # One batched draw per candidate width; a batch usually holds one or two.
        by_width: dict[int | None, list[int]] = {}
        for k, i in enumerate(random_rows):
            by_width.setdefault(_width(params[i], vocab), []).append(k)
        for width, members in by_width.items():
            rows = [random_rows[k] for k in members]
            rows_t = torch.tensor(rows, device=logits.device)
            picked = _draw(
                logits[rows_t],
                [params[i] for i in rows],
                u[torch.tensor(members, device=logits.device)],
                width,
            )
            tokens[rows_t] = picked
    return tokens.tolist()


def probabilities(
    logits: torch.Tensor,  # [R, V]
    params: Sequence[SamplingParams],  # one per row
) -> torch.Tensor:  # [R, V] float32, each row sums to 1
    """The whole distribution `sample` draws each row from: temperature, then top-k, then
    top-p over the renormalised top-k mass (a greedy row: all mass on its argmax).

    Speculative decoding with a draft model needs it whole (the draft's q to sample from and
    report, the target's p to accept with min(1, p/q) and to form max(0, p - q)); plain
    decoding never does, which is why `sample` avoids building it."""
    logits = logits.float()
    vocab = logits.shape[-1]
    probs = torch.zeros_like(logits)
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    if greedy:
        index = torch.tensor(greedy, device=logits.device)
        probs[index, logits[index].argmax(-1)] = 1.0
    plain = [i for i, p in enumerate(params) if not p.is_greedy and _width(p, vocab) is None]
    filtered = [i for i, p in enumerate(params) if not p.is_greedy and _width(p, vocab)]
    for members in (plain, filtered):
        if not members:
            continue
        index = torch.tensor(members, device=logits.device)
        temperature = torch.tensor([params[i].temperature for i in members], device=logits.device)
        scaled = logits[index] / temperature[:, None]
        if members is plain:
            probs[index] = scaled.softmax(-1)
            continue
        # Stable sort: equal logits keep token order, as in the sampler's top-p path.
        values, ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
        top_k = torch.tensor(
            [p.top_k if 0 < p.top_k < vocab else vocab for p in (params[i] for i in members)],
            device=logits.device,
        )
        ranks = torch.arange(vocab, device=logits.device)
        values = torch.where(ranks[None, :] < top_k[:, None], values, -torch.inf)
        sorted_probs = values.softmax(-1)
        top_p = torch.tensor(
            [params[i].top_p if params[i].top_p < 1.0 else 2.0 for i in members],
            device=logits.device,
        )
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < top_p[:, None]  # as _pick
        sorted_probs = torch.where(keep, sorted_probs, 0.0)
        sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)
        probs[index] = torch.zeros_like(sorted_probs).scatter_(1, ids, sorted_probs)
    return probs


def pick(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[R] token ids drawn by inverse CDF from [R, V] (unnormalised) probabilities, one
    uniform in [0, 1) per row; a token with no mass is never picked."""
    return _pick(probs, None, None, u)
