"""The vllm kind's settings are checked before vLLM starts, with errors that name the setting."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from engines import EngineError, load_engine

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model() -> Path:
    from engines.dev.tiny import make_tiny_model

    out = Path(tempfile.mkdtemp(prefix="tokenmill-vllm-settings-")) / "llama"
    return make_tiny_model(out, size="tiny-hd32")


def test_a_kv_cache_smaller_than_the_context_names_both(model: Path) -> None:
    with pytest.raises(EngineError, match=r"kv_cache_tokens \(1000\).*context \(2048 tokens\)"):
        load_engine("vllm", model=str(model), kv_cache_tokens=1000)


def test_an_unknown_setting_is_named(model: Path) -> None:
    with pytest.raises(TypeError, match="max_num_seqz"):
        load_engine("vllm", model=str(model), max_num_seqz=4)


def test_an_unsupported_dtype_is_named(model: Path) -> None:
    with pytest.raises(EngineError, match="float8"):
        load_engine("vllm", model=str(model), dtype="float8")


def test_the_parallel_settings_are_vllm_engine_args() -> None:
    """The multi-device settings the adapter names (and sets: the Ray executor) are fields of
    this vLLM's AsyncEngineArgs, so a renamed one fails here, not on a GPU cluster."""
    import dataclasses

    from vllm import AsyncEngineArgs

    names = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    parallel = {
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "enable_expert_parallel",
        "distributed_executor_backend",
    }
    assert parallel <= names
