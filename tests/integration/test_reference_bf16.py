"""bf16 parity: the reference engine in bfloat16 against transformers, per model family.

bf16 keeps 8 bits of mantissa, so two correct implementations that round in a different order
(fused q/k/v and gate/up projections, another matmul blocking, paged attention) pick different
argmaxes wherever the top two logits are closer than the rounding, and greedy sequences part
there. Exact equality is therefore not the bar. The documented tolerance (docs/engine.md,
"bf16 parity") is relative to transformers' own bf16 against the fp32 truth:
- the first generated token equals fp32's as often as transformers' bf16 gets it (it is decided
  by the prompt alone: a broken prefill shows here first);
- the share of generated tokens before the first divergence from fp32 is within
  BF16_SHARE_TOLERANCE of transformers' bf16 share (measured: 0.74-0.76 ours, 0.71-0.77 theirs on
  these models);
- and the engine's bf16 agrees with transformers' bf16 on most tokens (a wrong but consistent
  engine would agree with neither).
With prefix caching, chunked prefill and preemption on, as the fp32 equality tests run them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engines.reference.engine import ReferenceEngine
from engines.reference.model.cpu_kernels import kernels_available
from tests.engine_fixtures import (
    check_attention_path,
    count_attention_paths,
    cpu_without_onednn_bf16,
    greedy_requests,
    hf_greedy,
    run_all,
    tiny_model,
    varied_prompts,
)

pytestmark = pytest.mark.timeout(300)

BF16_SHARE_TOLERANCE = 0.10
# 16-token steps chunk most prompts; 28 blocks of 8 tokens force preemptions.
SETTINGS = {"max_num_tokens": 16, "kv_cache_tokens": 224, "block_size": 8, "max_batch_size": 8}


def agreement(ours: list[list[int]], truth: list[list[int]]) -> tuple[float, float]:
    """(share of tokens before each sequence's first divergence, share of equal first tokens)."""
    matched = total = firsts = 0
    for a, b in zip(ours, truth, strict=True):
        k = 0
        while k < len(a) and a[k] == b[k]:
            k += 1
        matched, total, firsts = matched + k, total + len(b), firsts + (a[:1] == b[:1])
    return matched / total, firsts / len(truth)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss"])
def test_bf16_greedy_is_as_close_to_fp32_as_transformers_bf16(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tiny_model(arch)
    requests = greedy_requests(varied_prompts(32, seed=7), seed=3)
    truth = hf_greedy(model_dir, requests)
    theirs = hf_greedy(model_dir, requests, dtype="bfloat16")
    paths = count_attention_paths(monkeypatch)
    engine = ReferenceEngine(str(model_dir), dtype="bfloat16", num_threads=1, **SETTINGS)
    try:
        results = run_all(engine, requests)
        stats = engine.stats()
    finally:
        engine.shutdown()
    ours = [r.output_token_ids for r in results]
    assert [len(o) for o in ours] == [r.sampling.max_tokens for r in requests]
    assert stats.num_preemptions > 0 and stats.kv_blocks_used == 0
    check_attention_path(arch, paths, kernel=kernels_available())

    our_share, our_firsts = agreement(ours, truth)
    their_share, their_firsts = agreement(theirs, truth)
    assert our_firsts >= their_firsts - 1 / len(requests), (our_firsts, their_firsts)
    assert our_share >= their_share - BF16_SHARE_TOLERANCE, (our_share, their_share)
    # Two bf16 runs cannot be expected to agree with each other more than each agrees with
    # fp32. The tiny GPT-OSS is the most rounding-sensitive model here: transformers' bf16 keeps
    # 0.48 of fp32's tokens on it (0.71-0.77 elsewhere), ours 0.51, and ours and theirs agree on
    # 0.50; its bar is transformers' own share of fp32, less the tolerance.
    floor = min(0.6, their_share - BF16_SHARE_TOLERANCE)
    assert agreement(ours, theirs)[0] >= floor, (agreement(ours, theirs), floor)


def test_bf16_where_onednn_cannot_take_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU whose oneDNN refuses bf16 (simulated: the op raises as it does there), the
    engine loads with torch's own linears, says so, and keeps the bf16 parity bar."""
    from torch import nn

    cpu_without_onednn_bf16(monkeypatch)
    model_dir = tiny_model("llama")
    requests = greedy_requests(varied_prompts(16, seed=11), seed=5)
    engine = ReferenceEngine(str(model_dir), dtype="bfloat16", num_threads=1, **SETTINGS)
    try:
        linears = [m for m in engine.model.modules() if isinstance(m, nn.Linear)]
        assert linears and all(type(m) is nn.Linear for m in linears)
        notes = [n for n in engine.info.limitations if "bfloat16" in n and "oneDNN" in n]
        assert len(notes) == 1, engine.info.limitations
        results = run_all(engine, requests)
    finally:
        engine.shutdown()
    ours = [r.output_token_ids for r in results]
    assert [len(o) for o in ours] == [r.sampling.max_tokens for r in requests]
    truth = hf_greedy(model_dir, requests)
    theirs = hf_greedy(model_dir, requests, dtype="bfloat16")
    our_share, our_firsts = agreement(ours, truth)
    their_share, their_firsts = agreement(theirs, truth)
    assert our_firsts >= their_firsts - 1 / len(requests), (our_firsts, their_firsts)
    assert our_share >= their_share - BF16_SHARE_TOLERANCE, (our_share, their_share)


def test_a_bf16_job_completes_where_onednn_cannot_take_bf16(
    ray_local: Any,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The same through the batch pipeline: the engine actors (Ray workers) get the simulated
    CPU from the test hook variable the driver passes on, load bf16 with torch's linears, and
    the job commits every row; the driver logs the engine's note once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.batch.driver.run import run_job
    from pipeline.spec import parse_job_spec

    monkeypatch.setenv("TOKENMILL_TEST_HOOKS", "1")
    monkeypatch.setenv("TOKENMILL_TEST_ONEDNN_REFUSES", "bfloat16")
    ids = [f"row-{i:02d}" for i in range(8)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "p": f"Name the {i} rivers"}) + "\n" for i in ids))
    out = tmp_path / "out"
    spec = parse_job_spec(
        {
            "name": "bf16-fallback",
            "input": {"uri": str(src), "format": "jsonl", "id_column": "id", "prompt_column": "p"},
            "model": {"path": str(tiny_model_dir)},
            "engine": {"kind": "reference", "device": "cpu", "dtype": "bfloat16"},
            "sampling": {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True},
            "resources": {"num_actors": 1, "cpus_per_actor": 0.25, "batch_size": 4},
            "output": {"uri": str(out), "rows_per_file": 4, "report": False},
        }
    )
    with caplog.at_level("WARNING", logger="pipeline.batch.driver.scheduler"):
        result = run_job(spec)
    assert result.status == "complete" and result.exit_code == 0, result
    table = pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("part-*.parquet")))
    assert sorted(table.column("id").to_pylist()) == ids
    assert set(table.column("completion_tokens").to_pylist()) == {6}
    assert table.column("error").null_count == len(ids)
    notes = [
        r.getMessage()
        for r in caplog.records
        if "engine limitation" in r.getMessage() and "bfloat16" in r.getMessage()
    ]
    assert len(notes) == 1, [r.getMessage() for r in caplog.records]
    assert "oneDNN" in notes[0]
