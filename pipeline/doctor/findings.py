"""One line of the doctor's report."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any


class Status(str, Enum):
    OK = "ok"  # present and within what tokenmill supports
    INFO = "info"  # absent or not usable here, and nothing needs it unless asked (--require)
    CONFLICT = "conflict"  # broken: a version outside the supported range, a failing import


@dataclass(frozen=True)
class Finding:
    area: str  # "package", "extra", "engine", "device", "storage", "ray"
    name: str  # what was checked: a package, an engine kind, "cuda", "fp8", ...
    status: Status
    detail: str  # what was found: versions, devices, the error
    fix: str = ""  # what to do about it (conflicts and unmet requirements)
    # Capabilities this finding provides when ok ("trtllm", "cuda", "fp8", "serve", ...),
    # which `tokenmill doctor --require` can ask for.
    provides: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        data["provides"] = list(self.provides)
        return data


def unmet(findings: list[Finding], required: list[str]) -> list[str]:
    """The required capabilities no ok finding provides."""
    provided = {p for f in findings if f.status is Status.OK for p in f.provides}
    return [r for r in required if r not in provided]
