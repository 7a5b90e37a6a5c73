"""`tokenmill run` of a `task: embed` job, as a user runs it: every row gets an `embedding`
(list<float32>, unit length by default), a row too long for the model is an error row, and
the manifest counts prompt tokens. The 10,000-row run is marked slow (`-m slow`); it prints
rows/s and prompt tokens/s."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow as pa
import pytest

from tests.e2e.test_run import base_job, committed, model_dir, tokenmill, write_job

pytestmark = pytest.mark.timeout(900)

__all__ = ["model_dir"]  # the module fixture, shared

MAX_MODEL_LEN = 128


def _embed_job(tmp_path: Path, model: Path, rows: int) -> dict:
    job = base_job(tmp_path, model, rows=rows)
    src = Path(job["input"]["uri"])
    lines = src.read_text().splitlines()
    # Row r001 repeats r000's prompt (equal embeddings); the last is too long (an error row).
    first = json.loads(lines[0])
    lines[1] = json.dumps({"id": "r001", "p": first["p"]})
    lines[-1] = json.dumps({"id": lines and json.loads(lines[-1])["id"], "p": "river " * 400})
    src.write_text("\n".join(lines) + "\n")
    job["task"] = "embed"
    job["prompt"] = {"chat_template": False}
    job["sampling"] = {}
    job["engine"] = {
        "kind": "reference",
        "device": "cpu",
        "max_batch_size": 64,
        "max_num_tokens": 1024,
        "max_model_len": MAX_MODEL_LEN,
    }
    job["resources"] = {
        "num_actors": 1,
        "cpus_per_actor": 1,
        "batch_size": 128,
        "max_in_flight": 256,
    }
    job["output"]["rows_per_file"] = 1000
    return job


def _check(out: Path, rows: int) -> pa.Table:
    table = committed(out)
    assert table.num_rows == rows
    assert table.schema.field("embedding").type == pa.list_(pa.float32())
    ok = table.filter(pa.compute.equal(table["finish_reason"], "stop"))
    errors = table.filter(pa.compute.equal(table["finish_reason"], "error"))
    assert errors.num_rows == 1 and "max_model_len" in errors["error"][0].as_py()
    assert errors["embedding"][0].as_py() is None
    assert ok.num_rows == rows - 1
    vectors = ok["embedding"].to_pylist()
    assert len({len(v) for v in vectors}) == 1
    assert all(abs(sum(x * x for x in v) ** 0.5 - 1) < 1e-4 for v in vectors)
    by_id = dict(zip(ok["id"].to_pylist(), vectors, strict=True))
    assert by_id["r000"] == by_id["r001"]
    assert set(ok["text"].to_pylist()) == {""}
    assert set(ok["completion_tokens"].to_pylist()) == {0}
    assert min(ok["prompt_tokens"].to_pylist()) > 0
    assert min(ok["gpu_seconds"].to_pylist()) > 0
    return table


def _run(tmp_path: Path, model_dir: Path, rows: int, timeout: float) -> tuple[pa.Table, float]:
    job = _embed_job(tmp_path, model_dir, rows)
    path = write_job(tmp_path / "job.yaml", job)
    started = time.monotonic()
    proc = tokenmill("run", str(path), timeout=timeout)
    seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = Path(job["output"]["uri"])
    table = _check(out, rows)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["totals"]["rows"] == rows and manifest["totals"]["rows_error"] == 1
    assert manifest["totals"]["prompt_tokens_per_s"] > 0
    assert "prompt tokens/s" in proc.stdout + proc.stderr
    return table, seconds


# Slow (55 s): by default a real embed job runs in tests/e2e/test_batch_api_embeddings.py, and
# the engine's embeddings equal transformers' in tests/integration/test_reference_embed.py.
@pytest.mark.slow
def test_embed_job_end_to_end(tmp_path: Path, model_dir: Path) -> None:
    _run(tmp_path, model_dir, 300, timeout=600)


def test_embed_job_refuses_other_engines(tmp_path: Path, model_dir: Path) -> None:
    job = _embed_job(tmp_path, model_dir, 4)
    job["engine"] = {"kind": "vllm"}
    proc = tokenmill("run", str(write_job(tmp_path / "job.yaml", job)), timeout=120)
    assert proc.returncode != 0 and "task embed" in proc.stderr


@pytest.mark.slow
def test_embed_job_10k_rows(tmp_path: Path, model_dir: Path) -> None:
    rows = 10_000
    table, seconds = _run(tmp_path, model_dir, rows, timeout=880)
    tokens = sum(table["prompt_tokens"].to_pylist())
    print(
        f"\nembed job: {rows} rows, {tokens} prompt tokens in {seconds:.1f} s (whole run, Ray "
        f"start included): {rows / seconds:.0f} rows/s, {tokens / seconds:.0f} prompt tokens/s"
    )
