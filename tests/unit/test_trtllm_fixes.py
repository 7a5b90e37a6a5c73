"""The TensorRT-LLM adapter against what the real 1.2 library does differently from the
reference engine, reproduced by the stand-in (tests/standins/tensorrt_llm): stop-token
accounting, explicit sampling values, per-request errors, unset perf metrics, seeds,
calibration data, CUDA graph settings and shared request admission. One section per item."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import time
from pathlib import Path

import pytest

from engines.api import GenerationRequest, SamplingParams
from tests.unit.test_trtllm import engine_for, greedy, make_checkpoint, run, toy_tokens, trt

__all__ = ["trt"]  # the fixture, imported for pytest

PROMPT = [20, 21]


def text_of(ids: list[int]) -> str:
    return "".join(f"<{t}>" for t in ids)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "llama-fp8")


# --- 1. stop tokens and stop strings stay in output_token_ids --------------------------------


@pytest.mark.parametrize("backend", ["pytorch", "tensorrt"])
def test_eos_is_kept_and_counted_on_both_backends(trt, tmp_path, backend):
    third = toy_tokens(PROMPT, 3)[2]
    # end_id (the tokenizer's EOS) is the first id; the TensorRT backend's decoder drops it.
    model = make_checkpoint(tmp_path / "m", eos=[third, 7])
    engine = engine_for(model, backend=backend)
    result = run(engine.generate(GenerationRequest(PROMPT, greedy(10))))
    assert result.finish_reason == "stop" and result.stop_reason is None
    assert result.output_token_ids == toy_tokens(PROMPT, 3) and result.completion_tokens == 3
    engine.shutdown()


def test_other_eos_ids_stop_the_request_as_eos(trt, tmp_path):
    third = toy_tokens(PROMPT, 3)[2]
    # TensorRT-LLM knows one end_id (7, never generated here); the checkpoint lists another.
    engine = engine_for(make_checkpoint(tmp_path / "m", eos=[7, third]))
    result = run(engine.generate(GenerationRequest(PROMPT, greedy(10))))
    assert result.finish_reason == "stop" and result.stop_reason is None
    assert result.output_token_ids == toy_tokens(PROMPT, 3)
    engine.shutdown()


def test_stop_string_is_cut_from_text_but_its_tokens_are_counted(trt, model_dir):
    tokens = toy_tokens(PROMPT, 3)
    stop = text_of(tokens[2:])  # tokenizes to the third token: matched as a stop word
    engine = engine_for(model_dir)
    sampling = greedy(10, stop=(stop,))
    result = run(engine.generate(GenerationRequest(PROMPT, sampling)))
    assert result.output_token_ids == tokens and result.completion_tokens == 3
    assert result.text == text_of(tokens[:2])
    assert result.finish_reason == "stop" and result.stop_reason == stop

    async def streamed():
        return [d async for d in engine.stream(GenerationRequest(PROMPT, sampling))]

    deltas = run(streamed())
    final = deltas[-1].result
    assert "".join(d.text for d in deltas) == final.text == text_of(tokens[:2])
    assert [t for d in deltas for t in d.token_ids] == final.output_token_ids == tokens
    engine.shutdown()


def test_stop_token_at_the_length_limit_is_a_stop(trt, model_dir):
    tokens = toy_tokens(PROMPT, 3)
    engine = engine_for(model_dir)
    # TensorRT-LLM checks length before stop words; the reference engine the other way round.
    sampling = greedy(3, stop_token_ids=(tokens[2],))
    result = run(engine.generate(GenerationRequest(PROMPT, sampling)))
    assert result.finish_reason == "stop" and result.stop_reason == tokens[2]
    engine.shutdown()


# --- 2. sampled requests carry explicit "off" values for top_k / top_p -----------------------


def test_temperature_only_request_samples_on_the_tensorrt_backend(trt, model_dir):
    engine = engine_for(model_dir, backend="tensorrt")
    sampling = SamplingParams(max_tokens=6, temperature=0.7, seed=3)
    result = run(engine.generate(GenerationRequest(PROMPT, sampling)))
    _, params, _ = trt.LLM.instances[-1].submitted[-1]
    assert (params.top_k, params.top_p, params.temperature) == (0, 1.0, 0.7)
    # None / None would be the C++ defaults top_k 0 and top_p 0: greedy decoding.
    assert result.output_token_ids != toy_tokens(PROMPT, 6)
    greedy_result = run(engine.generate(GenerationRequest(PROMPT, greedy(6))))
    assert greedy_result.output_token_ids == toy_tokens(PROMPT, 6)
    engine.shutdown()


# --- 3. a request that fails inside TensorRT-LLM is a row error ------------------------------


def test_request_error_is_a_row_error_and_the_engine_stays_up(trt, model_dir):
    engine = engine_for(model_dir)
    llm = trt.LLM.instances[-1]

    llm.inject_request_error("CUDA error in the request's sampler", after_tokens=2)
    failed = run(engine.generate(GenerationRequest(PROMPT, greedy(6))))
    assert failed.finish_reason == "error" and "sampler" in failed.error

    async def streamed():
        llm.inject_request_error("stream failed", after_tokens=1)
        return [d async for d in engine.stream(GenerationRequest(PROMPT, greedy(6)))]

    last = run(streamed())[-1]
    assert last.finished and last.result.finish_reason == "error"
    assert "stream failed" in last.result.error
    fine = run(engine.generate(GenerationRequest(PROMPT, greedy(3))))
    assert fine.ok and fine.output_token_ids == toy_tokens(PROMPT, 3)
    assert engine.stats().num_running == 0
    engine.shutdown()


def test_executor_death_kills_the_engine(trt, model_dir):
    from engines.api import EngineDeadError

    engine = engine_for(model_dir)

    async def go():
        task = asyncio.create_task(engine.generate(GenerationRequest(PROMPT, greedy(200))))
        for _ in range(5):
            await asyncio.sleep(0)
        trt.LLM.instances[-1].kill_executor()
        with pytest.raises(EngineDeadError, match="died"):
            await task

    run(go())
    with pytest.raises(EngineDeadError):
        run(engine.generate(GenerationRequest(PROMPT, greedy(2))))
    engine.shutdown()


# --- 4. unset perf-metric time points are zero, read as "never" ------------------------------


def test_cancelled_before_its_first_token_has_no_first_token_time(trt, model_dir):
    engine = engine_for(model_dir)

    async def go():
        task = asyncio.create_task(engine.generate(GenerationRequest(PROMPT, greedy(50), "c")))
        await asyncio.sleep(0)  # submitted, not yet scheduled by the executor
        engine.abort("c")
        return await task

    result = run(go())
    assert result.finish_reason == "cancelled" and result.completion_tokens == 0
    m = result.metrics
    assert m.first_token_time is None and m.ttft_s is None
    assert m.first_scheduled_time is None
    assert m.finish_time >= m.arrival_time
    engine.shutdown()


def test_zero_time_points_are_unset(trt):
    from tensorrt_llm._core import TimingMetrics

    from engines.trtllm import _metrics

    now = time.monotonic()

    class Perf:
        timing_metrics = TimingMetrics(
            arrival_time=dt.timedelta(seconds=now - 1.0),
            first_scheduled_time=dt.timedelta(seconds=now - 0.5),
        )

    m = _metrics(Perf(), now - 1.0, [])
    assert m.first_token_time is None and m.queue_s == pytest.approx(0.5)
    assert m.finish_time >= m.first_scheduled_time


# --- 5. per-request seeds on the PyTorch backend ---------------------------------------------


def test_pytorch_backend_says_once_that_seeds_are_ignored(trt, model_dir, caplog):
    engine = engine_for(model_dir)
    assert any("seed" in note for note in engine.limitations)
    assert engine.info.limitations == engine.limitations  # what a job's log reports
    seeded = SamplingParams(max_tokens=4, temperature=0.8, seed=11)
    with caplog.at_level(logging.WARNING, logger="engines.trtllm"):
        run(engine.generate(GenerationRequest(PROMPT, greedy(4, seed=11))))
        assert not caplog.records  # greedy rows are reproducible anyway
        first = run(engine.generate(GenerationRequest(PROMPT, seeded)))
        second = run(engine.generate(GenerationRequest(PROMPT, seeded)))
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "seed" in caplog.records[0].getMessage()
    # What the warning is about: same seed, different tokens (one shared generator).
    assert first.output_token_ids != second.output_token_ids
    engine.shutdown()


def test_tensorrt_backend_honours_seeds_without_a_warning(trt, model_dir, caplog):
    engine = engine_for(model_dir, backend="tensorrt")
    assert engine.limitations == () == engine.info.limitations
    seeded = SamplingParams(max_tokens=6, temperature=0.8, seed=11)
    with caplog.at_level(logging.WARNING, logger="engines.trtllm"):
        first = run(engine.generate(GenerationRequest(PROMPT, seeded)))
        second = run(engine.generate(GenerationRequest(PROMPT, seeded)))
    assert not caplog.records
    assert first.output_token_ids == second.output_token_ids
    engine.shutdown()


# --- 6. calibration data from the project, never a download ----------------------------------


def test_quantizing_build_calibrates_on_the_builtin_text(trt, model_dir):
    from engines.quantize.calibration import load_texts
    from engines.quantize.config import CalibrationSpec, QualitySpec

    engine = engine_for(model_dir, backend="tensorrt", quantize="fp8")
    llm = trt.LLM.instances[-1]
    calib = llm.args["calib_config"]
    assert "cnn_dailymail" not in calib.calib_dataset
    assert not Path(calib.calib_dataset).exists()  # a temporary directory, gone after the build
    expected = load_texts(CalibrationSpec(), QualitySpec()).calibration
    assert llm.calibration_texts == expected
    engine.shutdown()


def test_quantizing_build_calibrates_on_the_given_source(trt, model_dir, tmp_path):
    source = tmp_path / "calib.jsonl"
    rows = [{"body": f"calibration sentence number {i}."} for i in range(40)]
    source.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    calibration = {"source": str(source), "column": "body", "num_samples": 5, "batch_size": 2}
    engine = engine_for(model_dir, backend="tensorrt", quantize="fp8", calibration=calibration)
    llm = trt.LLM.instances[-1]
    assert len(llm.calibration_texts) == 5
    assert all(t.startswith("calibration sentence") for t in llm.calibration_texts)
    calib = llm.args["calib_config"]
    assert (calib.calib_batches, calib.calib_batch_size) == (3, 2)
    engine.shutdown()


def test_standin_refuses_the_default_calibration_download(trt, model_dir):
    from tensorrt_llm._tensorrt_engine import LLM as TensorrtEngineLLM
    from tensorrt_llm.llmapi import CalibConfig, QuantAlgo, QuantConfig

    with pytest.raises(ConnectionError, match="cnn_dailymail"):
        TensorrtEngineLLM(
            str(model_dir),
            quant_config=QuantConfig(quant_algo=QuantAlgo.FP8),
            calib_config=CalibConfig(),
        )


# --- 7. CUDA graphs and throughput defaults --------------------------------------------------


def test_cuda_graph_settings(trt, model_dir):
    from tensorrt_llm.llmapi import CudaGraphConfig

    from engines import load_engine
    from pipeline.engine_setup import engine_settings
    from pipeline.spec import EngineSpec

    spec = EngineSpec(
        kind="trtllm",
        max_batch_size=512,
        max_num_tokens=8192,
        extra={"cuda_graph_max_batch_size": 256, "cuda_graph_padding": False},
    )
    engine = load_engine("trtllm", model=str(model_dir), **engine_settings(spec))
    llm = trt.LLM.instances[-1]
    assert (llm.args["max_batch_size"], llm.args["max_num_tokens"]) == (512, 8192)
    assert llm.args["cuda_graph_config"] == CudaGraphConfig(max_batch_size=256)
    engine.shutdown()

    engine_for(model_dir, cuda_graphs=False).shutdown()
    assert trt.LLM.instances[-1].args["cuda_graph_config"] is None

    # Constructed directly: TensorRT-LLM's own throughput defaults, with graphs padded up to
    # 256 rather than to the batch of 2,048 (tests/unit/test_trtllm_library.py, item 6).
    engine_for(model_dir).shutdown()
    args = trt.LLM.instances[-1].args
    assert (args["max_batch_size"], args["max_num_tokens"]) == (2048, 8192)
    assert args["cuda_graph_config"] == CudaGraphConfig(max_batch_size=256, enable_padding=True)

    # The TensorRT backend takes no CUDA graph config (it would raise).
    engine_for(model_dir, backend="tensorrt").shutdown()
    assert "cuda_graph_config" not in trt.LLM.instances[-1].args


# --- 8. shared admission and checkpoint facts ------------------------------------------------


def test_admission_and_checkpoint_facts_are_the_shared_ones(trt, tmp_path):
    model = make_checkpoint(tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": 9}))
    engine = engine_for(model, max_model_len=64)
    # config.json first, then generation_config.json (engines.requests.eos_token_ids).
    assert engine.info.eos_token_ids == (9, 5, 6)

    async def go():
        oov = await engine.generate(GenerationRequest([1, 300], greedy(4)))
        full = await engine.generate(GenerationRequest(list(range(64)), greedy(4)))
        clipped = await engine.generate(GenerationRequest(list(range(60)), greedy(10)))
        return oov, full, clipped

    oov, full, clipped = run(go())
    assert oov.finish_reason == "error" and "vocabulary" in oov.error
    assert full.finish_reason == "error" and "max_model_len" in full.error
    assert clipped.finish_reason == "length" and clipped.completion_tokens == 4
    engine.shutdown()
