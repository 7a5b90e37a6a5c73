"""Structured output and logprobs on the TensorRT-LLM adapter, against the stand-in (written to
TensorRT-LLM 1.2's signatures): the GuidedDecodingParams / SamplingParams each request sends,
the conversion of CompletionOutput.logprobs, and the combinations that stay refused."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from engines.api import GenerationRequest, ResponseFormat, SamplingParams
from pipeline.openai.response_format import conforms

STANDINS = Path(__file__).resolve().parents[1] / "standins"
PROMPT = [11, 42, 7, 30, 5]
SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}


def _forget_tensorrt_llm() -> None:
    for name in list(sys.modules):
        if name == "tensorrt_llm" or name.startswith("tensorrt_llm."):
            del sys.modules[name]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.dev.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("trt-guided") / "llama", arch="llama")


@pytest.fixture
def trt(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(STANDINS))
    _forget_tensorrt_llm()
    import tensorrt_llm

    assert tensorrt_llm.IS_STANDIN
    tensorrt_llm.LLM.instances.clear()
    yield tensorrt_llm
    _forget_tensorrt_llm()


def _engine(model_dir: Path, **kw):
    from engines.trtllm import TrtllmEngine

    return TrtllmEngine(str(model_dir), check_gpu=False, max_model_len=256, **kw)


def _run(engine, sampling: SamplingParams, rid: str = "r"):
    async def go():
        return await engine.generate(GenerationRequest(list(PROMPT), sampling, request_id=rid))

    return asyncio.run(go())


def _sent(trt):
    return trt.LLM.instances[-1].submitted[-1][1]


@pytest.mark.parametrize("backend", ["pytorch", "tensorrt"])
def test_both_backends_are_built_with_the_xgrammar_guide(trt, model_dir, backend) -> None:
    _engine(model_dir, backend=backend)
    llm = (trt.LLM.instances or [None])[-1]
    if backend == "tensorrt":
        from tensorrt_llm._tensorrt_engine import LLM as TensorrtLLM

        llm = TensorrtLLM.instances[-1]
    assert llm.args["guided_decoding_backend"] == "xgrammar"


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        (ResponseFormat.json(SCHEMA), {"json": json.dumps(SCHEMA, sort_keys=True)}),
        # Not json_object=True: xgrammar's built-in JSON grammar admits any JSON value.
        (ResponseFormat("json_object"), {"json": '{"type": "object"}'}),
        (ResponseFormat("regex", regex="[ab]{3}"), {"regex": "[ab]{3}"}),
        (
            ResponseFormat("choice", choices=("left", 'say "hi"')),
            {"grammar": 'root ::= "left" | "say \\"hi\\""'},
        ),
    ],
)
def test_each_format_becomes_exactly_one_guide(trt, model_dir, fmt, expected) -> None:
    engine = _engine(model_dir)
    sampling = SamplingParams(max_tokens=24, temperature=0.0, response_format=fmt)
    result = _run(engine, sampling)
    guide = _sent(trt).guided_decoding
    assert guide == trt.GuidedDecodingParams(**expected)
    assert result.error is None
    if result.finish_reason == "stop":  # json_object may run to max_tokens
        assert conforms(fmt, result.text), result.text


def test_free_text_sends_no_guide_and_no_logprobs(trt, model_dir) -> None:
    _run(_engine(model_dir), SamplingParams(max_tokens=3, temperature=0.0))
    sent = _sent(trt)
    assert sent.guided_decoding is None and sent.logprobs is None and sent.prompt_logprobs is None


@pytest.mark.parametrize(("k", "sent_k"), [(0, 1), (1, 1), (5, 5)])
def test_logprobs_k_is_sent_at_least_one(trt, model_dir, k, sent_k) -> None:
    sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=k)
    result = _run(_engine(model_dir), sampling)
    assert _sent(trt).logprobs == sent_k  # TensorRT-LLM reads 0 as "off"
    assert [lp.token_id for lp in result.logprobs] == result.output_token_ids
    for lp in result.logprobs:
        assert len(lp.top) == k
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        if k:
            assert lp.top[0] == (lp.token_id, pytest.approx(lp.logprob))  # greedy: the top


def test_stream_deltas_carry_their_tokens_logprobs(trt, model_dir) -> None:
    engine = _engine(model_dir)
    sampling = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)

    async def go():
        deltas = []
        async for d in engine.stream(GenerationRequest(list(PROMPT), sampling, request_id="s")):
            deltas.append(d)
        return deltas

    deltas = asyncio.run(go())
    streamed = [lp for d in deltas for lp in (d.logprobs or [])]
    final = deltas[-1].result
    assert [lp.token_id for lp in streamed] == final.output_token_ids
    assert streamed == final.logprobs


def test_sampled_tokens_outside_the_top_k_keep_their_own_logprob(trt, model_dir) -> None:
    sampling = SamplingParams(max_tokens=6, temperature=1.0, top_k=6, ignore_eos=True, logprobs=1)
    result = _run(_engine(model_dir), sampling)
    assert result.ok, result.error
    for lp in result.logprobs:
        assert len(lp.top) == 1 and lp.logprob <= lp.top[0][1] + 1e-9


def test_a_position_without_the_chosen_token_is_a_row_error() -> None:
    from engines.trtllm import _Accounting, _StopRules

    request = GenerationRequest([1, 2], SamplingParams(max_tokens=2, logprobs=1), "m")
    rules = _StopRules((), (), frozenset(), keep_end_id=False)
    logprob = SimpleNamespace
    completion = SimpleNamespace(
        token_ids=[7, 8],
        text="ab",
        finish_reason="length",
        stop_reason=None,
        logprobs=[{7: logprob(logprob=-0.1, rank=1)}, {9: logprob(logprob=-0.2, rank=1)}],
    )
    out = SimpleNamespace(outputs=[completion], cached_tokens=0)
    result = _Accounting(request, rules, SimpleNamespace(end_id=None)).result(out, 0.0)
    assert result.finish_reason == "error" and "output token 1" in result.error


def test_plain_float_logprobs_give_the_chosen_token_only() -> None:
    from engines.trtllm import _token_logprob

    lp = _token_logprob(7, -0.25, 3, 0)
    assert (lp.token_id, lp.logprob, lp.top) == (7, -0.25, ())


def test_prompt_logprobs_are_refused(trt, model_dir) -> None:
    sampling = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    result = _run(_engine(model_dir), sampling)
    assert result.finish_reason == "error" and "prompt_logprobs" in result.error


def test_logprobs_on_the_tensorrt_backend_are_refused(trt, model_dir) -> None:
    sampling = SamplingParams(max_tokens=2, temperature=0.0, logprobs=1)
    result = _run(_engine(model_dir, backend="tensorrt"), sampling)
    assert result.finish_reason == "error" and "backend pytorch" in result.error


def test_the_standin_refuses_two_guides_and_llguidance_on_tensorrt(trt, model_dir) -> None:
    with pytest.raises(ValueError, match="Only one guide"):
        trt.SamplingParams(guided_decoding=trt.GuidedDecodingParams(regex="a", json_object=True))
    from tensorrt_llm._tensorrt_engine import LLM as TensorrtLLM

    with pytest.raises(ValueError, match="guided decoding backend"):
        TensorrtLLM(str(model_dir), guided_decoding_backend="llguidance")
