"""engines.quantize.numerics against ModelOpt's own CPU code paths: the shared FP8 / NVFP4
math must be ModelOpt's, or the reference engine would drift from the scored model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("modelopt.torch.quantization")

from engines.quantize import numerics


def test_fp8_qdq_is_modelopt_fp8_eager():
    from modelopt.torch.quantization.tensor_quant import fp8_eager

    torch.manual_seed(0)
    x = torch.randn(64, 48) * 3
    amax = x.abs().amax()
    assert torch.equal(numerics.fp8_qdq(x, amax), fp8_eager(x, amax))
    assert torch.equal(numerics.fp8_qdq_scale(x, amax / 448), numerics.fp8_qdq(x, amax))
    # Saturation: values past amax clip to it instead of overflowing to NaN.
    assert numerics.fp8_qdq(torch.tensor([1e6]), torch.tensor(2.0)).item() == 2.0


def test_nvfp4_weight_qdq_matches_modelopt_export_roundtrip():
    """Fake-quant of a weight == ModelOpt's NVFP4QTensor quantize (what export writes) →
    our dequantization of the packed bytes and scales."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    torch.manual_seed(1)
    w = torch.randn(32, 64) * 0.2
    w[3, :16] = 0  # an all-zero block
    amax = w.abs().amax()
    scale_2 = amax.float() / (6.0 * 448.0)
    packed, block_scale, _ = NVFP4QTensor.quantize(w.clone(), 16, None, scale_2)
    assert packed._quantized_data.dtype == torch.uint8
    assert packed._quantized_data.shape == (32, 32) and block_scale.shape == (32, 4)
    from_export = numerics.dequantize_nvfp4_weight(packed._quantized_data, block_scale, scale_2)
    fake = numerics.nvfp4_qdq(w, amax)
    assert torch.allclose(from_export, fake, rtol=0, atol=1e-7)
    assert torch.all(fake[3, :16] == 0)


def test_e2m1_codes_unpack_low_nibble_first():
    # byte 0x2B: low nibble 0xB (sign, code 3 → -1.5), high nibble 0x2 (code 2 → 1.0)
    values = numerics.unpack_e2m1(torch.tensor([[0x2B, 0x70]], dtype=torch.uint8))
    assert values.tolist() == [[-1.5, 1.0, 0.0, 6.0]]


def test_e2m1_rounding_ties():
    x = torch.tensor([0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 9.0])
    expected = [0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0]
    assert numerics.e2m1_round(x).tolist() == expected


def test_nvfp4_qdq_error_is_bounded_and_shape_checked():
    torch.manual_seed(2)
    x = torch.randn(4, 8, 32)
    y = numerics.nvfp4_qdq(x, x.abs().amax())
    assert y.shape == x.shape and y.dtype == x.dtype
    relative = (y - x).norm() / x.norm()
    assert 0.02 < float(relative) < 0.2  # FP4 is lossy, but not garbage
    with pytest.raises(ValueError, match="multiple of 16"):
        numerics.nvfp4_qdq(torch.randn(2, 24), torch.tensor(1.0))


def test_cpu_backend_reproduces_modelopt_dynamic_block_quantizer():
    """The registered CPU backend gives ModelOpt's NVFP4 quantizer a forward on CPU."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    from engines.quantize.build import CPU_NVFP4_BACKEND, register_cpu_nvfp4_backend

    register_cpu_nvfp4_backend()
    quantizer = TensorQuantizer()
    quantizer.set_from_attribute_config(
        {
            "num_bits": (2, 1),
            "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)},
            "backend": CPU_NVFP4_BACKEND,
        }
    )
    x = torch.randn(8, 64)
    quantizer.amax = x.abs().amax()
    assert torch.equal(quantizer(x), numerics.nvfp4_qdq(x, x.abs().amax()))


def test_quantized_linears_follow_the_activation_dtype():
    from engines.reference.model.quant import Fp8Linear, Nvfp4Linear

    torch.manual_seed(3)
    w = torch.randn(8, 32)
    scale = w.abs().amax() / 448
    fp8 = Fp8Linear(
        (w / scale).to(torch.float8_e4m3fn), scale, torch.tensor(0.01), None, torch.float32
    )
    x = torch.randn(2, 32)
    expected = numerics.fp8_qdq_scale(x, torch.tensor(0.01)) @ fp8.weight.T
    assert torch.allclose(fp8(x), expected)
    out = fp8(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and fp8.weight.dtype == torch.bfloat16

    packed = torch.randint(0, 256, (8, 16), dtype=torch.uint8)
    block = torch.full((8, 2), 1.0).to(torch.float8_e4m3fn)
    nv = Nvfp4Linear(
        packed, block, torch.tensor(0.5), torch.tensor(0.01), torch.ones(8), torch.float32
    )
    assert torch.equal(nv.weight, numerics.unpack_e2m1(packed) * 0.5)
    assert nv(x).shape == (2, 8)


def test_apply_quantized_checkpoint_errors_name_the_tensors():
    from torch import nn

    from engines.reference.model.quant import apply_quantized_checkpoint

    model = nn.Module()
    model.proj = nn.Linear(32, 8)
    tensors = {
        "other.weight": torch.zeros(8, 32).to(torch.float8_e4m3fn),
        "other.weight_scale": torch.tensor(1.0),
        "other.input_scale": torch.tensor(1.0),
    }
    with pytest.raises(ValueError, match=r"other.*no matching nn.Linear"):
        apply_quantized_checkpoint(model, dict(tensors), {"quantization": {"quant_algo": "FP8"}})
    with pytest.raises(ValueError, match=r"W8A8_SQ_PER_CHANNEL.*not supported"):
        apply_quantized_checkpoint(model, {}, {"quant_algo": "W8A8_SQ_PER_CHANNEL"})
    renamed = {k.replace("other", "proj"): v for k, v in tensors.items()}
    apply_quantized_checkpoint(model, renamed, {"quantization": {"quant_algo": "FP8"}})
    assert renamed == {}  # every tensor of the quantized layer was consumed
    assert type(model.proj).__name__ == "Fp8Linear"
