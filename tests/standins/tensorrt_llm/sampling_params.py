"""Stand-in for `tensorrt_llm.sampling_params` (1.2): GuidedDecodingParams.

As in the real class: a keyword-only dataclass whose fields are the guide kinds, of which a
request may set one (`_validate`, called by SamplingParams, raises ValueError otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(slots=True, kw_only=True)
class GuidedDecodingParams:
    json: str | dict[str, Any] | None = None  # a JSON schema (text or dict)
    regex: str | None = None
    grammar: str | None = None  # EBNF
    json_object: bool = False
    structural_tag: str | None = None

    def _validate(self) -> None:
        num_guides = sum(bool(getattr(self, f.name)) for f in fields(self))
        if num_guides > 1:
            raise ValueError(f"Only one guide can be used for a request, but got {num_guides}.")


__all__ = ["GuidedDecodingParams"]
