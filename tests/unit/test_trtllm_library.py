"""Where TensorRT-LLM 1.2 is stricter than a kind stand-in would be, one section per behaviour
(docs/engines.md, "TensorRT-LLM as it behaves"): speculation that turns sampling greedy, the
sampled token's logprob, requests pickled into the executor's workers, the arguments each
backend refuses, length checks and shutdown, and the CUDA graphs captured. Each test checks the
stand-in (tests/standins/tensorrt_llm) behaves as the library does, and the adapter with it."""

from __future__ import annotations

import asyncio
import pickle
import threading
from pathlib import Path

import pytest

from engines.api import EngineDeadError, EngineError, GenerationRequest, SamplingParams
from tests.unit.test_trtllm import engine_for, greedy, make_checkpoint, run, toy_tokens, trt

__all__ = ["trt"]  # the fixture, imported for pytest

PROMPT = [20, 21, 22]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "llama-fp8")


def sampled(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, seed=3, **kw)


async def _standin_result(llm, prompt: list[int], params):
    out = llm.generate_async(prompt, params)
    return await out.aresult()


# --- 1. speculation that decodes every request greedily --------------------------------------


@pytest.mark.parametrize(
    "speculative",
    [{"method": "eagle3", "num_tokens": 3, "model": "/heads/e3"}, {"method": "mtp"}],
)
def test_one_model_speculation_keeps_rows_sampled(trt, model_dir, speculative):
    engine = engine_for(model_dir, speculative=speculative)
    config = trt.LLM.instances[-1].args["speculative_config"]
    assert config.allow_advanced_sampling and not config.samples_greedily
    row = run(engine.generate(GenerationRequest(PROMPT, sampled(12))))
    assert row.ok and row.output_token_ids != toy_tokens(PROMPT, 12)  # not the greedy tokens
    engine.shutdown()


def test_the_standin_decodes_greedily_without_allow_advanced_sampling(trt, model_dir):
    from tensorrt_llm.llmapi import Eagle3DecodingConfig

    llm = trt.LLM(
        str(model_dir),
        speculative_config=Eagle3DecodingConfig(max_draft_len=3, speculative_model="/heads/e3"),
    )
    params = trt.SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    out = run(_standin_result(llm, PROMPT, params))
    assert out.outputs[0].token_ids == toy_tokens(PROMPT, 12)  # silently greedy, as in 1.2


def test_a_version_without_the_switch_refuses_sampled_rows_by_name(trt, model_dir, monkeypatch):
    from tensorrt_llm.llmapi import Eagle3DecodingConfig, MTPDecodingConfig

    for cls in (Eagle3DecodingConfig, MTPDecodingConfig):
        fields = dict(cls.__dataclass_fields__)
        del fields["allow_advanced_sampling"]
        monkeypatch.setattr(cls, "__dataclass_fields__", fields)
    engine = engine_for(model_dir, speculative={"method": "mtp"})
    refused = run(engine.generate(GenerationRequest(PROMPT, sampled(4))))
    assert refused.finish_reason == "error" and "allow_advanced_sampling" in refused.error
    assert run(engine.generate(GenerationRequest(PROMPT, greedy(4)))).ok
    engine.shutdown()


# --- 2. the sampled token's logprob ----------------------------------------------------------


def test_the_standin_leaves_a_sampled_token_outside_the_top_k_out(trt, model_dir):
    llm = trt.LLM(str(model_dir))
    params = trt.SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, logprobs=1)
    out = run(_standin_result(llm, PROMPT, params)).outputs[0]
    missing = [t for t, entry in zip(out.token_ids, out.logprobs, strict=True) if t not in entry]
    assert missing  # what TorchSampler returns: the top 1, whatever was sampled


def test_sampled_rows_with_top_k_get_their_tokens_logprob(trt, model_dir):
    engine = engine_for(model_dir)
    row = run(engine.generate(GenerationRequest(PROMPT, sampled(12, top_k=8, logprobs=1))))
    assert row.ok, row.error
    assert row.output_token_ids != toy_tokens(PROMPT, 12)
    assert [lp.token_id for lp in row.logprobs] == row.output_token_ids
    assert all(len(lp.top) == 1 and lp.logprob <= lp.top[0][1] for lp in row.logprobs)
    assert trt.LLM.instances[-1].submitted[-1][1].logprobs == 8  # its top_k: all it can draw
    run(engine.generate(GenerationRequest(PROMPT, greedy(4, logprobs=2))))
    assert trt.LLM.instances[-1].submitted[-1][1].logprobs == 2  # greedy: rank 1 always
    engine.shutdown()


@pytest.mark.parametrize("top_k", [0, 65])
def test_sampled_rows_that_could_draw_from_the_tail_are_refused_before_running(
    trt, model_dir, top_k
):
    engine = engine_for(model_dir)
    row = run(engine.generate(GenerationRequest(PROMPT, sampled(12, top_k=top_k, logprobs=1))))
    assert row.finish_reason == "error" and "top_k between 1 and 64" in row.error
    assert not trt.LLM.instances[-1].submitted  # no GPU time spent on it
    engine.shutdown()


def test_a_sampled_token_outside_what_came_back_names_the_position(trt):
    from tensorrt_llm.executor.result import Logprob

    from engines.trtllm import _MissingLogprob, _token_logprob

    entry = {t: Logprob(-0.1 * t, rank=t + 1) for t in range(20)}
    with pytest.raises(_MissingLogprob, match=r"output token 4 \(id 99.*temperature 0"):
        _token_logprob(99, entry, 1, 4)


# --- 3. requests cross a process boundary ----------------------------------------------------


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("this processor holds a lock")

    def __call__(self, *args):
        pass


def test_the_standin_pickles_what_crosses_to_the_workers(trt, model_dir):
    llm = trt.LLM(str(model_dir))
    params = trt.SamplingParams(max_tokens=2, logits_processor=_Unpicklable())
    with pytest.raises(TypeError, match="holds a lock"):
        llm.generate_async(PROMPT, params)


def test_the_adapters_processor_runs_as_a_copy_on_the_other_side(trt, model_dir):
    engine = engine_for(model_dir)
    row = run(
        engine.generate(
            GenerationRequest(PROMPT, greedy(6, presence_penalty=2.0, logit_bias=((30, -100.0),)))
        )
    )
    assert row.ok and 30 not in row.output_token_ids
    sent = trt.LLM.instances[-1].submitted[-1][1].logits_processor
    assert sent is not None
    pickle.loads(pickle.dumps(sent))  # and again: nothing in it is bound to this process
    engine.shutdown()


# --- 4. arguments each backend refuses --------------------------------------------------------


def test_the_standin_takes_the_arguments_of_the_shared_table(trt, model_dir):
    from tensorrt_llm._tensorrt_engine import LLM as TensorrtEngineLLM

    from engines.trtllm_args import PARALLEL_ARGS

    for name in ("batching_type", "normalize_log_probs"):
        with pytest.raises(ValueError, match=f"{name} is only supported by the tensorrt"):
            trt.LLM(str(model_dir), **{name: None})
        TensorrtEngineLLM(str(model_dir), **{name: None})
    with pytest.raises(ValueError, match="Invalid argument: kv_cache_dtype"):
        trt.LLM(str(model_dir), kv_cache_dtype="fp8")
    assert "pp_partition" in PARALLEL_ARGS
    trt.LLM(str(model_dir), pipeline_parallel_size=2, pp_partition=[10, 6])


def test_pp_partition_passes_through_the_adapter(trt, model_dir):
    from engines.trtllm import SETTINGS

    assert "pp_partition" in SETTINGS
    engine_for(model_dir, pipeline_parallel_size=2, pp_partition=[10, 6]).shutdown()
    args = trt.LLM.instances[-1].args
    assert (args["pipeline_parallel_size"], args["pp_partition"]) == (2, [10, 6])


# --- 5. length checks and shutdown ------------------------------------------------------------


def test_the_standin_clamps_length_on_pytorch_and_refuses_it_on_tensorrt(trt, model_dir):
    from tensorrt_llm._tensorrt_engine import LLM as TensorrtEngineLLM

    llm = trt.LLM(str(model_dir), max_seq_len=10)
    params = trt.SamplingParams(max_tokens=50, ignore_eos=True)
    out = run(_standin_result(llm, PROMPT, params)).outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert params.max_tokens == 50  # lowered on the worker's copy, not the caller's
    with pytest.raises(ValueError, match="fills max_seq_len"):
        llm.generate_async(list(range(10)), trt.SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        TensorrtEngineLLM(str(model_dir), max_seq_len=10).generate_async(PROMPT, params)


@pytest.mark.parametrize("backend", ["pytorch", "tensorrt"])
def test_rows_past_the_context_end_at_length_on_both_backends(trt, model_dir, backend):
    engine = engine_for(model_dir, backend=backend, max_model_len=12)
    row = run(engine.generate(GenerationRequest(PROMPT, greedy(50, ignore_eos=True))))
    assert row.ok and row.finish_reason == "length" and row.completion_tokens == 9
    engine.shutdown()


def test_the_standin_shutdown_cancels_what_is_in_flight(trt, model_dir):
    llm = trt.LLM(str(model_dir))
    llm.step_seconds = 0.01

    async def go():
        out = llm.generate_async(PROMPT, trt.SamplingParams(max_tokens=1000, ignore_eos=True))
        await asyncio.sleep(0.05)
        llm.shutdown()
        return await out.aresult()

    out = run(go()).outputs[0]
    assert out.finish_reason == "cancelled" and 0 < len(out.token_ids) < 1000


def test_shutdown_ends_rows_in_flight_cancelled_never_complete(trt, model_dir):
    engine = engine_for(model_dir)
    trt.LLM.instances[-1].step_seconds = 0.01

    async def go():
        row = asyncio.ensure_future(
            engine.generate(GenerationRequest(PROMPT, greedy(1000, ignore_eos=True)))
        )
        await asyncio.sleep(0.05)
        threading.Thread(target=engine.shutdown).start()  # as an actor's shutdown call
        return await row

    row = run(go())
    assert row.finish_reason == "cancelled" and row.error is None
    assert 0 < row.completion_tokens < 1000
    with pytest.raises(EngineDeadError, match="shut down"):
        run(engine.generate(GenerationRequest(PROMPT, greedy(2))))


# --- 6. CUDA graphs -----------------------------------------------------------------------------


def test_the_standin_generates_the_captured_sizes_as_the_library(trt):
    from tensorrt_llm.llmapi import CudaGraphConfig

    assert CudaGraphConfig().max_batch_size == 128
    sizes = CudaGraphConfig(max_batch_size=2048, enable_padding=True).batch_sizes
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-4:] == [256, 512, 1024, 2048] and len(sizes) == 23
    assert CudaGraphConfig(batch_sizes=[8, 1, 4]).max_batch_size == 8


@pytest.mark.parametrize(
    ("settings", "top"),
    [
        ({}, 256),  # not TensorRT-LLM's 2,048: ~20 graphs, none of the largest
        ({"actors_per_device": 2}, 128),  # two engines on one GPU share its memory
        ({"actors_per_device": 4}, 64),
        ({"max_batch_size": 96}, 96),
        ({"cuda_graph_max_batch_size": 1024}, 1024),  # the job's own size wins
    ],
)
def test_captured_batch_sizes_follow_the_job(trt, model_dir, settings, top):
    engine_for(model_dir, **settings).shutdown()
    config = trt.LLM.instances[-1].args["cuda_graph_config"]
    assert config.max_batch_size == top == config.batch_sizes[-1] and config.enable_padding
    assert len(config.batch_sizes) <= 23


def test_a_captured_size_above_the_batch_is_refused_by_name(trt, model_dir):
    with pytest.raises(EngineError, match=r"cuda_graph_max_batch_size 512 .*max_batch_size \(64"):
        engine_for(model_dir, max_batch_size=64, cuda_graph_max_batch_size=512)


@pytest.mark.parametrize(("devices", "actors"), [(0.5, 2), (0.25, 4), (0.3, 3), (1, None)])
def test_actors_sharing_a_gpu_are_told_how_many(devices, actors):
    from pipeline.engine_setup import placement_settings
    from pipeline.spec import EngineSpec

    settings = placement_settings(EngineSpec(kind="trtllm"), devices)
    assert settings.get("actors_per_device") == actors
    assert placement_settings(EngineSpec(kind="reference"), devices) == {}


# --- the GPU check's library section, on the stand-in -----------------------------------------


def test_the_device_checks_library_section_runs_on_the_standin(trt, tmp_path):
    from engines.dev.tiny import make_tiny_model
    from tests.gpu.library_checks import run_all

    model = make_tiny_model(tmp_path / "llama", arch="llama")
    report = run_all(model, rows=4, max_tokens=8, standin=True)
    speculation = report["sampling_under_speculation"]
    assert speculation["errors"] == [] and speculation["sampled_differ_from_greedy"] > 0
    logprobs = report["sampled_logprobs"]
    assert logprobs["rows_with_every_logprob"] == 4 and logprobs["errors"] == []
    assert logprobs["library_sampled_token_left_out"] > 0  # what 1.2's TorchSampler does
    graphs = report["cuda_graph_memory"]
    assert (graphs["default_256"]["graphs"], graphs["library_2048"]["graphs"]) == (20, 23)
    assert graphs["none"]["graphs"] == 0
