"""`tokenmill submit` end to end: a real `ray start --head` with token auth on loopback, the
nightly command (the same argv the Kubernetes CronJob runs, from pipeline.submit's template)
submitting a tiny-model job through the Ray Jobs API, the output committed, a second
submission of the same night not run again, and a failing job giving a non-zero exit.

The head runs on its own ports and temp dir because other local Ray instances may be running;
it is stopped by signalling the `ray start --block` process and its process group (never with
`ray stop`, which would stop every Ray instance on the machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import requests

from pipeline.spec import load_job_spec
from pipeline.submit import base_submission_id, nightly_submit_argv

pytestmark = pytest.mark.timeout(420)

VENV_BIN = Path(sys.executable).parent
DATE = "2026-11-28"
NUM_ROWS = 6
# A job that needs longer than this on an idle 2-core machine is hung, not slow.
SUBMIT_TIMEOUT_S = 240


@dataclass(frozen=True)
class RayHead:
    address: str  # Jobs API URL, http://127.0.0.1:<dashboard port>
    env: dict[str, str]  # environment for client processes (token path, venv on PATH)
    token: str
    gcs_address: str = ""  # 127.0.0.1:<port>: what a driver joining the head gets as RAY_ADDRESS


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE"):
        env.pop(name, None)
    # The job's entrypoint (`tokenmill run`) must resolve to this checkout's venv.
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(OMP_NUM_THREADS="1")
    return env


def _stop(proc: subprocess.Popen[bytes], temp_dir: Path) -> None:
    """Stop the head: SIGTERM then SIGKILL to its process group (a session of its own), then
    any straggler whose command line names this head's temp dir. All of them are ours."""
    import psutil

    for sig, grace_s in ((signal.SIGTERM, 4), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
            break
    for other in psutil.process_iter(["cmdline"]):
        if any(str(temp_dir) in arg for arg in other.info["cmdline"] or []):
            with contextlib.suppress(psutil.Error):
                other.kill()


def _session_of(address: str, headers: dict[str, str]) -> str | None:
    try:
        response = requests.get(f"{address}/api/version", headers=headers, timeout=2)
        return response.json().get("session_name") if response.ok else None
    except (requests.RequestException, ValueError):
        return None


def _jobs_api_up(address: str, headers: dict[str, str]) -> bool:
    try:
        return requests.get(f"{address}/api/jobs/", headers=headers, timeout=5).ok
    except requests.RequestException:
        return False


def _session_dir_name(temp_dir: Path) -> str | None:
    latest = temp_dir / "session_latest"
    return latest.resolve().name if latest.exists() else None


@pytest.fixture(scope="module")
def ray_head() -> Iterator[RayHead]:
    # Short path: Ray's unix sockets live under the temp dir and have a length limit.
    tmp = Path(tempfile.mkdtemp(prefix="tmsub", dir="/tmp"))
    token = secrets.token_hex(16)
    token_file = tmp / "auth_token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    env = _base_env()
    env["RAY_AUTH_TOKEN_PATH"] = str(token_file)
    head_env = dict(env, RAY_AUTH_MODE="token")
    dashboard_port = _free_port()
    ports = {
        "port": _free_port(),
        "dashboard-port": dashboard_port,
        "ray-client-server-port": _free_port(),
        "node-manager-port": _free_port(),
        "object-manager-port": _free_port(),
        "dashboard-agent-listen-port": _free_port(),
        "dashboard-agent-grpc-port": _free_port(),
        "metrics-export-port": _free_port(),
        "runtime-env-agent-port": _free_port(),
    }
    cmd = [
        str(VENV_BIN / "ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        "--include-dashboard=true",
        "--num-cpus=2",
        f"--object-store-memory={300 * 1024**2}",
        f"--temp-dir={tmp / 'ray'}",
        "--disable-usage-stats",
        *(f"--{name}={port}" for name, port in ports.items()),
    ]
    log = (tmp / "head.log").open("wb")
    proc = subprocess.Popen(
        cmd, env=head_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + 90
        headers = {"Authorization": f"Bearer {token}"}
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ray start exited {proc.returncode}: {(tmp / 'head.log').read_text()}")
            # Up, and really ours: another local Ray could answer on a port picked as free;
            # and its Jobs API answering, which comes a little after the version endpoint.
            if _session_of(address, headers) == _session_dir_name(tmp / "ray") and _jobs_api_up(
                address, headers
            ):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"Ray head not up in 90 s: {(tmp / 'head.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield RayHead(address, env, token, f"127.0.0.1:{ports['port']}")
    finally:
        _stop(proc, tmp)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


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
