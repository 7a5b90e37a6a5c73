"""Penalties, logit bias, min_tokens, bad words and min_p on the TensorRT-LLM adapter: the
per-request logits processor (engines/trtllm_logits.py) edits a row exactly as the reference
engine does, the adapter sends it on the PyTorch backend (checked against the stand-in, written
to 1.2's signatures), and refuses what it cannot apply before any work."""

from __future__ import annotations

import asyncio
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engines.api import GenerationRequest, SamplingParams
from engines.reference.sampling.processing import LogitsProcessing
from engines.reference.sampling.sampler import _min_p
from engines.trtllm_logits import SamplingProcessor

STANDINS = Path(__file__).resolve().parents[1] / "standins"
PROMPT = [11, 42, 7, 30, 5]


def _forget_tensorrt_llm() -> None:
    for name in list(sys.modules):
        if name == "tensorrt_llm" or name.startswith("tensorrt_llm."):
            del sys.modules[name]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.dev.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("trt-sampling") / "llama", arch="llama")


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


def _run(engine, sampling: SamplingParams):
    async def go():
        return await engine.generate(GenerationRequest(list(PROMPT), sampling, request_id="r"))

    return asyncio.run(go())


# --- the processor ---------------------------------------------------------------------------


def test_processor_edits_a_row_as_the_reference_engine_does() -> None:
    params = SamplingParams(
        temperature=0.7,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=-0.25,
        logit_bias={3: 4.0, 9: -2.0},
        min_tokens=4,
        min_p=0.1,
    )
    output = [9, 3, 9]
    tokens = PROMPT + output
    raw = torch.randn(1, 64, generator=torch.Generator().manual_seed(1)) * 3
    processor = pickle.loads(pickle.dumps(SamplingProcessor(params, len(PROMPT), (2,), ((9, 8),))))
    got = raw.clone()
    processor(7, got, [tokens], None, None)

    reference = LogitsProcessing(64, torch.device("cpu"))
    reference.admit("r", params, PROMPT, (2,), [[9, 8]])

    live = SimpleNamespace(
        request=SimpleNamespace(request_id="r"),
        sched=SimpleNamespace(token_ids=tokens, num_prompt_tokens=len(PROMPT)),
    )
    expected = raw.clone()
    reference.apply(expected, [0], [live])
    kept = _min_p(expected / 0.7, [params]) > -torch.inf
    torch.testing.assert_close(got[kept], expected[kept])
    assert torch.isinf(got[~kept]).all()
    assert torch.isinf(got[0, [2, 8]]).all()  # min_tokens' EOS, the bad word's last token


# --- the adapter -----------------------------------------------------------------------------


def test_logit_bias_forces_a_token_on_the_pytorch_backend(trt, model_dir) -> None:
    engine = _engine(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={5: 100})
    result = _run(engine, params)
    assert result.output_token_ids == [5] * 6
    sent = trt.LLM.instances[-1].submitted[-1][1]
    assert isinstance(sent.logits_processor, list) and len(sent.logits_processor) == 1
    plain = _run(engine, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert trt.LLM.instances[-1].submitted[-1][1].logits_processor is None
    assert plain.output_token_ids != result.output_token_ids


def test_min_tokens_holds_off_a_favoured_eos(trt, model_dir) -> None:
    engine = _engine(model_dir)
    eos = engine.info.eos_token_ids[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, logit_bias={eos: 100}, min_tokens=4)
    result = _run(engine, params)
    assert result.finish_reason == "stop"
    assert len(result.output_token_ids) == 5 and result.output_token_ids[-1] == eos


@pytest.mark.parametrize(
    ("settings", "params", "message"),
    [
        ({"backend": "tensorrt"}, {"repetition_penalty": 1.2}, "backend pytorch"),
        ({"backend": "tensorrt"}, {"min_p": 0.1, "logit_bias": {3: 1}}, "min_p, logit_bias"),
        (
            {"speculative": {"method": "ngram", "num_tokens": 2}},
            {"frequency_penalty": 0.5},
            "engine.speculative",
        ),
        ({}, {"min_tokens": 2, "stop": ("x",)}, "stop strings"),
    ],
)
def test_what_cannot_be_applied_is_refused_before_any_work(
    trt, model_dir, settings, params, message
) -> None:
    engine = _engine(model_dir, **settings)
    result = _run(engine, SamplingParams(max_tokens=4, **params))
    assert result.finish_reason == "error" and message in result.error
    llm = (trt.LLM.instances or [None])[-1]
    if settings.get("backend") == "tensorrt":
        from tensorrt_llm._tensorrt_engine import LLM as TensorrtLLM

        llm = TensorrtLLM.instances[-1]
    assert not llm.submitted
