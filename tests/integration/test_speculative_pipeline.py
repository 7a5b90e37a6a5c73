"""Batch jobs with speculation (n-gram, and a draft model): the same greedy texts as without
it, per-row proposed / accepted / verification counts in the output, and the acceptance rate
and accepted tokens per verification in the manifest totals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.batch.driver.run import run_job
from tests.integration.s3_server import S3Server
from tests.integration.test_pipeline import read_output, s3_jsonl_job

pytestmark = pytest.mark.timeout(600)


def test_speculative_job_matches_plain_job_and_counts_tokens(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path
) -> None:
    # Repetitive prompts, so prompt lookup finds n-grams to propose.
    lines = [
        {"id": f"r{i}", "text": " ".join(["the river runs under the old bridge"] * (2 + i % 3))}
        for i in range(24)
    ]
    # Raw prompts: a chat template would end every prompt with the assistant header, which
    # never occurs earlier, so prompt lookup would have nothing to match on the first step.
    common = {
        "sampling": {"max_tokens": 24, "ignore_eos": True},
        "prompt": {"chat_template": False},
    }
    plain = s3_jsonl_job("plain", lines, s3_server, tiny_model_dir, **common)
    spec = s3_jsonl_job(
        "speculative",
        lines,
        s3_server,
        tiny_model_dir,
        # The job keeps up to 16 rows in flight; speculate at that size too.
        engine={
            "speculative": {"method": "ngram", "num_tokens": 3, "disable_above_batch_size": 64}
        },
        **common,
    )
    assert run_job(plain).status == "complete"
    done = run_job(spec)
    assert done.status == "complete"
    plain_rows = {r["id"]: r for r in read_output(s3_server, plain.output.uri)[0].to_pylist()}
    spec_table, _ = read_output(s3_server, spec.output.uri)
    assert "spec_proposed_tokens" not in read_output(s3_server, plain.output.uri)[0].column_names
    proposed = accepted = verifications = 0
    for row in spec_table.to_pylist():
        assert row["text"] == plain_rows[row["id"]]["text"]  # greedy: speculation changes nothing
        assert 0 <= row["spec_accepted_tokens"] <= row["spec_proposed_tokens"]
        assert row["spec_verifications"] <= row["spec_proposed_tokens"]
        proposed += row["spec_proposed_tokens"]
        accepted += row["spec_accepted_tokens"]
        verifications += row["spec_verifications"]
    assert proposed > 0
    totals = done.totals
    assert (totals["spec_proposed_tokens"], totals["spec_accepted_tokens"]) == (proposed, accepted)
    assert totals["spec_acceptance_rate"] == pytest.approx(accepted / proposed)
    assert totals["spec_accepted_per_verification"] == pytest.approx(accepted / verifications)
    assert "spec_acceptance_rate" not in run_job(plain).totals  # (already complete: reread)

    # The model as its own draft: greedy texts unchanged, proposals accepted.
    draft = s3_jsonl_job(
        "draft",
        lines,
        s3_server,
        tiny_model_dir,
        engine={
            "speculative": {
                "method": "draft",
                "model": str(tiny_model_dir),
                "num_tokens": 3,
                "disable_above_batch_size": 64,
            }
        },
        **common,
    )
    done = run_job(draft)
    assert done.status == "complete"
    for row in read_output(s3_server, draft.output.uri)[0].to_pylist():
        assert row["text"] == plain_rows[row["id"]]["text"]
    assert done.totals["spec_acceptance_rate"] > 0.9
