"""The integration suite's S3 server and local Ray, for the vLLM tests that read a Dataset
from S3 (tests/integration/conftest.py describes them)."""

from tests.integration.conftest import aws_env, ray_local, s3_server  # noqa: F401
