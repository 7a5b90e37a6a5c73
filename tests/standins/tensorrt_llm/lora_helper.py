"""Stand-in for `tensorrt_llm.lora_helper` (1.2): the LLM API's LoRA configuration."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoraConfig:
    """1.2's fields and defaults; `lora_ckpt_source` hf or nemo, as the real one asserts."""

    lora_dir: list[str] = field(default_factory=list)
    lora_ckpt_source: str = "hf"
    max_lora_rank: int = 64
    lora_target_modules: list[str] = field(default_factory=list)
    trtllm_modules_to_hf_modules: dict[str, str] = field(default_factory=dict)
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    swap_gate_up_proj: bool = True

    def __post_init__(self) -> None:
        if self.lora_ckpt_source not in ("hf", "nemo"):
            raise AssertionError(
                f"lora_ckpt_source must be one of 'hf' or 'nemo', got {self.lora_ckpt_source}"
            )
