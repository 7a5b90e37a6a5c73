"""Low-precision builds: ModelOpt FP8 / NVFP4 post-training quantization of a Hugging Face
checkpoint, a quality gate against the original, and a cache of published artifacts.

    config.py       QuantizationSpec (format, KV cache, calibration, thresholds); no torch
    calibration.py  calibration and held-out texts from a file or the built-in sample
    numerics.py     FP8 / NVFP4 quantize-dequantize in plain PyTorch (shared with the engine)
    quality.py      teacher-forced agreement, KL, greedy match → QualityReport
    build.py        load → calibrate → score → export (ModelOpt)
    artifacts.py    cache key, build-or-reuse, publish to a local path or s3://

Only config.py is imported here, so importing the package stays cheap.
"""

from engines.quantize.config import (
    FORMATS,
    SUPPORTED_ARCHITECTURES,
    QuantizationSpec,
    QuantizeError,
)

__all__ = ["FORMATS", "SUPPORTED_ARCHITECTURES", "QuantizationSpec", "QuantizeError"]
