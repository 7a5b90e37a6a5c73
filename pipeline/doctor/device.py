"""torch and its device: CUDA version, GPUs, compute capability, FP8 / NVFP4 support."""

from __future__ import annotations

from engines.gpu import REQUIREMENTS
from pipeline.doctor.findings import Finding, Status


def check_device() -> list[Finding]:
    try:
        import torch
    except Exception as exc:  # an ABI mismatch raises more than ImportError
        return [Finding("device", "torch", Status.CONFLICT, f"torch does not import: {exc}")]
    if not torch.cuda.is_available():
        threads = torch.get_num_threads()
        return [
            Finding(
                "device",
                "cpu",
                Status.OK,
                f"torch {torch.__version__} on CPU ({threads} threads); no CUDA device visible",
                provides=("cpu",),
            )
        ]
    findings = [
        Finding(
            "device",
            "cuda",
            Status.OK,
            f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"{torch.cuda.device_count()} GPU(s)",
            provides=("cuda",),
        )
    ]
    capabilities = set()
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        capabilities.add((major, minor))
        findings.append(
            Finding(
                "device",
                f"gpu{index}",
                Status.OK,
                f"{torch.cuda.get_device_name(index)}, compute capability {major}.{minor}",
            )
        )
    lowest = min(capabilities)
    for algo, (minimum, gpus) in REQUIREMENTS.items():
        supported = lowest >= minimum
        findings.append(
            Finding(
                "device",
                algo.lower(),
                Status.OK if supported else Status.INFO,
                f"{algo} {'supported' if supported else 'not supported'} (needs compute "
                f"capability {minimum[0]}.{minimum[1]}+: {gpus})",
                "" if supported else f"{algo} checkpoints need {gpus}",
                provides=(algo.lower(),) if supported else (),
            )
        )
    return findings
