"""Zeroed CPU tensors backed by transparent huge pages (2 MB) where Linux offers them.

Why: decode attention walks each request's KV blocks (4 KB per block and KV head at block size
16, fp32, head size 64) scattered over a pool of hundreds of MB. On 4 KB pages nearly every
block is a TLB miss and a page walk (a nested one in a VM); on 2 MB pages the pool's
translations fit the TLB. Measured on the 2-core bench machine: the paged-attention kernel
alone reads 128 decode rows' K/V at 29.9 GB/s from a huge-page pool against 22.3 GB/s from a
4 KB one, the two interleaved in one process.

The KV pool and the weights the kernels stream in their own layouts (`copy`) ask for them;
each is allocated once. Activations are allocated every step, and torch's process-wide switch
(THP_MEM_ALLOC_ENABLE) made prefill steps slower by zeroing a fresh 2 MB page at every first
touch.

With THP in its common "madvise" mode the kernel backs only ranges that asked, and only pages
touched after the request, so the tensor is allocated empty, advised, then zeroed. Where the
advice is refused (THP "never", another OS) the pool keeps 4 KB pages: same contents, same
results, only slower.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

import torch

_MADV_HUGEPAGE = 14  # linux/mman.h
_HUGE_PAGE = 1 << 21


@functools.cache
def _madvise() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for huge pages under the whole 2 MB pages inside a CPU tensor's memory; whether the
    kernel took the advice. Pages already touched keep their size."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return False
    address = tensor.data_ptr()
    start = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    end = (address + tensor.numel() * tensor.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    return end > start and madvise(start, end - start, _MADV_HUGEPAGE) == 0


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.zeros`, on huge pages where the tensor is on the CPU and the kernel allows it."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    tensor = torch.empty(shape, dtype=dtype)
    advise_huge_pages(tensor)
    return tensor.zero_()


def copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor on huge pages where the OS gives them (else a plain
    copy). For weights a kernel streams at every step in its own layout (the fused MoE
    experts, the panel LM head): on 4 KB pages each page is a TLB miss and a restart of the
    hardware prefetcher (one sparse layer of the bench model ran 1.3-1.7x slower)."""
    return zeros(tuple(tensor.shape), tensor.dtype, tensor.device).copy_(tensor)
