"""The synthetic engine's own promises: its rate, its time to first token, its planned
endings and its determinism (the engine contract itself is checked in tests/contract)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from engines import load_engine
from engines.api import GenerationRequest, GenerationResult, SamplingParams, StepRecord
from engines.synthetic import SyntheticEngine, SyntheticSettings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the synthetic engine reads of a model: config.json and the tokenizer (no weights)."""
    from engines.dev.tiny import train_tokenizer

    out = tmp_path_factory.mktemp("synthetic-model")
    tokenizer = train_tokenizer(512)
    tokenizer.save_pretrained(out)
    config = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "max_position_embeddings": 512,
        "eos_token_id": tokenizer.eos_token_id,
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


def prompts(n: int) -> list[list[int]]:
    """n different prompts, every id inside the 512-token vocabulary."""
    return [[5 + i % 7, 40 + i % 400, 9, 100 + i // 400] for i in range(n)]


def run(
    model_dir: Path, requests: list[GenerationRequest], **settings: Any
) -> tuple[list[GenerationResult], list[StepRecord], float]:
    """Every request at once on a fresh engine: results, step records, seconds taken."""

    async def go():
        engine = load_engine("synthetic", str(model_dir), **settings)
        started = time.monotonic()
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
        elapsed = time.monotonic() - started
        records = engine.drain_step_records()
        engine.shutdown()
        return list(results), records, elapsed

    return asyncio.run(go())


def requests_for(n: int, tag: str = "r", **sampling: Any) -> list[GenerationRequest]:
    params = SamplingParams(**{"temperature": 0.0, **sampling})
    return [GenerationRequest(p, params, request_id=f"{tag}{i}") for i, p in enumerate(prompts(n))]


def test_aggregate_rate_is_close_to_tokens_per_s(model_dir: Path) -> None:
    # 32 requests x 40 tokens at 2000 tokens/s: each full step lasts 32 / 2000 s = 16 ms,
    # long beside a loaded machine's late wake-ups.
    results, records, elapsed = run(
        model_dir,
        requests_for(32, max_tokens=40, ignore_eos=True),
        tokens_per_s=2000,
        ttft_ms=0,
        step_interval_ms=1,
        max_batch_size=32,
    )
    tokens = sum(r.completion_tokens for r in results)
    assert tokens == 32 * 40 and {r.finish_reason for r in results} == {"length"}
    rate = tokens / elapsed
    # Never faster than asked (steps are at least tokens / rate long); loosely near it.
    assert 0.3 * 2000 < rate < 1.05 * 2000, rate
    # Every token is in a step record: each request's prompt once, then one decode per token.
    prefill, decode = Counter(), Counter()
    for record in records:
        prefill.update(record.prefill_tokens)
        decode.update(record.decode_tokens)
        assert record.end - record.start >= len(record.request_ids) / 2000 - 1e-3
    assert prefill == {f"r{i}": len(p) for i, p in enumerate(prompts(32))}
    assert decode == dict.fromkeys(prefill, 39)


def test_a_slow_stream_consumer_still_gets_every_token(model_dir: Path) -> None:
    """Tokens the step loop adds while a delta waits for its consumer go out with the next
    delta: the deltas' ids add up to the result's (token-reading splits depend on it)."""

    async def go() -> tuple[list[int], list[int]]:
        engine = load_engine(
            "synthetic", str(model_dir), tokens_per_s=2000, ttft_ms=1, output_tokens=40
        )
        request = requests_for(1, max_tokens=40)[0]
        streamed, result = [], None
        async for delta in engine.stream(request):
            streamed += delta.token_ids
            if delta.finished:
                result = delta.result
            await asyncio.sleep(0.01)  # a slow consumer: several steps per delta
        engine.shutdown()
        assert result is not None
        return streamed, list(result.output_token_ids)

    streamed, whole = asyncio.run(go())
    assert len(whole) == 40 and streamed == whole


def test_max_batch_size_bounds_the_running_requests(model_dir: Path) -> None:
    _, records, _ = run(
        model_dir, requests_for(20, max_tokens=5, ignore_eos=True), max_batch_size=4, ttft_ms=0
    )
    assert max(len(r.request_ids) for r in records) == 4


def test_time_to_first_token_follows_ttft_ms(model_dir: Path) -> None:
    results, _, _ = run(
        model_dir, requests_for(8, max_tokens=2), ttft_ms=60, ttft_jitter=0.5, seed=1
    )
    waits = [r.metrics.first_token_time - r.metrics.first_scheduled_time for r in results]
    assert all(0.030 <= w < 1.0 for w in waits), waits
    assert len({round(w, 3) for w in waits}) > 1  # jitter: not all the same


def test_same_seed_same_tokens_and_another_seed_others(model_dir: Path) -> None:
    sampled = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    reqs = requests_for(6, max_tokens=12, ignore_eos=True) + [
        GenerationRequest(p, SamplingParams(seed=i, **sampled), request_id=f"s{i}")
        for i, p in enumerate(prompts(6))
    ]
    first, _, _ = run(model_dir, reqs, seed=7)
    again, _, _ = run(model_dir, list(reversed(reqs)), seed=7, max_batch_size=3)
    other, _, _ = run(model_dir, reqs, seed=8)
    ids = {r.request_id: r.output_token_ids for r in first}
    assert {r.request_id: r.output_token_ids for r in again} == ids
    assert {r.request_id: r.output_token_ids for r in other} != ids
    assert len({tuple(v) for v in ids.values()}) == len(ids)  # prompts differ, tokens differ
    # The text is the tokenizer's decoding of the ids (meaningless, but real text).
    assert all(r.text and "\ufffd" not in r.text for r in first)


def test_planned_endings(model_dir: Path) -> None:
    engine = SyntheticEngine(str(model_dir))
    eos = engine.info.eos_token_ids[0]
    # The model "says" 5 tokens then EOS: a larger max_tokens stops there, a smaller is length.
    results, _, _ = run(
        model_dir,
        requests_for(4, max_tokens=10) + requests_for(4, "short", max_tokens=3),
        output_tokens=5,
        ttft_ms=0,
    )
    for result in results[:4]:
        assert result.finish_reason == "stop" and result.stop_reason is None
        assert result.completion_tokens == 5 and result.output_token_ids[-1] == eos
    assert all(r.finish_reason == "length" and r.completion_tokens == 3 for r in results[4:])


def test_stop_and_error_fractions(model_dir: Path) -> None:
    results, _, _ = run(
        model_dir,
        requests_for(200, max_tokens=8),
        stop_fraction=0.5,
        error_fraction=0.2,
        ttft_ms=0,
        max_batch_size=200,
    )
    reasons = Counter(r.finish_reason for r in results)
    assert 20 <= reasons["error"] <= 60, reasons
    assert reasons["stop"] >= 40 and reasons["length"] >= 40, reasons
    errors = [r for r in results if r.finish_reason == "error"]
    assert all("fails this fraction" in r.error and r.completion_tokens == 0 for r in errors)
    stopped = [r for r in results if r.finish_reason == "stop"]
    assert all(r.completion_tokens <= 8 for r in stopped)


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"tokens_per_s": 0}, "tokens_per_s"),
        ({"ttft_jitter": 1.5}, "ttft_jitter"),
        ({"output_tokens": 0}, "output_tokens"),
        ({"max_batch_size": True}, "max_batch_size"),
        ({"error_fraction": float("nan")}, "error_fraction"),
        ({"script": ""}, "script"),
    ],
)
def test_bad_settings_name_the_field(settings: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        SyntheticSettings.of(settings)


def test_unknown_setting_is_a_type_error_naming_it(model_dir: Path) -> None:
    with pytest.raises(TypeError, match="tokens_pr_s"):
        load_engine("synthetic", str(model_dir), tokens_pr_s=10)


def test_job_spec_checks_the_synthetic_settings() -> None:
    from pydantic import ValidationError

    from pipeline.engine_setup import engine_settings
    from pipeline.spec import EngineSpec

    spec = EngineSpec(kind="synthetic", max_batch_size=8, extra={"tokens_per_s": 1e5})
    assert engine_settings(spec) == {"max_batch_size": 8, "tokens_per_s": 1e5}
    with pytest.raises(ValidationError, match="stop_fraction"):
        EngineSpec(kind="synthetic", extra={"stop_fraction": -0.1})


def test_a_synthetic_job_refuses_response_format() -> None:
    from pipeline.spec import SpecError, parse_job_spec

    job = {
        "name": "synthetic-format",
        "input": {"uri": "in.jsonl", "format": "jsonl", "prompt_column": "text"},
        "model": {"path": "tiny"},
        "engine": {"kind": "synthetic"},
        "sampling": {"response_format": {"type": "json_object"}},
        "output": {"uri": "out/"},
    }
    with pytest.raises(SpecError, match="cannot constrain"):
        parse_job_spec(job)
    job["engine"] = {"kind": "reference"}
    assert parse_job_spec(job).sampling.response_format is not None


def test_a_script_is_said_exactly_then_eos_or_cut_by_max_tokens(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    script = "the river runs north. It is cold."
    ids = AutoTokenizer.from_pretrained(str(model_dir)).encode(script, add_special_tokens=False)
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    settings = {"script": script, "ttft_ms": 0, "step_interval_ms": 1}
    whole, cut, exact = run(
        model_dir,
        [
            *requests_for(1, "w", max_tokens=64),
            *requests_for(1, "c", max_tokens=3),
            *requests_for(1, "e", max_tokens=len(ids) + 1),  # room for the script and EOS
        ],
        **settings,
    )[0]
    assert (whole.output_token_ids, whole.text, whole.finish_reason) == (
        [*ids, eos],
        script,
        "stop",
    )
    assert (cut.output_token_ids, cut.finish_reason) == (ids[:3], "length")
    assert (exact.output_token_ids, exact.finish_reason) == ([*ids, eos], "stop")
