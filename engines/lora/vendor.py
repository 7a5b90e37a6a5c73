"""LoRA adapters handed to a vendor engine (vLLM, TensorRT-LLM): each adapter's stable integer
id and folder, and its `adapter_config.json` checked on first use the way the reference engine
checks it, so an unknown name, a rank over `max_lora_rank` or a malformed config is that
request's error with the same message on every engine kind. The vendor reads the weights.

The settings are the reference engine's (`max_loras`, `max_lora_rank`, `max_cpu_loras`, with
the same defaults), mapped by each adapter to its vendor's names."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from engines.lora.peft import AdapterError, read_config
from engines.lora.prefix import AdapterPrefix

# One set of defaults for every engine kind (the reference engine's constructor reads them too).
DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 64
# max_cpu_loras when unset: max(max_loras, this); a nightly over a few fine-tunes reads each once.
MIN_CPU_LORAS = 8


@dataclass(frozen=True)
class LoraLimits:
    """The adapter settings one engine runs with (defaults filled in)."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int

    @classmethod
    def of(
        cls, max_loras: int | None, max_lora_rank: int | None, max_cpu_loras: int | None
    ) -> LoraLimits:
        loras = max_loras if max_loras is not None else DEFAULT_MAX_LORAS
        rank = max_lora_rank if max_lora_rank is not None else DEFAULT_MAX_LORA_RANK
        cpu = max_cpu_loras if max_cpu_loras is not None else max(loras, MIN_CPU_LORAS)
        for name, value in (("max_loras", loras), ("max_lora_rank", rank), ("max_cpu_loras", cpu)):
            if value < 1:
                raise AdapterError(f"{name} must be >= 1, got {value}")
        if cpu < loras:
            raise AdapterError(f"max_cpu_loras ({cpu}) must be >= max_loras ({loras})")
        return cls(loras, rank, cpu)


@dataclass(frozen=True)
class VendorAdapter:
    name: str
    int_id: int  # 1-based and stable for the engine's life (vendors key their caches by it)
    path: str
    rank: int


class AdapterTable:
    """The adapters one vendor engine may run, by name."""

    def __init__(
        self, sources: Mapping[str, str], max_rank: int, prefix: AdapterPrefix | None = None
    ) -> None:
        for name, path in sources.items():
            if not name or not isinstance(path, str | Path):
                raise AdapterError(f"lora_adapters: {name!r} -> {path!r}: a name and a folder")
        # Sorted, so the ids do not depend on the map's order (two replicas agree).
        self._ids = {name: i for i, name in enumerate(sorted(sources), start=1)}
        self._sources = {name: str(path) for name, path in sources.items()}
        self._max_rank = max_rank
        self._prefix = prefix  # where names not in `sources` are looked up on first use
        self._checked: dict[str, VendorAdapter] = {}
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return sorted(self._sources)

    def get(self, name: str) -> VendorAdapter:
        """The adapter `name`, its config checked; AdapterError naming what is wrong."""
        with self._lock:
            known = self._checked.get(name)
        if known is not None:
            return known
        path = self._sources.get(name)
        if path is None and self._prefix is not None:
            path = self._prefix.folder(name)  # AdapterError when the prefix has none
        if path is None:
            have = ", ".join(self.names) or "none"
            raise AdapterError(f"unknown adapter {name!r}; this engine has: {have}")
        config = read_config(name, Path(path), self._max_rank)
        with self._lock:
            if name not in self._ids:  # found under the prefix: the next id, for good
                self._ids[name] = max(self._ids.values(), default=0) + 1
                self._sources[name] = path
            adapter = VendorAdapter(name, self._ids[name], path, config.rank)
        with self._lock:
            self._checked[name] = adapter
        return adapter
