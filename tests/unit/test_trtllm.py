"""The TensorRT-LLM adapter against the stand-in package (tests/standins/tensorrt_llm, written
to the TensorRT-LLM 1.2 signatures): argument mapping, result mapping, error paths."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import sys
import time
from pathlib import Path

import pytest

from engines.api import (
    EngineDeadError,
    EngineError,
    GenerationRequest,
    SamplingParams,
)

STANDINS = Path(__file__).resolve().parents[1] / "standins"


def _forget_tensorrt_llm() -> None:
    for name in list(sys.modules):
        if name == "tensorrt_llm" or name.startswith("tensorrt_llm."):
            del sys.modules[name]


@pytest.fixture
def trt(monkeypatch: pytest.MonkeyPatch):
    """The stand-in `tensorrt_llm` on sys.path and an H200 as the visible GPU."""
    import torch

    monkeypatch.syspath_prepend(str(STANDINS))
    _forget_tensorrt_llm()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    import tensorrt_llm

    assert tensorrt_llm.IS_STANDIN
    tensorrt_llm.LLM.instances.clear()
    yield tensorrt_llm
    _forget_tensorrt_llm()


def make_checkpoint(
    root: Path, algo: str | None = "FP8", kv: str | None = "FP8", eos: list[int] | None = None
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 256}
    (root / "config.json").write_text(json.dumps({**config, "vocab_size": 256}))
    eos = [5, 6] if eos is None else eos
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    if algo:
        quant = {"quant_algo": algo, "kv_cache_quant_algo": kv}
        (root / "hf_quant_config.json").write_text(json.dumps({"quantization": quant}))
    return root


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "llama-fp8")


def engine_for(model_dir: Path, **settings):
    from engines.trtllm import TrtllmEngine

    return TrtllmEngine(str(model_dir), **settings)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def run(coro):
    return asyncio.run(coro)


def toy_tokens(prompt: list[int], n: int) -> list[int]:
    return [(sum(prompt) + 7 * i) % 50 + 10 for i in range(n)]


def test_pytorch_backend_argument_mapping(trt, model_dir):
    from tensorrt_llm.llmapi import CapacitySchedulerPolicy, CudaGraphConfig, KvCacheConfig

    engine = engine_for(
        model_dir,
        max_batch_size=8,
        max_num_tokens=128,
        kv_cache_tokens=4096,
        kv_cache_memory_fraction=0.5,
        kv_cache_dtype="fp8",
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        dtype="bfloat16",
        max_model_len=200,
        scheduler_policy="max_utilization",
    )
    llm = trt.LLM.instances[-1]
    assert llm.backend == "pytorch" and llm.args["model"] == str(model_dir)
    assert llm.args["max_batch_size"] == 8 and llm.args["max_num_tokens"] == 128
    assert llm.args["max_seq_len"] == 200 and llm.args["max_input_len"] == 200
    assert llm.args["dtype"] == "bfloat16" and llm.args["enable_chunked_prefill"] is False
    assert llm.args["return_perf_metrics"] is True
    assert "quant_config" not in llm.args  # the PyTorch backend never gets one
    assert llm.args["kv_cache_config"] == KvCacheConfig(
        enable_block_reuse=False, free_gpu_memory_fraction=0.5, max_tokens=4096, dtype="fp8"
    )
    policy = llm.args["scheduler_config"].capacity_scheduler_policy
    assert policy is CapacitySchedulerPolicy.MAX_UTILIZATION
    assert llm.args["cuda_graph_config"] == CudaGraphConfig(max_batch_size=8, enable_padding=True)
    info = engine.info
    assert (info.kind, info.max_model_len, info.has_step_records) == ("trtllm", 200, False)
    assert info.eos_token_ids == (5, 6)
    engine.shutdown()


def test_job_engine_settings_are_all_accepted(trt, model_dir):
    from engines import load_engine
    from pipeline.engine_setup import engine_settings
    from pipeline.spec import EngineSpec

    settings = engine_settings(EngineSpec(kind="trtllm"))
    engine = load_engine("trtllm", model=str(model_dir), **settings)
    llm = trt.LLM.instances[-1]
    assert llm.args["max_seq_len"] == 256  # from config.json's max_position_embeddings
    assert llm.args["kv_cache_config"].dtype == "auto"
    engine.shutdown()


def test_missing_package_names_the_extra(monkeypatch, model_dir):
    import torch

    _forget_tensorrt_llm()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # import raises ImportError
    with pytest.raises(EngineError, match=r"pip install 'tokenmill\[trtllm\]'"):
        engine_for(model_dir)


def test_bad_settings(trt, model_dir):
    with pytest.raises(TypeError, match=r"unknown setting.*max_tokens_per_step"):
        engine_for(model_dir, max_tokens_per_step=3)
    with pytest.raises(EngineError, match="scheduler_policy 'fifo'"):
        engine_for(model_dir, scheduler_policy="fifo")
    with pytest.raises(EngineError, match="quantize needs backend: tensorrt"):
        engine_for(model_dir, quantize="fp8")
    assert trt.LLM.instances == []


def test_wrong_gpu_fails_before_loading(trt, tmp_path, monkeypatch):
    nvfp4 = make_checkpoint(tmp_path / "nvfp4", algo="NVFP4", kv=None)
    with pytest.raises(EngineError, match=r"NVIDIA H200 \(compute capability 9.0\).*10.0"):
        engine_for(nvfp4)
    assert trt.LLM.instances == []


def test_standin_rejects_what_the_real_llm_rejects(trt, model_dir):
    from tensorrt_llm._tensorrt_engine import LLM as TensorrtEngineLLM
    from tensorrt_llm.llmapi import QuantAlgo, QuantConfig

    with pytest.raises(ValueError, match="quant_config"):
        trt.LLM(str(model_dir), quant_config=QuantConfig(quant_algo=QuantAlgo.FP8))
    with pytest.raises(ValueError, match="Invalid argument"):
        trt.LLM(str(model_dir), max_tokens=3)
    with pytest.raises(ValueError, match="cuda_graph_config"):
        TensorrtEngineLLM(str(model_dir), cuda_graph_config=None)


def test_generate_maps_result_and_metrics(trt, model_dir):
    engine = engine_for(model_dir)
    prompt = [11, 12, 13]
    before = time.monotonic()
    result = run(engine.generate(GenerationRequest(prompt, greedy(6), request_id="r1")))
    after = time.monotonic()
    assert result.request_id == "r1" and result.ok
    assert result.output_token_ids == toy_tokens(prompt, 6)
    assert result.text == "".join(f"<{t}>" for t in toy_tokens(prompt, 6))
    assert result.finish_reason == "length"
    assert (result.prompt_tokens, result.completion_tokens) == (3, 6)
    m = result.metrics
    assert before <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time
    assert m.first_token_time <= m.finish_time <= after
    _, params, streaming = trt.LLM.instances[-1].submitted[0]
    assert not streaming
    assert params.max_tokens == 6 and params.top_k == 1 and params.return_perf_metrics
    engine.shutdown()


def test_sampling_mapping(trt, model_dir):
    engine = engine_for(model_dir)
    sampling = SamplingParams(
        max_tokens=3, temperature=0.7, top_p=0.9, top_k=0, seed=4, stop=("x",), ignore_eos=True
    )
    run(engine.generate(GenerationRequest([1, 2], sampling)))
    _, params, _ = trt.LLM.instances[-1].submitted[0]
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.7, 0.9, 0, 4)
    assert params.stop == ["x"] and params.stop_token_ids is None and params.ignore_eos
    assert params.include_stop_str_in_output  # stop ids stay in token_ids, as counted
    engine.shutdown()


def test_stop_token_finishes_with_stop(trt, model_dir):
    engine = engine_for(model_dir)
    prompt = [20, 21]
    third = toy_tokens(prompt, 3)[2]
    result = run(engine.generate(GenerationRequest(prompt, greedy(10, stop_token_ids=(third,)))))
    assert result.finish_reason == "stop" and result.stop_reason == third
    assert result.output_token_ids == toy_tokens(prompt, 3)
    engine.shutdown()


def test_prefix_cache_hits_are_cached_prompt_tokens(trt, model_dir):
    engine = engine_for(model_dir)
    shared = list(range(100, 170))  # 70 tokens: two full 32-token blocks

    async def both():
        first = await engine.generate(GenerationRequest([*shared, 1], greedy(2)))
        second = await engine.generate(GenerationRequest([*shared, 2], greedy(2)))
        return first, second

    first, second = run(both())
    assert (first.cached_prompt_tokens, second.cached_prompt_tokens) == (0, 64)
    engine.shutdown()


def test_too_long_prompts_are_row_errors_and_max_tokens_is_clipped(trt, model_dir):
    engine = engine_for(
        model_dir, max_num_tokens=64, enable_chunked_prefill=False, max_model_len=100
    )

    async def go():
        over_step = await engine.generate(GenerationRequest(list(range(70)), greedy(4)))
        over_len = await engine.generate(GenerationRequest(list(range(60)), greedy(50)))
        empty = await engine.generate(GenerationRequest([], greedy(4)))
        fine = await engine.generate(GenerationRequest(list(range(60)), greedy(4)))
        return over_step, over_len, empty, fine

    over_step, over_len, empty, fine = run(go())
    assert over_step.finish_reason == "error" and "max_num_tokens (64)" in over_step.error
    assert "enable_chunked_prefill" in over_step.error
    # As the reference engine: max_tokens is clipped to the context, ending with "length".
    assert over_len.ok and over_len.finish_reason == "length"
    assert over_len.completion_tokens == 40
    assert empty.finish_reason == "error" and "empty" in empty.error
    assert fine.ok
    submitted = trt.LLM.instances[-1].submitted
    assert [params.max_tokens for _, params, _ in submitted] == [40, 4]
    engine.shutdown()


def test_abort_returns_cancelled(trt, model_dir):
    engine = engine_for(model_dir)

    async def go():
        task = asyncio.create_task(engine.generate(GenerationRequest([1], greedy(200), "a")))
        for _ in range(5):
            await asyncio.sleep(0)
        assert engine.stats().num_running == 1
        engine.abort("a")
        return await task

    result = run(go())
    assert result.finish_reason == "cancelled"
    assert 0 < result.completion_tokens < 200
    assert engine.stats().num_running == 0
    engine.shutdown()


def test_stream_deltas_add_up_and_early_close_aborts(trt, model_dir):
    engine = engine_for(model_dir)
    prompt = [3, 4, 5]

    async def full():
        deltas = [d async for d in engine.stream(GenerationRequest(prompt, greedy(5)))]
        return deltas

    deltas = run(full())
    assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])
    assert len(deltas) > 1
    result = deltas[-1].result
    assert [t for d in deltas for t in d.token_ids] == result.output_token_ids
    assert "".join(d.text for d in deltas) == result.text
    assert result.output_token_ids == toy_tokens(prompt, 5)
    assert trt.LLM.instances[-1].submitted[-1][2] is True  # streaming=True

    async def early_close():
        stream = engine.stream(GenerationRequest(prompt, greedy(200), "s"))
        await stream.__anext__()
        await stream.aclose()
        llm = trt.LLM.instances[-1]
        (out,) = list(llm.live.values())
        await out
        return out

    out = run(early_close())
    assert out.outputs[0].finish_reason == "cancelled"
    assert engine.stats().num_running == 0
    engine.shutdown()


def test_shutdown_is_idempotent_and_final(trt, model_dir):
    engine = engine_for(model_dir)
    engine.shutdown()
    engine.shutdown()
    assert trt.LLM.instances[-1].shutdown_calls == 1
    with pytest.raises(EngineDeadError):
        run(engine.generate(GenerationRequest([1], greedy(2))))


def test_tensorrt_backend_quantizes_and_syncs_build_cache(trt, model_dir, tmp_path):
    import fsspec
    from tensorrt_llm.llmapi import BuildCacheConfig, QuantAlgo

    engine = engine_for(
        model_dir,
        backend="tensorrt",
        quantize="fp8",
        kv_cache_dtype="fp8",
        max_batch_size=16,
        max_num_tokens=512,
        build_cache="memory://trt-cache/llama",
        build_cache_dir=str(tmp_path / "cache"),
    )
    llm = trt.LLM.instances[-1]
    assert llm.backend == "tensorrt"
    build = llm.args["build_config"]
    assert (build.max_batch_size, build.max_num_tokens, build.max_seq_len) == (16, 512, 256)
    quant = llm.args["quant_config"]
    assert (quant.quant_algo, quant.kv_cache_quant_algo) == (QuantAlgo.FP8, QuantAlgo.FP8)
    assert llm.args["enable_build_cache"] == BuildCacheConfig(cache_root=tmp_path / "cache")
    # The built engine went back to the shared cache for other nodes.
    assert fsspec.filesystem("memory").exists("/trt-cache/llama/engine.standin")
    engine.shutdown()

    with pytest.raises(EngineError, match=r"quantize: nvfp4.*10.0"):
        engine_for(model_dir, backend="tensorrt", quantize="nvfp4")


def test_metrics_on_another_clock_base_are_anchored_on_arrival(trt):
    from tensorrt_llm._core import TimingMetrics

    from engines.trtllm import _metrics

    class Perf:
        timing_metrics = TimingMetrics(
            arrival_time=dt.timedelta(seconds=1000.0),
            first_scheduled_time=dt.timedelta(seconds=1000.5),
            first_token_time=dt.timedelta(seconds=1001.0),
            last_token_time=dt.timedelta(seconds=1003.0),
        )

    arrival = 5_000_000.0
    m = _metrics(Perf(), arrival, [11, 12])
    assert m.arrival_time == arrival
    assert (m.queue_s, m.ttft_s, m.decode_s) == pytest.approx((0.5, 1.0, 2.0))


def test_timeout_finish_reason_is_an_error(trt, model_dir):
    from tensorrt_llm._core import CompletionOutput

    from engines.trtllm import _Accounting

    class Out:
        outputs = [CompletionOutput(index=0, token_ids=[1, 2], finish_reason="timeout")]
        cached_tokens = 0

    engine = engine_for(model_dir)
    request = GenerationRequest([1], greedy(4))
    accounting = _Accounting(request, engine._stop_rules(request), None)
    result = accounting.result(Out(), time.monotonic())
    assert result.finish_reason == "error" and "timed out" in result.error
    engine.shutdown()
