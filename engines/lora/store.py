"""The adapters an engine knows by name, read from disk on first use and kept in a CPU cache.

Read on the caller's side (an asyncio loop's thread, several at once in Serve): a bad adapter
is that request's error at once, naming the adapter and the field, and the engine's step loop
only ever copies checked weights into its slots. The cache holds `max_cpu_loras` adapters,
least recently used dropped first; an adapter in a slot keeps its own copy there.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

from engines.lora.peft import AdapterError, LoraAdapter, Shapes, load_adapter
from engines.lora.prefix import AdapterPrefix


class AdapterStore:
    def __init__(
        self,
        sources: Mapping[str, str],
        shapes: Shapes,
        max_rank: int,
        max_cpu_loras: int,
        prefix: AdapterPrefix | None = None,
    ) -> None:
        for name, path in sources.items():
            if not name or not isinstance(path, str | Path):
                raise AdapterError(f"lora_adapters: {name!r} -> {path!r}: a name and a folder")
        self._sources = dict(sources)
        self._shapes = shapes
        self._max_rank = max_rank
        self._capacity = max_cpu_loras
        self._prefix = prefix  # where names not in `sources` are looked up on first use
        self._cache: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self.reads = 0  # adapters read from disk (a re-read after eviction counts again)

    @property
    def names(self) -> list[str]:
        return sorted(self._sources)

    def get(self, name: str) -> LoraAdapter:
        """The checked adapter `name`; AdapterError naming what is wrong (an unknown name
        included)."""
        with self._lock:
            adapter = self._cache.get(name)
            if adapter is not None:
                self._cache.move_to_end(name)
                return adapter
        source = self._sources.get(name)
        if source is None and self._prefix is not None:
            source = self._prefix.folder(name)  # AdapterError when the prefix has none
            with self._lock:
                self._sources[name] = source
        if source is None:
            known = ", ".join(self.names) or "none"
            raise AdapterError(f"unknown adapter {name!r}; this engine has: {known}")
        # Read outside the lock: a large adapter must not hold up requests for cached ones.
        adapter = load_adapter(name, source, self._shapes, self._max_rank)
        with self._lock:
            self.reads += 1
            self._cache[name] = adapter
            self._cache.move_to_end(name)
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        return adapter
