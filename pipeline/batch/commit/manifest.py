"""`_manifest.json`: what a job's output prefix holds, how it was made and what it cost.

The manifest is bookkeeping beside the committed parts (pipeline.batch.commit.parts), never
their source of truth: totals are recomputed from the parts each time it is written, so they
always equal the rows. It is written at the start of every run (status "running", with the fingerprint a resumed
run is compared against) and at the end ("complete" — then `_SUCCESS` follows —,
"incomplete", or "stopped_at_budget" when cost.budget_usd stopped the admission of rows).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import platform
import re
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.batch.commit.parts import MANIFEST_NAME, OutputDir, iter_committed, list_parts
from pipeline.spec import JobSpec

Status = Literal["running", "complete", "incomplete", "stopped_at_budget"]
# Key names that hold secrets. "token" alone would also hide max_tokens, kv_cache_tokens and
# friends, so only token names that are credentials match (auth_token, session_token, ...).
_SECRET_KEY = re.compile(
    r"(secret|password|passwd|credential|api_?keys?$|access_?key|"
    r"(auth|session|access|bearer|api|security)_?token)",
    re.I,
)
_URI_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")
REDACTED = "***"
# Columns the totals need (a part's text is not read back for them).
_TOTALS_COLUMNS = [
    "finish_reason",
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
    "gpu_seconds",
    "cost_usd",
    "list_price_usd",
    "latency_s",
    "ttft_s",
]


def redact(value: Any) -> Any:
    """A copy of `value` with secret-looking keys masked and user:pass@ removed from URIs."""
    if isinstance(value, dict):
        return {
            k: (REDACTED if _SECRET_KEY.search(str(k)) and v is not None else redact(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return _URI_USERINFO.sub(REDACTED + "@", value)
    return value


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for dist in ("tokenmill", "ray", "torch", "transformers", "pyarrow", "tensorrt_llm"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return found


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class RunRecord:
    """One attempt (one `tokenmill run`) on this output prefix."""

    attempt: int  # part names of this run start with part-<attempt>
    started_at: str  # UTC ISO time
    mode: str  # "run" | "retry-errors"
    finished_at: str | None = None
    wall_s: float = 0.0  # driver wall time from start to the last part
    rows: int = 0  # rows committed by this attempt
    error_rows: int = 0
    completion_tokens: int = 0
    parts: list[str] = field(default_factory=list)
    actors: list[dict[str, Any]] = field(default_factory=list)  # pipeline.cost.ActorAccount
    interrupted: bool = False  # the driver died before finishing; rows/parts from the listing


@dataclass
class Manifest:
    job: str
    status: Status
    fingerprint: dict[str, Any]  # pipeline.batch.commit.fingerprint.Fingerprint.to_json()
    spec: dict[str, Any]  # the normalized job spec, secrets redacted
    input_files: list[dict[str, Any]]
    runs: list[RunRecord]
    parts: list[dict[str, Any]] = field(default_factory=list)  # {name, rows}
    totals: dict[str, Any] = field(default_factory=dict)
    missing_ids: int = 0  # input ids not in committed parts (incomplete runs)
    budget: dict[str, Any] | None = None  # pipeline.batch.budget.BudgetState of the last run
    versions: dict[str, str] = field(default_factory=versions)
    updated_at: str = field(default_factory=utc_now)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False, default=str)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        data["runs"] = [RunRecord(**r) for r in data.get("runs", [])]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def read_manifest(out: OutputDir) -> Manifest | None:
    """The manifest under the prefix, or None if there is none (or it cannot be parsed)."""
    if not out.exists(MANIFEST_NAME):
        return None
    try:
        return Manifest.from_json(out.read(MANIFEST_NAME).decode())
    except (ValueError, TypeError, KeyError):
        return None


def write_manifest(out: OutputDir, manifest: Manifest) -> None:
    manifest.updated_at = utc_now()
    out.put_atomic(MANIFEST_NAME, manifest.to_json().encode())


def spec_snapshot(spec: JobSpec) -> dict[str, Any]:
    return redact(spec.model_dump(mode="json"))


def _quantile(values: pa.Array, q: float) -> float | None:
    values = values.drop_null()
    if len(values) == 0:
        return None
    return float(pc.quantile(values, q=q, interpolation="linear")[0].as_py())


def compute_totals(out: OutputDir, spec: JobSpec, runs: list[RunRecord]) -> dict[str, Any]:
    """Totals over every committed row, plus idle/load from every run's actor accounts."""
    from pipeline.cost import ActorAccount, job_totals

    tables = list(iter_committed(out, columns=_TOTALS_COLUMNS))
    rows = pa.concat_tables(tables) if tables else pa.table({c: [] for c in _TOTALS_COLUMNS})
    accounts = [ActorAccount.from_dict(a) for run in runs for a in run.actors]
    cost = job_totals(rows, accounts, spec.cost)
    num_errors = int(pc.sum(pc.equal(rows.column("finish_reason"), "error")).as_py() or 0)
    wall_s = math.fsum(run.wall_s for run in runs)
    return {
        "rows": rows.num_rows,
        "rows_ok": rows.num_rows - num_errors,
        "rows_error": num_errors,
        "error_fraction": num_errors / rows.num_rows if rows.num_rows else 0.0,
        "wall_s": wall_s,
        "output_tokens_per_s": cost.completion_tokens / wall_s if wall_s > 0 else None,
        "latency_p50_s": _quantile(rows.column("latency_s"), 0.5),
        "latency_p95_s": _quantile(rows.column("latency_s"), 0.95),
        "ttft_p50_s": _quantile(rows.column("ttft_s"), 0.5),
        "ttft_p95_s": _quantile(rows.column("ttft_s"), 0.95),
        **cost.to_dict(),
    }


def part_listing(out: OutputDir) -> list[dict[str, Any]]:
    """{name, rows} per committed part (row counts from the Parquet footers)."""
    import pyarrow.parquet as pq

    listing = []
    for part in list_parts(out):
        with out.fs.open(out.path(part.name), "rb") as fh:  # reads the footer only
            listing.append({"name": part.name, "rows": pq.ParquetFile(fh).metadata.num_rows})
    return listing
