"""LoRA adapters in the reference engine: rows of several adapters and the base model in one
batch give, token for token, what transformers gives on the base checkpoint with each adapter
merged into it (fp32, greedy), under prefix caching, chunked prefill and preemption; slots are
reused least recently used first; a bad adapter fails its own requests only, naming itself and
the field."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from engines.api import GenerationRequest, ResponseFormat, SamplingParams
from tests.engine_fixtures import hf_greedy, run_all, tiny_model, varied_prompts

pytestmark = pytest.mark.timeout(600)

# name -> (rank, alpha, targets, rslora): the attention only, everything, the MLP and o_proj.
ADAPTERS = {
    "qv": (8, 16, ("q_proj", "v_proj"), False),
    "all": (
        4,
        8,
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        True,
    ),
    "mlp": (16, 16, ("o_proj", "gate_proj", "up_proj", "down_proj"), False),
}
ENGINE = {"num_threads": 1, "max_model_len": 256}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from engines.dev.lora import make_lora_adapter

    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_lora_adapter(
            root / name, model_dir, rank=r, alpha=a, targets=t, use_rslora=rs, seed=i
        )
        for i, (name, (r, a, t, rs)) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def merged(
    model_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str | None, Path]:
    from engines.dev.lora import merge_lora

    root = tmp_path_factory.mktemp("merged")
    out: dict[str | None, Path] = {None: model_dir}
    for name, folder in adapters.items():
        out[name] = merge_lora(model_dir, folder, root / name)
    return out


def mixed_requests(count: int, names: list[str | None], seed: int = 3) -> list[GenerationRequest]:
    """Every other prompt shares a 40-token prefix, so the same prefix meets every adapter."""
    prompts = varied_prompts(count, seed=seed)
    return [
        GenerationRequest(
            p,
            SamplingParams(max_tokens=6 + i % 7, temperature=0.0, ignore_eos=True),
            request_id=f"r{i}",
            adapter=names[i % len(names)],
        )
        for i, p in enumerate(prompts)
    ]


def expected(requests: list[GenerationRequest], merged: dict[str | None, Path]) -> list[list[int]]:
    out: dict[str, list[int]] = {}
    for name, folder in merged.items():
        mine = [r for r in requests if r.adapter == name]
        for request, ids in zip(mine, hf_greedy(folder, mine), strict=True):
            out[request.request_id] = ids
    return [out[r.request_id] for r in requests]


def engine_with(model_dir: Path, adapters: dict[str, Path], **settings):
    from engines.reference.engine import ReferenceEngine

    sources = {name: str(path) for name, path in adapters.items()}
    return ReferenceEngine(str(model_dir), lora_adapters=sources, **ENGINE | settings)


@pytest.mark.parametrize(
    "variant",
    ["plain", "chunked-preempting", "torch-ops"],
)
def test_mixed_adapters_equal_transformers_with_each_merged(
    variant: str,
    model_dir: Path,
    adapters: dict[str, Path],
    merged: dict[str | None, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """plain and chunked-preempting add the LoRA terms with the CPU kernel (kernels/lora.cpp);
    torch-ops with the grouped torch ops CUDA runs."""
    names: list[str | None] = [None, "qv", "all", "mlp"]
    requests = mixed_requests(24, names)
    settings = {"max_loras": 3}
    if variant == "torch-ops":
        monkeypatch.setattr("engines.reference.model.cpu_kernels.use_kernels", lambda device: False)
    if variant != "plain":
        # As the equality tests' variant: 16-token steps split prompts, a 112-token pool of
        # 8-token blocks evicts (and adapters give up their slots and take them again).
        settings |= {"max_num_tokens": 16, "kv_cache_tokens": 112, "block_size": 8}
        settings |= {"max_batch_size": 8}
    engine = engine_with(model_dir, adapters, **settings)
    try:
        results = run_all(engine, requests)
        stats = engine.stats()
    finally:
        engine.shutdown()
    want = expected(requests, merged)
    wrong = [
        (r.request_id, r.error, w, r.output_token_ids)
        for r, w in zip(results, want, strict=True)
        if r.output_token_ids != w
    ]
    assert not wrong, wrong[:2]
    # The adapters matter: each changes some output against the base model.
    base_alone = dict(
        zip([r.request_id for r in requests], hf_greedy(model_dir, requests), strict=True)
    )
    for name in ("qv", "all", "mlp"):
        assert any(
            r.output_token_ids != base_alone[q.request_id]
            for q, r in zip(requests, results, strict=True)
            if q.adapter == name
        ), name
    # Shared prefixes under other adapters never hit one another's KV: a hit needs the same
    # adapter (requests 1, 5, 9 ... share prefix and adapter "qv"; 3, 7 ... "mlp").
    assert stats.kv_blocks_used == 0
    if variant != "plain":
        assert stats.num_preemptions > 0


def test_more_adapters_than_slots_take_turns(
    model_dir: Path, adapters: dict[str, Path], merged: dict[str | None, Path]
) -> None:
    """Three adapters, two slots. Mixed at once, requests wait for a slot (passed over, not
    blocking the line). In waves, the least recently used adapter gives up its slot, and a row
    never sees the weights a slot held before."""
    mixed = mixed_requests(12, ["qv", "all", "mlp"], seed=5)
    engine = engine_with(model_dir, adapters, max_loras=2, max_batch_size=4)
    try:
        results = run_all(engine, mixed)
        slots = engine.scheduler.adapters
        waves = []
        for name in ("qv", "all", "mlp", "qv"):  # mlp evicts qv (least recently used)
            before = slots.loads
            wave = [
                dataclasses.replace(r, request_id=f"{name}-{len(waves)}-{r.request_id}")
                for r in mixed_requests(3, [name], seed=len(waves) + 7)
            ]
            waves.append((wave, run_all(engine, wave), slots.loads - before, slots.resident()))
    finally:
        engine.shutdown()
    assert [r.output_token_ids for r in results] == expected(mixed, merged)
    for wave, out, _, _ in waves:
        assert [r.output_token_ids for r in out] == expected(wave, merged)
    loads = [w[2] for w in waves]
    assert loads[2] == 1 and "qv" not in waves[2][3]  # mlp took qv's slot
    assert loads[3] == 1 and set(waves[3][3]) == {"qv", "mlp"}  # qv came back, in all's


def test_the_prefix_cache_is_keyed_by_adapter(model_dir: Path, adapters: dict[str, Path]) -> None:
    """The same prompt under the base model and an adapter: the second computes its whole
    prompt; a repeat under the same adapter reuses the first's blocks."""
    prompt = list(range(10, 74))  # four full blocks
    engine = engine_with(model_dir, adapters)
    try:
        first = run_all(engine, [GenerationRequest(prompt, SamplingParams(max_tokens=2))])
        other = run_all(
            engine, [GenerationRequest(prompt, SamplingParams(max_tokens=2), adapter="qv")]
        )
        again = run_all(
            engine, [GenerationRequest(prompt, SamplingParams(max_tokens=2), adapter="qv")]
        )
    finally:
        engine.shutdown()
    assert first[0].cached_prompt_tokens == 0
    assert other[0].cached_prompt_tokens == 0  # the base model's blocks are not the adapter's
    assert again[0].cached_prompt_tokens == 48


def _write(folder: Path, config: dict) -> None:
    (folder / "adapter_config.json").write_text(json.dumps(config))


def test_bad_adapters_fail_their_requests_naming_adapter_and_field(
    model_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    from engines.dev.lora import make_lora_adapter

    high = make_lora_adapter(tmp_path / "high", model_dir, rank=32, seed=9)
    missing = tmp_path / "missing"
    missing.mkdir()
    dora = make_lora_adapter(tmp_path / "dora", model_dir, seed=10)
    config = json.loads((dora / "adapter_config.json").read_text())
    _write(dora, config | {"use_dora": True})
    # Trained for another base: one with a wider hidden size (only its config.json is read).
    wide = tmp_path / "wide-base"
    wide.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    (wide / "config.json").write_text(
        json.dumps(config | {"hidden_size": 2 * config["hidden_size"]})
    )
    foreign = make_lora_adapter(tmp_path / "foreign", wide, seed=11)
    lm_head = make_lora_adapter(tmp_path / "lm_head", model_dir, seed=12)
    config = json.loads((lm_head / "adapter_config.json").read_text())
    _write(lm_head, config | {"target_modules": ["q_proj", "lm_head"]})
    bad = {"high": high, "missing": missing, "dora": dora, "foreign": foreign, "lm_head": lm_head}
    engine = engine_with(model_dir, adapters | bad, max_lora_rank=16)
    names = [*bad, "nope", "qv", None]
    requests = [
        GenerationRequest([5, 6, 7], SamplingParams(max_tokens=3), request_id=str(n), adapter=n)
        for n in names
    ]
    try:
        results = {r.request_id: r for r in run_all(engine, requests)}
    finally:
        engine.shutdown()
    assert "'high'" in results["high"].error and "r 32" in results["high"].error
    assert "max_lora_rank 16" in results["high"].error
    assert "'missing'" in results["missing"].error
    assert "adapter_config.json" in results["missing"].error
    assert "use_dora" in results["dora"].error
    assert "'foreign'" in results["foreign"].error
    assert "another base model" in results["foreign"].error
    assert "lm_head" in results["lm_head"].error and "target_modules" in results["lm_head"].error
    assert "unknown adapter 'nope'" in results["nope"].error and "qv" in results["nope"].error
    assert results["qv"].ok and results["None"].ok  # nothing else fails


def test_an_engine_without_adapters_refuses_one_and_wraps_nothing(model_dir: Path) -> None:
    from engines.reference.engine import ReferenceEngine
    from engines.reference.model.lora import LoraLinear

    engine = ReferenceEngine(str(model_dir), **ENGINE)
    try:
        (result,) = run_all(
            engine, [GenerationRequest([5, 6], SamplingParams(max_tokens=2), adapter="qv")]
        )
        assert not any(isinstance(m, LoraLinear) for m in engine.model.modules())
    finally:
        engine.shutdown()
    assert "unknown adapter 'qv'" in result.error and "base model only" in result.error


def test_speculation_samples_and_structured_output_keep_working_under_adapters(
    model_dir: Path, adapters: dict[str, Path], merged: dict[str | None, Path]
) -> None:
    """N-gram speculation verifies with each row's adapter (the greedy ids stay the merged
    model's); n = 2 samples of one prompt fork its KV under its adapter; a JSON schema
    constrains an adapter's output."""
    from engines.samples import fan_out

    spec = {"method": "ngram", "num_tokens": 4, "disable_above_batch_size": 64}
    # Repetitive prompts, so proposals come and some are accepted.
    prompts = [[7, 8, 9, 10] * 6 + [i + 3] for i in range(6)]
    greedy = [
        GenerationRequest(
            p,
            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
            request_id=f"g{i}",
            adapter=[None, "qv", "all"][i % 3],
        )
        for i, p in enumerate(prompts)
    ]
    pair = fan_out(
        GenerationRequest(
            [11, 12, 13], SamplingParams(max_tokens=8, temperature=1.0, seed=5), adapter="mlp"
        ),
        2,
    )
    fmt = ResponseFormat("regex", regex=r"(yes|no), [0-9]{1,3}")
    structured = GenerationRequest(
        [20, 21, 22],
        SamplingParams(max_tokens=40, temperature=0.0, response_format=fmt),
        adapter="qv",
    )
    engine = engine_with(model_dir, adapters, speculative=spec)
    try:
        results = run_all(engine, [*greedy, *pair, structured])
    finally:
        engine.shutdown()
    out = results[: len(greedy)]
    assert [r.output_token_ids for r in out] == expected(greedy, merged)
    assert sum(r.spec_accepted_tokens for r in out) > 0
    samples = results[len(greedy) : len(greedy) + 2]
    assert all(r.ok and len(r.output_token_ids) == 8 for r in samples)
    assert samples[0].output_token_ids != samples[1].output_token_ids  # seeds differ
    answer = results[-1]
    assert answer.ok and re.fullmatch(r"(yes|no), [0-9]{1,3}", answer.text), answer.text
