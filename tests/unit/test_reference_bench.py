"""Bench bookkeeping: seeded workload, FLOP accounting, report maths (no engine runs)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from engines.dev.bench import (
    BenchConfig,
    BenchReport,
    ExpertLoadSummary,
    ModeResult,
    _percentile,
    format_result,
    format_summary,
    make_workload,
    matmul_params,
    summarize_expert_load,
)


def test_workload_is_seeded_and_within_ranges() -> None:
    config = BenchConfig(num_prompts=64, prompt_len=(16, 512), max_tokens=(8, 256), seed=3)
    prompts, max_tokens = make_workload(config, vocab_size=1000)
    assert (prompts, max_tokens) == make_workload(config, vocab_size=1000)
    assert (prompts, max_tokens) != make_workload(BenchConfig(num_prompts=64, seed=4), 1000)
    assert len(prompts) == len(max_tokens) == 64
    assert all(16 <= len(p) <= 512 for p in prompts)
    assert all(8 <= m <= 256 for m in max_tokens)
    assert all(3 <= t < 1000 for p in prompts for t in p)
    assert len({len(p) for p in prompts}) > 20  # lengths really vary


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_matmul_params_counts_every_linear(tmp_path, arch) -> None:
    import transformers

    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen3Config(**common, head_dim=32)
        model = transformers.Qwen3ForCausalLM(config)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    import torch

    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_params(tmp_path) == linears


def test_percentile_and_summary_ratios() -> None:
    assert _percentile([], 0.5) is None
    assert _percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert _percentile(list(range(101)), 0.95) == 95
    report = BenchReport(
        config=BenchConfig(),
        model="m",
        threads=2,
        matmul_params=10,
        matmul_flops_per_s=100e9,
        onednn_flops_per_s=180e9,
    )
    report.results = [
        ModeResult(
            "reference", tokens_per_s=300.0, decode_flops_per_s=45e9, decode_steps_counted=7
        ),
        ModeResult("hf-static", tokens_per_s=50.0),
        ModeResult("hf-continuous", tokens_per_s=100.0),
        ModeResult("hf-continuous", error="boom"),
    ]
    assert report.speedup_vs_best_hf == pytest.approx(3.0)
    assert report.decode_flops_fraction == pytest.approx(0.45)
    assert report.decode_onednn_fraction == pytest.approx(0.25)
    text = format_summary(report)
    assert "3.00x" in text and "45% of matmul" in text and "25% of oneDNN's 180.0" in text
    data = report.to_json()
    assert data["speedup_vs_best_hf"] == pytest.approx(3.0)
    assert data["results"][0]["mode"] == "reference"


def test_ratios_are_taken_per_round_and_the_median_reported() -> None:
    report = BenchReport(
        config=BenchConfig(rounds=3),
        model="m",
        threads=2,
        matmul_params=10,
        matmul_flops_per_s=100e9,
    )
    speeds = [(240.0, 200.0, 40e9), (210.0, 200.0, 50e9), (300.0, 200.0, 60e9)]
    for i, (ref, vllm, flops) in enumerate(speeds):
        report.results += [
            ModeResult("reference", tokens_per_s=ref, decode_flops_per_s=flops, round=i),
            ModeResult("vllm", tokens_per_s=vllm, round=i),
        ]
    report.results.append(ModeResult("vllm", error="crashed", round=3))  # a round without a pair
    assert report.ratios_vs_vllm == pytest.approx([1.2, 1.05, 1.5])
    assert report.speedup_vs_vllm == pytest.approx(1.2)  # the median, not the mean (1.25)
    assert report.decode_flops_fraction == pytest.approx(0.5)
    text = format_summary(report)
    assert "reference vs vllm: 1.20x" in text and "median of 3 rounds: 1.20x, 1.05x, 1.50x" in text
    assert report.to_json()["ratios_vs_vllm"] == pytest.approx([1.2, 1.05, 1.5])


def test_matmul_params_counts_a_tokens_router_and_k_experts(tmp_path) -> None:
    """Qwen3-MoE: a sparse layer's token multiplies the router and its k experts, a dense layer
    (mlp_only_layers) its dense MLP."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mlp_only_layers=[1],
    )
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    attention = 64 * 16 * (2 * 4 + 2 * 2)
    sparse = 64 * 8 + 2 * 3 * 64 * 32
    dense = 3 * 64 * 96
    assert matmul_params(tmp_path) == 3 * attention + 2 * sparse + dense + 64 * 300


def test_expert_load_is_summarized_over_the_steps_that_ran_experts() -> None:
    from engines.api import StepRecord

    def step(max_tokens: int | None, mean: float | None) -> StepRecord:
        return StepRecord(
            0.0, 1.0, {"a": 4}, {}, expert_tokens_max=max_tokens, expert_tokens_mean=mean
        )

    assert summarize_expert_load([step(None, None)]) is None  # a dense model
    load = summarize_expert_load([step(6, 2.0), step(3, 1.0), step(9, 3.0)])
    assert load == ExpertLoadSummary(
        num_steps=3, tokens_max=6.0, tokens_mean=2.0, tokens_peak=9, max_over_mean=3.0
    )
    text = format_result(
        ModeResult(
            "reference",
            tokens_per_s=1.0,
            ttft_p50_s=0.1,
            ttft_p95_s=0.2,
            expert_load=dataclasses.asdict(load),
        )
    )
    assert "tokens per expert per step: max 6.0, mean 2.0 (max/mean 3.00), peak 9" in text
