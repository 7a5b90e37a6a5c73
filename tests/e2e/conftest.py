"""Fixtures every e2e module may use, registered once here so a shared one really is one: a
fixture function assigned into several modules is a fixture of each, and each would start its
own (a second `tokenmill serve`, a second Ray head).

Package scope: the shared server and head stop when the last e2e test is done, rather than
idling beside the rest of the suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engines import faults
from tests.e2e.ray_head import RayHead, running_ray_head
from tests.e2e.serve_fixtures import serve_adapters, serve_model_dir, serve_workdir, server

__all__ = ["ray_head", "serve_adapters", "serve_model_dir", "serve_workdir", "server"]

# The shared head's engines sleep this long after every step: the Batch API's cancel tests
# (tests/e2e/test_batch_api.py) then see 200-1500 requests take 25 s or more on any machine,
# so a cancel after the first part lands mid-run; short jobs (test_submit) barely notice.
HEAD_STEP_DELAY_S = 0.01


@pytest.fixture(scope="package")
def ray_head() -> Iterator[RayHead]:
    """One `ray start --head` (Jobs API, token auth) for the modules that submit jobs."""
    with running_ray_head(faults.step_delay_env(HEAD_STEP_DELAY_S)) as head:
        yield head
