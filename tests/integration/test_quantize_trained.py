"""A model with learned structure passes the default quality gate (slow: trains a tiny model).

Random tiny models fail the defaults by design (their next-token distributions are nearly flat,
so any perturbation flips the argmax). A tiny Llama trained briefly on the built-in text has
confident predictions like a real checkpoint; FP8 and NVFP4 builds of it must pass the default
thresholds, and NVFP4 must drift more than FP8.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("modelopt.torch.quantization")

pytestmark = pytest.mark.slow

TRAIN_STEPS = 150


def train_tiny_llama(out: Path, steps: int = TRAIN_STEPS) -> Path:
    import torch
    import transformers

    from engines.dev.tiny import make_tiny_model
    from engines.quantize.calibration import sample_text

    make_tiny_model(out, arch="llama", initializer_range=0.02)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    texts = sample_text(3000, seed=42)  # other seeds than calibration (0): no overlap
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    model.train()
    for step in range(steps):
        start = (step * 16) % (len(texts) - 16)
        enc = tok(
            texts[start : start + 16],
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=64,
        )
        labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)  # [B, T]
        model(**enc, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_llama(tmp_path_factory.mktemp("trained") / "llama")


def test_default_gate_passes_on_a_trained_model(trained, tmp_path):
    from engines.quantize.artifacts import build_or_reuse
    from engines.quantize.config import QuantizationSpec

    reports = {}
    for fmt in ("fp8", "nvfp4"):
        spec = QuantizationSpec(format=fmt, kv_cache="fp8", device="cpu")
        reports[fmt] = build_or_reuse(trained, str(tmp_path / fmt), spec).report
        assert reports[fmt]["passed"], reports[fmt]["failures"]
    assert reports["fp8"]["mean_kl"] < reports["nvfp4"]["mean_kl"]
    assert reports["fp8"]["greedy_match_mean"] > reports["nvfp4"]["greedy_match_mean"]
