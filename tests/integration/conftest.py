"""Shared fixtures for integration tests: an S3 server over real HTTP, a tiny model, local Ray.

- `aws_env` (session): dummy AWS credentials in os.environ (set before Ray starts, so workers
  inherit them).
- `s3_server` (session): a running `tests.integration.s3_server.S3Server` on 127.0.0.1.
- `bucket` (function): a fresh, empty bucket name on that server.
- `s3_storage` (session): the job `storage` section (StorageSpec) pointing at the server.
- `tiny_model_dir` (session): a tiny random Llama with a chat-template tokenizer (engines.dev.tiny).
- `ray_local` (session): `ray.init(address="local", num_cpus=2, ...)`, shut down at the end
  of the session. Never attaches to another cluster on this machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.s3_server import S3Server, dummy_aws_env, running_s3_server


@pytest.fixture(scope="session")
def aws_env() -> Iterator[dict[str, str]]:
    with dummy_aws_env() as env:
        yield env


@pytest.fixture(scope="session")
def s3_server(aws_env: dict[str, str]) -> Iterator[S3Server]:
    with running_s3_server(set_env=False) as server:
        yield server


@pytest.fixture
def bucket(s3_server: S3Server) -> str:
    return s3_server.make_bucket()


@pytest.fixture(scope="session")
def s3_storage(s3_server: S3Server) -> Any:
    return s3_server.storage_spec()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.dev.tiny import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("tiny-model") / "llama", arch="llama"))


@pytest.fixture(scope="session")
def ray_local(aws_env: dict[str, str]) -> Iterator[Any]:
    """A private local Ray instance for the session (2 CPUs, small object store)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=300 * 1024**2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": dict(aws_env)},
    )
    try:
        yield ray
    finally:
        ray.shutdown()
