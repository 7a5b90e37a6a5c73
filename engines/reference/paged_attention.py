"""The CPU kernel that attends short query chunks over the paged KV cache in place
(kernels/paged_attention.cpp), built on first use, and the torch fallback's switch.

Why a kernel: the torch path gathers every decode request's KV blocks into a padded copy per
layer before SDPA; for a step of 64 requests with ~330 tokens of context on the `small` model
that is ~170 MB copied per step, more than the step's matmuls move. The kernel reads each K/V
row where it lies. It is compiled once per machine with the compiler torch itself uses (about
half a minute) into ~/.cache/tokenmill/kernels/<key> (TOKENMILL_KERNEL_CACHE overrides), keyed
by the source, the torch version and the CPU's instruction-set flags (it is built for the host
CPU), and loaded from there afterwards in well under a second; torch serialises concurrent
builds of one directory with a lock file. Where it cannot be built (no C++ compiler) the engine
says so once in its log and keeps the torch path; TOKENMILL_PAGED_KERNEL=0 forces that path.
CUDA always uses the torch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "kernels" / "paged_attention.cpp"
DISABLE_ENV = "TOKENMILL_PAGED_KERNEL"
CACHE_ENV = "TOKENMILL_KERNEL_CACHE"
# Reassociation lets the compiler vectorise the dot products and sums (fp32 results then
# differ from a sequential sum in the last bits, as any blocked kernel does); no -ffast-math:
# it would also assume no infinities. -fopenmp: at::parallel_for is a header template whose
# OpenMP pragma is dropped without it (the kernel then runs on one thread); the library it
# links, libgomp.so.1, resolves to the copy torch has already loaded (same soname), so the
# kernel shares torch's thread pool.
_CFLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
]
# (row, KV head) pairs below which a call runs on the calling thread: waking the OpenMP
# workers costs tens of microseconds, more than a few rows' attention.
PARALLEL_GRAIN = 16


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_dir() -> Path:
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), torch.__version__.encode(), _cpu_flags().encode()):
        key.update(part)
    key.update(" ".join(_CFLAGS).encode())
    base = os.environ.get(CACHE_ENV) or "~/.cache/tokenmill/kernels"
    return Path(base).expanduser() / f"paged_attention-{key.hexdigest()[:16]}"


@functools.cache
def kernel_available() -> bool:
    """Build (first time on this machine) and load the kernel; False where it cannot be."""
    if os.environ.get(DISABLE_ENV) == "0":
        return False
    try:
        from torch.utils.cpp_extension import load

        build = _build_dir()
        build.mkdir(parents=True, exist_ok=True)
        load(
            name="tokenmill_paged_attention",
            sources=[str(_SOURCE)],
            build_directory=str(build),
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, a failed build: the torch path still works
        logger.warning(
            "paged attention kernel unavailable (%s: %s); attention gathers KV blocks instead",
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )
        return False
    return True


def use_kernel(device: torch.device) -> bool:
    return device.type == "cpu" and kernel_available()


def paged_attention(
    out: torch.Tensor,  # [T, H, D], written at `rows`
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [KVH, num_blocks, block_size, D]
    v_cache: torch.Tensor,
    rows: torch.Tensor,  # [R] int64 query rows of the flat batch
    req: torch.Tensor,  # [R] int32 each row's index into `tables`
    limit: torch.Tensor,  # [R] int32 keys each row attends to (its position + 1)
    tables: torch.Tensor,  # [N, max_blocks] int32 block tables of the step's short chunks
    scale: float,
) -> None:
    torch.ops.tokenmill.paged_attention(
        out, q, k_cache, v_cache, rows, req, limit, tables, scale, PARALLEL_GRAIN
    )
