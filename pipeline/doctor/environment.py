"""Storage credentials (present or not: never their values) and the Ray cluster in RAY_ADDRESS."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

from pipeline.doctor.findings import Finding, Status
from pipeline.doctor.packages import installed_version
from pipeline.submit import resolve_auth_token

KEY_PAIR = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
ENDPOINTS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT_URL")


def check_storage(env: Mapping[str, str], home: Path | None = None) -> list[Finding]:
    """Which S3 credentials the environment offers, by name only."""
    present = [name for name in KEY_PAIR if env.get(name)]
    profile_file = Path(
        env.get("AWS_SHARED_CREDENTIALS_FILE") or (home or Path.home()) / ".aws/credentials"
    )
    endpoint = next((name for name in ENDPOINTS if env.get(name)), None)
    where = (
        f"; endpoint from ${endpoint}"
        if endpoint
        else "; no endpoint variable (the job file's storage.endpoint_url, or AWS)"
    )
    if len(present) == 1:
        missing = next(name for name in KEY_PAIR if name not in present)
        return [
            Finding(
                "storage",
                "s3",
                Status.CONFLICT,
                f"${present[0]} is set without ${missing}",
                f"set both {KEY_PAIR[0]} and {KEY_PAIR[1]}, or neither",
            )
        ]
    if present:
        session = " and $AWS_SESSION_TOKEN" if env.get("AWS_SESSION_TOKEN") else ""
        detail = f"${KEY_PAIR[0]} and ${KEY_PAIR[1]}{session} set{where}"
        return [Finding("storage", "s3", Status.OK, detail, provides=("storage",))]
    if env.get("AWS_PROFILE") or profile_file.is_file():
        source = f"profile {env['AWS_PROFILE']}" if env.get("AWS_PROFILE") else str(profile_file)
        return [
            Finding(
                "storage",
                "s3",
                Status.OK,
                f"credentials from {source}{where}",
                provides=("storage",),
            )
        ]
    return [
        Finding(
            "storage",
            "s3",
            Status.INFO,
            "no S3 credentials in the environment: local files and public buckets only",
            f"export {KEY_PAIR[0]} and {KEY_PAIR[1]} (on a cluster: from a Kubernetes secret)",
        )
    ]


def _dashboard_version(address: str, env: Mapping[str, str], timeout_s: float) -> str:
    """The Ray version the dashboard at `address` reports (raises on failure)."""

    request = urllib.request.Request(address.rstrip("/") + "/api/version")
    token = resolve_auth_token(env)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return str(json.loads(response.read()).get("ray_version", "unknown"))


# Where `ray start --head` records the address of the Ray it started; `ray stop` removes it,
# a head that crashed or was killed leaves it behind.
current_cluster_file = Path("/tmp/ray/ray_current_cluster")


def _check_auto(current: Path, timeout_s: float) -> list[Finding]:
    """RAY_ADDRESS=auto: the Ray last started on this machine, if it still answers (the
    file alone outlives a crashed head)."""
    if not current.is_file():
        return [
            Finding(
                "ray",
                "cluster",
                Status.CONFLICT,
                "RAY_ADDRESS=auto but no Ray runs on this machine",
                "start one with `ray start --head`, or point RAY_ADDRESS at a cluster",
            )
        ]
    gcs = current.read_text().strip()
    host, _, port = gcs.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        return [
            Finding(
                "ray",
                "cluster",
                Status.CONFLICT,
                f"RAY_ADDRESS=auto names the Ray last started on this machine ({gcs}), which "
                f"does not answer ({exc}): it crashed or was killed",
                "`ray stop --force`, then `ray start --head`, or point RAY_ADDRESS at a cluster",
            )
        ]
    detail = f"RAY_ADDRESS=auto: the Ray started on this machine ({gcs}), reachable"
    return [Finding("ray", "cluster", Status.OK, detail, provides=("ray",))]


def check_ray(env: Mapping[str, str], timeout_s: float = 5.0) -> list[Finding]:
    """RAY_ADDRESS reachable, and running this environment's Ray version where it says."""
    address = env.get("RAY_ADDRESS", "")
    local = installed_version("ray")
    if not address:
        return [
            Finding(
                "ray",
                "cluster",
                Status.INFO,
                f"ray {local}; no RAY_ADDRESS: `tokenmill run` starts a Ray on this machine",
                "export RAY_ADDRESS=http://HEAD:8265 to use a cluster",
            )
        ]
    if address == "auto":
        return _check_auto(current_cluster_file, timeout_s)
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    if parsed.scheme in ("http", "https"):
        try:
            remote = _dashboard_version(address, env, timeout_s)
        except (OSError, urllib.error.URLError, ValueError) as exc:
            return [
                Finding(
                    "ray",
                    "cluster",
                    Status.CONFLICT,
                    f"the Ray dashboard at {address} did not answer: {exc}",
                    "check RAY_ADDRESS, the network path to the head's port, and the auth "
                    "token (RAY_AUTH_TOKEN or ~/.ray/auth_token)",
                )
            ]
        if remote != local:
            return [
                Finding(
                    "ray",
                    "cluster",
                    Status.CONFLICT,
                    f"the cluster at {address} runs Ray {remote}, this environment {local}",
                    "every node and every client of a cluster must run the same Ray version",
                )
            ]
        return [Finding("ray", "cluster", Status.OK, f"{address}: Ray {remote}", provides=("ray",))]
    host, port = parsed.hostname or "", parsed.port or (10001 if parsed.scheme == "ray" else 6379)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        return [
            Finding(
                "ray",
                "cluster",
                Status.CONFLICT,
                f"{address}: {host}:{port} is not reachable ({exc})",
                "check RAY_ADDRESS and the network path to the head",
            )
        ]
    return [Finding("ray", "cluster", Status.OK, f"{address}: reachable (TCP)", provides=("ray",))]
