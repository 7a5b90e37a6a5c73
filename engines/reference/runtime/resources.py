"""Load-time choices of the reference engine: device, dtype, context length, KV pool size,
tokenizer. Each turns a user setting (or "auto") into a concrete value, or an EngineError that
names the setting and what to do."""

from __future__ import annotations

from pathlib import Path

from engines.api import EngineError
from engines.reference.model.config import ModelConfig

_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}
_DEFAULT_POOL_CONTEXT = 2048  # default pool: max_batch_size sequences of this many tokens
_CPU_POOL_CAP_BYTES = 1 << 30  # ...but at most 1 GiB on CPU
_CUDA_POOL_FREE_FRACTION = 0.5  # ...or half of the free GPU memory


def resolve_device(device: str):
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise EngineError(f"device {device!r} is not a torch device (auto, cpu, cuda:N)") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"device {device!r} asked for, but CUDA is not available here")
    return resolved


def resolve_dtype(dtype: str, device) -> str:
    import torch

    if dtype == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return "bfloat16"
        return "float32"
    if dtype not in _DTYPES:
        raise EngineError(
            f"dtype {dtype!r} is not supported; choose auto, float32, bfloat16 or float16"
        )
    return _DTYPES[dtype]


def resolve_max_model_len(cfg: ModelConfig, asked: int | None) -> int:
    limit = cfg.max_position_embeddings
    if cfg.sliding_window is not None:
        # Sliding layers attend to the last `sliding_window` tokens; within the window that is
        # full attention, so capping the context keeps every layer exact without windowed masks
        # in the attention path (Mistral, and Qwen2/3 with use_sliding_window).
        limit = min(limit, cfg.sliding_window)
    if asked is None:
        return limit
    if not isinstance(asked, int) or asked < 2 or asked > limit:
        raise EngineError(
            f"max_model_len={asked!r} is outside what the model supports (2..{limit} tokens, "
            "from max_position_embeddings, and sliding_window when the model has sliding-window "
            "layers, in config.json)"
        )
    return asked


def pool_blocks(
    kv_cache_tokens: int | None,
    kv_cache_memory_gb: float | None,
    block_size: int,
    bytes_per_token: int,
    max_batch_size: int,
    max_model_len: int,
    device,
) -> int:
    """Blocks in the KV pool: from tokens, else from memory, else a default sized for a full
    batch of moderately long sequences (capped so a CPU job cannot eat all the RAM)."""
    if kv_cache_tokens is not None:
        if not isinstance(kv_cache_tokens, int) or kv_cache_tokens < block_size:
            raise EngineError(
                f"kv_cache_tokens must be an integer >= block_size ({block_size}), "
                f"got {kv_cache_tokens!r}"
            )
        return kv_cache_tokens // block_size
    bytes_per_block = bytes_per_token * block_size
    if kv_cache_memory_gb is not None:
        blocks = int(kv_cache_memory_gb * (1 << 30)) // bytes_per_block
        if blocks < 1:
            raise EngineError(
                f"kv_cache_memory_gb={kv_cache_memory_gb!r} holds no {block_size}-token block "
                f"({bytes_per_block} bytes each); raise it"
            )
        return blocks
    tokens = max_batch_size * min(max_model_len, _DEFAULT_POOL_CONTEXT)
    blocks = -(-tokens // block_size)
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        cap = int(free * _CUDA_POOL_FREE_FRACTION)
    else:
        cap = _CPU_POOL_CAP_BYTES
    return max(1, min(blocks, cap // bytes_per_block))


def load_tokenizer(model_dir: Path):
    """The model's tokenizer, or None when the directory has none (text stays empty)."""
    if not any((model_dir / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        raise EngineError(f"{model_dir}: cannot load the tokenizer ({exc})") from exc
