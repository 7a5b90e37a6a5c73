"""oneDNN linears of the reference engine on CPU: same results as nn.Linear, swapped only where
they apply."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engines.reference.linear import OneDnnLinear, linear_add, pack_linears
from tests.engine_fixtures import cpu_without_onednn_bf16


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
def test_matches_nn_linear(bias: bool, dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 80, bias=bias).to(dtype)
    packed = OneDnnLinear(linear)
    for shape in [(1, 96), (37, 96), (2, 5, 96)]:  # decode row, a step's rows, batched
        x = torch.randn(shape).to(dtype)
        with torch.inference_mode():
            expected, got = linear(x), packed(x)
        assert got.shape == expected.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_add_is_the_residual_plus_the_linear(bias: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    linear = nn.Linear(96, 80, bias=bias).to(dtype)
    x, residual = torch.randn(37, 96).to(dtype), torch.randn(37, 80).to(dtype)
    with torch.inference_mode():
        expected = residual + linear(x)
        fused = linear_add(OneDnnLinear(linear), x, residual)
        plain = linear_add(linear, x, residual)
    torch.testing.assert_close(plain, expected, rtol=0, atol=0)  # not packed: the same two ops
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused.float(), expected.float(), rtol=tol, atol=tol)


def test_non_contiguous_input() -> None:
    linear = nn.Linear(64, 32)
    x = torch.randn(64, 10).t()  # [10, 64], a transposed view
    with torch.inference_mode():
        torch.testing.assert_close(OneDnnLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


class _Quantized(nn.Linear):
    """A subclass with its own forward stands for a quantized replacement."""


def test_pack_swaps_plain_linears_only() -> None:
    model = nn.Sequential(
        nn.Linear(8, 8), nn.ReLU(), _Quantized(8, 8), nn.Sequential(nn.Linear(8, 4))
    )
    assert pack_linears(model) == 2
    assert type(model[0]) is OneDnnLinear and type(model[3][0]) is OneDnnLinear
    assert type(model[2]) is _Quantized
    assert pack_linears(model) == 0  # nothing left to swap


def test_float16_stays_nn_linear() -> None:
    model = nn.Sequential(nn.Linear(8, 8).half())
    assert pack_linears(model) == 0 and type(model[0]) is nn.Linear


@pytest.mark.xfail(strict=True, reason="oneDNN's bf16 reorder is called on any CPU")
def test_a_dtype_onednn_refuses_keeps_nn_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_without_onednn_bf16(monkeypatch)
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(96, 80), nn.ReLU(), nn.Linear(80, 64)).to(torch.bfloat16)
    x = torch.randn(37, 96).to(torch.bfloat16)
    with torch.inference_mode():
        expected = model(x)
    assert pack_linears(model) == 0
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear
    with torch.inference_mode():
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
        residual = torch.randn(37, 80).to(torch.bfloat16)
        torch.testing.assert_close(
            linear_add(model[0], x, residual), residual + model[0](x), rtol=0, atol=0
        )
    # fp32 still goes to oneDNN on the same CPU.
    fp32 = nn.Sequential(nn.Linear(8, 8))
    assert pack_linears(fp32) == 1 and type(fp32[0]) is OneDnnLinear
