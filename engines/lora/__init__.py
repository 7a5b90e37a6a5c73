"""LoRA adapters: PEFT's on-disk format read and checked once, for every engine kind."""
