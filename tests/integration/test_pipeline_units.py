"""Pure pieces of the run and generate stages, without Ray: the Ray connection choice, the CPU
headroom check, per-row sampling, output rows of one shard's rows, exit codes."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pytest

from engines.api import GenerationResult, RequestMetrics
from pipeline.batch.commit.parts import conform
from pipeline.batch.driver.cluster import ResourceError, check_cpu_headroom
from pipeline.batch.driver.run import RunResult
from pipeline.batch.session import ray_init_kwargs
from pipeline.batch.stages.generate import RowServer
from pipeline.batch.stages.prompts import prompt_pool_size
from pipeline.batch.stages.rows import GenerateConfig, RowOutcome, outcomes_to_table, row_sampling
from pipeline.batch.stages.schema import output_schema
from pipeline.spec import JobSpec, SamplingSpec, parse_job_spec


def _spec(**resources: object) -> JobSpec:
    return parse_job_spec(
        {
            "name": "units",
            "input": {
                "uri": "in.jsonl",
                "format": "jsonl",
                "prompt_column": "p",
                "passthrough_columns": ["user"],
            },
            "model": {"path": "m", "name": "tiny"},
            "sampling": {"max_tokens": 9, "stop": ["\n\n"], "seed": 5},
            "resources": resources,
            "output": {"uri": "out", "include_token_ids": True},
            "cost": {"device_hour_usd": 3.6, "price_per_million": {"input": 1.0, "output": 2.0}},
        }
    )


def test_ray_address_in_env_connects_else_a_private_local_ray() -> None:
    assert ray_init_kwargs({"RAY_ADDRESS": "ray://head:10001"}) == {"address": "ray://head:10001"}
    local = ray_init_kwargs({}, cpu_count=6)
    assert local["address"] == "local"  # never attaches to a cluster started by someone else
    assert local["num_cpus"] == 6
    assert local["object_store_memory"] <= 2 * 1024**3
    assert ray_init_kwargs({"RAY_ADDRESS": "  "}, cpu_count=2)["address"] == "local"


def test_cpu_headroom_refuses_a_pool_that_would_starve_the_prompt_actors() -> None:
    # Besides the engines: the prompt actors (1/4 CPU each).
    check_cpu_headroom(_spec(num_actors=2, cpus_per_actor=0.85), 2.0)
    check_cpu_headroom(_spec(num_actors=1, cpus_per_actor=1.75), 2.0)
    check_cpu_headroom(_spec(num_actors=8, cpus_per_actor=1), None)  # unknown: not checked
    with pytest.raises(ResourceError, match=r"resources.cpus_per_actor <= 0.88"):
        check_cpu_headroom(_spec(num_actors=2, cpus_per_actor=0.9), 2.0)
    with pytest.raises(ResourceError, match=r"resources.cpus_per_actor <= 0.62"):
        check_cpu_headroom(_spec(num_actors=2, cpus_per_actor=0.75, prompt_actors=3), 2.0)


def test_prompt_pool_is_one_tokenizer_per_four_engines_unless_set() -> None:
    assert prompt_pool_size(_spec(num_actors=1)) == 1
    assert prompt_pool_size(_spec(num_actors=4)) == 1
    assert prompt_pool_size(_spec(num_actors=9)) == 3
    assert prompt_pool_size(_spec(num_actors=None, min_actors=2, max_actors=16)) == 4
    assert prompt_pool_size(_spec(num_actors=16, prompt_actors=2)) == 2


def test_row_sampling_takes_row_columns_over_job_defaults() -> None:
    sampling = SamplingSpec(max_tokens=9, temperature=0.3, stop=["\n\n"], seed=5)
    params = row_sampling(
        {"id": "a", "max_tokens": 4, "temperature": None, "top_p": 0.5, "seed": 77}, sampling
    )
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (4, 0.3, 0.5, 77)
    assert params.stop == ("\n\n",)
    # without a seed column (no prompt stage), the seed is still derived from (seed, id)
    derived = row_sampling({"id": "a"}, sampling).seed
    assert derived is not None and derived == row_sampling({"id": "a"}, sampling).seed
    assert derived != row_sampling({"id": "b"}, sampling).seed
    with pytest.raises(ValueError, match="max_tokens"):
        row_sampling({"id": "a", "max_tokens": 0}, sampling)


def test_outcomes_table_keeps_order_and_fits_the_output_schema() -> None:
    spec = _spec()
    schema = output_schema([pa.field("user", pa.int64())], include_token_ids=True)
    config = GenerateConfig.from_spec(spec, schema)
    batch = pa.table(
        {
            "_row": pa.array([4, 9], pa.int64()),
            "id": ["x", "y"],
            "user": pa.array([7, 8], pa.int64()),
            "p": ["a", "b"],
        }
    )
    metrics = RequestMetrics(
        arrival_time=1.0, first_scheduled_time=1.5, first_token_time=2.0, finish_time=4.0
    )
    ok = RowOutcome.from_result(
        GenerationResult(
            "x#1",
            [5, 6],
            "hi",
            "length",
            prompt_tokens=3,
            completion_tokens=2,
            cached_prompt_tokens=1,
            metrics=metrics,
        ),
        gpu_seconds=2.0,
    )
    bad = RowOutcome.failed("empty prompt", prompt_tokens=0, served=False)
    table = outcomes_to_table(batch, [ok, bad], config, "actor-1", "reference")
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == ["x", "y"] and [r["user"] for r in rows] == [7, 8]
    assert [r["_row"] for r in rows] == [4, 9]  # the shard rows, for the part's record
    assert (rows[0]["queue_s"], rows[0]["ttft_s"], rows[0]["decode_s"], rows[0]["latency_s"]) == (
        0.5,
        1.0,
        2.0,
        3.0,
    )
    assert rows[0]["cost_usd"] == pytest.approx(2.0 * 3.6 / 3600)
    assert rows[0]["list_price_usd"] == pytest.approx((2 * 1.0 + 1 * 1.0 + 2 * 2.0) / 1e6)
    assert rows[0]["completion_token_ids"] == [5, 6] and rows[0]["actor_id"] == "actor-1"
    assert rows[1]["finish_reason"] == "error" and rows[1]["error"] == "empty prompt"
    assert rows[1]["actor_id"] is None and rows[1]["gpu_seconds"] == 0.0
    assert isinstance(rows[1]["finished_at"], dt.datetime)
    assert conform(table, schema).schema == schema


def test_exit_codes() -> None:
    def result(status: str, error_fraction: float) -> RunResult:
        return RunResult(
            status=status,  # type: ignore[arg-type]
            output_uri="o",
            message="",
            attempt=1,
            rows_written=1,
            parts_written=[],
            totals={"error_fraction": error_fraction},
            max_error_fraction=0.1,
        )

    assert result("complete", 0.1).exit_code == 0
    assert result("complete", 0.2).exit_code == 3
    assert result("already_complete", 0.2).exit_code == 3
    assert result("incomplete", 0.0).exit_code == 1


def test_a_row_that_raises_becomes_that_rows_error() -> None:
    outcome = RowServer.failure({"id": "r", "prompt_tokens": 4}, KeyError("meter"))
    assert outcome.finish_reason == "error" and "KeyError" in (outcome.error or "")
    assert outcome.prompt_tokens == 4
    with pytest.raises(KeyboardInterrupt):
        RowServer.failure({"id": "r"}, KeyboardInterrupt())


def test_demo_rows_vary_and_ids_are_unique() -> None:
    from pipeline.batch.driver.demo import DEMO_JOB, sample_rows

    rows = sample_rows(300)
    assert len({r["id"] for r in rows}) == 300
    assert len({r["max_tokens"] for r in rows}) >= 5
    assert len({r["prompt"] for r in rows}) > 250  # varied text
    assert sample_rows(20) == sample_rows(20)  # deterministic
    assert DEMO_JOB.is_file()
