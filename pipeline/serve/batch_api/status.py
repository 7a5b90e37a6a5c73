"""A batch's status, brought up to date each time it is read, from its Ray job and its output's
manifest (the batch service, pipeline.serve.batch_api.batches, saves what changed):

    Ray PENDING                               validating
    Ray RUNNING                               in_progress (finalizing once the manifest is
                                              final); cancelling after a cancel
    Ray SUCCEEDED                             completed
    Ray STOPPED / FAILED after a cancel       cancelled (until Ray has taken the stop, each
                                              read while cancelling sends it again)
    ... after the completion window passed    expired (the job was stopped at expiry)
    Ray FAILED / STOPPED otherwise            failed

On a terminal job the output and error files are registered (pipeline.serve.batch_api.files)
from the committed parts' export files (written by the job, or here if the job was killed
before it got to them), and request_counts and the cost come from the manifest's totals. A
read that cannot reach Ray keeps the last status; only Ray's own "no such job" ends a batch
whose job never came (SUBMIT_GRACE_S after creation).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

from pipeline.batch.interface.batch_api import LineContext, expected_exports, export_committed
from pipeline.batch.interface.output import Manifest, read_manifest
from pipeline.serve.batch_api.files import PRIVATE, FileStore
from pipeline.serve.batch_api.jobs import JOB_TERMINAL, SUBMIT_GRACE_S, JobsApi, job_status
from pipeline.spec import StorageSpec
from pipeline.storage import OutputDir
from pipeline.submit import job_missing

logger = logging.getLogger(__name__)

TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})


class BatchStatus:
    """Refreshes batch records in place (see the module docstring). `jobs` and `now` are read
    at each use: the Jobs client is made on first use, and tests move the clock."""

    def __init__(
        self,
        jobs: Callable[[], JobsApi],
        storage: StorageSpec,
        files: Callable[[str], FileStore],
        now: Callable[[], float],
    ) -> None:
        self._jobs = jobs
        self._storage = storage
        self._files = files
        self.now = now

    def stop(self, record: dict) -> bool:
        """Ask Ray to stop the batch's job; False when that failed (the next read retries)."""
        try:
            self._jobs().stop_job(record[PRIVATE]["job"])  # False: it had ended already
            return True
        except Exception:  # the head is away: every read while stopping tries again
            logger.warning(
                "stopping %s failed; retried on the next read",
                record[PRIVATE]["job"],
                exc_info=True,
            )
            return False

    def refresh(self, record: dict) -> None:
        """Bring a batch's status up to date in place (see the module docstring)."""
        if record["status"] in TERMINAL:
            return
        if record[PRIVATE].get("input_errors"):
            record["status"], record["failed_at"] = "failed", int(self.now())
            record["errors"] = {"object": "list", "data": record[PRIVATE]["input_errors"]}
            return
        try:
            job = self._jobs().get_job_info(record[PRIVATE]["job"])
        except Exception as exc:
            logger.warning("reading %s failed", record[PRIVATE]["job"], exc_info=True)
            if job_missing(exc):  # Ray answered: no such job (yet)
                self._never_submitted(record)
            return  # the last known status; the next read tries again
        record[PRIVATE]["submitted"] = True
        state = job_status(job)
        now = int(self.now())
        output = OutputDir(record[PRIVATE]["output_uri"], self._storage)
        manifest = read_manifest(output)
        if manifest is not None:
            record["request_counts"].update(_counts(manifest))
        if state not in JOB_TERMINAL:
            self._running(record, state, manifest, now)
        else:
            self._ended(record, job, state, output, manifest, now)

    def _never_submitted(self, record: dict) -> None:
        """A record saved before its submit whose job never came (the ingress died between
        the two, the submit's fate was unknown, or it failed and the record could not be
        removed) ends once Ray has had SUBMIT_GRACE_S to show the job: cancelled if it was
        cancelled meanwhile, else failed (it can be resumed)."""
        # Records from before "submitted" was kept were all submitted.
        if record[PRIVATE].get("submitted", True) is True:
            return
        now = int(self.now())
        if now - record["created_at"] < SUBMIT_GRACE_S:
            return
        if record["cancelling_at"] is not None:
            record["status"], record["cancelled_at"] = "cancelled", now
            return
        message = (
            "the batch job was never submitted (the server stopped meanwhile, or the cluster "
            "did not take it); resume it"
        )
        record["status"], record["failed_at"] = "failed", now
        record["errors"] = {
            "object": "list",
            "data": [{"code": "batch_failed", "message": message, "param": None, "line": None}],
        }

    def _running(self, record: dict, job_status: str, manifest: Manifest | None, now: int) -> None:
        if record["cancelling_at"] is None and now >= record["expires_at"]:
            record[PRIVATE].setdefault("expiring", now)  # ends as expired, with what finished
        stopping = record["cancelling_at"] is not None or record[PRIVATE].get("expiring")
        if stopping:
            # Until Ray took the stop: a stop that failed (the head away) is sent again.
            if not record[PRIVATE].get("stopped") and self.stop(record):
                record[PRIVATE]["stopped"] = True
            return
        if job_status == "PENDING":
            return
        if record["in_progress_at"] is None:
            record["in_progress_at"] = now
        own = manifest is not None and len(manifest.runs) > record[PRIVATE].get("runs_before", 0)
        if own and manifest is not None and manifest.status != "running":
            record["status"] = "finalizing"  # the job is writing its report and exiting
            record["finalizing_at"] = record["finalizing_at"] or now
        else:
            record["status"] = "in_progress"

    def _ended(
        self,
        record: dict,
        job: Any,
        job_status: str,
        output: OutputDir,
        manifest: Manifest | None,
        now: int,
    ) -> None:
        if manifest is not None:
            self._register_files(record, output, manifest)
            totals = manifest.totals or {}
            record["metadata"] = {
                **record["metadata"],
                "tokenmill_cost_usd": f"{float(totals.get('total_usd') or 0.0):.6f}",
            }
            if totals.get("list_price_usd") is not None:
                record["metadata"]["tokenmill_list_price_usd"] = f"{totals['list_price_usd']:.6f}"
        complete = manifest is not None and manifest.status == "complete"
        if record["cancelling_at"] is not None:
            record["status"], record["cancelled_at"] = "cancelled", now
        elif record[PRIVATE].get("expiring") or (not complete and now >= record["expires_at"]):
            # Stopped at its window's end, by this service or by the job's own deadline.
            record["status"], record["expired_at"] = "expired", now
        elif job_status == "SUCCEEDED" and complete:
            record["finalizing_at"] = record["finalizing_at"] or now
            record["status"], record["completed_at"] = "completed", now
        else:
            message = str(getattr(job, "message", "") or "the batch job failed")[-500:]
            record["status"], record["failed_at"] = "failed", now
            record["errors"] = {
                "object": "list",
                "data": [{"code": "batch_failed", "message": message, "param": None, "line": None}],
            }

    def _register_files(self, record: dict, output: OutputDir, manifest: Manifest) -> None:
        """Output and error files from the committed parts' export files (written here when
        the job was killed before it wrote them)."""
        parts = manifest.part_records()
        prices = (manifest.spec.get("cost") or {}).get("price_per_million") is not None
        export_committed(output, parts, LineContext(manifest.fingerprint["value"], prices))
        names = [n for p in parts for n in expected_exports(p.sums.rows, p.sums.errors, p.name)]
        files = self._files(record[PRIVATE]["owner"])
        for kind, prefix in (("output", "openai-output-"), ("error", "openai-errors-")):
            mine = [n for n in names if n.startswith(prefix)]
            if not mine:
                continue
            file_id = "file-" + hashlib.sha256(f"{record['id']}:{kind}".encode()).hexdigest()[:24]
            size = sum(output.stat(n)[0] for n in mine)
            files.register(
                file_id,
                f"{record['id']}_{kind}.jsonl",
                "batch_output",
                [output.uri_of(n) for n in mine],
                size,
            )
            record[f"{kind}_file_id"] = file_id


def _counts(manifest: Manifest) -> dict[str, int]:
    """Finished requests so far, from the committed parts (the totals come only at the end)."""
    rows = sum(int(p.get("rows", 0)) for p in manifest.parts)
    errors = sum(int(p.get("errors", 0)) for p in manifest.parts)
    return {"completed": rows - errors, "failed": errors}
