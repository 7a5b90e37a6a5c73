"""Draft-model speculative decoding in the reference engine: greedy output is exactly what
decoding without speculation gives, with prefix caching, chunked prefill and preemption active;
the target itself as its own draft is accepted throughout; seeded sampling is reproducible;
the draft's KV pool gives every block back; a draft with another tokenizer is refused."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import tempfile
from pathlib import Path

import pytest

from engines.api import EngineError, GenerationRequest, SamplingParams
from engines.reference.engine import ReferenceEngine
from tests.engine_fixtures import check_speculative_run, run_all
from tests.integration.test_reference_speculative import (
    MODELS,
    VARIANTS,
    repeating_model,
    repeating_prompts,
    requests,
)

pytestmark = pytest.mark.timeout(600)

_DRAFTS: dict[tuple[str, str, bool], Path] = {}


def truncated_draft(arch: str, tied: bool) -> Path:
    """The target's first layer alone: a smaller model that agrees with it now and then."""
    if ("truncated", arch, tied) not in _DRAFTS:
        from engines.dev.tiny import make_truncated_model

        out = Path(tempfile.mkdtemp(prefix="tokenmill-draft-")) / f"{arch}-{tied}-1layer"
        _DRAFTS["truncated", arch, tied] = make_truncated_model(repeating_model(arch, tied), out, 1)
    return _DRAFTS["truncated", arch, tied]


def random_draft() -> Path:
    """A separately drawn random llama (other weights) carrying the llama target's tokenizer."""
    if ("random", "llama", False) not in _DRAFTS:
        from engines.dev.tiny import make_tiny_model

        target = repeating_model("llama", False)
        out = Path(tempfile.mkdtemp(prefix="tokenmill-draft-")) / "random"
        make_tiny_model(out, arch="llama", seed=1, initializer_range=0.05)
        for path in target.iterdir():
            if path.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(path, out / path.name)
        _DRAFTS["random", "llama", False] = out
    return _DRAFTS["random", "llama", False]


def spec(draft: Path, **extra) -> dict:
    return {"method": "draft", "model": str(draft), "num_tokens": 4, **extra}


def generate(model: Path, reqs, **settings):
    """Results, step records, stats, and blocks still held in the draft's pool."""
    engine = ReferenceEngine(str(model), num_threads=1, **settings)
    try:
        results = run_all(engine, reqs)
        records = engine.drain_step_records()
        stats = engine.stats()
        draft_used = engine.drafter.block_manager.num_used_blocks if engine.drafter else 0
    finally:
        engine.shutdown()
    return results, records, stats, draft_used


_BASELINES: dict[tuple[str, bool], list[list[int]]] = {}


def baseline(arch: str, tied: bool, reqs) -> list[list[int]]:
    if (arch, tied) not in _BASELINES:
        plain, _, _, _ = generate(repeating_model(arch, tied), reqs)
        _BASELINES[arch, tied] = [r.output_token_ids for r in plain]
    return _BASELINES[arch, tied]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(("arch", "tied"), MODELS, ids=[f"{a}-{t}" for a, t in MODELS])
def test_greedy_ids_equal_decoding_without_speculation(arch, tied, variant) -> None:
    model = repeating_model(arch, tied)
    reqs = requests(repeating_prompts(16, seed=len(arch)))
    expected = baseline(arch, tied, reqs)
    draft = truncated_draft(arch, tied)
    results, records, stats, draft_used = generate(
        model, reqs, speculative=spec(draft, disable_above_batch_size=64), **VARIANTS[variant]
    )

    check_speculative_run(results, expected, records, stats, variant)
    assert draft_used == 0  # the draft pool got every block back too


def test_target_as_its_own_draft_is_accepted_throughout() -> None:
    """The same weights propose what the target then computes: greedy proposals are (all
    but float noise between batch shapes) accepted, so ~k + 1 tokens per verification."""
    model = repeating_model("qwen2", False)
    reqs = requests(repeating_prompts(8, seed=2))
    plain, _, _, _ = generate(model, reqs)
    results, records, _, draft_used = generate(
        model, reqs, speculative=spec(model, disable_above_batch_size=64), block_size=4
    )
    assert [r.output_token_ids for r in results] == [r.output_token_ids for r in plain]
    proposed = sum(r.spec_proposed_tokens for r in results)
    accepted = sum(r.spec_accepted_tokens for r in results)
    assert proposed > 0 and accepted / proposed >= 0.98
    verifications = sum(len(rec.spec_proposed_tokens) for rec in records)
    assert 1 + accepted / verifications > 3.5  # k = 4: most steps emit 5 tokens
    assert draft_used == 0


def test_random_draft_greedy_and_seeded_sampling() -> None:
    """A separately drawn random model as the draft (q far from p): greedy output is still
    the target's own; seeded sampled rows give the same tokens run after run."""
    model, draft = repeating_model("llama", False), random_draft()
    reqs = requests(repeating_prompts(8, seed=7))
    plain, _, _, _ = generate(model, reqs)
    results, _, _, draft_used = generate(model, reqs, speculative=spec(draft))
    assert [r.output_token_ids for r in results] == [r.output_token_ids for r in plain]
    assert sum(r.spec_proposed_tokens for r in results) > 0 and draft_used == 0

    sampled = [
        GenerationRequest(
            r.prompt_token_ids,
            SamplingParams(
                max_tokens=r.sampling.max_tokens,
                temperature=[0.3, 0.8, 1.0][i % 3],
                top_k=[0, 40, 0][i % 3],
                top_p=[1.0, 1.0, 0.9][i % 3],
                seed=50 + i,
                ignore_eos=True,
            ),
            request_id=r.request_id,
        )
        for i, r in enumerate(reqs)
    ]
    # One request at a time: a seeded row's tokens depend on its own proposals only.
    runs = []
    for _ in range(2):
        engine = ReferenceEngine(
            str(model), num_threads=1, speculative=spec(truncated_draft("llama", False))
        )
        try:
            runs.append([run_all(engine, [r])[0] for r in sampled])
        finally:
            engine.shutdown()
    assert [r.output_token_ids for r in runs[0]] == [r.output_token_ids for r in runs[1]]
    assert sum(r.spec_accepted_tokens for r in runs[0]) > 0


def test_aborts_and_stops_give_every_draft_block_back() -> None:
    """Streams abandoned mid-way, stop tokens inside accepted runs and preemptions (a small
    pool): both pools end empty and the surviving rows match decoding without speculation."""
    model = repeating_model("llama", False)
    prompts = repeating_prompts(12, seed=4)
    reqs = requests(prompts, max_tokens=40)
    plain, _, _, _ = generate(model, reqs)
    stop_reqs = []
    for i, (r, out) in enumerate(zip(reqs, plain, strict=True)):
        token = out.output_token_ids[len(out.output_token_ids) // 2]
        sampling = SamplingParams(
            max_tokens=40,
            temperature=0.0,
            ignore_eos=True,
            stop_token_ids=(token,) if i % 2 else (),
        )
        stop_reqs.append(GenerationRequest(r.prompt_token_ids, sampling, request_id=r.request_id))
    expected = {r.request_id: r.output_token_ids for r in generate(model, stop_reqs)[0]}
    engine = ReferenceEngine(
        str(model),
        num_threads=1,
        kv_cache_tokens=160,
        block_size=8,
        max_num_tokens=32,
        speculative=spec(truncated_draft("llama", False), disable_above_batch_size=64),
    )
    rng = random.Random(3)
    cut = {r.request_id: rng.randint(1, 6) for r in stop_reqs if rng.random() < 0.4}

    async def consume(request):
        got = []
        async for delta in engine.stream(request):
            got += delta.token_ids
            if request.request_id in cut and len(got) >= cut[request.request_id]:
                return None  # leaving the stream aborts the request
            if delta.finished:
                return delta.result
        return None

    async def main():
        return await asyncio.gather(*(consume(r) for r in stop_reqs))

    try:
        results = asyncio.run(main())
        for _ in range(100):  # aborts are processed by the step loop: wait until idle
            if not engine.stats().num_running and not engine.stats().num_waiting:
                break
            asyncio.run(asyncio.sleep(0.05))
        stats = engine.stats()
        draft_used = engine.drafter.block_manager.num_used_blocks
    finally:
        engine.shutdown()
    done = [r for r in results if r is not None]
    assert done and cut
    for r in done:
        assert r.output_token_ids == expected[r.request_id]
    assert stats.kv_blocks_used == 0 and draft_used == 0
    assert stats.spec_accepted_tokens > 0


def test_logprob_rows_do_not_draft() -> None:
    model = repeating_model("llama", False)
    reqs = requests(repeating_prompts(4, seed=1), max_tokens=16, logprobs=2)
    plain, _, _, _ = generate(model, reqs)
    results, _, _, draft_used = generate(
        model, reqs, speculative=spec(truncated_draft("llama", False))
    )
    assert [r.logprobs for r in plain] == [r.logprobs for r in results]
    assert all(r.spec_proposed_tokens == 0 for r in results) and draft_used == 0


def test_a_draft_with_another_tokenizer_or_vocab_is_refused(tmp_path: Path) -> None:
    from engines.dev.tiny import make_tiny_model

    model = repeating_model("llama", False)
    other = make_tiny_model(tmp_path / "other-tokenizer", seed=1)  # its own BPE training run
    with pytest.raises(EngineError, match="different tokenizer") as raised:
        ReferenceEngine(str(model), speculative=spec(other))
    assert str(model) in str(raised.value) and str(other) in str(raised.value)

    wider = tmp_path / "wider-vocab"
    shutil.copytree(truncated_draft("llama", False), wider)
    config = json.loads((wider / "config.json").read_text())
    config["vocab_size"] += 64
    (wider / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineError, match="vocab_size") as raised:
        ReferenceEngine(str(model), speculative=spec(wider))
    assert str(model) in str(raised.value) and str(wider) in str(raised.value)


def test_sampled_tokens_follow_the_target_distribution() -> None:
    """End to end with a draft whose q differs from p (the target's first layer: their top-5
    sets overlap, with other weights): 3000 unseeded requests with one prompt (top-k 5,
    temperature 0.3) each sample a first token, then have it and one draft proposal
    verified. The second token's counts must follow the target's own marginal
    sum_x p(x) p(. | x), computed with transformers (chi-square), while proposals are both
    accepted and rejected."""
    import torch
    from scipy.stats import chisquare
    from transformers import AutoModelForCausalLM

    from engines.reference.sampling.sampler import probabilities

    model, draft = repeating_model("llama", False), truncated_draft("llama", False)
    prompt = repeating_prompts(1, seed=11)[0]
    params = SamplingParams(max_tokens=3, temperature=0.3, top_k=5, ignore_eos=True)
    reqs = [GenerationRequest(list(prompt), params, request_id=f"s{i}") for i in range(3000)]
    engine = ReferenceEngine(
        str(model),
        num_threads=1,
        max_batch_size=256,
        speculative=spec(draft, num_tokens=1, disable_above_batch_size=256),
    )
    try:
        results = run_all(engine, reqs)
    finally:
        engine.shutdown()
    proposed = sum(r.spec_proposed_tokens for r in results)
    accepted = sum(r.spec_accepted_tokens for r in results)
    assert proposed > 1000 and 0 < accepted < proposed

    hf = AutoModelForCausalLM.from_pretrained(model).eval()
    with torch.inference_mode():

        def dist(ids: list[int]) -> torch.Tensor:
            logits = hf(torch.tensor([ids])).logits[0, -1:].float()
            return probabilities(logits, [params])[0]

        first = dist(prompt)
        marginal = sum(first[x] * dist([*prompt, x]) for x in first.nonzero()[:, 0].tolist())
    counts = torch.bincount(
        torch.tensor([r.output_token_ids[1] for r in results]), minlength=marginal.shape[0]
    ).double()
    keep = marginal > 1e-4
    assert counts[~keep].sum() <= 2  # (float noise between engines at the top-k edge)
    expected = marginal[keep].double() / marginal[keep].double().sum() * counts[keep].sum()
    assert chisquare(counts[keep].numpy(), expected.numpy()).pvalue > 1e-3
