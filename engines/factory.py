"""Build an engine by name. Heavy imports happen here, only for the engine asked for."""

from __future__ import annotations

from typing import Any

from engines.api import Engine, EngineError

# synthetic: a test and capacity tool (random tokens at a set rate), not a model engine.
ENGINE_KINDS = ("reference", "trtllm", "vllm", "synthetic")


def load_engine(kind: str, model: str, **settings: Any) -> Engine:
    """Load `model` (a local Hugging Face directory) into the engine `kind`.

    `settings` are the engine's own options (max_num_tokens, max_batch_size, ...); an unknown
    option is a TypeError naming it, so a typo in a job file cannot pass silently.
    """
    if kind == "reference":
        # each kind loads its vendor (torch, vllm, tensorrt_llm) only when asked for
        from engines.reference.engine import ReferenceEngine

        return ReferenceEngine(model, **settings)
    if kind == "trtllm":
        # each kind loads its vendor (torch, vllm, tensorrt_llm) only when asked for
        from engines.trtllm import TrtllmEngine

        return TrtllmEngine(model, **settings)
    if kind == "vllm":
        # each kind loads its vendor (torch, vllm, tensorrt_llm) only when asked for
        from engines.vllm import VllmEngine

        return VllmEngine(model, **settings)
    if kind == "synthetic":
        # each kind loads its vendor (torch, vllm, tensorrt_llm) only when asked for
        from engines.synthetic import SyntheticEngine

        return SyntheticEngine(model, **settings)
    raise EngineError(f"unknown engine kind {kind!r}; supported: {', '.join(ENGINE_KINDS)}")


def accepted_settings(kind: str) -> tuple[str, ...]:
    """The keyword settings engine `kind` accepts (its module's SETTINGS; no torch imported)."""
    if kind == "reference":
        # each kind's settings without loading its vendor
        from engines.reference.engine import SETTINGS

        return SETTINGS
    if kind == "trtllm":
        # each kind's settings without loading its vendor
        from engines.trtllm import SETTINGS

        return SETTINGS
    if kind == "vllm":
        # each kind's settings without loading its vendor
        from engines.vllm import SETTINGS

        return SETTINGS
    if kind == "synthetic":
        # each kind's settings without loading its vendor
        from engines.synthetic.settings import SETTINGS

        return SETTINGS
    raise EngineError(f"unknown engine kind {kind!r}; supported: {', '.join(ENGINE_KINDS)}")
