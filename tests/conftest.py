"""Suite-wide settings: GPU tests skip without CUDA, vLLM tests without vLLM (they run in
.venv-vllm through `make test-vllm`); torch stays on few threads."""

from __future__ import annotations

import os

import pytest

# Tests share two cores with Ray workers; oversubscribed BLAS threads only slow everyone down.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # By marker, not keyword: a test id that merely names vLLM (a parameter) is not one.
    marked = {name: [i for i in items if i.get_closest_marker(name)] for name in ("vllm", "gpu")}
    if marked["vllm"] and not _has_vllm():
        skip = pytest.mark.skip(reason="needs vLLM: run `make test-vllm` (its own environment)")
        for item in marked["vllm"]:
            item.add_marker(skip)
    if marked["gpu"] and not _has_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in marked["gpu"]:
            item.add_marker(skip)
