"""The KV pool's allocation: zeroed like torch.zeros, and on huge pages where Linux offers them."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from engines.reference.model import hugepages

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The active THP mode ("always", "madvise", "never"), None where there is no THP."""
    if not _THP.exists():
        return None
    match = re.search(r"\[(\w+)\]", _THP.read_text())
    return match.group(1) if match else None


def _smaps_field(address: int, field: str) -> str:
    """A field of the mapping that holds `address`, from /proc/self/smaps ("" if absent)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith(f"{field}:"):
            return line.split(":", 1)[1].strip()
    return ""


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping that holds `address`."""
    value = _smaps_field(address, "AnonHugePages")
    return int(value.split()[0]) if value else 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_is_a_zeroed_tensor_of_the_shape_and_dtype(dtype) -> None:
    pool = hugepages.zeros((2, 300, 16, 64), dtype, torch.device("cpu"))
    assert pool.shape == (2, 300, 16, 64) and pool.dtype == dtype and pool.is_contiguous()
    assert not pool.any()
    pool[1, 299] = 1.5  # writable to the last element
    assert pool.sum().item() == pytest.approx(1.5 * 16 * 64)


def test_a_tensor_smaller_than_a_huge_page_is_left_alone() -> None:
    assert hugepages.advise_huge_pages(torch.empty(1024)) is False


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or _thp_mode() not in ("always", "madvise"),
    reason="needs Linux with transparent huge pages on (always or madvise)",
)
def test_the_pool_sits_on_huge_pages_where_linux_offers_them() -> None:
    pool = hugepages.zeros((64 << 20) // 4, torch.float32, torch.device("cpu"))  # 64 MB
    middle = pool.data_ptr() + (32 << 20)
    # What the pool controls: its range asked for huge pages (VmFlags "hg", MADV_HUGEPAGE).
    assert "hg" in _smaps_field(middle, "VmFlags").split()
    # Whether the kernel found free 2 MB pages to give depends on how fragmented memory is
    # after what else ran (seen: none at all late in a long suite): checked where it could.
    if _anon_huge_kb(middle) < 2048:
        pytest.skip("asked for huge pages, but the kernel had no free 2 MB page to give now")
