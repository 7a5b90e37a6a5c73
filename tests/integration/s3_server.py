"""A real S3 HTTP endpoint for tests: moto's S3 app behind a threaded WSGI server on
127.0.0.1, a free port.

Ray workers are separate processes, so in-process mocking (`mock_aws`) cannot reach them; a
server on a local port can. Credentials are dummies set in the environment *before* Ray starts,
so every worker inherits them.

Two things sit between the client and moto (`S3Gate`):
- conditional writes (If-None-Match / If-Match) are served one at a time: moto checks the
  condition and then writes without a lock, where S3 does both atomically, so two racing
  conditional PUTs could both succeed on moto but never on S3;
- injected failures: `s3.fail_next("PUT", "part-", times=2)` answers the next two matching
  requests with 503 SlowDown, as a throttled S3 would; `s3.fail_after("PUT", "_lease", 1)`
  lets the next matching request through and then answers 503 all the same, as when a
  response is lost on its way back: the write landed, and the client retries it.

    with running_s3_server() as s3:            # or the `s3_server` fixture in conftest.py
        bucket = s3.make_bucket()              # fresh, unique bucket per test
        s3.put(f"s3://{bucket}/in/a.jsonl", b"...")
        storage = s3.storage_spec()            # StorageSpec(endpoint_url=s3.endpoint_url)
        s3.get(...), s3.list_uris(f"s3://{bucket}/out/"), s3.delete(...)
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
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


@dataclass
class _Fault:
    method: str
    key_contains: str
    left: int
    status: int
    code: str
    served: int = 0
    after: bool = False  # let the request through first (it lands), then answer the error


class S3Gate:
    """WSGI middleware in front of moto: serialized conditional writes, injected failures."""

    def __init__(self, app: Any):
        self.app = app
        self._conditional = threading.Lock()
        self._faults_lock = threading.Lock()
        self.faults: list[_Fault] = []

    def _fault_for(self, method: str, path: str) -> _Fault | None:
        with self._faults_lock:
            for fault in self.faults:
                if fault.left > 0 and fault.method == method and fault.key_contains in path:
                    fault.left -= 1
                    fault.served += 1
                    return fault
        return None

    def _serve(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        if environ.get("HTTP_IF_NONE_MATCH") or environ.get("HTTP_IF_MATCH"):
            with self._conditional:
                return list(self.app(environ, start_response))
        return self.app(environ, start_response)

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        fault = self._fault_for(environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""))
        if fault is not None:
            body = (
                f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{fault.code}</Code>'
                f"<Message>injected by the test</Message></Error>"
            ).encode()
            if fault.after:  # the request lands; its answer is replaced below
                list(self._serve(environ, lambda *args, **kwargs: None))
            else:
                environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            start_response(
                f"{fault.status} Injected",
                [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
            )
            return [body]
        return self._serve(environ, start_response)


@dataclass
class S3Server:
    """Handle on a running test S3 endpoint, with a few boto3 helpers for arranging data."""

    endpoint_url: str  # e.g. "http://127.0.0.1:41234"
    gate: S3Gate | None = field(default=None, repr=False, compare=False)

    def fail_next(
        self, method: str, key_contains: str, times: int, status: int = 503, code: str = "SlowDown"
    ) -> _Fault:
        """Answer the next `times` requests of `method` whose path contains `key_contains` with
        an S3 error (503 SlowDown by default); returns the fault, whose `served` counts them."""
        return self._arm(_Fault(method, key_contains, times, status, code))

    def fail_after(
        self, method: str, key_contains: str, times: int, status: int = 503, code: str = "SlowDown"
    ) -> _Fault:
        """Like `fail_next`, but each matching request is carried out first: the write lands,
        the client sees the error (a response lost on its way back)."""
        return self._arm(_Fault(method, key_contains, times, status, code, after=True))

    def _arm(self, fault: _Fault) -> _Fault:
        assert self.gate is not None
        with self.gate._faults_lock:
            self.gate.faults.append(fault)
        return fault

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
    """Start moto's S3 app (behind S3Gate) on 127.0.0.1 with a free port; stop it on exit.

    `set_env` also sets the dummy AWS variables for the block (needed by code that takes
    credentials from the environment, i.e. all of tokenmill).
    """
    import logging

    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    # werkzeug logs every request at INFO; test output should show failures, not traffic.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    gate = S3Gate(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, gate, threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, name="s3-server", daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    handle = S3Server(endpoint_url=f"http://{host}:{port}", gate=gate)
    try:
        if set_env:
            with dummy_aws_env():
                yield handle
        else:
            yield handle
    finally:
        server.shutdown()
        thread.join()
