"""Inference engines behind one contract (engines.api). No Ray and no pipeline imports here.

from engines import load_engine, GenerationRequest, SamplingParams
engine = load_engine("reference", model="path/to/hf_dir", max_num_tokens=512)
"""

from engines.api import (
    Engine,
    EngineDeadError,
    EngineError,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    RequestMetrics,
    SamplingParams,
    StepRecord,
    StreamDelta,
)
from engines.factory import ENGINE_KINDS, load_engine

__all__ = [
    "ENGINE_KINDS",
    "Engine",
    "EngineDeadError",
    "EngineError",
    "EngineInfo",
    "EngineStats",
    "GenerationRequest",
    "GenerationResult",
    "RequestMetrics",
    "SamplingParams",
    "StepRecord",
    "StreamDelta",
    "load_engine",
]
