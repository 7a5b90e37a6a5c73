"""Object storage: filesystems and input listing (files), model downloads (models), one output
prefix with atomic and conditional writes (prefix), and commit-path retries (retry)."""

from pipeline.storage.files import (
    InputFile,
    StorageError,
    endpoint_of,
    exists,
    expand_uri,
    filesystem_for,
    is_s3,
    join_uri,
    list_input_files,
)
from pipeline.storage.models import COMPLETE_MARKER, materialize_model
from pipeline.storage.prefix import OutputDir, Versioned
from pipeline.storage.retry import PreconditionFailed, RetryPolicy, is_transient, with_retries

__all__ = [
    "COMPLETE_MARKER",
    "InputFile",
    "OutputDir",
    "PreconditionFailed",
    "RetryPolicy",
    "StorageError",
    "Versioned",
    "endpoint_of",
    "exists",
    "expand_uri",
    "filesystem_for",
    "is_s3",
    "is_transient",
    "join_uri",
    "list_input_files",
    "materialize_model",
    "with_retries",
]
