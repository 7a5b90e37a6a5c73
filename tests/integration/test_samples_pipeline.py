"""n > 1 and prompt logprobs through the whole batch pipeline (local Ray, S3 over HTTP,
Parquet): each row keeps one output row, with its n samples in the `samples` column, seeded per
sample; a per-row `n` override; token counts and cost cover every sample. A scoring job gets
every prompt token's logprob."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from engines.api import GenerationRequest, SamplingParams
from engines.reference.engine import ReferenceEngine
from pipeline.batch.driver.run import run_job
from pipeline.batch.stages.prompts import derive_seed
from pipeline.openai.chat import render_prompt
from tests.integration.s3_server import S3Server
from tests.integration.test_pipeline import (
    assert_exactly_once,
    assert_totals_match,
    manifest_of,
    read_output,
    s3_jsonl_job,
)

pytestmark = pytest.mark.timeout(600)

SAMPLING = {
    "max_tokens": 8,
    "temperature": 1.0,
    "seed": 11,
    "n": 3,
    "ignore_eos": True,
    "overrides": {"n": "samples_wanted"},
}


def _job(name: str, lines: list[dict[str, Any]], s3: S3Server, model: Path):
    return s3_jsonl_job(
        name,
        lines,
        s3,
        model,
        sampling=SAMPLING,
        output={"include_token_ids": True},
        resources={"batch_size": 8, "max_in_flight": 8},
    )


def test_rows_with_n_samples(ray_local: Any, s3_server: S3Server, tiny_model_dir: Path) -> None:
    lines: list[dict[str, Any]] = [
        {"id": f"r{i:02d}", "text": f"Write a line about the harbour, take {i}."} for i in range(12)
    ]
    lines[0]["samples_wanted"] = 1  # one sample: the row is the answer, no samples cell
    lines[1]["samples_wanted"] = 5
    lines.append({"id": "bad-n", "text": "x", "samples_wanted": 0})
    spec = _job("samples", lines, s3_server, tiny_model_dir)
    assert run_job(spec).status == "complete"
    table, _ = read_output(s3_server, spec.output.uri)
    assert_exactly_once(table, [x["id"] for x in lines])
    assert_totals_match(manifest_of(s3_server, spec.output.uri), table)
    rows = {r["id"]: r for r in table.to_pylist()}

    bad = rows.pop("bad-n")
    assert bad["finish_reason"] == "error" and "'samples_wanted'" in bad["error"]
    assert "[1, 128]" in bad["error"]
    single = rows.pop("r00")
    assert single["samples"] is None and single["completion_tokens"] == 8
    for row_id, row in rows.items():
        n = 5 if row_id == "r01" else 3
        samples = row["samples"]
        assert [s["index"] for s in samples] == list(range(n)), row_id
        assert all(s["finish_reason"] == "length" and s["completion_tokens"] == 8 for s in samples)
        assert row["text"] == samples[0]["text"]
        assert row["completion_token_ids"] == samples[0]["completion_token_ids"]
        assert row["completion_tokens"] == 8 * n
        assert row["gpu_seconds"] > 0
        assert len({tuple(s["completion_token_ids"]) for s in samples}) > 1, row_id

    # Sample i of a row draws with the row's seed + i: the same tokens as a lone request.
    engine = ReferenceEngine(str(tiny_model_dir), num_threads=1)
    try:
        row = rows["r01"]
        prompt = render_prompt(engine.tokenizer, spec.prompt, text=lines[1]["text"])
        seed = derive_seed(11, "r01")
        for s in row["samples"]:
            params = SamplingParams(
                max_tokens=8, temperature=1.0, seed=seed + s["index"], ignore_eos=True
            )
            alone = asyncio.run(engine.generate(GenerationRequest(prompt, params)))
            assert alone.output_token_ids == s["completion_token_ids"]
    finally:
        engine.shutdown()


def test_scoring_job_gets_prompt_logprobs(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path
) -> None:
    lines = [{"id": f"s{i}", "text": f"The harbour at dawn, number {i}."} for i in range(6)]
    lines.append({"id": "s-again", "text": lines[0]["text"]})  # its prompt is in the cache
    spec = s3_jsonl_job(
        "scoring",
        lines,
        s3_server,
        tiny_model_dir,
        sampling={"max_tokens": 1, "prompt_logprobs": 2},
    )
    assert run_job(spec).status == "complete"
    table, _ = read_output(s3_server, spec.output.uri)
    rows = {r["id"]: r for r in table.to_pylist()}
    engine = ReferenceEngine(str(tiny_model_dir), num_threads=1)
    try:
        for line in lines:
            row = rows[line["id"]]
            scores = row["prompt_logprobs"]
            assert len(scores) == row["prompt_tokens"] and scores[0] is None
            assert row["cached_prompt_tokens"] == 0
            prompt = render_prompt(engine.tokenizer, spec.prompt, text=line["text"])
            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
            alone = asyncio.run(engine.generate(GenerationRequest(prompt, params)))
            assert [s["token_id"] for s in scores[1:]] == prompt[1:]
            assert [s["logprob"] for s in scores[1:]] == pytest.approx(
                [lp.logprob for lp in alone.prompt_logprobs[1:]], abs=1e-5
            )
            assert all(len(s["top"]) == 2 for s in scores[1:])
    finally:
        engine.shutdown()
