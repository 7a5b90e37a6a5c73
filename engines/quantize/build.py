"""One quantized build: load the HF checkpoint, calibrate with ModelOpt, gate, export.

    original model ──► reference run on held-out texts (logits, greedy tokens)
                   ──► mtq.quantize(forward_loop over calibration texts)
                   ──► fuse shared scales (q/k/v, gate/up) as the export will
                   ──► quantized (fake-quant) run on the same texts ──► QualityReport
                   ──► export_hf_checkpoint (unified HF layout) + tokenizer files

The fake-quant run happens after the shared-scale fusion, so the model that is scored is the
model that is exported. Export packs the weights in place, so nothing runs on the model after it.
Publishing, caching and the pass/fail decision belong to engines.quantize.artifacts.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.quantize.calibration import CalibrationTexts
from engines.quantize.config import (
    SUPPORTED_ARCHITECTURES,
    QuantizationSpec,
    QuantizeError,
)
from engines.quantize.quality import QualityReport, compare, run_model

log = logging.getLogger(__name__)

CPU_NVFP4_BACKEND = "tokenmill_nvfp4_cpu"
# Files of a source checkpoint that the export replaces (everything else, i.e. the tokenizer
# and chat template, is copied so the artifact is a complete model directory).
_REPLACED_BY_EXPORT = ("config.json", "generation_config.json", "hf_quant_config.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


@dataclass
class BuildOutcome:
    export_dir: Path  # local directory holding the export, tokenizer and quality_report.json
    report: QualityReport
    calibration_batches: int  # forward passes run for calibration (0 never happens here)
    seconds: dict[str, float] = field(default_factory=dict)  # load, calibrate, quality, export
    device: str = "cpu"


def read_architecture(model_dir: str | Path) -> str:
    """The checkpoint's architecture, or a QuantizeError if it is not one we can quantize."""
    config_path = Path(model_dir) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise QuantizeError(
            f"{config_path}: not found; MODEL must be a Hugging Face directory"
        ) from None
    if "quantization_config" in config:
        raise QuantizeError(
            f"{model_dir} is already quantized ({config['quantization_config']}); "
            "quantize the original checkpoint instead"
        )
    archs = config.get("architectures") or []
    supported = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise QuantizeError(
            f"{config_path}: architecture {archs or 'unknown'} is not supported for "
            f"quantization; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return supported[0]


def resolve_device(requested: str) -> str:
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise QuantizeError("quantization.device is cuda but no CUDA device is visible")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def modelopt_config(spec: QuantizationSpec, device: str) -> dict[str, Any]:
    """ModelOpt's quant config for the spec (0.47: `quant_cfg` is a list of entries)."""
    import modelopt.torch.quantization as mtq

    base = {"fp8": mtq.FP8_DEFAULT_CFG, "nvfp4": mtq.NVFP4_DEFAULT_CFG}[spec.format]
    cfg = copy.deepcopy(base)
    if spec.format == "nvfp4" and device == "cpu":
        # ModelOpt's NVFP4 fake-quant kernels are CUDA-only; route the dynamic block quantizers
        # to the same math in plain PyTorch (engines.quantize.numerics). Export is unaffected.
        register_cpu_nvfp4_backend()
        for entry in cfg["quant_cfg"]:
            qcfg = entry.get("cfg")
            if isinstance(qcfg, dict) and (qcfg.get("block_sizes") or {}).get("type") == "dynamic":
                qcfg["backend"] = CPU_NVFP4_BACKEND
    if spec.kv_cache == "fp8":
        # Same as mtq.update_quant_cfg_with_kv_cache_quant, without its print of the config.
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    return cfg


def register_cpu_nvfp4_backend() -> None:
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import (
        is_registered_quant_backend,
        register_quant_backend,
    )

    # torch and modelopt: loaded with the backend that needs them
    from engines.quantize.numerics import nvfp4_qdq

    if not is_registered_quant_backend(CPU_NVFP4_BACKEND):
        register_quant_backend(CPU_NVFP4_BACKEND, lambda x, q: nvfp4_qdq(x, q.amax))


def require_modelopt() -> None:
    """QuantizeError unless the installed ModelOpt is the one the quantize extra names.

    The build uses ModelOpt 0.47's list-form quant configs and its pluggable quantizer backend
    (NVFP4 calibration on CPUs); TensorRT-LLM 1.2's container carries 0.37, where a build
    would fail deep inside ModelOpt. The range is read from tokenmill's installed metadata
    (pyproject's quantize extra), so it is stated once."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        wanted = next(
            req
            for line in metadata.requires("tokenmill") or []
            if (req := Requirement(line)).name == "nvidia-modelopt"
        )
    except (metadata.PackageNotFoundError, StopIteration):
        return  # not installed as a package (a source tree): nothing to compare against
    try:
        found = metadata.version("nvidia-modelopt")
    except metadata.PackageNotFoundError:
        found = None
    if found is not None and wanted.specifier.contains(found, prereleases=True):
        return
    raise QuantizeError(
        f"building a quantized checkpoint needs nvidia-modelopt{wanted.specifier} (tokenmill's "
        f"quantize extra); this environment has {found or 'none'} (TensorRT-LLM 1.2's container "
        "carries 0.37). Build it with `tokenmill quantize` where `pip install "
        "'tokenmill[quantize]'` works, then point model.path at the artifact (docs/deploy.md)"
    )


def quantize_checkpoint(
    model_dir: str | Path,
    export_dir: str | Path,
    spec: QuantizationSpec,
    texts: CalibrationTexts,
) -> BuildOutcome:
    """Quantize `model_dir` to `export_dir` (created; must be empty) and score it."""
    read_architecture(model_dir)
    require_modelopt()
    import modelopt.torch.quantization as mtq
    import torch
    import transformers
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    export_dir = Path(export_dir)
    if export_dir.exists() and any(export_dir.iterdir()):
        raise QuantizeError(f"export directory {export_dir} is not empty")
    device = resolve_device(spec.device)
    seconds: dict[str, float] = {}

    start = time.monotonic()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = model.to(device).eval()
    seconds["load"] = time.monotonic() - start

    q = spec.quality
    held_out = [
        tokenizer(t, add_special_tokens=False).input_ids[: q.prompt_tokens] for t in texts.held_out
    ]
    held_out = [ids for ids in held_out if len(ids) >= 2]
    if not held_out:
        raise QuantizeError(
            "no held-out text is at least 2 tokens long; check the calibration data"
        )
    prompt_len = max(1, q.prompt_tokens // 4)
    prompts = [ids[:prompt_len] for ids in held_out]

    start = time.monotonic()
    original = run_model(model, held_out, prompt_len, q.greedy_tokens)
    seconds["quality_original"] = time.monotonic() - start

    batches = [
        texts.calibration[i : i + spec.calibration.batch_size]
        for i in range(0, len(texts.calibration), spec.calibration.batch_size)
    ]
    num_batches = 0

    def forward_loop(m: Any) -> None:
        nonlocal num_batches
        for batch in batches:
            enc = tokenizer(
                batch,
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=spec.calibration.max_length,
            ).to(device)
            with torch.no_grad():
                m(**enc, use_cache=False)
            num_batches += 1

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    start = time.monotonic()
    model = mtq.quantize(model, modelopt_config(spec, device), forward_loop)
    # Share scales of layers that read the same input (q/k/v, gate/up) now, as export would,
    # so the scored fake-quant model is the exported one.
    requantize_resmooth_fused_llm_layers(model)
    seconds["calibrate"] = time.monotonic() - start
    log.info(
        "calibrated %s with %d batches in %.1fs", spec.label, num_batches, seconds["calibrate"]
    )

    start = time.monotonic()
    quantized = run_model(model, held_out, prompt_len, q.greedy_tokens)
    report = compare(
        original,
        quantized,
        spec.thresholds(),
        format=spec.format,
        kv_cache=spec.kv_cache,
        prompts=prompts,
    )
    seconds["quality_quantized"] = time.monotonic() - start

    start = time.monotonic()
    export_dir.mkdir(parents=True, exist_ok=True)
    export_hf_checkpoint(model, export_dir=str(export_dir))
    copy_tokenizer_files(Path(model_dir), export_dir)
    seconds["export"] = time.monotonic() - start
    return BuildOutcome(
        export_dir=export_dir,
        report=report,
        calibration_batches=num_batches,
        seconds=seconds,
        device=device,
    )


def copy_tokenizer_files(source: Path, export_dir: Path) -> None:
    """Copy the source's non-weight files (tokenizer, chat template) beside the export."""
    for path in source.iterdir():
        name = path.name
        if (
            not path.is_file()
            or name in _REPLACED_BY_EXPORT
            or name.endswith(_WEIGHT_SUFFIXES)
            or name.startswith("tokenmill_")
            or (export_dir / name).exists()
        ):
            continue
        shutil.copy2(path, export_dir / name)
