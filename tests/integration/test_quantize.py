"""Quantized builds of tiny Llama / Qwen models on CPU: export layout, reference-engine loading,
quality gate and artifact cache.

Exports are built once per module (ModelOpt import ~10 s, each build a few seconds) and shared.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

pytest.importorskip("modelopt.torch.quantization")

from engines.quantize.config import (
    CalibrationSpec,
    QualitySpec,
    QuantizationSpec,
    QuantizeError,
)

# Random tiny models have near-flat next-token distributions, so their quantized argmax flips
# often; these builds publish regardless and the tests check the numbers themselves.
LOOSE = QualitySpec(
    num_prompts=4,
    prompt_tokens=32,
    greedy_tokens=12,
    min_token_agreement=0.0,
    max_mean_kl=10.0,
    min_greedy_match=0.0,
)
CALIBRATION = CalibrationSpec(num_samples=16, max_length=64, batch_size=8)
# (name, arch, format, kv cache)
BUILDS = [
    ("llama-fp8", "llama", "fp8", None),
    ("llama-nvfp4", "llama", "nvfp4", None),
    ("llama-fp8-kvfp8", "llama", "fp8", "fp8"),
    ("qwen3-nvfp4-kvfp8", "qwen3", "nvfp4", "fp8"),
    ("qwen2-fp8", "qwen2", "fp8", None),
    ("qwen3moe-fp8-kvfp8", "qwen3_moe", "fp8", "fp8"),
    ("qwen3moe-nvfp4", "qwen3_moe", "nvfp4", None),
]


def spec_for(fmt: str, kv: str | None, **quality: float) -> QuantizationSpec:
    return QuantizationSpec(
        format=fmt,
        kv_cache=kv,
        calibration=CALIBRATION,
        quality=LOOSE.model_copy(update=quality),
        device="cpu",
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from engines.dev.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("quant-src")
    archs = ("llama", "qwen2", "qwen3", "qwen3_moe")
    return {arch: make_tiny_model(root / arch, arch=arch) for arch in archs}


@pytest.fixture(scope="module")
def builds(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    from engines.quantize.artifacts import build_or_reuse

    root = tmp_path_factory.mktemp("quant-out")
    results = {}
    for name, arch, fmt, kv in BUILDS:
        started = time.monotonic()
        result = build_or_reuse(models[arch], str(root / name), spec_for(fmt, kv))
        results[name] = (result, time.monotonic() - started)
    return results


def _tensors(export: Path):
    from safetensors.torch import load_file

    return load_file(str(export / "model.safetensors"))


def _check_down(tensors, down: str, fmt: str, hidden: int, inter: int) -> None:
    import torch

    if fmt == "fp8":
        assert tensors[f"{down}.weight"].dtype == torch.float8_e4m3fn
        assert tensors[f"{down}.weight"].shape == (hidden, inter)
        assert tensors[f"{down}.weight_scale"].shape == ()
        # weight_scale = amax / 448: the largest stored code reaches the FP8 maximum.
        assert tensors[f"{down}.weight"].float().abs().max() == pytest.approx(448, rel=0.07)
    else:
        assert tensors[f"{down}.weight"].dtype == torch.uint8
        assert tensors[f"{down}.weight"].shape == (hidden, inter // 2)
        assert tensors[f"{down}.weight_scale"].dtype == torch.float8_e4m3fn
        assert tensors[f"{down}.weight_scale"].shape == (hidden, inter // 16)
        assert tensors[f"{down}.weight_scale_2"].shape == ()
    assert tensors[f"{down}.input_scale"].dtype == torch.float32
    assert float(tensors[f"{down}.input_scale"]) > 0


@pytest.mark.parametrize(("name", "arch", "fmt", "kv"), BUILDS)
def test_export_layout(builds, name, arch, fmt, kv):
    import torch

    result, _ = builds[name]
    export = Path(result.uri)
    names = {p.name for p in export.iterdir()}
    assert {
        "config.json",
        "hf_quant_config.json",
        "model.safetensors",
        "quality_report.json",
        "tokenmill_artifact.json",
        "tokenizer.json",
    } <= names
    quant = json.loads((export / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == fmt.upper()
    assert quant["kv_cache_quant_algo"] == (kv.upper() if kv else None)
    assert "lm_head" in quant["exclude_modules"]
    config = json.loads((export / "config.json").read_text())
    assert config["quantization_config"]["quant_algo"] == fmt.upper()

    tensors = _tensors(export)
    src = json.loads((export / "config.json").read_text())
    hidden, inter = src["hidden_size"], src["intermediate_size"]
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32
    assert tensors["lm_head.weight"].dtype == torch.float32
    experts = src.get("num_local_experts", 0)
    if experts:  # Qwen3-MoE: every expert quantized under its own names, the router not
        inter = src["moe_intermediate_size"]
        assert quant["exclude_modules"].count("model.layers.0.mlp.gate") == 1
    for layer in range(src["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        if experts:
            assert tensors[f"{prefix}.mlp.gate.weight"].dtype == torch.float32
            assert f"{prefix}.mlp.experts.gate_up_proj" not in tensors  # not the fused layout
        mlps = [f"{prefix}.mlp.experts.{e}" for e in range(experts)] or [f"{prefix}.mlp"]
        for mlp in mlps:
            _check_down(tensors, f"{mlp}.down_proj", fmt, hidden, inter)
        if fmt == "nvfp4":
            # q/k/v read one input, so they share the global scales (as do gate/up).
            attn = f"{prefix}.self_attn"
            for suffix in ("weight_scale_2", "input_scale"):
                q = tensors[f"{attn}.q_proj.{suffix}"]
                assert torch.equal(q, tensors[f"{attn}.k_proj.{suffix}"])
                assert torch.equal(q, tensors[f"{attn}.v_proj.{suffix}"])
                for mlp in mlps:
                    gate = tensors[f"{mlp}.gate_proj.{suffix}"]
                    assert torch.equal(gate, tensors[f"{mlp}.up_proj.{suffix}"])
        has_kv = f"{prefix}.self_attn.k_proj.k_scale" in tensors
        assert has_kv == (kv is not None)
        if kv:
            assert float(tensors[f"{prefix}.self_attn.v_proj.v_scale"]) > 0
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in tensors


@pytest.mark.parametrize(("name", "arch", "fmt", "kv"), BUILDS)
def test_reference_engine_matches_fake_quant(builds, name, arch, fmt, kv):
    """Greedy tokens of the reference engine on the export == ModelOpt's fake-quant model's."""
    from engines import GenerationRequest, SamplingParams, load_engine

    result, _ = builds[name]
    samples = result.report["samples"]
    assert len(samples) == LOOSE.num_prompts
    engine = load_engine(
        "reference", model=result.uri, device="cpu", dtype="float32", max_num_tokens=256
    )

    async def run_all():
        requests = [
            GenerationRequest(
                s["prompt_token_ids"],
                SamplingParams(
                    max_tokens=len(s["output_token_ids"]), temperature=0.0, ignore_eos=True
                ),
            )
            for s in samples
        ]
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    try:
        outputs = asyncio.run(run_all())
    finally:
        engine.shutdown()
    # The engine and ModelOpt's fake-quant model compute the same function with different
    # summation orders (oneDNN, the CPU kernels); FP8 rounding of the activations turns a last-bit
    # difference into another FP8 code now and then, and greedy decoding parts there. So: every
    # sample's first token agrees (decided by the prompt: a wrong export shows here), and at most
    # one sample of the few parts later (measured: one qwen2-fp8 sample, at its third token).
    parted = []
    for i, (sample, out) in enumerate(zip(samples, outputs, strict=True)):
        assert out.ok, out.error
        expected = sample["output_token_ids"]
        assert out.output_token_ids[:1] == expected[:1], i
        if out.output_token_ids != expected:
            parted.append(i)
    assert len(parted) <= 1, parted


def test_quality_report(builds):
    reports = {name: builds[name][0].report for name, *_ in BUILDS}
    for name, report in reports.items():
        assert 0.0 <= report["token_agreement"] <= 1.0, name
        assert report["mean_kl"] >= 0.0
        assert report["num_positions"] > report["num_prompts"]
        assert report["passed"] is True and report["failures"] == []
        assert report["cache_inputs"]["versions"]["nvidia-modelopt"] == "0.47.0"
    # FP8 keeps 3 mantissa bits per value, NVFP4 one: its drift must be the larger one.
    assert reports["llama-fp8"]["mean_kl"] < reports["llama-nvfp4"]["mean_kl"]
    assert reports["llama-fp8"]["token_agreement"] > reports["llama-nvfp4"]["token_agreement"]


def test_second_build_reuses_artifact(builds, models, caplog):
    from engines.quantize.artifacts import build_or_reuse

    first, first_s = builds["llama-fp8"]
    assert not first.reused and first.calibration_batches == 2
    marker = Path(first.uri, "tokenmill_artifact.json").read_text()
    started = time.monotonic()
    with caplog.at_level("INFO", logger="engines.quantize.artifacts"):
        again = build_or_reuse(models["llama"], first.uri, spec_for("fp8", None))
    assert again.reused and again.calibration_batches == 0
    assert again.key == first.key and again.report == first.report
    assert time.monotonic() - started < first_s
    assert "no calibration" in caplog.text
    assert Path(first.uri, "tokenmill_artifact.json").read_text() == marker


def test_changed_inputs_change_the_key(builds, models, tmp_path):
    from engines.quantize.artifacts import build_or_reuse, cache_inputs, cache_key
    from engines.quantize.calibration import load_texts

    first, _ = builds["llama-fp8"]
    spec = spec_for("fp8", None)
    other = spec.model_copy(update={"calibration": CALIBRATION.model_copy(update={"seed": 1})})
    texts = load_texts(other.calibration, other.quality)
    assert cache_key(cache_inputs("x", other, texts.sha256)) != cache_key(
        cache_inputs("x", spec, load_texts(spec.calibration, spec.quality).sha256)
    )
    with pytest.raises(QuantizeError, match="built from other inputs"):
        build_or_reuse(models["llama"], first.uri, spec_for("fp8", "fp8"))


def test_failed_gate_publishes_only_the_report(models, tmp_path):
    from engines.quantize.artifacts import QualityGateFailed, build_or_reuse

    out = tmp_path / "strict"
    strict = spec_for("nvfp4", None, min_token_agreement=1.0, max_mean_kl=0.0)
    with pytest.raises(QualityGateFailed, match="min_token_agreement") as info:
        build_or_reuse(models["llama"], str(out), strict)
    assert sorted(p.name for p in out.iterdir()) == ["quality_report.json"]
    assert info.value.report["passed"] is False

    allowed = strict.model_copy(update={"allow_quality_failure": True})
    result = build_or_reuse(models["llama"], str(out), allowed)
    assert (out / "tokenmill_artifact.json").exists() and (out / "model.safetensors").exists()
    assert result.report["quality_failure_allowed"] is True
    marker = json.loads((out / "tokenmill_artifact.json").read_text())
    assert marker["quality_passed"] is False and marker["quality_failure_allowed"] is True


def test_unsupported_architecture_and_foreign_output(models, tmp_path):
    from engines.quantize.artifacts import build_or_reuse

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(QuantizeError, match=r"GPT2LMHeadModel.*not supported"):
        build_or_reuse(gpt2, str(tmp_path / "out"), spec_for("fp8", None))

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(QuantizeError, match="not empty and holds no quantized artifact"):
        build_or_reuse(models["llama"], str(busy), spec_for("fp8", None))
    assert (busy / "notes.txt").read_text() == "mine"


def test_unsupported_format_is_a_clear_error():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"fp8.*nvfp4"):
        QuantizationSpec(format="int4")


def test_job_builds_then_reuses_quantized_model(models, tmp_path, caplog):
    """A job naming model.quantization gets the artifact built once, then reused."""
    from pipeline.engine_setup import open_engine
    from pipeline.spec import EngineSpec, ModelSpec, StorageSpec

    model = ModelSpec(
        path=str(models["qwen2"]),
        name="tiny-qwen2",
        cache_dir=str(tmp_path / "models"),
        quantization=spec_for("fp8", "fp8").model_copy(
            update={"cache_uri": str(tmp_path / "quantized")}
        ),
    )
    engine_spec = EngineSpec(kind="reference", device="cpu", dtype="float32")
    with caplog.at_level("INFO", logger="engines.quantize"):
        first = open_engine(model, engine_spec, StorageSpec())
        first.shutdown()
        assert "calibrated fp8-kvfp8" in caplog.text
        caplog.clear()
        second = open_engine(model, engine_spec, StorageSpec())
        second.shutdown()
    assert "no calibration" in caplog.text and "calibrated" not in caplog.text
    (artifact,) = (p for p in (tmp_path / "quantized").iterdir() if p.is_dir())
    assert artifact.name.startswith("tiny-qwen2-fp8-kvfp8-")
    assert (artifact / "tokenmill_artifact.json").exists()
    assert second.info.model == str(artifact)
