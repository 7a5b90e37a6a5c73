"""engine.speculative on the TensorRT-LLM adapter (stand-in): the speculative_config object
built for each method, the overlap scheduler switched off, and the acceptance counts read
back from request_perf_metrics."""

from __future__ import annotations

import asyncio

import pytest

from engines.api import EngineError, GenerationRequest, SamplingParams
from tests.unit.test_trtllm import engine_for, model_dir, trt  # noqa: F401 (fixtures)


def _config(trt, model_dir, speculative):  # noqa: F811 (fixtures as arguments)
    engine = engine_for(model_dir, speculative=speculative)
    llm = trt.LLM.instances[-1]
    engine.shutdown()
    return llm.args


def test_ngram_maps_to_ngram_decoding_config(trt, model_dir):  # noqa: F811
    from tensorrt_llm.llmapi import NGramDecodingConfig

    args = _config(
        trt,
        model_dir,
        {"method": "ngram", "num_tokens": 5, "prompt_lookup_max": 3, "disable_above_batch_size": 8},
    )
    assert args["speculative_config"] == NGramDecodingConfig(
        max_draft_len=5,
        max_matching_ngram_size=3,
        is_public_pool=False,
        max_concurrency=8,
    )
    assert args["disable_overlap_scheduler"] is True


def test_draft_eagle3_and_mtp_configs(trt, model_dir, tmp_path):  # noqa: F811
    from tensorrt_llm.llmapi import (
        DraftTargetDecodingConfig,
        Eagle3DecodingConfig,
        MTPDecodingConfig,
    )

    draft = _config(trt, model_dir, {"method": "draft", "model": str(tmp_path / "d")})
    assert draft["speculative_config"] == DraftTargetDecodingConfig(
        max_draft_len=4, speculative_model=str(tmp_path / "d")
    )
    eagle = _config(trt, model_dir, {"method": "eagle3", "num_tokens": 3, "model": "/heads/e3"})
    # allow_advanced_sampling: without it the one-model path decodes every row greedily.
    assert eagle["speculative_config"] == Eagle3DecodingConfig(
        max_draft_len=3, speculative_model="/heads/e3", allow_advanced_sampling=True
    )
    assert eagle["speculative_config"].eagle3_one_model is True
    mtp = _config(trt, model_dir, {"method": "mtp", "num_layers": 2})
    assert mtp["speculative_config"] == MTPDecodingConfig(
        num_nextn_predict_layers=2, allow_advanced_sampling=True
    )
    assert mtp["speculative_config"].max_draft_len == 2


def test_no_speculation_sends_no_config(trt, model_dir):  # noqa: F811
    args = _config(trt, model_dir, None)
    assert args["speculative_config"] is None
    assert args["disable_overlap_scheduler"] is False


def test_unsupported_settings_are_errors(trt, model_dir):  # noqa: F811
    with pytest.raises(EngineError, match="prompt_lookup_min"):
        engine_for(model_dir, speculative={"method": "ngram", "prompt_lookup_min": 2})
    with pytest.raises(EngineError, match="needs model"):
        engine_for(model_dir, speculative={"method": "eagle3"})
    with pytest.raises(EngineError, match="pytorch backend"):
        engine_for(model_dir, backend="tensorrt", speculative={"method": "ngram"})


def test_acceptance_counts_come_from_perf_metrics(trt, model_dir):  # noqa: F811
    engine = engine_for(model_dir, speculative={"method": "ngram", "num_tokens": 2})
    request = GenerationRequest([11, 12], SamplingParams(max_tokens=5, temperature=0.0))
    result = asyncio.run(engine.generate(request))
    engine.shutdown()
    # The stand-in drafts max_draft_len per token after the first and accepts half.
    assert (result.spec_proposed_tokens, result.spec_accepted_tokens) == (8, 4)


def test_job_spec_passes_speculative_through(trt, model_dir):  # noqa: F811
    from engines import load_engine
    from pipeline.engine_setup import engine_settings
    from pipeline.spec import EngineSpec

    spec = EngineSpec(kind="trtllm", speculative={"method": "mtp"})
    settings = engine_settings(spec)
    assert settings["speculative"] == {"method": "mtp"}
    engine = load_engine("trtllm", model=str(model_dir), **settings)
    llm = trt.LLM.instances[-1]
    assert llm.args["speculative_config"].num_nextn_predict_layers == 4
    engine.shutdown()
    with pytest.raises(ValueError, match="pytorch backend only"):
        EngineSpec(kind="trtllm", speculative={"method": "ngram"}, extra={"backend": "tensorrt"})
