"""What every part of the job spec shares: the strict base model, SpecError, and the message
a failed validation becomes.

Strict on purpose (`extra="forbid"` everywhere): a misspelled key in a nightly job must fail
before any actor starts, with the field path, not be silently ignored."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class SpecError(ValueError):
    """A job file that cannot run; the message names the file, the field path and the fix."""


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One line per problem: `field.path: what is wrong (got <value>)`.

    Pydantic's messages already list allowed values for Literal fields ("Input should be
    'reference', 'trtllm' or 'vllm'"); the value given is appended so the user sees both.
    """
    lines = [f"{source}: invalid job spec ({exc.error_count()} problem(s))"]
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "(top level)"
        kind = err["type"]
        msg = err["msg"]
        if kind == "extra_forbidden":
            msg = "unknown field (check the spelling; see docs/job-spec.md)"
        elif kind == "missing":
            msg = "required field is missing"
        elif kind == "value_error":
            # Our own validators: the message already names the fields involved.
            msg = msg.removeprefix("Value error, ")
        elif not isinstance(err.get("input"), dict):
            msg = f"{msg} (got {_short(err.get('input'))})"
        lines.append(f"  - {path}: {msg}")
    return "\n".join(lines)
