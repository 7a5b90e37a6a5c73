"""GPT-OSS pieces against their definitions: sink attention and the sliding window against a
naive softmax, the router and clamped-SwiGLU experts against transformers' GptOssMLP, YaRN
against transformers' RoPE init, MXFP4 against transformers' dequantization, and the
config.json fields."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
import torch

from engines.api import EngineError
from engines.reference.model import mxfp4
from engines.reference.model.config import (
    ModelConfig,
    RopeConfig,
    load_model_config,
    rope_inv_freq,
    rope_scaling_factor,
)
from engines.reference.model.model import (
    Attention,
    CausalLM,
    DecodeGroup,
    PrefillSeq,
    attend_with_sinks,
)
from engines.reference.model.moe import SparseMoeBlock
from engines.reference.model.weights import _split_gpt_oss_experts

GPT_OSS_BASE = {
    "model_type": "gpt_oss",
    "architectures": ["GptOssForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 4,
    "eos_token_id": 2,
}


_CONFIGS: dict[str, ModelConfig] = {}


def load_model_config_from(raw: dict) -> ModelConfig:
    """load_model_config of a config.json holding `raw` (one file per distinct dict)."""
    key = json.dumps(raw, sort_keys=True)
    if key not in _CONFIGS:
        directory = Path(tempfile.mkdtemp(prefix="gpt-oss-config-"))
        (directory / "config.json").write_text(json.dumps(raw))
        _CONFIGS[key] = load_model_config(directory)
    return _CONFIGS[key]


def _naive(q, k, v, sinks, window: int | None, positions, key_positions) -> torch.Tensor:
    """transformers' GPT-OSS eager attention, one query and one head at a time: softmax over
    the scores of the keys it may see (causal, within the window) and the head's sink, the
    sink's share dropped. q [n, H, D], k/v [L, KVH, D] -> [n, H, D]."""
    n, heads, dim = q.shape
    group = heads // k.shape[1]
    out = torch.zeros_like(q)
    for i in range(n):
        for h in range(heads):
            keys = [
                j
                for j in range(k.shape[0])
                if key_positions[j] <= positions[i]
                and (window is None or key_positions[j] > positions[i] - window)
            ]
            scores = torch.stack([q[i, h] @ k[j, h // group] / math.sqrt(dim) for j in keys])
            probs = torch.softmax(torch.cat([scores, sinks[h : h + 1]]), dim=0)[:-1]
            out[i, h] = sum(p * v[j, h // group] for p, j in zip(probs, keys, strict=True))
    return out


def _attention(window: int | None) -> Attention:
    cfg = load_model_config_from(GPT_OSS_BASE)
    attn = Attention(cfg, index=0 if window else 1)
    assert attn.window == (4 if window else None)
    with torch.no_grad():
        attn.sinks.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    return attn


@pytest.mark.parametrize("window", [4, None], ids=["sliding", "full"])
def test_prefill_with_sinks_and_window_matches_the_naive_softmax(window) -> None:
    attn = _attention(window)
    gen = torch.Generator().manual_seed(0)
    n, start = 7, 5  # a chunk of 7 queries after 5 cached tokens
    q = torch.randn(n, 4, 8, generator=gen)
    keys = torch.randn(start + n, 2, 8, generator=gen)
    values = torch.randn(start + n, 2, 8, generator=gen)
    context, queries = torch.arange(start + n), torch.arange(start, start + n)
    mask = context[None, :] <= queries[:, None]
    window_mask = mask & (context[None, :] > queries[:, None] - 4)
    seq = PrefillSeq(0, n, start, torch.arange(start + n), mask, window_mask)
    k_flat, v_flat = keys.transpose(0, 1), values.transpose(0, 1)  # [KVH, slots, D]
    with torch.inference_mode():
        got = attn._prefill(q, None, None, k_flat, v_flat, seq)
    expected = _naive(q, keys, values, attn.sinks.detach(), window, queries, context)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_prefill_without_history_spells_out_the_causal_mask() -> None:
    attn = _attention(None)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(6, h, 8, generator=gen) for h in (4, 2, 2))
    seq = PrefillSeq(0, 6, 0, None, None)
    with torch.inference_mode():
        got = attn._prefill(q, k, v, None, None, seq)
    positions = torch.arange(6)
    expected = _naive(q, k, v, attn.sinks.detach(), None, positions, positions)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("window", [4, None], ids=["sliding", "full"])
def test_decode_group_with_sinks_and_window_matches_the_naive_softmax(window, n) -> None:
    """Two requests with 9 and 6 tokens of context in blocks of 4 (the second padded to the
    first's 3 blocks), n queries each: the sinks follow each query head through the grouped
    [KVH, B, n * G] layout."""
    attn = _attention(window)
    gen = torch.Generator().manual_seed(2)
    block, lens, tables = 4, [9, 6], [[3, 0, 5], [1, 4]]
    k_cache = torch.randn(2, 6, block, 8, generator=gen)
    v_cache = torch.randn(2, 6, block, 8, generator=gen)
    q = torch.randn(2 * n, 4, 8, generator=gen)
    per_kv = 2
    limits = torch.tensor([ln - n + 1 + j for ln in lens for j in range(n) for _ in range(per_kv)])
    context = torch.arange(3 * block)
    mask = context[None, :] < limits[:, None]
    window_mask = mask & (context[None, :] >= limits[:, None] - 4)
    group = DecodeGroup(
        rows=torch.arange(2 * n),
        blocks=torch.tensor([3, 0, 5, 1, 4, 0]),
        mask=mask.view(1, 2, n * per_kv, -1),
        num_queries=n,
        window_mask=window_mask.view(1, 2, n * per_kv, -1),
    )
    with torch.inference_mode():
        got = attn._decode(q, k_cache, v_cache, group)
    for r, (length, table) in enumerate(zip(lens, tables, strict=True)):
        slots = [(table[p // block], p % block) for p in range(length)]
        keys = torch.stack([k_cache[:, b, o] for b, o in slots])  # [L, KVH, D]
        values = torch.stack([v_cache[:, b, o] for b, o in slots])
        positions = torch.arange(length - n, length)
        expected = _naive(
            q[r * n : (r + 1) * n], keys, values, attn.sinks.detach(), window, positions,
            torch.arange(length),
        )  # fmt: skip
        torch.testing.assert_close(got[r * n : (r + 1) * n], expected, rtol=1e-5, atol=1e-5)


def test_attend_with_sinks_of_minus_infinity_is_plain_attention() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 5, 8, generator=gen) for _ in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    got = attend_with_sinks(q, k, v, mask, torch.full((1, 4, 1, 1), float("-inf")))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(got, expected)


def _hf_config(**changes):
    from transformers import GptOssConfig

    fields = {k: v for k, v in GPT_OSS_BASE.items() if k not in ("model_type", "architectures")}
    return GptOssConfig(**{**fields, **changes})


def test_moe_block_matches_transformers_gpt_oss_mlp() -> None:
    """Weights large enough that the clamps (gate <= 7, |up| <= 7) bite; the checkpoint's
    stacked, interleaved tensors go through the loader's split."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    hf_config = _hf_config()
    hf_config._experts_implementation = "eager"
    torch.manual_seed(4)
    reference = GptOssMLP(hf_config).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.normal_(0.0, 1.5)
    tensors = {
        f"model.layers.0.mlp.{n}": p.detach().clone() for n, p in reference.named_parameters()
    }
    _split_gpt_oss_experts(tensors, dict.fromkeys(tensors, None), torch.float32)
    cfg = load_model_config_from(GPT_OSS_BASE)
    block = SparseMoeBlock(cfg.hidden_size, cfg.moe)
    state = {n.removeprefix("model.layers.0.mlp."): t for n, t in tensors.items()}
    block.load_state_dict(state, strict=True)
    x = torch.randn(1, 23, 32, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        expected, _ = reference(x)
        gate_up = torch.cat([e.gate_up_proj(x[0]) for e in block.experts])
        assert gate_up.max() > 7 and gate_up.min() < -7  # the clamps are exercised
        got = block(x[0])
    torch.testing.assert_close(got, expected[0], rtol=1e-5, atol=1e-4)
    assert int(block.last_counts.sum()) == 23 * 2


@pytest.mark.parametrize(
    "params",
    [
        {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
        {"factor": 8.0, "original_max_position_embeddings": 256},
        {"factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": True},
        {"factor": 16.0, "attention_factor": 1.3},
    ],
)
def test_yarn_matches_transformers_rope_init(params) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "original_max_position_embeddings": 64}
    rope.update(params)
    hf_config = _hf_config(rope_parameters=dict(rope), max_position_embeddings=2048)
    # transformers before 5 (TensorRT-LLM 1.2's 4.57.1) reads `rope_scaling` and `rope_theta`
    # instead of `rope_parameters`: set them as it reads them, so both versions compute
    # from the same numbers.
    hf_config.rope_scaling = dict(rope)
    hf_config.rope_theta = rope["rope_theta"]
    expected, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, None)
    cfg = load_model_config_from({**GPT_OSS_BASE, "rope_parameters": rope})
    assert cfg.rope.rope_type == "yarn"
    torch.testing.assert_close(rope_inv_freq(cfg.head_dim, cfg.rope), expected, rtol=0, atol=0)
    assert rope_scaling_factor(cfg.rope) == pytest.approx(expected_factor, rel=1e-12)
    assert rope_scaling_factor(RopeConfig(theta=1e4)) == 1.0


def test_mxfp4_dequantizes_as_transformers_and_round_trips() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(6)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 135, (3, 10, 2), dtype=torch.uint8, generator=gen)
    ours = mxfp4.dequantize(blocks, scales, torch.float32)  # [E, R, C]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, C, R]
    assert torch.equal(ours.transpose(1, 2), theirs)
    assert torch.equal(mxfp4.dequantize(blocks, scales, torch.bfloat16).float(), ours)
    # Values already on the FP4 grid survive packing unchanged.
    packed = mxfp4.quantize(ours)
    assert torch.equal(mxfp4.dequantize(*packed, torch.float32), ours)
    with pytest.raises(ValueError, match="do not match"):
        mxfp4.dequantize(blocks, scales[..., :1], torch.float32)


def test_gpt_oss_config_fields() -> None:
    cfg = load_model_config_from(GPT_OSS_BASE)
    assert cfg.model_type == "gpt_oss" and cfg.attention_sinks and cfg.fp32_norms
    assert cfg.attention_bias and cfg.o_proj_bias  # GptOssConfig's default
    # No layer_types: even layers slide, odd ones attend fully (GptOssConfig).
    assert cfg.masked_window == 4 and cfg.window_layers == (0, 2)
    assert cfg.sliding_window is None  # no context cap: the window is masked instead
    assert cfg.moe.style == "gpt_oss" and cfg.moe.sparse_layers == (0, 1, 2, 3)
    assert cfg.moe.intermediate_size == 32 and cfg.moe.num_experts == 4
    assert cfg.rope.theta == 150000.0  # GptOssConfig.default_theta
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert load_model_config_from({**GPT_OSS_BASE, "layer_types": types}).window_layers == (1, 2)
    assert load_model_config_from({**GPT_OSS_BASE, "sliding_window": None}).window_layers == ()
    model = CausalLM(cfg)
    names = {n for n, _ in model.named_parameters()}
    assert {"model.layers.0.self_attn.sinks", "model.layers.0.mlp.router.bias"} <= names
    assert "model.layers.3.mlp.experts.3.gate_up_proj.bias" in names


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"layer_types": ["sliding_attention"] * 3}, "one type per layer"),
        ({"layer_types": ["chunked_attention"] * 4}, "layer_types \\['chunked_attention'\\]"),
        ({"sliding_window": -1}, "sliding_window must be a positive integer"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok must be between 1 and"),
        ({"rope_parameters": {"rope_type": "longrope"}}, "rope_type 'longrope'"),
    ],
)
def test_unsupported_gpt_oss_values_are_refused_by_name(changes, words) -> None:
    with pytest.raises(EngineError, match=words):
        load_model_config_from({**GPT_OSS_BASE, **changes})
