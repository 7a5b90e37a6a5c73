"""Fixtures of the engine contract suite: one engine per kind per module, on a tiny model
whose head size every engine kind supports."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.contract.harness import OTHER_PYTHON, REPO, EngineHarness

_MODELS: dict[str, Path] = {}


def contract_model(param: str = "") -> Path:
    """A tiny random Llama with head_dim 32 (vLLM's CPU kernels need >= 32), built once. The
    engines under the other environment's interpreter get one built there: a tokenizer saved
    by this environment's transformers 5 (tokenizer_class TokenizersBackend) does not load
    under TensorRT-LLM 1.2's transformers 4.57, as a checkpoint's would not (docs/deploy.md)."""
    where = "elsewhere" if param.endswith("-elsewhere") else "here"
    if where not in _MODELS:
        out = Path(tempfile.mkdtemp(prefix="tokenmill-contract-")) / "llama"
        if where == "here":
            from engines.dev.tiny import make_tiny_model

            make_tiny_model(out, arch="llama", size="tiny-hd32")
        else:
            build = (
                "import sys; from engines.dev.tiny import make_tiny_model; "
                "make_tiny_model(sys.argv[1], arch='llama', size='tiny-hd32')"
            )
            subprocess.run([str(OTHER_PYTHON), "-c", build, str(out)], cwd=REPO, check=True)
        _MODELS[where] = out
    return _MODELS[where]


@pytest.fixture(scope="module")
def harness(request: pytest.FixtureRequest) -> Iterator[EngineHarness]:
    """A long-lived engine of the test's kind (shared by the module's tests of that kind)."""
    h = EngineHarness(request.param, contract_model(request.param))
    yield h
    h.close()


@pytest.fixture
def fresh(request: pytest.FixtureRequest) -> Iterator[EngineHarness]:
    """An engine of its own, for tests that shut it down or kill it."""
    h = EngineHarness(request.param, contract_model(request.param))
    yield h
    with contextlib.suppress(Exception):  # it was killed or shut down on purpose
        h.close()
