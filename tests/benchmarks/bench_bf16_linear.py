"""What the bf16 fallback costs: torch's nn.Linear in bf16 (the reference engine's path where
oneDNN refuses bf16: CPUs without AVX-512 BW/VL/DQ or AVX-NE-CONVERT) against the oneDNN
linears with packed weights, in bf16 where this CPU's oneDNN takes it and in fp32 (what a job
on such a CPU can choose instead, `engine.dtype: float32`).

    .venv/bin/python tests/benchmarks/bench_bf16_linear.py [--threads 1] [--rounds 5]

    # an AVX2-only CPU, approximated on a newer one (oneDNN, MKL and ATen held to AVX2):
    ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 \
        .venv/bin/python tests/benchmarks/bench_bf16_linear.py

Shapes are the linears of the `small` bench model (engines/dev/tiny.py: hidden 512, 8 heads of 64,
2 KV heads, intermediate 1408, vocab 8192) after the engine fuses q/k/v and gate/up, for a
decode row and for a step of 64 rows. The variants run alternately, round by round, and the
median of the rounds is printed, so a burst of load from elsewhere hits all of them.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from engines.reference.model.linear import OneDnnLinear, onednn_refusal

# (name, in_features, out_features) of the `small` model's linears
LINEARS = [("qkv", 512, 768), ("gate_up", 512, 2816), ("down", 1408, 512), ("lm_head", 512, 8192)]
ROWS = (1, 64)
CALLS_PER_ROUND = 50


def _seconds_per_call(layer: nn.Module, x: torch.Tensor) -> float:
    for _ in range(3):  # warm-up
        layer(x)
    start = time.perf_counter()
    for _ in range(CALLS_PER_ROUND):
        layer(x)
    return (time.perf_counter() - start) / CALLS_PER_ROUND


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    refusal = onednn_refusal(torch.bfloat16)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{args.threads} thread(s), median of {args.rounds} rounds, microseconds per call")
    print(f"oneDNN bf16: {'refused (' + refusal + ')' if refusal else 'taken'}")
    for rows in ROWS:
        for name, fan_in, fan_out in LINEARS:
            fallback = nn.Linear(fan_in, fan_out, bias=False).to(torch.bfloat16)
            variants = {
                "nn.Linear bf16": (fallback, torch.bfloat16),
                "oneDNN fp32": (OneDnnLinear(copy.deepcopy(fallback).float()), torch.float32),
            }
            if refusal is None:
                variants["oneDNN bf16"] = (OneDnnLinear(fallback), torch.bfloat16)
            x = torch.randn(rows, fan_in)
            times: dict[str, list[float]] = {label: [] for label in variants}
            with torch.inference_mode():
                for _ in range(args.rounds):
                    for label, (layer, dtype) in variants.items():
                        times[label].append(_seconds_per_call(layer, x.to(dtype)))
            medians = {label: statistics.median(t) * 1e6 for label, t in times.items()}
            cells = ", ".join(f"{label} {us:8.1f}" for label, us in medians.items())
            print(f"  {rows:3d} rows {name:8s} {fan_in:5d}->{fan_out:5d}: {cells}")


if __name__ == "__main__":
    main()
