"""Fixtures of the engine contract suite: one engine per kind per module, on a tiny model
whose head size every engine kind supports."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.contract.harness import EngineHarness

_MODEL: list[Path] = []


def contract_model() -> Path:
    """A tiny random Llama with head_dim 32 (vLLM's CPU kernels need >= 32), built once."""
    if not _MODEL:
        from engines.dev.tiny import make_tiny_model

        out = Path(tempfile.mkdtemp(prefix="tokenmill-contract-")) / "llama"
        _MODEL.append(make_tiny_model(out, arch="llama", size="tiny-hd32"))
    return _MODEL[0]


@pytest.fixture(scope="module")
def harness(request: pytest.FixtureRequest) -> Iterator[EngineHarness]:
    """A long-lived engine of the test's kind (shared by the module's tests of that kind)."""
    h = EngineHarness(request.param, contract_model())
    yield h
    h.close()


@pytest.fixture
def fresh(request: pytest.FixtureRequest) -> Iterator[EngineHarness]:
    """An engine of its own, for tests that shut it down or kill it."""
    h = EngineHarness(request.param, contract_model())
    yield h
    with contextlib.suppress(Exception):  # it was killed or shut down on purpose
        h.close()
