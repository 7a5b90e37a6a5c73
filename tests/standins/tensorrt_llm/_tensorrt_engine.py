"""Stand-in for `tensorrt_llm._tensorrt_engine` (1.2): the TensorRT-engine backend's LLM, which
alone takes quant_config / calib_config / build_config / enable_build_cache and has save()."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tensorrt_llm._core import PYTORCH_ONLY_ARGS, TENSORRT_ONLY_ARGS, LlmCore
from tensorrt_llm.llmapi import BuildCacheConfig, BuildConfig, QuantConfig


class LLM(LlmCore):
    backend = "tensorrt"
    extra_args: dict[str, Any] = TENSORRT_ONLY_ARGS
    rejected_args: dict[str, Any] = PYTORCH_ONLY_ARGS

    def __init__(self, model: str, tokenizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, tokenizer, **kwargs)
        for name, kind in (
            ("build_config", BuildConfig),
            ("quant_config", QuantConfig),
        ):
            value = self.args[name]
            if value is not None and not isinstance(value, kind):
                raise ValueError(f"{name} must be a {kind.__name__}")
        cache = self.args["enable_build_cache"]
        if isinstance(cache, BuildCacheConfig) and cache.cache_root is not None:
            # The real build cache stores an engine per build key under cache_root.
            root = Path(cache.cache_root)
            root.mkdir(parents=True, exist_ok=True)
            (root / "engine.standin").write_text(f"{model}\n")

    def save(self, engine_dir: str) -> None:
        Path(engine_dir).mkdir(parents=True, exist_ok=True)
        (Path(engine_dir) / "rank0.engine").write_text("stand-in engine\n")
