"""GPU capability checks against simulated devices (torch.cuda monkeypatched)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engines import gpu
from engines.api import EngineError

H200 = ("NVIDIA H200", (9, 0))
B200 = ("NVIDIA B200", (10, 0))
A100 = ("NVIDIA A100-SXM4-80GB", (8, 0))
L40S = ("NVIDIA L40S", (8, 9))
RTX_PRO = ("NVIDIA RTX PRO 6000 Blackwell", (12, 0))


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch):
    import torch

    def install(device: tuple[str, tuple[int, int]] | None) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: device is not None)
        if device is not None:
            monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: device[0])
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: device[1])

    return install


def checkpoint(tmp_path: Path, algo: str | None, kv: str | None = None) -> Path:
    (tmp_path / "config.json").write_text("{}")
    if algo is not None or kv is not None:
        quant = {"quant_algo": algo, "kv_cache_quant_algo": kv, "exclude_modules": ["lm_head"]}
        (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": quant}))
    return tmp_path


@pytest.mark.parametrize(
    ("device", "algo", "kv", "ok"),
    [
        (H200, "FP8", None, True),
        (H200, "FP8", "FP8", True),
        (L40S, "FP8", "FP8", True),
        (A100, "FP8", None, False),
        (A100, None, "FP8", False),
        (A100, None, None, True),
        (H200, "NVFP4", None, False),
        (B200, "NVFP4", "FP8", True),
        (RTX_PRO, "NVFP4", None, True),
    ],
)
def test_capability_matrix(tmp_path, fake_gpu, device, algo, kv, ok):
    fake_gpu(device)
    model = checkpoint(tmp_path, algo, kv)
    if ok:
        found = gpu.check_quantization_support(model)
        assert found.version == device[1]
        return
    with pytest.raises(EngineError) as info:
        gpu.check_quantization_support(model)
    message = str(info.value)
    major, minor = device[1]
    # The message names the GPU, its capability and what is needed.
    assert device[0] in message and f"{major}.{minor}" in message
    assert ("10.0" if algo == "NVFP4" else "8.9") in message


def test_no_cuda_is_a_clear_error(tmp_path, fake_gpu):
    fake_gpu(None)
    with pytest.raises(EngineError, match=r"no CUDA device.*engine.kind: reference"):
        gpu.check_quantization_support(checkpoint(tmp_path, "FP8"))


def test_fp8_kv_cache_requested_without_scales(tmp_path, fake_gpu):
    fake_gpu(H200)
    with pytest.raises(EngineError, match=r"no FP8 KV cache scales.*--kv-cache fp8"):
        gpu.check_quantization_support(checkpoint(tmp_path, "FP8"), kv_cache_dtype="fp8")
    gpu.check_quantization_support(checkpoint(tmp_path, "FP8", "FP8"), kv_cache_dtype="fp8")


def test_unknown_algo_and_bad_json(tmp_path, fake_gpu):
    fake_gpu(B200)
    with pytest.raises(EngineError, match=r"W4A16_AWQ.*not supported"):
        gpu.check_quantization_support(checkpoint(tmp_path, "W4A16_AWQ"))
    (tmp_path / "hf_quant_config.json").write_text("{not json")
    with pytest.raises(EngineError, match="not valid JSON"):
        gpu.read_checkpoint_quantization(tmp_path)


def test_reads_modelopt_layout(tmp_path):
    quant = gpu.read_checkpoint_quantization(checkpoint(tmp_path, "NVFP4", "FP8"))
    assert quant == gpu.CheckpointQuantization("NVFP4", "FP8")
    assert gpu.read_checkpoint_quantization(tmp_path / "missing") == gpu.CheckpointQuantization(
        None, None
    )
