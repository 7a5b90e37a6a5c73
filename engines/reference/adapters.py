"""LoRA for the reference engine, put together: the adapters it knows (engines/lora/store.py),
the model's projections wrapped with slots (model/lora.py) and the slots' bookkeeping
(runtime/adapters.py), or nothing at all for an engine without adapters."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engines.api import EngineError
from engines.lora.peft import AdapterError, LoraAdapter, Shapes
from engines.lora.prefix import AdapterPrefix
from engines.lora.store import AdapterStore
from engines.lora.vendor import MIN_CPU_LORAS
from engines.reference.model.config import ModelConfig
from engines.reference.model.lora import LoraStepState, attach_lora
from engines.reference.model.model import CausalLM
from engines.reference.runtime.adapters import AdapterSlots


def attach_adapters(
    model: CausalLM,
    config: ModelConfig,
    sources: Mapping[str, str],
    max_loras: int,
    max_rank: int,
    max_cpu_loras: int | None,
    prefix: Mapping[str, Any] | None = None,
) -> tuple[AdapterStore | None, AdapterSlots | None, LoraStepState | None]:
    """(store, slots, per-step state) for an engine with `sources` or a `prefix` to find
    adapters under (engines/lora/prefix.py); (None, None, None) without either: its
    projections stay unwrapped and cost nothing."""
    try:
        found = AdapterPrefix.of(prefix)
    except AdapterError as exc:
        raise EngineError(str(exc)) from None
    if not sources and found is None:
        return None, None, None
    cpu = max_cpu_loras if max_cpu_loras is not None else max(max_loras, MIN_CPU_LORAS)
    if cpu < 1:
        raise EngineError(f"max_cpu_loras must be >= 1, got {max_cpu_loras!r}")
    shapes = Shapes(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        q_size=config.q_size,
        kv_size=config.kv_size,
        intermediate_size=config.intermediate_size,
        dense_mlp_layers=frozenset(
            i for i in range(config.num_layers) if not config.is_moe_layer(i)
        ),
    )
    try:
        store = AdapterStore(sources, shapes, max_rank, cpu, found)
    except AdapterError as exc:
        raise EngineError(str(exc)) from None
    state = LoraStepState()
    wrapped = attach_lora(model, max_loras, max_rank, state)

    def fill(slot: int, adapter: LoraAdapter) -> None:
        for module in wrapped:
            module.load(slot, adapter)

    return store, AdapterSlots(max_loras, fill), state


def adapter_for(store: AdapterStore | None, name: str) -> tuple[LoraAdapter | None, str | None]:
    """(the checked adapter, None) or (None, why this request cannot use `name`)."""
    if store is None:
        return None, (
            f"unknown adapter {name!r}: this engine serves its base model only (no "
            "lora_adapters configured)"
        )
    try:
        return store.get(name), None
    except AdapterError as exc:
        return None, str(exc)
