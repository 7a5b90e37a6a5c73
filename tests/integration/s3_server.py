"""A real S3 HTTP endpoint for tests: moto's ThreadedMotoServer on 127.0.0.1, a free port.

Ray workers are separate processes, so in-process mocking (`mock_aws`) cannot reach them; a
server on a local port can. Credentials are dummies set in the environment *before* Ray starts,
so every worker inherits them.

    with running_s3_server() as s3:            # or the `s3_server` fixture in conftest.py
        bucket = s3.make_bucket()              # fresh, unique bucket per test
        s3.put(f"s3://{bucket}/in/a.jsonl", b"...")
        storage = s3.storage_spec()            # StorageSpec(endpoint_url=s3.endpoint_url)
        s3.get(...), s3.list_uris(f"s3://{bucket}/out/"), s3.delete(...)
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# Dummy credentials: moto accepts anything, botocore only needs something to sign with.
# AWS_EC2_METADATA_DISABLED stops botocore probing 169.254.169.254 when a variable is missing.
DUMMY_AWS_ENV: dict[str, str] = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
# Variables that would make botocore pick up a real profile or session instead of the dummies.
_UNSET_AWS_ENV = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")


@contextmanager
def dummy_aws_env() -> Iterator[dict[str, str]]:
    """Set the dummy AWS variables in os.environ for the block; restore the old values after."""
    saved = {name: os.environ.get(name) for name in (*DUMMY_AWS_ENV, *_UNSET_AWS_ENV)}
    os.environ.update(DUMMY_AWS_ENV)
    for name in _UNSET_AWS_ENV:
        os.environ.pop(name, None)
    try:
        yield dict(DUMMY_AWS_ENV)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _split(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise ValueError(f"expected an s3:// URI, got {uri!r}")
    bucket, _, key = uri[len("s3://") :].partition("/")
    return bucket, key


@dataclass(frozen=True)
class S3Server:
    """Handle on a running test S3 endpoint, with a few boto3 helpers for arranging data."""

    endpoint_url: str  # e.g. "http://127.0.0.1:41234"

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=DUMMY_AWS_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=DUMMY_AWS_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name=DUMMY_AWS_ENV["AWS_DEFAULT_REGION"],
        )

    def storage_spec(self) -> Any:
        """The job's `storage` section pointing at this server."""
        from pipeline.spec import StorageSpec

        return StorageSpec(endpoint_url=self.endpoint_url)

    def make_bucket(self, prefix: str = "test") -> str:
        """Create a bucket with a unique name (tests share one server) and return its name."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def put(self, uri: str, data: bytes | str) -> None:
        bucket, key = _split(uri)
        body = data.encode() if isinstance(data, str) else data
        self.client().put_object(Bucket=bucket, Key=key, Body=body)

    def get(self, uri: str) -> bytes:
        bucket, key = _split(uri)
        return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()

    def delete(self, uri: str) -> None:
        bucket, key = _split(uri)
        self.client().delete_object(Bucket=bucket, Key=key)

    def list_uris(self, prefix_uri: str) -> list[str]:
        """Every object under the prefix (recursive), as sorted s3:// URIs."""
        bucket, prefix = _split(prefix_uri)
        paginator = self.client().get_paginator("list_objects_v2")
        uris = []
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            uris += [f"s3://{bucket}/{obj['Key']}" for obj in page.get("Contents", [])]
        return sorted(uris)

    def upload_dir(self, local_dir: str | os.PathLike[str], prefix_uri: str) -> list[str]:
        """Upload a local directory tree under an s3:// prefix; returns the object URIs."""
        from pathlib import Path

        root = Path(local_dir)
        uris = []
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            uri = f"{prefix_uri.rstrip('/')}/{path.relative_to(root).as_posix()}"
            self.put(uri, path.read_bytes())
            uris.append(uri)
        return uris


@contextmanager
def running_s3_server(set_env: bool = True) -> Iterator[S3Server]:
    """Start moto's S3 server on 127.0.0.1 with a free port; stop it on exit.

    `set_env` also sets the dummy AWS variables for the block (needed by code that takes
    credentials from the environment, i.e. all of tokenmill).
    """
    import logging

    from moto.server import ThreadedMotoServer

    # werkzeug logs every request at INFO; test output should show failures, not traffic.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        if set_env:
            with dummy_aws_env():
                yield S3Server(endpoint_url=f"http://{host}:{port}")
        else:
            yield S3Server(endpoint_url=f"http://{host}:{port}")
    finally:
        server.stop()
