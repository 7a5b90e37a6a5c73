"""Qwen2-VL's multimodal rotary positions (mrope): three position rows per token.

A text token has one position p, the same in all three rows, so it rotates exactly as in a
text model. An image's tokens (its merged patch grid, t x h x w) all start at the position
after the text before it: row 0 adds the frame, row 1 the grid row, row 2 the grid column;
the text after the image resumes at that start plus max(h, w). A prompt with images therefore
ends at a position below its length, and each generated token's position is its index plus
that (negative) delta.

The head's rotary pairs are split in three (`mrope_section`, e.g. 16/24/24 of 64 pairs), each
rotated by one row's position: cos/sin of a token are gathered per dimension from the text
tables (section_rows tells each dimension's row), so the tables stay one per position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def section_rows(head_dim: int, section: tuple[int, int, int]) -> torch.Tensor:
    """[head_dim] int64: which position row (0: frame, 1: row, 2: column) rotates each
    dimension. Both halves of the head (the two members of each rotary pair) agree."""
    half = torch.cat([torch.full((n,), row, dtype=torch.int64) for row, n in enumerate(section)])
    if half.numel() * 2 != head_dim:
        raise ValueError(f"mrope_section {list(section)} must sum to head_dim / 2 ({head_dim})")
    return torch.cat([half, half])


def prompt_positions(
    length: int,
    spans: Sequence[tuple[int, int, tuple[int, int, int]]],
) -> tuple[torch.Tensor, int]:
    """Positions [3, length] int64 of a prompt whose images sit at `spans` (placeholder start,
    placeholder count, merged grid (t, h, w)) in order, and the delta of every later token
    (position = index + delta)."""
    rows = torch.empty(3, length, dtype=torch.int64)
    index = 0  # next prompt token to place
    position = 0  # its position
    for start, count, (t, h, w) in spans:
        text = start - index
        rows[:, index:start] = torch.arange(position, position + text)
        position += text
        grid = torch.stack(
            torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        ).reshape(3, -1)
        rows[:, start : start + count] = grid + position
        position += max(h, w)
        index = start + count
    rows[:, index:] = torch.arange(position, position + length - index)
    position += length - index
    return rows, position - length
