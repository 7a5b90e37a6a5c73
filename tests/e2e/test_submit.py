"""`tokenmill submit` end to end: a real `ray start --head` with token auth on loopback, the
nightly command (the same argv the Kubernetes CronJob runs, from pipeline.submit's template)
submitting a tiny-model job through the Ray Jobs API, the output committed, a second
submission of the same night not run again, and a failing job giving a non-zero exit.

The head runs on its own ports and temp dir because other local Ray instances may be running;
it is stopped by signalling the `ray start --block` process and its process group (never with
`ray stop`, which would stop every Ray instance on the machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.spec import load_job_spec
from pipeline.submit import base_submission_id, nightly_submit_argv
from tests.e2e.ray_head import RayHead

pytestmark = pytest.mark.timeout(420)

VENV_BIN = Path(sys.executable).parent
DATE = "2026-11-28"
NUM_ROWS = 6
# A job that needs longer than this on an idle 2-core machine is hung, not slow.
SUBMIT_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.dev.tiny import make_tiny_model
    from engines.quantize.calibration import sample_text

    root = tmp_path_factory.mktemp("submit-e2e")
    model = make_tiny_model(root / "model", arch="llama")
    inputs = root / "in" / DATE
    inputs.mkdir(parents=True)
    rows = [{"id": f"row-{i}", "prompt": text} for i, text in enumerate(sample_text(NUM_ROWS))]
    (inputs / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # `{{ date }}` in both paths, as in jobs/nightly.yaml.
    (root / "nightly.yaml").write_text(
        f"""\
name: e2e-submit
input:
  uri: {root}/in/{{{{ date }}}}/prompts.jsonl
  format: jsonl
  id_column: id
  prompt_column: prompt
model:
  path: {model}
engine:
  kind: reference
  device: cpu
  max_batch_size: 8
sampling:
  max_tokens: 6
resources:
  num_actors: 1
  cpus_per_actor: 0.5
  batch_size: 4
  max_in_flight: 8
output:
  uri: {root}/out/{{{{ date }}}}
"""
    )
    return root


def _submit(head: RayHead, argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, env=head.env, capture_output=True, text=True, timeout=SUBMIT_TIMEOUT_S
    )


def _jobs_with_prefix(head: RayHead, prefix: str) -> dict[str, str]:
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(head.address, headers={"Authorization": f"Bearer {head.token}"})
    return {
        job.submission_id: str(job.status)
        for job in client.list_jobs()
        if job.submission_id and job.submission_id.startswith(prefix)
    }


def test_nightly_submit_runs_once_and_commits_the_output(ray_head: RayHead, job_dir: Path) -> None:
    job_file = job_dir / "nightly.yaml"
    argv = nightly_submit_argv(str(job_file), ray_head.address, DATE)
    started = time.monotonic()
    first = _submit(ray_head, argv)
    print(f"first submission: {time.monotonic() - started:.1f} s")
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]

    output = job_dir / "out" / DATE
    assert (output / "_SUCCESS").is_file(), sorted(p.name for p in output.iterdir())
    parts = sorted(output.glob("part-*.parquet"))
    ids = [
        i for part in parts for i in pq.read_table(part, columns=["id"]).column("id").to_pylist()
    ]
    assert sorted(ids) == sorted(f"row-{i}" for i in range(NUM_ROWS))

    base_id = base_submission_id(load_job_spec(job_file, date=DATE))
    assert base_id in first.stdout
    # The driver joined this head through RAY_ADDRESS (set by the Jobs API), not a private Ray.
    assert "Connected to Ray cluster" in first.stdout
    assert "Started a local Ray instance" not in first.stdout

    # The same night again: reported, not run a second time.
    second = _submit(ray_head, argv)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "already SUCCEEDED" in second.stdout
    assert _jobs_with_prefix(ray_head, base_id) == {base_id: "SUCCEEDED"}


def test_failing_job_exits_non_zero(ray_head: RayHead, job_dir: Path) -> None:
    broken = job_dir / "broken.yaml"
    text = (job_dir / "nightly.yaml").read_text()
    # Valid as a spec (so it is submitted), fails in the cluster: the model is not there.
    broken.write_text(
        text.replace("name: e2e-submit", "name: e2e-broken").replace(
            "path: ", f"path: {job_dir}/no-such-model  # was: ", 1
        )
    )
    argv = nightly_submit_argv(str(broken), ray_head.address, DATE)
    result = _submit(ray_head, argv)
    assert result.returncode != 0, result.stdout[-3000:]
    base_id = base_submission_id(load_job_spec(broken, date=DATE))
    assert _jobs_with_prefix(ray_head, base_id) == {base_id: "FAILED"}


def test_wrong_token_is_refused_with_exit_4(ray_head: RayHead, job_dir: Path) -> None:
    env = dict(ray_head.env, RAY_AUTH_TOKEN="not-the-token")
    argv = nightly_submit_argv(str(job_dir / "nightly.yaml"), ray_head.address, DATE)
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 4, result.stdout + result.stderr
    assert "token" in result.stderr.lower()
