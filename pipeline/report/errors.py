"""Error rows grouped by kind: a short, stable label per error message."""

from __future__ import annotations

import re


def error_kind(message: str | None) -> str:
    """A short, stable label for an error message: its exception type or leading phrase."""
    if not message:
        return "unknown"
    # "row 'x': ..." prefixes name the row, not the kind: drop them first.
    text = re.sub(r"^row\s+\S+?:\s*", "", message.strip())
    # "<file> line 3: ..." / "<file> row 7: ..." / "<file> byte 99: ..." name the place: drop it.
    text = re.sub(r"^\S+ (line|row|byte) \d+(?: \(byte \d+\))?:\s*", "", text)
    head = re.split(r"[:(\n]", text, maxsplit=1)[0].strip()
    return (head or text)[:48]
