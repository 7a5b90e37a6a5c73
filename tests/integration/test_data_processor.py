"""build_processor on a Ray Data Dataset read from the S3 server, with the reference engine.

The same rows and the same job file go through `tokenmill run` (in-process) and through the
processor: greedy texts, finish reasons, token counts and error messages must be equal, bad
rows must be error rows, and the engine actors' accounts must add up.

The pool autoscales from one engine actor to two. Ray Data starts `min_actors` (1) and adds
one when the pool's tasks in flight reach `actor_pool_util_upscaling_threshold` x its
concurrency; whether the new actor then gets rows would be a race with the first actor's
speed. The processor barrier hook (engines.faults) makes it certain: every batch waits
until two actors have one, so the first actor's batches pile up (utilization 2.0, above the
1.75 threshold) and the blocks it cannot take wait for the second.
"""

from __future__ import annotations

import io
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from engines import faults
from pipeline.batch.commit.parts import table_to_parquet
from pipeline.batch.driver.run import run_job
from pipeline.batch.stages.schema import RESULT_FIELDS
from pipeline.spec import JobSpec, SpecError
from pipeline.storage import filesystem_for
from tests.integration.s3_server import S3Server
from tests.integration.test_pipeline import make_spec

# The second engine actor's start-up is on the critical path (the barrier waits for it).
pytestmark = pytest.mark.timeout(600)

NUM_ROWS = 24
# Rows per Ray Data block and batch: 8 tasks, more than the 4 one actor holds at once
# (2 running, 2 queued), so blocks are left for the actor the autoscaler adds.
BATCH_ROWS = 3


def question(i: int) -> str:
    return f"Tell me about item {i} and the river."


@pytest.fixture(scope="module")
def data_context(ray_local: Any) -> Any:
    """Ray Data settings for tests: a hang is an error, no progress bars."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    saved = (ctx.execution_no_progress_timeout_s, ctx.enable_progress_bars)
    ctx.execution_no_progress_timeout_s = 240
    ctx.enable_progress_bars = False
    yield ctx
    ctx.execution_no_progress_timeout_s, ctx.enable_progress_bars = saved


@pytest.fixture(scope="module")
def job(
    data_context: Any, s3_server: S3Server, tiny_model_dir: Path, tmp_path_factory: Any
) -> tuple[JobSpec, Path, str]:
    """A Parquet file on S3 (good rows, a null prompt, a prompt too long), a job over it run
    to completion, and the job's YAML file."""
    bucket = s3_server.make_bucket()
    questions: list[str | None] = [question(i) for i in range(NUM_ROWS)]
    questions[5] = None  # empty prompt
    questions[9] = "river bucket " * 300  # above engine.max_model_len
    table = pa.table(
        {
            "qid": [f"q{i:03d}" for i in range(NUM_ROWS)],
            "question": pa.array(questions, pa.string()),
            "user": pa.array(range(NUM_ROWS), pa.int64()),
        }
    )
    source = f"s3://{bucket}/in/rows.parquet"
    s3_server.put(source, table_to_parquet(table))
    spec = make_spec(
        "processor-equality",
        {"uri": source, "format": "parquet", "id_column": "qid", "prompt_column": "question"},
        f"s3://{bucket}/out/",
        s3_server,
        tiny_model_dir,
        engine={"max_model_len": 256},
        # Autoscaling between one and two engine actors, small batches so there are several.
        resources={
            "num_actors": None,
            "min_actors": 1,
            "max_actors": 2,
            "batch_size": BATCH_ROWS,
        },
        limits={"max_error_fraction": 0.5},
    )
    result = run_job(spec)
    assert result.status == "complete"
    path = tmp_path_factory.mktemp("processor") / "job.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude={"date"})))
    return spec, path, source


def run_rows(s3_server: S3Server, spec: JobSpec) -> dict[str, dict[str, Any]]:
    """`tokenmill run`'s committed rows by id."""
    uris = [u for u in s3_server.list_uris(spec.output.uri) if "/part-" in u]
    tables = [pq.read_table(io.BytesIO(s3_server.get(u))) for u in uris]
    return {r["id"]: r for r in pa.concat_tables(tables).to_pylist()}


def read_s3_dataset(uri: str, spec: JobSpec) -> Any:
    import ray.data
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    fs, path = filesystem_for(uri, spec.storage)
    return ray.data.read_parquet(path, filesystem=PyFileSystem(FSSpecHandler(fs)))


@pytest.fixture(scope="module")
def processed(
    job: tuple[JobSpec, Path, str], s3_server: S3Server
) -> tuple[Any, list[dict[str, Any]]]:
    from pipeline.data import build_processor

    spec, path, source = job
    processor = build_processor(path)
    ds = read_s3_dataset(source, spec).repartition(NUM_ROWS // BATCH_ROWS)
    with pytest.MonkeyPatch.context() as env:
        # Read when the Dataset runs: the engine actors get the hook, later calls do not.
        env.setenv(faults.HOOKS_ENV, "1")
        env.setenv(faults.PROCESSOR_BARRIER_ENV, "2")
        return processor, processor(ds).take_all()


def test_texts_equal_tokenmill_run_on_the_same_rows(
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
    # The Dataset's own columns stay; the result columns are `tokenmill run`'s.
    first = rows[0]
    assert {"qid", "question", "user"} <= set(first)
    assert {f.name for f in RESULT_FIELDS} <= set(first)
    assert all(r["model"] == "tiny" and r["engine"] == "reference" for r in rows)


def test_bad_rows_are_error_rows(processed: tuple[Any, list[dict[str, Any]]]) -> None:
    _, rows = processed
    errors = {r["id"]: r for r in rows if r["finish_reason"] == "error"}
    assert sorted(errors) == ["q005", "q009"]
    assert errors["q005"]["error"] == "empty prompt"
    assert "context length 256" in errors["q009"]["error"]
    assert all(e["text"] == "" and e["actor_id"] is None for e in errors.values())
    ok = [r for r in rows if r["finish_reason"] != "error"]
    assert all(r["gpu_seconds"] > 0 and r["cost_usd"] > 0 for r in ok)


def test_accounts_add_up(processed: tuple[Any, list[dict[str, Any]]]) -> None:
    processor, rows = processed
    accounts = processor.accounts()
    assert len(accounts) == 2, accounts
    for account in accounts:
        parts = account.attributed_s + account.pending_s + account.idle_s + account.load_s
        assert parts == pytest.approx(account.total_s, rel=1e-6, abs=1e-6)
        assert account.load_s > 0 and account.pending_s == pytest.approx(0.0, abs=1e-9)
    served = [r for r in rows if r["actor_id"] is not None]
    assert sum(a.num_rows for a in accounts) == len(served) == NUM_ROWS - 2
    assert sum(a.attributed_s for a in accounts) == pytest.approx(
        sum(r["gpu_seconds"] for r in served), rel=1e-6
    )
    assert {r["actor_id"] for r in served} <= {a.actor_id for a in accounts}


def test_the_pool_grows_from_one_actor_to_two(processed: tuple[Any, list[dict[str, Any]]]) -> None:
    processor, rows = processed
    accounts = processor.accounts()
    # Two engine actors served rows, and each one's account has exactly the rows it served.
    per_actor = Counter(r["actor_id"] for r in rows if r["actor_id"] is not None)
    assert len(per_actor) == 2, per_actor
    assert {a.actor_id: a.num_rows for a in accounts} == dict(per_actor)
    # The pool started with one (min_actors): the second actor's constructor began only after
    # the first actor had a batch, i.e. the autoscaler added it once the first was busy.
    (first_start, first_batch), (second_start, _) = sorted(processor.arrivals().values())
    assert first_start < first_batch < second_start


def test_a_missing_column_makes_error_rows_not_a_failed_dataset(
    job: tuple[JobSpec, Path, str], processed: tuple[Any, list[dict[str, Any]]]
) -> None:
    import ray.data

    processor, _ = processed
    ds = ray.data.from_items([{"qid": "a", "prompt": "hello"}, {"qid": "b", "prompt": "hi"}])
    rows = processor(ds).take_all()
    assert [r["finish_reason"] for r in rows] == ["error", "error"]
    assert all("'question' (input.prompt_column) not found" in r["error"] for r in rows)
    assert [r["prompt"] for r in rows] == ["hello", "hi"]  # the Dataset's columns stay


def test_preprocess_and_postprocess_rows(
    job: tuple[JobSpec, Path, str], processed: tuple[Any, list[dict[str, Any]]]
) -> None:
    import ray.data

    from pipeline.data import build_processor

    spec, _, _ = job
    _, reference = processed
    want = {r["id"]: r["text"] for r in reference}
    processor = build_processor(
        {
            "input": {"id_column": "qid", "prompt_column": "question"},
            "model": spec.model,
            "engine": spec.engine,
            "sampling": spec.sampling,
            "resources": {"cpus_per_actor": 0.25, "batch_size": 4},
            "cost": spec.cost,
        },
        preprocess=lambda row: {"qid": row["key"], "question": row["q"]},
        postprocess=lambda row: {"id": row["id"], "answer": row["text"]},
    )
    ds = ray.data.from_items([{"key": "q001", "q": question(1)}, {"key": "z", "q": "Hi"}])
    rows = {r["id"]: r for r in processor(ds).take_all()}
    assert set(rows["q001"]) == {"id", "answer"}
    assert rows["q001"]["answer"] == want["q001"]


def test_invalid_config_is_refused_before_any_actor(tiny_model_dir: Path) -> None:
    from pipeline.data import build_processor

    with pytest.raises(SpecError, match=r"engine\.kinds"):
        build_processor({"model": {"path": str(tiny_model_dir)}, "engine": {"kinds": "x"}})
    with pytest.raises(SpecError, match="no prompt source"):
        build_processor({"model": {"path": str(tiny_model_dir)}})
