"""A real `ray start --head` with token auth on loopback, on ports and a temp dir of its own
(other local Ray instances may be running), for the tests that submit through the Jobs API.

It is stopped by signalling the `ray start --block` process and its process group (never with
`ray stop`, which would stop every Ray instance on the machine). tests/e2e/conftest.py shares
one head among the modules that need it; a module that needs a head started with its own
environment starts one with `running_ray_head`.
"""

from __future__ import annotations

import contextlib
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

import pytest
import requests

VENV_BIN = Path(sys.executable).parent


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


@contextlib.contextmanager
def running_ray_head(extra_env: dict[str, str] | None = None) -> Iterator[RayHead]:
    """A head whose processes (and so the jobs it runs) see this process's environment plus
    `extra_env`."""
    # Short path: Ray's unix sockets live under the temp dir and have a length limit.
    tmp = Path(tempfile.mkdtemp(prefix="tmsub", dir="/tmp"))
    token = secrets.token_hex(16)
    token_file = tmp / "auth_token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    env = _base_env()
    env["RAY_AUTH_TOKEN_PATH"] = str(token_file)
    head_env = dict(env, RAY_AUTH_MODE="token", **(extra_env or {}))
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
