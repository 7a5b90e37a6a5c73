"""config.json parsing: families, RoPE variants, head_dim, EOS ids, clear errors."""

from __future__ import annotations

import json

import pytest

from engines.api import EngineError
from engines.reference.model.config import RopeConfig, load_model_config, rope_inv_freq
from tests.engine_fixtures import rope_config_fields

BASE = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "eos_token_id": 2,
}


def _write(tmp_path, **changes):
    config = {**BASE, **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_defaults_and_gqa(tmp_path) -> None:
    cfg = load_model_config(_write(tmp_path, rope_theta=5000.0))
    assert cfg.head_dim == 16 and cfg.num_kv_heads == 2 and cfg.q_size == 64 and cfg.kv_size == 32
    assert cfg.rope == RopeConfig(theta=5000.0)
    assert not cfg.attention_bias and not cfg.qk_norm and cfg.eos_token_ids == (2,)


def test_transformers5_rope_parameters_and_explicit_head_dim(tmp_path) -> None:
    cfg = load_model_config(
        _write(
            tmp_path,
            model_type="qwen3",
            architectures=["Qwen3ForCausalLM"],
            head_dim=32,
            rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
        )
    )
    assert cfg.head_dim == 32 and cfg.qk_norm and cfg.rope.theta == 1e6


def test_family_detected_from_architectures_and_qwen2_bias(tmp_path) -> None:
    cfg = load_model_config(
        _write(tmp_path, model_type="custom", architectures=["Qwen2ForCausalLM"])
    )
    assert cfg.model_type == "qwen2" and cfg.attention_bias


def test_eos_ids_merge_generation_config(tmp_path) -> None:
    _write(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_model_config(tmp_path).eos_token_ids == (2, 7)


def test_unsupported_and_broken_configs_are_named(tmp_path) -> None:
    with pytest.raises(EngineError, match=r"not found"):
        load_model_config(tmp_path)
    _write(tmp_path, model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(EngineError, match=r"GPTNeoX.*supports.*MistralForCausalLM"):
        load_model_config(tmp_path)
    config = dict(BASE)
    del config["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineError, match=r"'hidden_size' is missing"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(EngineError, match=r"not valid JSON"):
        load_model_config(tmp_path)
    _write(tmp_path, rope_parameters={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(EngineError, match=r"longrope.*default, llama3, yarn"):
        load_model_config(tmp_path)


def test_llama3_inv_freq_matches_transformers(tmp_path) -> None:
    import torch
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = load_model_config(
        _write(tmp_path, hidden_size=512, num_attention_heads=4, rope_parameters=params)
    )
    hf_config = transformers.LlamaConfig(
        hidden_size=512, num_attention_heads=4, **rope_config_fields(params)
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = rope_inv_freq(cfg.head_dim, cfg.rope)
    assert torch.equal(ours, expected)
    assert not torch.equal(ours, rope_inv_freq(cfg.head_dim, RopeConfig(theta=500000.0)))


def test_bias_flags_follow_transformers_per_family(tmp_path) -> None:
    cfg = load_model_config(_write(tmp_path, attention_bias=True, mlp_bias=True))
    assert cfg.attention_bias and cfg.o_proj_bias and cfg.mlp_bias  # Llama: as configured
    # Qwen2 hard-codes q/k/v bias on and o_proj / MLP bias off, whatever the config says.
    cfg = load_model_config(
        _write(tmp_path, model_type="qwen2", attention_bias=False, mlp_bias=True)
    )
    assert cfg.attention_bias and not cfg.o_proj_bias and not cfg.mlp_bias
    cfg = load_model_config(_write(tmp_path, model_type="qwen3", attention_bias=True))
    assert cfg.attention_bias and cfg.o_proj_bias and not cfg.mlp_bias
    cfg = load_model_config(_write(tmp_path, model_type="mistral", attention_bias=True))
    assert not (cfg.attention_bias or cfg.o_proj_bias or cfg.mlp_bias)


@pytest.mark.parametrize(
    ("changes", "window"),
    [
        # Real Qwen configs often carry a window with the flag off: no layer slides.
        ({"sliding_window": 4096, "use_sliding_window": False}, None),
        ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 1}, 64),
        # max_window_layers >= num_hidden_layers: every layer attends fully.
        ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2}, None),
        # layer_types, when written, decides (transformers 5 saves it).
        (
            {
                "sliding_window": 64,
                "use_sliding_window": True,
                "max_window_layers": 0,
                "layer_types": ["full_attention", "full_attention"],
            },
            None,
        ),
        (
            {
                "sliding_window": 64,
                "use_sliding_window": True,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            64,
        ),
    ],
)
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_sliding_window_follows_use_sliding_window(
    tmp_path, model_type: str, changes: dict, window: int | None
) -> None:
    cfg = load_model_config(_write(tmp_path, model_type=model_type, **changes))
    assert cfg.sliding_window == window


def test_mistral_slides_every_layer_and_unknown_layer_types_are_refused(tmp_path) -> None:
    assert (
        load_model_config(_write(tmp_path, model_type="mistral", sliding_window=32)).sliding_window
        == 32
    )
    assert load_model_config(_write(tmp_path, sliding_window=32)).sliding_window is None  # llama
    _write(
        tmp_path,
        model_type="qwen3",
        sliding_window=32,
        use_sliding_window=True,
        layer_types=["chunked_attention", "full_attention"],
    )
    with pytest.raises(EngineError, match=r"chunked_attention.*sliding_attention"):
        load_model_config(tmp_path)
