"""A batch's record in object storage: read with its version, changed only by compare-and-swap
(a write that lost to another replica's is applied again to the record as it is now), shown
to clients without its private fields; and what makes a stopped batch resumable."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.openai.errors import ApiError
from pipeline.serve.batch_api.files import PRIVATE
from pipeline.storage import OutputDir, PreconditionFailed

# Records are written by compare-and-swap: a write that lost to another replica's reads the
# record again and re-applies its change, this many times at most.
MAX_RECORD_WRITES = 5
# Metadata key naming a cancelled, failed or expired batch of the same file to resume.
RESUME_KEY = "tokenmill_resume_from"
RESUMABLE = frozenset({"cancelled", "failed", "expired"})


@dataclass
class Loaded:
    """A batch record as read, and the version a compare-and-swap of it names."""

    record: dict
    version: str


def load(out: OutputDir, batch_id: str) -> Loaded:
    """A batch's record and its version (what a compare-and-swap names), or 404."""
    if not batch_id.startswith("batch_") or "/" in batch_id:
        raise not_found(batch_id)
    found = out.read_versioned(f"{batch_id}.json")
    if found is None:
        raise not_found(batch_id)
    return Loaded(json.loads(found.data), found.version)


def save(out: OutputDir, loaded: Loaded) -> str:
    """Write the record if it is still the version read (PreconditionFailed if not)."""
    return out.replace(f"{loaded.record['id']}.json", dumps(loaded.record), loaded.version)


def write(out: OutputDir, loaded: Loaded, change: Callable[[dict], None]) -> None:
    """Apply `change` and save; on a lost compare-and-swap, to the record as it is now."""
    for _ in range(MAX_RECORD_WRITES):
        change(loaded.record)
        try:
            loaded.version = save(out, loaded)
            return
        except PreconditionFailed:
            loaded = load(out, loaded.record["id"])
    raise busy_record(loaded.record["id"])


def dumps(record: dict) -> bytes:
    return json.dumps(record).encode()


def refuse_resume(resume_id: str, why: str) -> ApiError:
    return ApiError(
        400,
        f"Cannot resume {resume_id}: {why}",
        param=f"metadata.{RESUME_KEY}",
        code="invalid_value",
    )


def check_resumable(old: dict, input_file_id: str, endpoint: str) -> None:
    resume_id = old["id"]
    if old["status"] not in RESUMABLE:
        raise refuse_resume(
            resume_id,
            f"its status is {old['status']!r}; only {', '.join(sorted(RESUMABLE))} "
            "batches can be resumed",
        )
    if "output_uri" not in old[PRIVATE]:
        raise refuse_resume(resume_id, "it never ran (its input failed validation)")
    if (old["input_file_id"], old["endpoint"]) != (input_file_id, endpoint):
        raise refuse_resume(resume_id, "a resume must use the same input_file_id and endpoint")
    if old[PRIVATE].get("resumed_by"):
        raise refuse_resume(
            resume_id, f"it was resumed by {old[PRIVATE]['resumed_by']}; resume that batch"
        )


def busy_record(batch_id: str) -> ApiError:
    return ApiError(
        503,
        f"Batch {batch_id} is being changed by several requests at once; retry shortly",
        type="server_error",
        code="conflict",
    )


def public(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != PRIVATE}


def not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"No such Batch object: {batch_id}", param="batch_id", code="not_found")
