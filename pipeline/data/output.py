"""`read_output`: a committed output prefix as a Ray Data Dataset.

The manifest is the only truth of what an output holds (pipeline.batch.commit): a part is
committed when the manifest lists it, and a prefix can also hold files no manifest lists (a
dead run's unadopted parts, a part a fenced-off run wrote late, anything copied there). So the
Dataset reads exactly the parts `_manifest.json` lists, by name, never a listing of the prefix.

An output is complete when its manifest says so and `_SUCCESS` is there (the check a rerun
makes). Anything else (a run still writing, a run that failed or stopped, or one that
stopped at its budget) is refused with the state and its counts, unless
`allow_incomplete=True`: then the committed parts so far are read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.spec import StorageSpec
from pipeline.storage import OutputDir

if TYPE_CHECKING:
    from ray.data import Dataset

    from pipeline.batch.interface.output import Manifest


class OutputNotFound(FileNotFoundError):
    """No readable `_manifest.json` under the prefix: not a tokenmill output (yet)."""


class OutputIncomplete(RuntimeError):
    """The output is not complete; the message names its state and what to do."""


def read_output(
    uri: str, *, allow_incomplete: bool = False, storage: StorageSpec | None = None
) -> Dataset:
    """The committed rows under an output prefix (local path or s3://) as a Dataset.

    `storage`: the job's storage section (S3 endpoint; credentials from the environment).
    Raises OutputNotFound without a manifest, OutputIncomplete for an incomplete output
    unless `allow_incomplete`."""
    import ray.data

    # lazy: importing pipeline.data loads no pyarrow or Ray (a Ray Data driver imports it at start)
    from pipeline.batch.interface.output import SUCCESS_NAME, read_manifest

    out = OutputDir(uri, storage or StorageSpec())
    manifest = read_manifest(out)
    if manifest is None:
        raise OutputNotFound(
            f"{out.uri}: no readable _manifest.json; is this the output.uri of a tokenmill "
            "job that has started?"
        )
    complete = manifest.status == "complete" and out.exists(SUCCESS_NAME)
    if not complete and not allow_incomplete:
        raise OutputIncomplete(describe_incomplete(out.uri, manifest))
    paths = [out.path(part["name"]) for part in manifest.parts]
    if not paths:
        return ray.data.from_items([])
    return ray.data.read_parquet(paths, filesystem=_arrow_filesystem(out.fs))


def describe_incomplete(uri: str, manifest: Manifest) -> str:
    """Why an output is not complete, with its counts, and what to do."""
    shards = manifest.shards
    done = sum(1 for s in shards if s.get("complete"))
    rows = sum(int(p.get("rows", 0)) for p in manifest.parts)
    missing = "unknown" if manifest.missing_rows is None else str(manifest.missing_rows)
    state = {
        "running": "a run is writing it, or its driver died before finishing",
        "failed": "its last run failed",
        "incomplete": "its last run ended before every row was committed",
        "stopped_at_budget": "its last run stopped at cost.budget_usd",
        "complete": "its manifest says complete but _SUCCESS is missing (a run is finishing)",
    }.get(manifest.status, "unknown state")
    return (
        f"{uri}: output is {manifest.status} ({state}): {done} of {len(shards)} shards "
        f"complete, {rows} rows committed in {len(manifest.parts)} parts, {missing} rows "
        "missing. Rerun `tokenmill run` on its job to finish it, or pass "
        "allow_incomplete=True to read the committed rows."
    )


def _arrow_filesystem(fs: object) -> object:
    """Ray Data reads through pyarrow: the same fsspec filesystem (endpoint, timeouts) the
    jobs use, wrapped."""
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    return PyFileSystem(FSSpecHandler(fs))
