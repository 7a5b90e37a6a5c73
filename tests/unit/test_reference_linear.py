"""oneDNN linears of the reference engine on CPU: same results as nn.Linear, swapped only where
they apply, and nn.Linear kept for a dtype this CPU's oneDNN refuses (both paths run on any
machine: the refusal is simulated where the CPU would take the dtype)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from engines import faults
from engines.reference.model import linear as linear_module
from engines.reference.model.linear import (
    OneDnnLinear,
    PanelLinear,
    fallback_note,
    linear_add,
    onednn_refusal,
    pack_linears,
)
from tests.engine_fixtures import ONEDNN_BF16_REFUSAL, cpu_without_onednn_bf16

CPU = torch.device("cpu")
# OneDnnLinear itself, in bf16, needs a CPU whose oneDNN takes bf16 (AVX-512 BW/VL/DQ or
# AVX-NE-CONVERT); elsewhere pack_linears never builds one, and the fallback tests below run.
_BF16_REFUSED = onednn_refusal(torch.bfloat16)
BF16 = pytest.param(
    torch.bfloat16,
    2e-2,
    id="bf16",
    marks=pytest.mark.skipif(
        _BF16_REFUSED is not None, reason=f"this CPU's oneDNN refuses bf16: {_BF16_REFUSED}"
    ),
)
FP32 = pytest.param(torch.float32, 1e-5, id="fp32")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("dtype", "tol"), [FP32, BF16])
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
@pytest.mark.parametrize(("dtype", "tol"), [FP32, BF16])
def test_linear_add_is_the_residual_plus_the_linear(
    bias: bool, dtype: torch.dtype, tol: float
) -> None:
    torch.manual_seed(3)
    linear = nn.Linear(96, 80, bias=bias).to(dtype)
    x, residual = torch.randn(37, 96).to(dtype), torch.randn(37, 80).to(dtype)
    with torch.inference_mode():
        expected = residual + linear(x)
        fused = linear_add(OneDnnLinear(linear), x, residual)
        plain = linear_add(linear, x, residual)
    torch.testing.assert_close(plain, expected, rtol=0, atol=0)  # not packed: the same two ops
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


def _bf16_model() -> nn.Sequential:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(96, 80), nn.ReLU(), nn.Linear(80, 64)).to(torch.bfloat16)


def _keeps_nn_linear(model: nn.Sequential) -> None:
    """pack_linears leaves the bf16 model as it is: the same modules, bit-identical results."""
    x = torch.randn(37, 96).to(torch.bfloat16)
    residual = torch.randn(37, 80).to(torch.bfloat16)
    with torch.inference_mode():
        expected = model(x)
        assert pack_linears(model) == 0
        assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
        torch.testing.assert_close(
            linear_add(model[0], x, residual), residual + model[0](x), rtol=0, atol=0
        )
    # fp32 still goes to oneDNN on the same CPU.
    fp32 = nn.Sequential(nn.Linear(8, 8))
    assert pack_linears(fp32) == 1 and type(fp32[0]) is OneDnnLinear


def test_a_dtype_onednn_refuses_keeps_nn_linear(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The CPU refuses: oneDNN's op raises as torch's does without the instructions."""
    cpu_without_onednn_bf16(monkeypatch)
    assert onednn_refusal(torch.bfloat16) == ONEDNN_BF16_REFUSAL
    assert onednn_refusal(torch.float32) is None
    with caplog.at_level(logging.WARNING, logger=linear_module.__name__):
        _keeps_nn_linear(_bf16_model())
        _keeps_nn_linear(_bf16_model())  # a second model (a draft model, say): no second line
    note = fallback_note(CPU, torch.bfloat16)
    assert note is not None and ONEDNN_BF16_REFUSAL in note and "nn.Linear" in note
    assert [r.getMessage() for r in caplog.records] == [note]


def test_the_test_hook_refuses_a_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """TOKENMILL_TEST_ONEDNN_REFUSES, which the batch driver passes on to its engine actors,
    forces the same fallback, and only with the test hooks on."""
    monkeypatch.setenv(faults.ONEDNN_REFUSES_ENV, "bfloat16")
    monkeypatch.delenv(faults.HOOKS_ENV, raising=False)
    assert onednn_refusal(torch.bfloat16) == _BF16_REFUSED  # off: whatever this CPU says
    monkeypatch.setenv(faults.HOOKS_ENV, "1")
    assert onednn_refusal(torch.bfloat16) == "refused by the test hook " + (
        faults.ONEDNN_REFUSES_ENV
    )
    assert onednn_refusal(torch.float32) is None
    assert faults.forwarded_env()[faults.ONEDNN_REFUSES_ENV] == "bfloat16"
    _keeps_nn_linear(_bf16_model())


def test_no_note_where_onednn_was_never_the_path() -> None:
    # CUDA keeps cuBLAS, float16 keeps nn.Linear by design: neither is a fallback.
    assert fallback_note(torch.device("cuda"), torch.bfloat16) is None
    assert fallback_note(CPU, torch.float16) is None
    assert fallback_note(CPU, torch.float32) is None


# --- the panel kernel (kernels/panel_linear.cpp) and the LM head on it --------------------------
needs_kernels = pytest.mark.skipif(
    not linear_module.cpu_kernels.kernels_available(), reason="no C++ compiler for the kernels"
)


def _with_threads(threads: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@needs_kernels
@pytest.mark.parametrize("bias", [True, False])
# 16 and 17 rows: one tile and one more; 300: many tiles over the threads; widths that are and
# are not multiples of the kernel's 16 columns.
@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"),
    [(1, 64, 48), (16, 96, 80), (17, 40, 33), (300, 128, 200)],
)
def test_panel_linear_matches_nn_linear(rows, in_features, out_features, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(in_features, out_features, bias=bias)
    panel = PanelLinear(linear)
    x = torch.randn(rows, in_features)
    with torch.inference_mode():
        expected, got = linear(x), panel(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    residual = torch.randn(rows, out_features)
    with_residual = linear_module.cpu_kernels.panel_linear(
        x, panel.packed, out_features, panel.bias, residual
    )
    torch.testing.assert_close(with_residual, expected + residual, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_a_panel_row_gets_the_same_bits_alone_in_any_batch_on_any_thread_count() -> None:
    # Each output is one sequential sum over K, whatever rows share its tile and whichever
    # thread computes its columns: a row's logits do not depend on what else is in the step.
    torch.manual_seed(2)
    panel = PanelLinear(nn.Linear(256, 1000))
    x = torch.randn(70, 256)
    with torch.inference_mode():
        batch = _with_threads(2, lambda: panel(x))
        assert torch.equal(_with_threads(1, lambda: panel(x)), batch)
        for row in (0, 17, 69):
            assert torch.equal(panel(x[row : row + 1])[0], batch[row])
        assert torch.equal(panel(x[5:40]), batch[5:40])


@needs_kernels
def test_panel_linear_refuses_what_does_not_fit() -> None:
    panel = PanelLinear(nn.Linear(32, 40))
    with pytest.raises(RuntimeError, match="K = x's columns"):
        linear_module.cpu_kernels.panel_linear(torch.randn(3, 31), panel.packed, 40)
    with pytest.raises(RuntimeError, match="do not fit the packed weight"):
        linear_module.cpu_kernels.panel_linear(torch.randn(3, 32), panel.packed, 60)
    with pytest.raises(RuntimeError, match="residual must be fp32"):
        linear_module.cpu_kernels.panel_linear(
            torch.randn(3, 32), panel.packed, 40, None, torch.randn(2, 40)
        )


@needs_kernels
def test_pack_head_takes_an_fp32_head_only() -> None:
    class Head(nn.Module):
        def __init__(self, dtype: torch.dtype) -> None:
            super().__init__()
            self.proj = nn.Linear(16, 16)
            self.lm_head = nn.Linear(16, 50, bias=False).to(dtype)

    fp32 = Head(torch.float32)
    assert linear_module.pack_head(fp32)
    assert type(fp32.lm_head) is PanelLinear and type(fp32.proj) is nn.Linear
    assert pack_linears(fp32) == 1 and type(fp32.lm_head) is PanelLinear  # oneDNN leaves it
    bf16 = Head(torch.bfloat16)
    assert not linear_module.pack_head(bf16) and type(bf16.lm_head) is nn.Linear
