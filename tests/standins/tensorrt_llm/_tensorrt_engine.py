"""Stand-in for `tensorrt_llm._tensorrt_engine` (1.2): the TensorRT-engine backend's LLM, which
alone takes quant_config / calib_config / build_config / enable_build_cache and has save()."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tensorrt_llm._core import PYTORCH_ONLY_ARGS, TENSORRT_ONLY_ARGS, LlmCore
from tensorrt_llm.llmapi import BuildCacheConfig, BuildConfig, CalibConfig, QuantConfig

# Dataset names the real calibration loader fetches from the network (matched as substrings of
# calib_dataset, before it looks for a local directory).
_HUB_DATASETS = ("cnn_dailymail", "pileval", "scienceqa", "science_qa")


def load_calibration_texts(calib: CalibConfig) -> list[str]:
    """The texts a quantizing build calibrates on, read as the real loader does: a hub name
    is downloaded (refused here: the clusters this stands in for are air-gapped), a local
    directory is loaded as a dataset whose "train" split has a "text" column."""
    name = str(calib.calib_dataset)
    if any(hub in name.lower() for hub in _HUB_DATASETS):
        raise ConnectionError(
            f"calibration dataset {name!r} would be downloaded from the Hugging Face Hub; "
            "this (stand-in) cluster has no network access"
        )
    root = Path(name)
    if not root.is_dir():
        raise NotImplementedError(f"Unsupported dataset name or local repo directory: {name}.")
    texts: list[str] = []
    for path in sorted(root.glob("train*.jsonl")):
        texts += [json.loads(line)["text"] for line in path.read_text().splitlines() if line]
    if not texts:
        raise ValueError(f"{name}: no train split with a text column")
    return texts[: calib.calib_batches * calib.calib_batch_size]


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
        quant = self.args["quant_config"]
        if quant is not None and quant.quant_algo is not None:
            # Quantizing while building runs ModelOpt calibration right here.
            self.calibration_texts = load_calibration_texts(
                self.args["calib_config"] or CalibConfig()
            )
        cache = self.args["enable_build_cache"]
        if isinstance(cache, BuildCacheConfig) and cache.cache_root is not None:
            # The real build cache stores an engine per build key under cache_root.
            root = Path(cache.cache_root)
            root.mkdir(parents=True, exist_ok=True)
            (root / "engine.standin").write_text(f"{model}\n")

    def save(self, engine_dir: str) -> None:
        Path(engine_dir).mkdir(parents=True, exist_ok=True)
        (Path(engine_dir) / "rank0.engine").write_text("stand-in engine\n")
