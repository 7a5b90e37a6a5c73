"""build_processor with engine.kind vllm on a Ray Data Dataset read from the S3 server.

The same rows and job go through `tokenmill run` (in-process, the same engine kind) and through
the processor: greedy texts, finish reasons, token counts and error messages must be equal,
the bad rows (a null prompt, a prompt above the context) must be error rows, and the engine
actor's account must add up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import yaml

from pipeline.batch.commit.parts import table_to_parquet
from pipeline.batch.driver.run import run_job
from pipeline.spec import JobSpec
from tests.integration.s3_server import S3Server
from tests.integration.test_data_processor import read_s3_dataset, run_rows
from tests.integration.test_pipeline import make_spec

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

NUM_ROWS = 16
NULL_PROMPT, TOO_LONG = 3, 7  # row positions of the bad rows


@pytest.fixture(scope="module")
def job(
    ray_local: Any, s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory
) -> tuple[JobSpec, Path, str]:
    """A Parquet file on S3 with good and bad rows, a vllm job over it run to completion, and
    the job's YAML file."""
    import ray.data

    from engines.dev.tiny import make_tiny_model
    from engines.quantize.calibration import sample_text

    ctx = ray.data.DataContext.get_current()
    ctx.execution_no_progress_timeout_s = 300  # a hang is an error
    ctx.enable_progress_bars = False
    work = tmp_path_factory.mktemp("processor-vllm")
    model = make_tiny_model(work / "llama", arch="llama", size="tiny-hd32")
    prompts: list[str | None] = list(sample_text(NUM_ROWS, seed=5))
    prompts[NULL_PROMPT] = None
    prompts[TOO_LONG] = "river bucket " * 300  # above engine.max_model_len
    table = pa.table(
        {
            "qid": [f"q{i:03d}" for i in range(NUM_ROWS)],
            "question": pa.array(prompts, pa.string()),
        }
    )
    bucket = s3_server.make_bucket()
    source = f"s3://{bucket}/in/rows.parquet"
    s3_server.put(source, table_to_parquet(table))
    spec = make_spec(
        "processor-vllm",
        {"uri": source, "format": "parquet", "id_column": "qid", "prompt_column": "question"},
        f"s3://{bucket}/out/",
        s3_server,
        Path(model),
        engine={
            "kind": "vllm",
            "device": "auto",  # the reference engine's setting; vLLM picks its platform
            "max_batch_size": 8,
            "kv_cache_tokens": 4096,
            "max_model_len": 256,
            "extra": {"enforce_eager": True},  # start-up in seconds: no graph compile
        },
        sampling={"max_tokens": 8, "temperature": 0.0, "ignore_eos": True},
        # One vLLM engine at a time: two on two cores only slow the test down.
        resources={"num_actors": 1, "cpus_per_actor": 0.5, "batch_size": 4, "max_in_flight": 8},
        limits={"max_error_fraction": 0.5},
    )
    result = run_job(spec)
    assert result.status == "complete"
    path = work / "job.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude={"date"})))
    return spec, path, source


@pytest.fixture(scope="module")
def processed(job: tuple[JobSpec, Path, str]) -> tuple[Any, list[dict[str, Any]]]:
    from pipeline.data import build_processor

    spec, path, source = job
    processor = build_processor(path)
    ds = read_s3_dataset(source, spec).repartition(4)
    return processor, processor(ds).take_all()


def test_texts_equal_tokenmill_run_with_vllm(
    job: tuple[JobSpec, Path, str], processed: tuple[Any, list[dict[str, Any]]], s3_server: S3Server
) -> None:
    spec, _, _ = job
    _, rows = processed
    expected = run_rows(s3_server, spec)
    got = {r["id"]: r for r in rows}
    assert sorted(got) == sorted(expected) and len(rows) == NUM_ROWS
    for row_id, want in expected.items():
        row = got[row_id]
        for column in ("text", "finish_reason", "error", "prompt_tokens", "completion_tokens"):
            assert row[column] == want[column], (row_id, column)
    served = [r for r in rows if r["finish_reason"] != "error"]
    assert len(served) == NUM_ROWS - 2
    assert all(r["engine"] == "vllm" and r["completion_tokens"] == 8 for r in served)
    assert all(r["text"] for r in served)


def test_bad_rows_are_error_rows(processed: tuple[Any, list[dict[str, Any]]]) -> None:
    _, rows = processed
    errors = {r["id"]: r for r in rows if r["finish_reason"] == "error"}
    assert sorted(errors) == [f"q{NULL_PROMPT:03d}", f"q{TOO_LONG:03d}"]
    assert errors[f"q{NULL_PROMPT:03d}"]["error"] == "empty prompt"
    assert "context length 256" in errors[f"q{TOO_LONG:03d}"]["error"]
    assert all(e["text"] == "" and e["actor_id"] is None for e in errors.values())


def test_accounts_add_up(processed: tuple[Any, list[dict[str, Any]]]) -> None:
    processor, rows = processed
    accounts = processor.accounts()
    assert len(accounts) == 1, accounts
    (account,) = accounts
    assert not account.has_step_records  # vLLM: the interval-based split
    parts = account.attributed_s + account.pending_s + account.idle_s + account.load_s
    assert parts == pytest.approx(account.total_s, rel=1e-6, abs=1e-6)
    assert account.load_s > 0 and account.pending_s == pytest.approx(0.0, abs=1e-9)
    served = [r for r in rows if r["actor_id"] is not None]
    assert account.num_rows == len(served) == NUM_ROWS - 2
    assert account.attributed_s == pytest.approx(sum(r["gpu_seconds"] for r in served), rel=1e-6)
    assert all(r["gpu_seconds"] > 0 and r["cost_usd"] > 0 for r in served)
    assert {r["actor_id"] for r in served} == {account.actor_id}
