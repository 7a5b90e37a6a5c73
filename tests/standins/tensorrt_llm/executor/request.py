"""Stand-in for `tensorrt_llm.executor.request` (1.2): the per-request LoRA choice."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(slots=True)
class LoRARequest:
    """As the real one: a name, an integer id the executor caches the adapter by, and its
    folder, which must exist when the request is made."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if self.lora_path is not None and not os.path.exists(self.lora_path):
            raise ValueError(f"lora_path ({self.lora_path}) does not exist.")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
