"""PEFT adapter folders read and checked (engines/lora/peft.py), and the slot bookkeeping
(engines/reference/runtime/adapters.py), without a model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from engines.lora.peft import TARGETS, AdapterError, LoraAdapter, LoraConfig, read_config
from engines.reference.runtime.adapters import AdapterSlots


def folder(tmp_path: Path, **config: object) -> Path:
    out = tmp_path / "adapter"
    out.mkdir(exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    return out


def test_scale_rank_and_targets(tmp_path: Path) -> None:
    plain = read_config("a", folder(tmp_path, r=8, lora_alpha=16, target_modules=["q_proj"]), 64)
    assert plain == LoraConfig(8, 16.0, False, ("q_proj",)) and plain.scale == 2.0
    rs = read_config(
        "a", folder(tmp_path, r=16, lora_alpha=8, use_rslora=True, target_modules="all-linear"), 64
    )
    assert rs.scale == pytest.approx(8 / math.sqrt(16)) and set(rs.target_modules) == set(TARGETS)
    # Full module paths and a missing alpha (PEFT's default is r's value in old saves).
    dotted = read_config(
        "a", folder(tmp_path, r=4, target_modules=["model.layers.0.mlp.down_proj"]), 64
    )
    assert dotted.target_modules == ("down_proj",) and dotted.scale == 1.0


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"peft_type": "PREFIX_TUNING"}, "peft_type"),
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"layers_to_transform": [0]}, "layers_to_transform"),
        ({"r": 0}, "positive integer"),
        ({"r": "8"}, "positive integer"),
        ({"r": 128}, "max_lora_rank 64"),
        ({"lora_alpha": "x"}, "lora_alpha"),
        ({"target_modules": []}, "target_modules"),
        ({"target_modules": ["embed_tokens"]}, "embed_tokens"),
    ],
)
def test_refused_configs_name_adapter_and_field(tmp_path: Path, fields: dict, words: str) -> None:
    base = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    with pytest.raises(AdapterError) as caught:
        read_config("mine", folder(tmp_path, **(base | fields)), 64)
    assert "adapter 'mine'" in str(caught.value) and words in str(caught.value)


def test_not_json_and_missing(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{r: 8")
    with pytest.raises(AdapterError, match="not JSON"):
        read_config("b", broken, 64)
    with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
        read_config("b", tmp_path / "nowhere", 64)


def _adapter(name: str) -> LoraAdapter:
    return LoraAdapter(name, "/x", LoraConfig(4, 4.0, False, ("q_proj",)), {})


def test_slots_fill_least_recently_used_free_slot_and_never_one_in_use() -> None:
    filled: list[tuple[int, str]] = []
    slots = AdapterSlots(2, lambda slot, adapter: filled.append((slot, adapter.name)))
    assert slots.acquire("r1", _adapter("a")) == 0
    assert slots.acquire("r2", _adapter("b")) == 1
    assert slots.acquire("r3", _adapter("a")) == 0  # resident: no fill
    assert not slots.can_acquire("c") and slots.acquire("r4", _adapter("c")) is None
    slots.release("r2")  # b's slot is free now, a's still in use by r1 and r3
    assert slots.can_acquire("c") and slots.acquire("r4", _adapter("c")) == 1
    slots.release("r1")
    slots.release("r3")
    slots.release("r4")
    assert slots.acquire("r5", _adapter("d")) == 0  # a's slot was used longest ago
    assert filled == [(0, "a"), (1, "b"), (1, "c"), (0, "d")] and slots.loads == 4
    assert slots.slot("r5") == 0 and slots.slot("r1") == -1


def test_engines_without_adapters_refuse_an_adapters_request() -> None:
    """vLLM, TensorRT-LLM and the synthetic engine admit through engines.requests.admit: a
    request naming an adapter is an error there, never an answer from the base model."""
    from engines.api import GenerationRequest, SamplingParams
    from engines.requests import admit

    request = GenerationRequest([1, 2], SamplingParams(max_tokens=2), adapter="sql")
    refused = admit(request, vocab_size=10, max_model_len=16)
    assert not refused.ok and "'sql'" in refused.error and "does not run adapters" in refused.error
    assert admit(request, vocab_size=10, max_model_len=16, takes_adapters=True).ok


def _adapter_folder(folder: Path, rank: int = 8) -> Path:
    folder.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def test_a_prefix_finds_adapters_by_name_and_names_what_it_lacks(tmp_path: Path) -> None:
    from engines.lora.prefix import AdapterPrefix
    from engines.lora.vendor import AdapterTable

    lib = tmp_path / "lib"
    _adapter_folder(lib / "ft-a")
    _adapter_folder(lib / "ft-b", rank=32)
    prefix = AdapterPrefix.of({"uri": str(lib), "cache_dir": str(tmp_path / "cache")})
    assert prefix is not None and prefix.folder("ft-a") == str(lib / "ft-a")
    for name, words in (
        ("nope", f"no adapter_config.json at {lib / 'nope'}"),
        ("../lib", "not a name that can be looked up"),
        (".hidden", "not a name that can be looked up"),
    ):
        with pytest.raises(AdapterError, match="unknown adapter") as caught:
            prefix.folder(name)
        assert words in str(caught.value)
    with pytest.raises(AdapterError, match="unknown: bucket"):
        AdapterPrefix.of({"uri": str(lib), "bucket": "x"})
    assert AdapterPrefix.of(None) is None
    # A vendor engine's table: listed adapters first (ids by name), then each one found
    # under the prefix takes the next id for good; its config is checked like a listed one.
    listed = _adapter_folder(tmp_path / "z-listed")
    table = AdapterTable({"z": str(listed)}, max_rank=16, prefix=prefix)
    assert (table.get("z").int_id, table.get("ft-a").int_id, table.get("z").int_id) == (1, 2, 1)
    assert table.get("ft-a").path == str(lib / "ft-a") and table.get("ft-a").int_id == 2
    with pytest.raises(AdapterError, match="r 32 is over the engine's max_lora_rank 16"):
        table.get("ft-b")
    with pytest.raises(AdapterError, match="unknown adapter 'gone'"):
        table.get("gone")
