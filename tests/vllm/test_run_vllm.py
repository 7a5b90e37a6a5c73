"""`tokenmill run` of a small job with engine.kind vllm, as a user runs it (a subprocess with
its own local Ray): the job completes, every actor's books balance (rows + idle + load =
devices × lifetime, with vLLM's interval-based split), and the greedy texts equal the
reference engine's on the same job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.test_run import tokenmill
from tests.integration.test_cost_pipeline import check_books, read_rows

pytestmark = pytest.mark.vllm

NUM_ROWS = 24


def job(model: Path, prompts: Path, out: Path, kind: str) -> dict[str, Any]:
    engine: dict[str, Any] = {"kind": kind, "max_batch_size": 8, "kv_cache_tokens": 4096}
    if kind == "vllm":
        engine["extra"] = {"enforce_eager": True}  # start-up in seconds: no graph compile
    else:
        engine["device"] = "cpu"
    return {
        "name": f"vllm-e2e-{kind}",
        "input": {"uri": str(prompts), "format": "jsonl", "id_column": "id", "prompt_column": "p"},
        "model": {"path": str(model)},
        "engine": engine,
        "sampling": {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True},
        "resources": {"num_actors": 1, "cpus_per_actor": 0.5, "batch_size": 8, "max_in_flight": 8},
        "output": {"uri": str(out), "rows_per_file": 10},
        "cost": {"device_hour_usd": 3.5, "price_per_million": {"input": 0.5, "output": 2.0}},
    }


def test_a_job_on_vllm_completes_balances_and_matches_the_reference(tmp_path: Path) -> None:
    from engines.dev.tiny import make_tiny_model
    from engines.quantize.calibration import sample_text

    model = make_tiny_model(tmp_path / "llama", arch="llama", size="tiny-hd32")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"r{i:03d}", "p": s}) + "\n"
            for i, s in enumerate(sample_text(NUM_ROWS, seed=5))
        )
    )
    texts = {}
    for kind in ("vllm", "reference"):
        out = tmp_path / f"out-{kind}"
        job_file = tmp_path / f"{kind}.yaml"
        job_file.write_text(yaml.safe_dump(job(model, prompts, out, kind)))
        done = tokenmill("run", str(job_file), timeout=420)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert (out / "_SUCCESS").exists()
        check_books(out)
        rows = read_rows(out).to_pylist()
        assert sorted(r["id"] for r in rows) == [f"r{i:03d}" for i in range(NUM_ROWS)]
        assert all(r["finish_reason"] == "length" and r["completion_tokens"] == 12 for r in rows)
        assert {r["engine"] for r in rows} == {kind}
        assert all(r["gpu_seconds"] > 0 for r in rows)
        texts[kind] = {r["id"]: r["text"] for r in rows}
    assert texts["vllm"] == texts["reference"]
