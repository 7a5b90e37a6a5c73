"""`tokenmill validate` and `tokenmill plan` on local files (no Ray, no network)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from pipeline.cli import app


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.dev.tiny import train_tokenizer

    path = tmp_path_factory.mktemp("cli-model")
    train_tokenizer(512).save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    return path


def write_job(tmp_path: Path, model_dir: Path, **changes: Any) -> Path:
    inputs = tmp_path / "in"
    inputs.mkdir(exist_ok=True)
    lines = [json.dumps({"q": f"question {i}"}) for i in range(30)]
    lines += ["{broken", json.dumps({"q": "river " * 200})]
    (inputs / "a.jsonl").write_text("\n".join(lines[:20]) + "\n")
    (inputs / "b.jsonl").write_text("\n".join(lines[20:]) + "\n")
    job: dict[str, Any] = {
        "name": "cli-job",
        "input": {"uri": str(inputs / "*.jsonl"), "format": "jsonl", "prompt_column": "q"},
        "model": {"path": str(model_dir)},
        "sampling": {"max_tokens": 10},
        "output": {"uri": str(tmp_path / "out" / "{{ date }}")},
        "cost": {"device_hour_usd": 3.6},
    }
    for key, value in changes.items():
        job[key] = {**job.get(key, {}), **value}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def run(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def test_validate_ok(tmp_path: Path, model_dir: Path) -> None:
    job = write_job(tmp_path, model_dir)
    result = run("validate", str(job), "--date", "2026-04-05")
    assert result.exit_code == 0, result.output
    assert "ok: job cli-job (date 2026-04-05)" in result.output


def test_validate_reports_field_and_allowed_values(tmp_path: Path, model_dir: Path) -> None:
    job = write_job(tmp_path, model_dir)
    result = run("validate", str(job), "--set", "engine.kind=sglang")
    assert result.exit_code == 1
    expected = (
        "engine.kind: Input should be 'reference', 'trtllm', 'vllm' or 'synthetic' (got 'sglang')"
    )
    assert expected in result.output


@pytest.mark.parametrize("column", ["actor_id", "finished_at"])
def test_validate_refuses_an_output_column_as_passthrough(
    tmp_path: Path, model_dir: Path, column: str
) -> None:
    job = write_job(tmp_path, model_dir, input={"passthrough_columns": [column]})
    result = run("validate", str(job))
    assert result.exit_code != 0, result.output
    assert f"input.passthrough_columns: [{column!r}] are written by the pipeline" in result.output


def test_validate_check_storage_lists_inputs(tmp_path: Path, model_dir: Path) -> None:
    job = write_job(tmp_path, model_dir)
    result = run("validate", str(job), "--check-storage")
    assert result.exit_code == 0, result.output
    assert "a.jsonl" in result.output and "b.jsonl" in result.output
    assert "ok: job cli-job (2 input file(s))" in result.output


def test_validate_check_storage_missing_input(tmp_path: Path, model_dir: Path) -> None:
    job = write_job(tmp_path, model_dir)
    result = run("validate", str(job), "--check-storage", "--set", "input.uri=/nowhere/*.jsonl")
    assert result.exit_code == 1
    assert "input.uri: no input file matches '/nowhere/*.jsonl'" in result.output


def test_validate_check_storage_bad_model_dir(tmp_path: Path, model_dir: Path) -> None:
    job = write_job(tmp_path, model_dir, model={"path": str(tmp_path)})
    result = run("validate", str(job), "--check-storage")
    assert result.exit_code == 1
    assert f"model.path: {tmp_path} has no config.json" in result.output


def test_plan_counts_errors_and_estimates(tmp_path: Path, model_dir: Path) -> None:
    job = write_job(tmp_path, model_dir)
    result = run("plan", str(job), "--tokens-per-s", "20", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["num_files"] == 2 and plan["num_rows"] == 32
    assert plan["sample_rows"] == 32
    assert plan["sample_errors"] == 2 and plan["sample_too_long"] == 1
    assert plan["context_length"] == 64
    assert plan["est_ok_rows"] == 30 and plan["est_output_tokens_max"] == 300
    assert plan["est_wall_s"] == pytest.approx(300 / 20)
    assert plan["tokens_per_s_source"] == "--tokens-per-s"
    if plan["cost"] is not None:  # pipeline.cost.estimate_cost present
        assert plan["cost"]["usd"] == pytest.approx(3.6 * 15 / 3600)


def test_plan_extrapolates_from_a_sample(tmp_path: Path, model_dir: Path) -> None:
    job = write_job(tmp_path, model_dir, engine={"expected_tokens_per_s": 100.0})
    result = run("plan", str(job), "--sample-rows", "10", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["sample_rows"] == 10 and plan["num_rows"] == 32
    # the first 10 rows are all fine: 10 x 10 max_tokens, scaled by 32/10
    assert plan["est_output_tokens_max"] == 320
    assert plan["tokens_per_s_source"] == "engine.expected_tokens_per_s"


def test_plan_text_output(tmp_path: Path, model_dir: Path) -> None:
    job = write_job(tmp_path, model_dir)
    result = run("plan", str(job))
    assert result.exit_code == 0, result.output
    assert "32 rows" in result.output
    assert "2 error row(s)" in result.output and "not valid JSON" in result.output
    assert "time        unknown" in result.output


def test_plan_warns_about_duplicate_ids(tmp_path: Path, model_dir: Path) -> None:
    data = tmp_path / "dup.jsonl"
    data.write_text("\n".join(json.dumps({"k": k, "q": "hello"}) for k in ["a", "b", "a"]))
    job = write_job(tmp_path, model_dir, input={"uri": str(data), "id_column": "k"})
    result = run("plan", str(job))
    assert result.exit_code == 0, result.output
    assert "1 duplicate id(s) in the sample" in result.output


@pytest.mark.slow
def test_plan_measure_runs_the_engine(tmp_path: Path) -> None:
    from engines.dev.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "model", arch="llama")
    job = write_job(tmp_path, model, engine={"device": "cpu", "kv_cache_tokens": 4096})
    result = run("plan", str(job), "--measure", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["tokens_per_s_source"] == "measured"
    assert plan["tokens_per_s"] > 0 and plan["est_wall_s"] > 0


def test_count_job_rows_estimates_big_jsonl_inputs(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.batch.driver import plan as plan_module
    from pipeline.spec import load_job_spec
    from pipeline.storage import list_input_files

    folder = tmp_path / "many"
    folder.mkdir()
    for part in range(3):
        lines = [json.dumps({"q": f"row {part}-{i:03d}"}) for i in range(10)]
        (folder / f"part-{part}.jsonl").write_text("\n".join(lines) + "\n")
    job = write_job(tmp_path, model_dir, input={"uri": str(folder)})
    spec = load_job_spec(job)
    files = list_input_files(spec)
    assert plan_module.count_job_rows(spec, files) == (30, True)

    # Budget for one file: the first is counted, the other two estimated from its bytes/row.
    monkeypatch.setattr(plan_module, "EXACT_COUNT_BYTES", files[0].size)
    assert plan_module.count_job_rows(spec, files) == (30, False)
    # Budget smaller than any file: estimated from the first lines of the first file.
    monkeypatch.setattr(plan_module, "EXACT_COUNT_BYTES", 10)
    assert plan_module.count_job_rows(spec, files) == (30, False)

    limited = load_job_spec(job, overrides=["input.limit=12"])
    monkeypatch.setattr(plan_module, "EXACT_COUNT_BYTES", files[0].size * 2)
    assert plan_module.count_job_rows(limited, files) == (12, True)


def test_plan_reads_a_column_whose_type_differs_between_files(
    tmp_path: Path, model_dir: Path
) -> None:
    """A passthrough column of numbers in one file and text in the next (and an id too large
    for int64): the run fixes one type for them; the plan's sample must read them too."""
    job = write_job(tmp_path, model_dir, input={"passthrough_columns": ["tag", "big"]})
    inputs = tmp_path / "in"
    first = [json.dumps({"q": f"question {i}", "tag": i, "big": 2**63 + i}) for i in range(3)]
    second = [json.dumps({"q": f"question {i}", "tag": f"t{i}", "big": i}) for i in range(3)]
    (inputs / "a.jsonl").write_text("\n".join(first) + "\n")
    (inputs / "b.jsonl").write_text("\n".join(second) + "\n")
    result = run("plan", str(job), "--tokens-per-s", "20", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["sample_rows"] == 6


def test_a_json_number_past_int64_is_inferred_as_text() -> None:
    import pyarrow as pa

    from pipeline.batch.stages.schema import infer_type

    assert infer_type([1, 2**63]) == pa.string()
    assert infer_type([1, 2]) == pa.int64()
