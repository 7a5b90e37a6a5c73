"""Streamed text split at markers (`</think>`, `<tool_call>`): how much of a delta to hold back."""

from __future__ import annotations


def marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`: what a stream
    holds back because the marker may be arriving."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
