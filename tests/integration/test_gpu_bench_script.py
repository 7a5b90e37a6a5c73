"""The GPU benchmark script (tests/gpu/bench_reference_cuda.py) kept working without a GPU: its
smoke shape on CPU in float32, where greedy parity with transformers must be exact."""

from __future__ import annotations

import pytest

from tests.gpu.bench_reference_cuda import main

pytestmark = pytest.mark.timeout(300)


def test_smoke_shape_on_cpu_reports_both_sides_and_exact_fp32_parity(capsys) -> None:
    args = "--shape tiny --device cpu --dtype float32 --no-vllm --num-requests 8"
    args += " --prompt-len 8 64 --max-tokens 4 16 --hf-batch 4 --parity-requests 4"
    report = main([*args.split(), "--max-num-tokens", "256"])
    assert set(report["sides"]) == {"reference", "transformers"}
    for side in report["sides"].values():
        assert side["useful_tokens"] > 0 and side["tokens_per_s"] > 0
    assert report["parity_with_transformers"] == {
        "exact_share": 1.0,
        "first_token_share": 1.0,
        "prefix_token_share": 1.0,
    }
    assert report["reference_vs"]["transformers"] > 0
    assert '"parity_with_transformers"' in capsys.readouterr().out
