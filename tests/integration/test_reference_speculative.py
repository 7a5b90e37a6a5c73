"""N-gram speculative decoding in the reference engine: the output is exactly what decoding
without speculation gives (greedy, and seeded sampling too), with prefix caching, chunked
prefill and preemption active, and proposals are really accepted."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import pytest

from engines.api import GenerationRequest, SamplingParams
from engines.reference.engine import ReferenceEngine
from tests.engine_fixtures import check_speculative_run, run_all

pytestmark = pytest.mark.timeout(600)

SPEC = {"method": "ngram", "num_tokens": 4, "disable_above_batch_size": 64}
# (arch, tied): the families the parity tests cover.
MODELS = [
    ("llama", False),
    ("qwen2", False),
    ("qwen3", True),
    ("qwen3_moe", False),
    ("gpt_oss", False),
]
# name -> engine settings (as test_reference_equality's variants)
VARIANTS = {
    "default": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "no-chunked-prefill": {"enable_chunked_prefill": False, "max_num_tokens": 128},
    # 16-token steps chunk prompts and cut proposals; 14 blocks of 8 force preemptions.
    "chunked-preempting": {
        "max_num_tokens": 16,
        "kv_cache_tokens": 112,
        "block_size": 8,
        "max_batch_size": 8,
    },
}

_MODELS: dict[tuple[str, bool], Path] = {}


def repeating_model(arch: str, tied: bool) -> Path:
    """A tiny random model with a narrow init: its greedy output falls into repeats, which
    n-gram proposals then predict (a wide-init random model almost never repeats itself)."""
    if (arch, tied) not in _MODELS:
        from engines.dev.tiny import make_tiny_model

        out = Path(tempfile.mkdtemp(prefix="tokenmill-spec-")) / f"{arch}-{tied}"
        _MODELS[arch, tied] = make_tiny_model(
            out, arch=arch, tie_word_embeddings=tied, initializer_range=0.05
        )
    return _MODELS[arch, tied]


def repeating_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Spans repeated 2-5 times (copy-heavy prompts); every other one shares a prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 1000) for _ in range(20)]
    prompts = []
    for i in range(count):
        span = [rng.randrange(3, 1000) for _ in range(rng.randint(3, 10))]
        prompt = span * rng.randint(2, 5)
        prompts.append(shared + prompt if i % 2 else prompt)
    return prompts


def requests(prompts, **sampling) -> list[GenerationRequest]:
    rng = random.Random(5)
    out = []
    for i, prompt in enumerate(prompts):
        params = {"max_tokens": rng.randint(8, 40), "temperature": 0.0, "ignore_eos": True}
        params.update(sampling)
        out.append(GenerationRequest(list(prompt), SamplingParams(**params), request_id=f"r{i}"))
    return out


def generate(model: Path, reqs, **settings):
    engine = ReferenceEngine(str(model), num_threads=1, **settings)
    try:
        results = run_all(engine, reqs)
        records = engine.drain_step_records()
        stats = engine.stats()
    finally:
        engine.shutdown()
    return results, records, stats


_BASELINES: dict[tuple[str, bool], list[list[int]]] = {}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(("arch", "tied"), MODELS, ids=[f"{a}-{t}" for a, t in MODELS])
def test_greedy_ids_equal_decoding_without_speculation(arch, tied, variant) -> None:
    model = repeating_model(arch, tied)
    reqs = requests(repeating_prompts(16, seed=len(arch)))
    if (arch, tied) not in _BASELINES:
        plain, _, _ = generate(model, reqs)
        _BASELINES[arch, tied] = [r.output_token_ids for r in plain]
    expected = _BASELINES[arch, tied]
    settings = VARIANTS[variant]
    results, records, stats = generate(model, reqs, speculative=SPEC, **settings)

    check_speculative_run(results, expected, records, stats, variant)


def test_prefix_cache_hits_after_speculation() -> None:
    """Blocks filled through accepted proposals join the prefix cache with the right hashes:
    a later request continuing an earlier one's prompt + output reuses them and still decodes
    the same tokens."""
    model = repeating_model("llama", False)
    first = requests(repeating_prompts(1, seed=9), max_tokens=40)[0]
    engine = ReferenceEngine(str(model), num_threads=1, block_size=4, speculative=SPEC)
    plain = ReferenceEngine(str(model), num_threads=1, block_size=4)
    try:
        (done,) = run_all(engine, [first])
        assert done.spec_accepted_tokens > 0
        follow = GenerationRequest(
            first.prompt_token_ids + done.output_token_ids[:-1],
            SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
            request_id="follow",
        )
        (again,) = run_all(engine, [follow])
        (baseline,) = run_all(plain, [follow])
    finally:
        engine.shutdown()
        plain.shutdown()
    assert again.cached_prompt_tokens >= len(first.prompt_token_ids)
    assert again.output_token_ids == baseline.output_token_ids


def test_seeded_sampling_is_unchanged_by_speculation() -> None:
    """Each emitted token uses one draw of the request's own generator, as without
    speculation: seeded rows give identical tokens with speculation on or off, run after run."""
    model = repeating_model("qwen2", False)
    prompts = repeating_prompts(12, seed=3)
    reqs = []
    for i, r in enumerate(requests(prompts, temperature=0.7, top_k=50, seed=0)):
        sampling = SamplingParams(
            max_tokens=r.sampling.max_tokens,
            temperature=[0.02, 0.05, 0.1][i % 3],
            top_p=[1.0, 0.9, 0.95][i % 3],
            top_k=[0, 40, 0][i % 3],
            seed=100 + i,
            ignore_eos=True,
        )
        reqs.append(GenerationRequest(r.prompt_token_ids, sampling, request_id=r.request_id))
    plain, _, _ = generate(model, reqs)
    first, _, _ = generate(model, reqs, speculative=SPEC)
    second, _, _ = generate(model, reqs, speculative=SPEC, max_num_tokens=24)
    ids = [[r.output_token_ids for r in rs] for rs in (plain, first, second)]
    assert ids[0] == ids[1] == ids[2]
    assert sum(r.spec_accepted_tokens for r in first) > 0


def test_stops_inside_accepted_tokens_drop_what_follows() -> None:
    """EOS, stop token ids, stop strings and max_tokens are checked for each accepted token in
    order: results equal decoding without speculation."""
    model = repeating_model("llama", False)
    prompts = repeating_prompts(12, seed=4)
    base = requests(prompts, max_tokens=40)
    plain, _, _ = generate(model, base)
    reqs = []
    for i, (r, out) in enumerate(zip(base, plain, strict=True)):
        ids = out.output_token_ids
        token = ids[len(ids) // 2]
        kind = i % 3
        sampling = SamplingParams(
            max_tokens=40,
            temperature=0.0,
            stop_token_ids=(token,) if kind == 0 else (),
            stop=(),
            ignore_eos=kind != 1,
        )
        reqs.append(GenerationRequest(r.prompt_token_ids, sampling, request_id=r.request_id))
    # kind 1 stops at the model's EOS only if it emits one; kind 2 runs to max_tokens.
    plain, _, _ = generate(model, reqs)
    spec, _, stats = generate(model, reqs, speculative=SPEC)
    for a, b in zip(plain, spec, strict=True):
        assert (a.output_token_ids, a.finish_reason, a.stop_reason, a.text) == (
            b.output_token_ids,
            b.finish_reason,
            b.stop_reason,
            b.text,
        )
    assert any(r.stop_reason is not None for r in spec)
    assert sum(r.spec_accepted_tokens for r in spec) > 0
    assert stats.kv_blocks_used == 0


def test_stop_strings_with_speculation() -> None:
    model = repeating_model("llama", False)
    prompts = repeating_prompts(6, seed=6)
    base = requests(prompts, max_tokens=40)
    plain, _, _ = generate(model, base)
    reqs = []
    for r, out in zip(base, plain, strict=True):
        text = out.text
        stop = text[len(text) // 2 : len(text) // 2 + 3].strip() or "e"
        sampling = SamplingParams(max_tokens=40, temperature=0.0, stop=(stop,), ignore_eos=True)
        reqs.append(GenerationRequest(r.prompt_token_ids, sampling, request_id=r.request_id))
    plain, _, _ = generate(model, reqs)
    spec, _, _ = generate(model, reqs, speculative=SPEC)
    for a, b in zip(plain, spec, strict=True):
        assert (a.output_token_ids, a.text, a.finish_reason, a.stop_reason) == (
            b.output_token_ids,
            b.text,
            b.finish_reason,
            b.stop_reason,
        )
    assert any(r.finish_reason == "stop" for r in spec)


def test_large_batches_do_not_speculate() -> None:
    model = repeating_model("llama", False)
    reqs = requests(repeating_prompts(8, seed=2))  # 8 to 40 tokens: a tail of few requests
    small_limit = {**SPEC, "disable_above_batch_size": 2}
    results, records, _ = generate(model, reqs, speculative=small_limit)
    for rec in records:
        if rec.spec_proposed_tokens:
            # Running requests (those with tokens in the step) never exceed the limit then.
            assert len(rec.request_ids) <= 2
    assert sum(r.spec_proposed_tokens for r in results) > 0  # the tail of the run speculates


def test_streams_deliver_every_accepted_token_once() -> None:
    import asyncio

    model = repeating_model("llama", False)
    reqs = requests(repeating_prompts(4, seed=8), max_tokens=32)
    engine = ReferenceEngine(str(model), num_threads=1, speculative=SPEC)

    async def collect(request):
        ids, text, last = [], "", None
        async for delta in engine.stream(request):
            ids += delta.token_ids
            text += delta.text
            last = delta
        return ids, text, last.result

    async def main():
        return await asyncio.gather(*(collect(r) for r in reqs))

    try:
        streamed = asyncio.run(main())
    finally:
        engine.shutdown()
    for ids, text, result in streamed:
        assert ids == result.output_token_ids
        assert text == result.text
    assert sum(result.spec_accepted_tokens for _, _, result in streamed) > 0


def test_rows_with_logprobs_or_formats_do_not_speculate() -> None:
    model = repeating_model("llama", False)
    reqs = requests(repeating_prompts(4, seed=1), max_tokens=24, logprobs=2)
    plain, _, _ = generate(model, reqs)
    spec, _, _ = generate(model, reqs, speculative=SPEC)
    assert [r.output_token_ids for r in plain] == [r.output_token_ids for r in spec]
    assert [r.logprobs for r in plain] == [r.logprobs for r in spec]
    assert all(r.spec_proposed_tokens == 0 for r in spec)
