"""Retries for the commit path: exponential backoff with full jitter, bounded by time.

Pre-flight checks fail fast (two attempts, short timeouts: a typo in an endpoint should be
reported in seconds). Once a job is generating, one throttled PUT late in a ten-hour run must
not kill it and lose what is in flight, so part writes, manifest updates and lease renewals
go through `with_retries`, which keeps trying transient failures for `storage.retry_s`
seconds. Permanent failures (access denied, no such bucket, a failed precondition) raise at
once: retrying them only delays the error.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# S3 error codes that mean "try again later" (throttling, a busy or restarting server).
TRANSIENT_S3_CODES = frozenset(
    {
        "SlowDown",
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "ConditionalRequestConflict",  # two conditional writes raced: one of them retries
        "500",
        "502",
        "503",
        "504",
    }
)


class PreconditionFailed(RuntimeError):
    """A conditional write lost: the object was there (create-only) or had changed."""


@dataclass(frozen=True)
class RetryPolicy:
    """How long and how often a storage operation is retried."""

    total_s: float  # give up once this much time has passed since the first attempt
    first_delay_s: float = 0.5  # the first backoff; doubles up to max_delay_s
    max_delay_s: float = 20.0

    def delays(self) -> Callable[[int], float]:
        """Full jitter: the n-th wait is uniform in [0, min(max, first x 2^n)]."""

        def delay(attempt: int) -> float:
            return random.uniform(0.0, min(self.max_delay_s, self.first_delay_s * 2**attempt))

        return delay


def _s3_code(exc: BaseException) -> str | None:
    """The S3 error code behind an exception (s3fs wraps botocore's ClientError)."""
    for candidate in (exc, exc.__cause__, exc.__context__):
        response = getattr(candidate, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            code = error.get("Code")
            if code is not None:
                return str(code)
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if status is not None:
                return str(status)
    return None


def is_transient(exc: BaseException) -> bool:
    """True for failures worth retrying: throttling, 5xx, dropped connections, timeouts."""
    if isinstance(exc, (PreconditionFailed, FileNotFoundError, PermissionError)):
        return False
    code = _s3_code(exc)
    if code is not None:
        return code in TRANSIENT_S3_CODES
    # No S3 code: a connection that was refused, reset or timed out (aiohttp, botocore's
    # EndpointConnectionError and ReadTimeoutError, plain socket errors).
    name = type(exc).__name__
    if isinstance(exc, (ConnectionError, TimeoutError)) or any(
        word in name for word in ("Connection", "Timeout", "ServerDisconnected", "ClientOS")
    ):
        return True
    return isinstance(exc, OSError) and not isinstance(exc, (IsADirectoryError, FileExistsError))


def with_retries(
    operation: Callable[[], T],
    what: str,
    policy: RetryPolicy,
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """`operation()`, retried on transient failures until `policy.total_s` has passed.

    The last failure is raised as it is; `what` names the operation in the log lines.
    """
    started = clock()
    delay = policy.delays()
    attempt = 0
    while True:
        try:
            return operation()
        except Exception as exc:
            waited = clock() - started
            if not is_transient(exc) or waited >= policy.total_s:
                raise
            pause = min(delay(attempt), max(policy.total_s - waited, 0.0))
            logger.warning(
                "%s failed (%s: %s); retry %d in %.1fs (giving up after %.0fs)",
                what,
                type(exc).__name__,
                exc,
                attempt + 1,
                pause,
                policy.total_s,
            )
            sleep(pause)
            attempt += 1
