"""A batch job's metrics as Prometheus scrapes them from a real local Ray.

The job runs in a subprocess with its own local Ray, started with a known metrics export
port (and a 1 s metrics report interval, so the test waits seconds, not tens of seconds); the
test scrapes the node's Prometheus endpoint over HTTP while the job runs and after it ends
(the driver keeps its Ray up until the test closes its stdin) and checks the job's series:
rows equal to the input rows, tokens and USD equal to the manifest totals, every shard
committed, a commit latency per part, and a busy fraction from the engine actor.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from pipeline.batch.metrics import PROMETHEUS_NAMES
from tests.e2e.test_run import base_job, cli_env, model_dir, write_job  # noqa: F401

ROWS = 30  # ~1.3 KB of JSONL: two shards of input.shard_bytes 1024
# Bounded waits, each named for what it waits for.
METRICS_DEADLINE_S = 150.0  # the whole run and the final values; ~40 s on an idle 2-core machine
SCRAPE_EVERY_S = 0.5

DRIVER = """
import json, logging, sys, yaml, ray
from pipeline.batch.driver.run import run_job
from pipeline.spec import parse_job_spec

logging.basicConfig(level=logging.INFO, format="%(message)s")
spec = parse_job_spec(yaml.safe_load(open(sys.argv[1])))
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
         object_store_memory=200 * 1024**2, _metrics_export_port=int(sys.argv[2]))
result = run_job(spec, progress_interval_s=1.0)
print("RESULT " + json.dumps({"status": result.status, "totals": result.totals}), flush=True)
sys.stdin.read()  # Ray, and the driver's metrics with it, stay up until the test is done
ray.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(port: int, job: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """tokenmill series of `job` on the endpoint: name -> [(labels, value)]."""
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("ray_tokenmill_") and sample.labels.get("job") == job:
                found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def total(series: dict[str, list[tuple[dict[str, str], float]]], name: str, **match: str) -> float:
    return sum(
        v for labels, v in series.get(name, []) if all(labels.get(k) == x for k, x in match.items())
    )


@pytest.mark.timeout(240)
def test_job_metrics_reach_prometheus(tmp_path: Path, model_dir: Path) -> None:  # noqa: F811
    from engines import faults

    job = base_job(tmp_path, model_dir, rows=ROWS)
    job["name"] = "metrics-e2e"
    job["input"]["shard_bytes"] = 1024  # the smallest allowed: several shards
    job["output"]["flush_interval_s"] = 0.5
    job["cost"] = {"device_hour_usd": 1.0, "price_per_million": {"input": 1.0, "output": 2.0}}
    path = write_job(tmp_path / "job.yaml", job)
    port = _free_port()
    env = {
        **cli_env(),
        # Steps slow enough that the engine is busy for a few busy-gauge windows.
        **faults.step_delay_env(0.15),
        "RAY_metrics_report_interval_ms": "1000",
        # Plain torch ops: no wait on the machine-wide CPU kernel build (and its lock).
        "TOKENMILL_CPU_KERNELS": "0",
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(path), str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()
    busy_seen: list[float] = []
    result: dict[str, Any] | None = None
    num_shards = num_parts = -1  # known from the manifest once the run ends
    series: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        deadline = time.monotonic() + METRICS_DEADLINE_S
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the driver ended early:\n" + "".join(lines)[-6000:]
            try:
                series = scrape(port, "metrics-e2e")
            except requests.RequestException:
                series = {}  # the endpoint is not up yet
            busy_seen += [v for _, v in series.get("ray_tokenmill_batch_engine_busy_fraction", [])]
            if result is None:
                done = [line for line in lines if line.startswith("RESULT ")]
                result = json.loads(done[0][len("RESULT ") :]) if done else None
                if result is not None:
                    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
                    num_shards = len(manifest["shards"])
                    num_parts = len(manifest["parts"])
            if result is not None and (
                total(series, "ray_tokenmill_batch_rows_total") >= result["totals"]["rows"]
                and total(series, "ray_tokenmill_batch_commit_latency_seconds_count") == num_parts
                and total(series, "ray_tokenmill_batch_shards", state="committed") == num_shards
            ):
                break
            time.sleep(SCRAPE_EVERY_S)
        else:
            pytest.fail(
                f"the job's final metrics were not on the endpoint within {METRICS_DEADLINE_S}s;"
                f" last scrape: {sorted(series)}\n" + "".join(lines)[-6000:]
            )
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    assert result["status"] == "complete"
    totals = result["totals"]
    assert totals["rows"] == ROWS
    assert set(series) <= PROMETHEUS_NAMES, "a series the code does not define"
    assert total(series, "ray_tokenmill_batch_rows_total") == ROWS
    assert total(series, "ray_tokenmill_batch_error_rows_total") == totals["rows_error"]
    assert total(series, "ray_tokenmill_batch_prompt_tokens_total") == totals["prompt_tokens"]
    assert (
        total(series, "ray_tokenmill_batch_completion_tokens_total")
        == totals["completion_tokens"]
        > 0
    )
    assert total(series, "ray_tokenmill_batch_cost_usd_total") == pytest.approx(totals["rows_usd"])
    assert totals["rows_usd"] > 0
    assert num_shards >= 2  # the plan has several shards, all committed (the loop's condition)
    assert total(series, "ray_tokenmill_batch_shards", state="queued") == 0
    assert total(series, "ray_tokenmill_batch_shards", state="running") == 0
    # One latency per committed part (the loop's condition), each within the run.
    assert num_parts >= num_shards
    latency_s = total(series, "ray_tokenmill_batch_commit_latency_seconds_sum")
    assert 0 <= latency_s < 60 * num_parts
    # The engine actor reported a busy share; with rows in flight most of the time, above 0.
    assert busy_seen, "no busy fraction was scraped while the engine actor lived"
    assert all(0.0 <= b <= 1.0 for b in busy_seen) and max(busy_seen) > 0.0
    runs = {labels["run_id"] for labels, _ in series["ray_tokenmill_batch_rows_total"]}
    assert len(runs) == 1 and runs != {""}
    # JSONL: the progress line has a total (estimated from bytes, then exact), never "?".
    progress = [line for line in lines if line.startswith("rows ")]
    assert progress and all(re.match(r"rows \d+/~?\d+ ", line) for line in progress)
    assert progress[-1].startswith(f"rows {ROWS}/{ROWS} (100%)")
