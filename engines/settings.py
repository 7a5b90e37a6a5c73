"""The engine settings every engine kind shares, declared once: which kinds take each, each
kind's default, and what it means.

The job spec's engine section (pipeline/spec/engine.py) builds these fields' descriptions from
here, and each engine's constructor reads its defaults from here (`default(kind, name)`), so a
default changes in one place. A kind that takes a setting with no default of ours leaves it to
the vendor's engine (None). tests/unit/test_engine_settings.py checks every constructor
against this table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KINDS = ("reference", "trtllm", "vllm", "synthetic")
MODEL_KINDS = ("reference", "trtllm", "vllm")  # the kinds that run a model


@dataclass(frozen=True)
class Setting:
    name: str
    kinds: tuple[str, ...]  # the engine kinds that take it
    defaults: Mapping[str, Any]  # kind -> its default; a kind absent: the vendor's own (None)
    description: str  # what it means; the spec appends each kind's default


SHARED: tuple[Setting, ...] = (
    Setting(
        "max_batch_size",
        KINDS,
        # trtllm: TensorRT-LLM's own default and the range its published benchmarks run.
        {"reference": 64, "trtllm": 2048, "synthetic": 256},
        "Most requests in one engine step.",
    ),
    Setting(
        "max_num_tokens",
        MODEL_KINDS,
        {"reference": 2048, "trtllm": 8192},  # trtllm: as its published benchmarks
        "Token budget of one engine step (prefill chunks + decodes).",
    ),
    Setting(
        "kv_cache_tokens",
        MODEL_KINDS,
        {},
        "KV cache size in tokens. Null: sized from kv_cache_memory_fraction (GPU) or "
        "kv_cache_memory_gb (CPU).",
    ),
    Setting(
        "kv_cache_memory_gb",
        ("reference", "vllm"),
        {},
        "KV cache size as memory (GiB); used when kv_cache_tokens is null.",
    ),
    Setting(
        "kv_cache_memory_fraction",
        ("trtllm", "vllm"),
        {"trtllm": 0.9, "vllm": 0.9},
        "trtllm, vllm on GPU: fraction of GPU memory for the KV cache "
        "(free_gpu_memory_fraction / gpu_memory_utilization).",
    ),
    Setting(
        "kv_cache_dtype",
        ("trtllm", "vllm"),
        {"trtllm": "auto", "vllm": "auto"},
        "auto (model dtype) | fp8 (trtllm with an FP8-KV checkpoint, vllm).",
    ),
    Setting(
        "enable_prefix_caching",
        MODEL_KINDS,
        {"reference": True, "trtllm": True, "vllm": True},
        "Reuse KV of shared prompt prefixes (full blocks only).",
    ),
    Setting(
        "enable_chunked_prefill",
        MODEL_KINDS,
        {"reference": True, "trtllm": True, "vllm": True},
        "Split long prompts across steps so decodes are not stalled.",
    ),
    Setting("block_size", ("reference",), {"reference": 16}, "Tokens per KV cache block."),
    Setting(
        "dtype",
        MODEL_KINDS,
        {"reference": "auto", "trtllm": "auto", "vllm": "auto"},
        "Compute dtype. auto: float32 on CPU, bfloat16 on GPU.",
    ),
    Setting("device", ("reference",), {"reference": "auto"}, "auto | cpu | cuda | cuda:N."),
    Setting(
        "max_model_len",
        KINDS,
        {},
        "Cap on prompt + output tokens; null: the model's context.",
    ),
    Setting(
        "scheduler_policy",
        ("trtllm",),
        {"trtllm": "guaranteed_no_evict"},
        "TensorRT-LLM's capacity scheduler policy.",
    ),
    Setting("speculative", MODEL_KINDS, {}, "Speculative decoding; null: off."),
)
BY_NAME: dict[str, Setting] = {s.name: s for s in SHARED}


def default(kind: str, name: str) -> Any:
    """`kind`'s default for the shared setting `name` (None: the vendor engine's own)."""
    setting = BY_NAME[name]
    if kind not in setting.kinds:
        raise KeyError(f"engine kind {kind} does not take {name}")
    return setting.defaults.get(kind)


def defaults_text(name: str) -> str:
    """Each kind's default of `name`, as the spec's descriptions say it."""
    setting = BY_NAME[name]
    parts = [
        f"{kind} {setting.defaults[kind]}" if kind in setting.defaults else f"{kind}: its own"
        for kind in setting.kinds
    ]
    return "; ".join(parts)


def common_default(name: str) -> Any:
    """The default every kind taking `name` shares, else None (the job spec's default: null
    then means each kind's own)."""
    setting = BY_NAME[name]
    values = {repr(setting.defaults.get(kind)) for kind in setting.kinds}
    return setting.defaults.get(setting.kinds[0]) if len(values) == 1 else None


def spec_description(name: str) -> str:
    """The job spec field's description: what it means, who takes it, each kind's default."""
    setting = BY_NAME[name]
    text = setting.description
    if setting.kinds != KINDS:
        text += f" Engine kinds: {', '.join(setting.kinds)}."
    if common_default(name) is None and setting.defaults:
        text += f" Null: the kind's default ({defaults_text(name)})."
    return text
