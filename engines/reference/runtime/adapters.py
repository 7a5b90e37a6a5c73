"""Which LoRA adapters sit in the model's slots, and which running requests use each.

A request with an adapter runs only while its adapter is in a slot (`max_loras` of them). A
slot whose adapter no running request uses can take another adapter, least recently used
first; a request whose adapter finds every slot in use waits while requests behind it that
can run go ahead (the scheduler skips it, keeping its place). Slots are filled on the step
loop's thread, between steps, from adapters already read and checked on the caller's side
(engine.py keeps those in a CPU cache of `max_cpu_loras`).
"""

from __future__ import annotations

from collections.abc import Callable

from engines.lora.peft import LoraAdapter


class AdapterSlots:
    def __init__(self, num_slots: int, fill: Callable[[int, LoraAdapter], None]) -> None:
        self._fill = fill  # puts an adapter's weights into a slot of the model
        self._names: list[str | None] = [None] * num_slots
        self._users: list[set[str]] = [set() for _ in range(num_slots)]
        self._last_used = [-1] * num_slots  # step-loop tick of the slot's last acquire
        self._slot_of_request: dict[str, int] = {}
        self._tick = 0
        self.loads = 0  # adapters put into a slot (a reload after eviction counts again)

    @property
    def num_slots(self) -> int:
        return len(self._names)

    def _resident(self, name: str) -> int | None:
        try:
            return self._names.index(name)
        except ValueError:
            return None

    def can_acquire(self, name: str) -> bool:
        return self._resident(name) is not None or any(not users for users in self._users)

    def acquire(self, request_id: str, adapter: LoraAdapter) -> int | None:
        """The slot `request_id` runs in (loading `adapter` if it is not resident), or None
        when every slot holds another adapter in use."""
        slot = self._resident(adapter.name)
        if slot is None:
            free = [s for s, users in enumerate(self._users) if not users]
            if not free:
                return None
            slot = min(free, key=lambda s: self._last_used[s])
            self._fill(slot, adapter)
            self._names[slot] = adapter.name
            self.loads += 1
        self._tick += 1
        self._last_used[slot] = self._tick
        self._users[slot].add(request_id)
        self._slot_of_request[request_id] = slot
        return slot

    def release(self, request_id: str) -> None:
        slot = self._slot_of_request.pop(request_id, None)
        if slot is not None:
            self._users[slot].discard(request_id)

    def slot(self, request_id: str) -> int:
        """The slot of a running request; -1 for one on the base model."""
        return self._slot_of_request.get(request_id, -1)

    def resident(self) -> list[str | None]:
        return list(self._names)
