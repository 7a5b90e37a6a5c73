"""`_manifest.json`: the commit record of an output prefix.

A part is committed when, and only when, the manifest lists it. The manifest holds:

- how the output was made: job name, fingerprint, the redacted spec, the input listing, the
  output schema, the shard plan;
- what it holds: per shard its row count (once known) and whether every row is committed;
  per part its shard, the rows it holds (`RowRanges` of shard row indexes), sums, size and
  version; the merged row statistics of all parts (histograms, timeline, errors by kind);
- how it went: every run (attempt, host, start/end, rows, actor cost accounts, events such as
  a lost actor), the budget state, the totals and the status.

It is replaced by compare-and-swap (`ManifestStore.write` names the version it last read or
wrote): a run whose lease was taken over fails to write it and stops. Its size grows with
shards and parts, never with rows.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import uuid
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any, Literal

from pipeline.batch.commit.parts import MANIFEST_NAME, PartRecord
from pipeline.spec import JobSpec
from pipeline.spec.redact import redact
from pipeline.storage import OutputDir, PreconditionFailed

# Version of the commit protocol; outputs of another version are not resumed.
PROTOCOL = 2

Status = Literal["running", "complete", "incomplete", "stopped_at_budget", "failed"]


class ManifestConflict(RuntimeError):
    """The manifest changed under this run: another run holds the output now."""


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


def spec_snapshot(spec: JobSpec) -> dict[str, Any]:
    return redact(spec.model_dump(mode="json"))


@dataclass
class RunRecord:
    """One attempt (one `tokenmill run`) on this output prefix."""

    attempt: int  # part names of this run carry it
    started_at: str  # UTC ISO time
    mode: str  # "run" | "retry-errors"
    run_id: str = ""  # the lease holder's id
    host: str = ""
    pid: int = 0
    finished_at: str | None = None
    wall_s: float = 0.0  # driver wall time from start to the last commit
    rows: int = 0  # rows in parts this run wrote (including parts adopted after it died)
    error_rows: int = 0
    completion_tokens: int = 0
    parts: int = 0  # parts this run wrote
    actors: list[dict[str, Any]] = field(default_factory=list)  # pipeline.cost.ActorAccount
    events: list[dict[str, Any]] = field(default_factory=list)  # lost actors, adoptions, ...
    interrupted: bool = False  # the driver died before finishing; rows/parts from the parts


@dataclass
class Manifest:
    job: str
    status: Status
    fingerprint: dict[str, Any]  # pipeline.batch.commit.fingerprint.Fingerprint.to_json()
    spec: dict[str, Any]  # the normalized job spec, secrets redacted
    input_files: list[dict[str, Any]]
    schema: list[list[str]]  # [[column, type], ...] of every part
    shards: list[dict[str, Any]]  # ShardState.to_json(): the shard, rows, complete, parts, sums
    runs: list[RunRecord]
    # Engine slots the shard plan was sized for (pipeline.batch.driver.shards): a resume plans for
    # the same number, so it derives the same shards whatever its own pool. None: TARGET_SHARDS.
    shard_slots: int | None = None
    parts: list[dict[str, Any]] = field(default_factory=list)  # PartRecord.to_json()
    stats: dict[str, Any] = field(default_factory=dict)  # merged RowStats of the parts
    totals: dict[str, Any] = field(default_factory=dict)
    missing_rows: int | None = None  # input rows without a committed row (None: not known)
    budget: dict[str, Any] | None = None  # pipeline.batch.driver.budget.BudgetState of the last run
    duplicate_ids: dict[str, Any] | None = None  # the last cross-shard duplicate-id check
    fenced: bool = True  # the store honours conditional writes (two drivers are fenced)
    protocol: int = PROTOCOL
    versions: dict[str, str] = field(default_factory=versions)
    updated_at: str = field(default_factory=utc_now)
    # Fresh on every write: a write retried after its answer was lost recognises its own
    # bytes on storage (pipeline.storage.prefix), even if another write had the same content.
    write_id: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), default=str)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        data["runs"] = [RunRecord(**r) for r in data.get("runs", [])]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    def part_records(self) -> list[PartRecord]:
        return [PartRecord.from_json(p) for p in self.parts]


def manifest_protocol(text: str) -> int | None:
    """The protocol of a manifest's text (1 for manifests written before it was recorded)."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return int(data.get("protocol", 1)) if isinstance(data, dict) else None


class ManifestStore:
    """Reads and compare-and-swap writes of one prefix's manifest."""

    def __init__(self, out: OutputDir):
        self.out = out
        self.version: str | None = None  # what this store last read or wrote; None: absent

    def read(self) -> Manifest | None:
        """The manifest (None if absent or unparseable); remembers its version."""
        current = self.out.read_versioned(MANIFEST_NAME)
        if current is None:
            self.version = None
            return None
        self.version = current.version
        try:
            return Manifest.from_json(current.data.decode())
        except (ValueError, TypeError, KeyError):
            return None

    def read_text(self) -> str | None:
        current = self.out.read_versioned(MANIFEST_NAME)
        self.version = None if current is None else current.version
        return None if current is None else current.data.decode(errors="replace")

    def write(self, manifest: Manifest) -> None:
        """Replace the manifest if it is still the version this store knows; raises
        ManifestConflict if another run wrote it since."""
        manifest.updated_at = utc_now()
        manifest.write_id = uuid.uuid4().hex
        data = manifest.to_json().encode()
        try:
            if self.version is None:
                self.version = self.out.create(MANIFEST_NAME, data)
            else:
                self.version = self.out.replace(MANIFEST_NAME, data, self.version)
        except PreconditionFailed as exc:
            raise ManifestConflict(
                f"{self.out.uri}/{MANIFEST_NAME} was changed by another run: this run's lease "
                "was taken over and it commits nothing more"
            ) from exc


def read_manifest(out: OutputDir) -> Manifest | None:
    """The manifest under the prefix, or None if there is none (or it cannot be parsed)."""
    return ManifestStore(out).read()
