"""A LoRA adapter folder as PEFT saves it: `adapter_config.json` and
`adapter_model.safetensors`, read and checked before any engine uses it.

What is taken: `peft_type` LORA, rank `r`, `lora_alpha`, `use_rslora` (scale alpha / sqrt(r)
instead of alpha / r), `target_modules` among the decoder's seven projections (a list, or
"all-linear"). What is refused, with the adapter and the field named: DoRA, trained biases,
`modules_to_save` (whole replaced modules, e.g. a new LM head), per-module rank or alpha
patterns, `layers_to_transform`, `fan_in_fan_out`, a rank above the engine's maximum, and
weights whose shapes do not fit the base model (an adapter trained for another base).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (the adapter name, "default",
# appears in the key in some older saves: .lora_A.default.weight).
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)


# How every engine kind's "no such adapter" error starts (Serve answers it with a 404).
UNKNOWN_ADAPTER = "unknown adapter"


class AdapterError(ValueError):
    """An adapter that cannot be used: the message names the adapter, the file and the field."""


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(frozen=True)
class Shapes:
    """What an adapter's weights must fit: the base model's projection sizes."""

    num_layers: int
    hidden_size: int
    q_size: int  # heads x head_dim
    kv_size: int  # kv heads x head_dim
    intermediate_size: int
    # Layers whose MLP is one dense MLP (the others' experts cannot be adapted); None: all.
    dense_mlp_layers: frozenset[int] | None = None

    def in_out(self, target: str) -> tuple[int, int]:
        h = self.hidden_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, self.intermediate_size),
            "up_proj": (h, self.intermediate_size),
            "down_proj": (self.intermediate_size, h),
        }[target]


@dataclass
class LoraAdapter:
    """One adapter's weights: per (layer, target) the pair A [r, in] and B [out, r], with the
    scale not yet applied."""

    name: str
    path: str
    config: LoraConfig
    weights: dict[tuple[int, str], tuple[Any, Any]]  # (layer, target) -> (A, B) tensors


def read_config(name: str, folder: Path, max_rank: int) -> LoraConfig:
    path = folder / CONFIG_FILE
    where = f"adapter {name!r} ({path})"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{where}: no {CONFIG_FILE}; is this a PEFT adapter folder?") from None
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{where}: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{where}: expected a JSON object")

    def field(key: str, default: Any = None) -> Any:
        return raw.get(key, default)

    if str(field("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{where}: peft_type {field('peft_type')!r}: only LORA is supported")
    refused = {
        "use_dora": "DoRA adapters",
        "fan_in_fan_out": "fan_in_fan_out weights (GPT-2 style Conv1D)",
        "modules_to_save": "modules_to_save (whole modules replaced)",
        "layers_to_transform": "layers_to_transform (some layers only)",
        "rank_pattern": "per-module ranks",
        "alpha_pattern": "per-module alphas",
    }
    for key, what in refused.items():
        if field(key):
            raise AdapterError(f"{where}: {key} is set: {what} are not supported")
    if field("bias", "none") != "none":
        raise AdapterError(f"{where}: bias {field('bias')!r}: trained biases are not supported")
    rank = field("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(
            f"{where}: r {rank} is over the engine's max_lora_rank {max_rank}; raise "
            "max_lora_rank or use an adapter of lower rank"
        )
    alpha = field("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    targets = field("target_modules")
    if targets == "all-linear":
        targets = list(TARGETS)
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets:
        raise AdapterError(f"{where}: target_modules must name the projections it adapts")
    names = [t.rsplit(".", 1)[-1] for t in targets]
    unknown = sorted(set(names) - set(TARGETS))
    if unknown:
        raise AdapterError(
            f"{where}: target_modules {', '.join(unknown)}: only the decoder's projections "
            f"({', '.join(TARGETS)}) can be adapted"
        )
    return LoraConfig(rank, float(alpha), bool(field("use_rslora", False)), tuple(sorted(names)))


def load_adapter(name: str, path: str | Path, shapes: Shapes, max_rank: int) -> LoraAdapter:
    """Read and check one adapter folder against the base model's `shapes` (CPU tensors)."""
    from safetensors.torch import load_file

    folder = Path(path)
    config = read_config(name, folder, max_rank)
    file = folder / WEIGHTS_FILE
    where = f"adapter {name!r} ({file})"
    if not file.is_file():
        raise AdapterError(f"{where}: missing; PEFT saves the weights there")
    tensors = load_file(str(file))
    halves: dict[tuple[int, str], dict[str, Any]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"{where}: weight {key!r} is not a LoRA weight of a decoder layer")
        layer, target, half = int(match[1]), match[2], match[3]
        if target not in config.target_modules:
            raise AdapterError(f"{where}: weight {key!r} is for a module not in target_modules")
        if layer >= shapes.num_layers:
            raise AdapterError(
                f"{where}: weight {key!r}: layer {layer}, the base model has "
                f"{shapes.num_layers}; this adapter is for another base model"
            )
        dense = shapes.dense_mlp_layers
        if target in MLP_TARGETS and dense is not None and layer not in dense:
            raise AdapterError(
                f"{where}: weight {key!r}: layer {layer} is a mixture-of-experts layer, whose "
                "experts cannot be adapted; target the attention projections only"
            )
        halves.setdefault((layer, target), {})[half] = tensor
    weights: dict[tuple[int, str], tuple[Any, Any]] = {}
    for (layer, target), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where}: layer {layer} {target} has lora_A or lora_B, not both")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = shapes.in_out(target)
        if tuple(a.shape) != (config.rank, fan_in) or tuple(b.shape) != (fan_out, config.rank):
            raise AdapterError(
                f"{where}: layer {layer} {target}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)} do not fit r {config.rank} on the base model's "
                f"{fan_in} -> {fan_out}; this adapter is for another base model"
            )
        weights[(layer, target)] = (a, b)
    if not weights:
        raise AdapterError(f"{where}: holds no LoRA weights")
    return LoraAdapter(name, str(folder), config, weights)
