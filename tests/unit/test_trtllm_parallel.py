"""The TensorRT-LLM adapter's parallel settings, against the stand-in package
(tests/standins/tensorrt_llm, written to TensorRT-LLM 1.2's LlmArgs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_trtllm import engine_for, make_checkpoint, trt  # noqa: F401


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "llama-fp8")


def test_our_list_is_the_standin_llm_args_parallel_fields(trt):  # noqa: F811
    from tensorrt_llm._core import COMMON_ARGS, PARALLEL_ARGS

    from engines.trtllm import PARALLEL_SETTINGS, SETTINGS

    assert set(PARALLEL_ARGS) == set(PARALLEL_SETTINGS)
    assert len(PARALLEL_SETTINGS) == len(set(PARALLEL_SETTINGS))
    assert set(PARALLEL_SETTINGS) <= set(COMMON_ARGS)  # both backends take them
    assert set(PARALLEL_SETTINGS) <= set(SETTINGS)


def test_parallel_settings_reach_the_llm_and_the_device_count(trt, model_dir):  # noqa: F811
    engine = engine_for(
        model_dir,
        tensor_parallel_size=4,
        pipeline_parallel_size=2,
        moe_expert_parallel_size=4,
        moe_tensor_parallel_size=1,
        enable_attention_dp=True,
        orchestrator_type=None,  # null: TensorRT-LLM's default (MPI), not sent
    )
    args = trt.LLM.instances[-1].args
    assert (args["tensor_parallel_size"], args["pipeline_parallel_size"]) == (4, 2)
    assert (args["moe_expert_parallel_size"], args["moe_tensor_parallel_size"]) == (4, 1)
    assert args["enable_attention_dp"] is True and args["orchestrator_type"] is None
    assert engine.info.num_devices == 8
    engine.shutdown()


def test_a_misspelt_parallel_setting_is_refused_by_name(trt, model_dir):  # noqa: F811
    with pytest.raises(TypeError, match=r"unknown setting.*moe_parallel_size"):
        engine_for(model_dir, moe_parallel_size=2)
    assert trt.LLM.instances == []
