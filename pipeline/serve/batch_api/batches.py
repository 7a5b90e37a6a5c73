"""`/v1/batches`: batch records, the pipeline job behind each, and OpenAI's state machine.

A batch is a pipeline job (input.format and output.format openai_batch) built from the model's
`batch:` template in the serve file and submitted through the Ray Jobs API, as `tokenmill
submit` does (pipeline.submit). Its record is one JSON object in object storage,

    <batch_api.uri>/batches/<owner>/batch_<id>.json   the Batch object plus private fields
    <batch_api.uri>/batches/<owner>/batch_<id>/       the job's output prefix (parts, manifest,
                                                      OpenAI export files, report)

so it survives a restart of the Serve application and any ingress replica can answer for it.
Every write of a record is a compare-and-swap on the version read (pipeline.storage's
conditional writes): two replicas reading one batch at once cannot undo each other's change (a
cancel, a stop sent), and a record is created before its job is submitted, so a job never runs
without one; a resume claims the stopped batch by the same kind of write before it submits,
so of two resumes racing only one runs a job into that output.
Batch ids begin with their creation time counted down, so a listing of names is newest first
and a list page reads only its own records.

A batch whose input file has problems (pipeline.serve.batch_api.files keeps them from the
upload) or whose lines do not fit it (a url not its endpoint, a model it cannot run) gets no
job: it is stored `validating` and fails on its next read with OpenAI's `errors` list, naming
lines. A batch whose metadata names RESUME_KEY continues a stopped batch of the same file: its job
writes into that batch's output, so the pipeline resumes there and runs only what is missing.

Otherwise the status is derived each time a batch is read, from the Ray job's status and the
output's manifest (pipeline.serve.batch_api.status); the job itself is built and named by
pipeline.serve.batch_api.jobs. Nothing here blocks the event loop: callers run it in a thread.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from pipeline.batch.interface.batch_api import (
    SUPPORTED_BATCH_URLS,
)
from pipeline.batch.interface.output import read_manifest
from pipeline.openai.errors import ApiError
from pipeline.serve.access.keys import BatchQuota
from pipeline.serve.batch_api.batch_quota import QuotaLedger
from pipeline.serve.batch_api.files import (
    PRIVATE,
    BatchInputSummary,
    FileStore,
    owner_slug,
)
from pipeline.serve.batch_api.jobs import (
    SUBMIT_GRACE_S,
    JobsApi,
    batch_created_s,
    input_errors,
    job_spec_data,
    list_order,
    new_batch_id,
    submission_id,
)
from pipeline.serve.batch_api.records import (
    MAX_RECORD_WRITES,
    RESUME_KEY,
    Loaded,
    busy_record,
    check_resumable,
    dumps,
    load,
    public,
    refuse_resume,
    save,
    write,
)
from pipeline.serve.batch_api.status import TERMINAL, BatchStatus
from pipeline.serve.spec import BatchApiSpec, ServedModelSpec, ServeSpec
from pipeline.spec import SpecError, parse_job_spec
from pipeline.storage import OutputDir, PreconditionFailed, join_uri
from pipeline.submit import (
    SUBMIT_BACKOFF_S,
    SubmitFate,
    forwarded_env,
    run_entrypoint,
    runtime_env_for,
    submit_once,
)

logger = logging.getLogger(__name__)

COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_METADATA_PAIRS = 16  # OpenAI's limits on a batch's metadata
MAX_LIST_LIMIT = 100


class BatchService:
    """Create, read, list and cancel one serve file's batches (see the module docstring)."""

    def __init__(
        self,
        spec: ServeSpec,
        jobs: Callable[[], JobsApi],
        now: Callable[[], float] = time.time,
    ):
        assert spec.batch_api is not None
        self.spec = spec
        self.api: BatchApiSpec = spec.batch_api
        self._jobs_factory = jobs
        self._jobs: JobsApi | None = None
        self.now = now
        # Between tries of a submit whose fate is unknown (tests shorten it).
        self.submit_backoff_s = SUBMIT_BACKOFF_S
        self._status = BatchStatus(lambda: self.jobs, spec.storage, self.files, lambda: self.now())
        self._id_lock = threading.Lock()
        self._last_id_ms = 0  # ids made here are strictly ordered, even within a millisecond

    @property
    def jobs(self) -> JobsApi:
        if self._jobs is None:  # connected on first use: the head may come up after Serve
            self._jobs = self._jobs_factory()
        return self._jobs

    def files(self, owner: str) -> FileStore:
        return FileStore(self.api.uri, self.spec.storage, owner)

    def quota_ledger(self, owner: str, quota: BatchQuota, who: str) -> QuotaLedger:
        """The count `owner`'s quotas share across ingress replicas (`who`: the key's name)."""
        return QuotaLedger(self._dir(owner), quota, who, self.now)

    def _dir(self, owner: str) -> OutputDir:
        return OutputDir(join_uri(self.api.uri, f"batches/{owner_slug(owner)}"), self.spec.storage)

    # --- create ------------------------------------------------------------------------------

    def create(
        self,
        owner: str,
        allows: Callable[[str], bool],
        body: dict[str, Any],
        quota: BatchQuota | None = None,
        key_name: str | None = None,
    ) -> dict:
        """A new batch of `owner`'s (`quota`: its key's Batch API quota, `key_name` the name
        messages give it)."""
        endpoint = body.get("endpoint")
        if endpoint not in SUPPORTED_BATCH_URLS:
            raise ApiError(
                400,
                f"Invalid endpoint {endpoint!r}; supported: {', '.join(SUPPORTED_BATCH_URLS)}",
                param="endpoint",
                code="invalid_value",
            )
        window = body.get("completion_window")
        if window not in COMPLETION_WINDOWS:
            raise ApiError(
                400,
                f"Invalid completion_window {window!r}; supported: {', '.join(COMPLETION_WINDOWS)}",
                param="completion_window",
                code="invalid_value",
            )
        metadata = _metadata(body.get("metadata"))
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str):
            raise ApiError(
                400,
                "Missing required parameter: 'input_file_id'.",
                param="input_file_id",
                code="missing_required_parameter",
            )
        files = self.files(owner)
        stored = files.get(input_file_id)
        if stored.data.get("purpose") != "batch" or "models" not in stored.private:
            raise ApiError(
                400,
                f"File {input_file_id} was not uploaded with purpose 'batch'",
                param="input_file_id",
                code="invalid_value",
            )
        summary = BatchInputSummary.from_json(stored.private)
        out = self._dir(owner)
        now = self.now()
        batch_id = self._new_id(now)
        resumed = self._resumed(out, metadata, input_file_id, endpoint)
        errors, served = input_errors(self.spec, summary, endpoint, allows)
        created = int(now)
        window_s = self.api.completion_window_s or COMPLETION_WINDOWS[window]
        record = {
            "id": batch_id,
            "object": "batch",
            "endpoint": endpoint,
            "model": served.name if served else next(iter(summary.models), None),
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": created,
            "in_progress_at": None,
            "expires_at": created + window_s,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": summary.lines, "completed": 0, "failed": 0},
            "metadata": metadata,
            PRIVATE: {"owner": owner, "created": now},
        }
        if errors:
            # No job: the batch fails on its next read, as OpenAI's fails during validating.
            record["request_counts"]["total"] = 0
            record[PRIVATE]["input_errors"] = [e.to_json() for e in errors]
            out.create(f"{batch_id}.json", dumps(record))
            return public(record)
        assert served is not None
        output_uri = resumed.record[PRIVATE]["output_uri"] if resumed else out.uri_of(batch_id)
        record[PRIVATE].update(
            {"output_uri": output_uri, "job": submission_id(batch_id), "submitted": False}
        )
        if resumed is not None:
            record[PRIVATE]["resumed_from"] = resumed.record["id"]
            # The manifest is the stopped batch's until the new job begins its run.
            before = read_manifest(OutputDir(output_uri, self.spec.storage))
            record[PRIVATE]["runs_before"] = len(before.runs) if before else 0
        lines = summary.lines
        if resumed is not None:  # only what the stopped batch did not finish runs
            done = resumed.record["request_counts"]
            lines = max(0, done["total"] - done["completed"] - done["failed"])
        job = self._job(record, served, files.content_uris(stored)[0])
        ledger = None
        if quota is not None and not quota.unlimited:
            ledger = self.quota_ledger(owner, quota, key_name or owner)
            ledger.reserve(batch_id, lines, lambda b: self._ended_or_gone(out, b))
        try:
            if resumed is not None:
                # Claimed before anything is submitted: of two resumes racing, one wins.
                self._claim(out, resumed, batch_id)
            self._start(out, record, resumed, job)
        except _NoJob as refused:
            # Nothing runs for this batch: its quota place is free again.
            if ledger is not None:
                ledger.release(batch_id, lines)
            raise refused.error from None
        # Anything else may have left a job running (a submit interrupted mid-way): the place
        # stays taken until the batch's record says it ended (_ended_or_gone).
        return public(record)

    def _ended_or_gone(self, out: OutputDir, batch_id: str) -> bool:
        """Whether a batch counted in a quota no longer takes a place: it ended, or its record
        was never written (its create failed, or the ingress died, SUBMIT_GRACE_S ago)."""
        try:
            return self._current(out, batch_id).record["status"] in TERMINAL
        except ApiError as exc:
            if exc.status != 404:
                return False  # unreadable now: it keeps its place
            created = batch_created_s(batch_id)
            return created is None or self.now() - created >= SUBMIT_GRACE_S

    def _job(self, record: dict, served: ServedModelSpec, input_uri: str) -> dict[str, Any]:
        """The batch's pipeline job, checked before anything is stored or submitted."""
        batch_id = record["id"]
        job = job_spec_data(
            batch_id,
            served,
            self.spec,
            input_uri,
            record[PRIVATE]["output_uri"],
            expires_at=record["expires_at"],
            endpoint=record["endpoint"],
        )
        try:
            parse_job_spec(job, source=f"batch {batch_id}")  # ours to get right, not the job's
        except SpecError as exc:
            raise ApiError(
                500, f"could not build the batch job: {exc}", type="server_error"
            ) from None
        return job

    def _start(
        self, out: OutputDir, record: dict, resumed: Loaded | None, job: dict[str, Any]
    ) -> None:
        """Save the record, then submit its job.

        A submit that raised is not taken as "nothing happened": Ray may have taken the job
        before its answer was lost. Its fate is settled first (pipeline.submit.submit_once:
        sent again under the same submission id, which Ray runs once, then looked up):
          accepted   the batch goes on as if the first answer had come;
          refused    the record is removed and the resumed batch unclaimed (_NoJob: the
                     quota place is given back, the client gets 503);
          unknown    the record stays, `validating`, visible and cancellable; its reads
                     follow Ray, and it fails SUBMIT_GRACE_S after creation if the job
                     never shows (_never_submitted). The client gets the batch, so its retry
                     starts no second job.
        """
        batch_id = record["id"]
        # Saved before the submit: no job ever runs without its record.
        try:
            version = out.create(f"{batch_id}.json", dumps(record))
        except Exception as exc:
            # Nothing was submitted. (A create whose answer was lost leaves a record with no
            # job, which fails after the grace.)
            if resumed is not None:
                self._unclaim(out, resumed.record["id"], batch_id)
            raise _NoJob(exc) from exc
        fate, error = self._submit(batch_id, job)
        if fate == "refused":
            logger.error("the cluster refused batch %s's job: %s", batch_id, error)
            try:
                out.delete(f"{batch_id}.json")
            except Exception:  # left behind, it fails after the grace (_never_submitted)
                logger.exception("batch %s: removing the record of a refused job failed", batch_id)
            if resumed is not None:
                self._unclaim(out, resumed.record["id"], batch_id)
            raise _NoJob(
                ApiError(
                    503,
                    f"the batch cluster refused the job ({type(error).__name__}); retry shortly",
                    type="server_error",
                    code="batch_submit_failed",
                )
            )
        if fate == "unknown":
            logger.error(
                "batch %s: the cluster did not say whether it took the job (%s); the batch "
                "is kept and follows the cluster",
                batch_id,
                error,
            )
        submitted = True if fate == "accepted" else None  # None: unknown, reads look it up
        record[PRIVATE]["submitted"] = submitted
        try:
            self._write(
                out, Loaded(record, version), lambda r: r[PRIVATE].update(submitted=submitted)
            )
        except Exception:
            # The job may run: the client gets its batch all the same (a retry would start a
            # second one). The next read that finds the job on Ray records it.
            logger.exception("batch %s: recording the submit failed", batch_id)

    def _new_id(self, now: float) -> str:
        with self._id_lock:
            self._last_id_ms = max(int(now * 1000), self._last_id_ms + 1)
            return new_batch_id(self._last_id_ms)

    def _resumed(
        self, out: OutputDir, metadata: dict[str, str], input_file_id: str, endpoint: str
    ) -> Loaded | None:
        """The batch metadata[RESUME_KEY] names, if it can be resumed: the new batch's job then
        writes to its output, so the job's own resume runs only the requests it did not
        finish, and the new batch's files hold every request once."""
        resume_id = metadata.get(RESUME_KEY)
        if resume_id is None:
            return None
        try:
            old = self._current(out, resume_id)
        except ApiError:
            raise refuse_resume(resume_id, "no such batch") from None
        check_resumable(old.record, input_file_id, endpoint)
        return old

    def _claim(self, out: OutputDir, resumed: Loaded, batch_id: str) -> None:
        """Mark the resumed batch as resumed by `batch_id`, by compare-and-swap on the record
        read when it was checked: a resume that lost the race reads the winner's name."""
        try:
            resumed.record[PRIVATE]["resumed_by"] = batch_id
            resumed.version = out.replace(
                f"{resumed.record['id']}.json", dumps(resumed.record), resumed.version
            )
        except PreconditionFailed:
            current = self._current(out, resumed.record["id"])
            check_resumable(
                current.record, resumed.record["input_file_id"], resumed.record["endpoint"]
            )
            raise ApiError(
                409,
                f"Batch {resumed.record['id']} changed while this resume was being made; retry",
                param=f"metadata.{RESUME_KEY}",
                code="conflict",
            ) from None

    def _unclaim(self, out: OutputDir, resumed_id: str, batch_id: str) -> None:
        def release(record: dict) -> None:
            if record[PRIVATE].get("resumed_by") == batch_id:
                record[PRIVATE]["resumed_by"] = None

        try:
            self._write(out, load(out, resumed_id), release)
        except Exception:  # the refused resume is reported to the client either way
            logger.exception("releasing %s after a refused resume failed", resumed_id)

    def _submit(
        self, batch_id: str, job: dict[str, Any]
    ) -> tuple[SubmitFate, BaseException | None]:
        env = forwarded_env(os.environ, self.api.env_from)
        # Ray waits this long after SIGTERM (cancel, expiry) before it kills the job: time to
        # commit and export what finished.
        env["RAY_JOB_STOP_WAIT_TIME_S"] = str(self.api.cancel_grace_s)
        with tempfile.TemporaryDirectory(prefix="tokenmill-batch-") as tmp:
            (Path(tmp) / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
            date = time.strftime("%Y-%m-%d", time.gmtime(self.now()))
            try:
                jobs = self.jobs
            except Exception as exc:  # no client could be made: nothing was sent
                return "refused", exc
            fate, error = submit_once(
                jobs,
                backoff_s=self.submit_backoff_s,
                entrypoint=run_entrypoint("job.yaml", date, (), self.api.ship_code),
                submission_id=submission_id(batch_id),
                runtime_env=runtime_env_for(Path(tmp), env, self.api.ship_code),
                metadata={"tokenmill_batch": batch_id},
            )
        return ("accepted" if fate == "exists" else fate), error

    # --- read --------------------------------------------------------------------------------

    def retrieve(self, owner: str, batch_id: str) -> dict:
        return public(self._current(self._dir(owner), batch_id).record)

    def list(self, owner: str, limit: int = 20, after: str | None = None) -> dict:
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise ApiError(
                400, f"limit must be 1 to {MAX_LIST_LIMIT}", param="limit", code="invalid_value"
            )
        out = self._dir(owner)
        # One listing of names, newest first by construction (new_batch_id); only the page's
        # records are read.
        ids = sorted(
            (n.removesuffix(".json") for n in out.names("batch_") if n.endswith(".json")),
            key=list_order,
        )
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        page = []
        for batch_id in ids[:limit]:
            try:
                page.append(public(self._current(out, batch_id).record))
            except ApiError:  # deleted since the listing
                continue
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(ids) > limit,
        }

    def cancel(self, owner: str, batch_id: str) -> dict:
        out = self._dir(owner)
        for _ in range(MAX_RECORD_WRITES):
            loaded = self._current(out, batch_id)
            record = loaded.record
            if record["status"] in ("cancelling", "cancelled"):
                return public(record)
            if record["status"] in TERMINAL:
                raise ApiError(
                    400,
                    f"Cannot cancel a batch with status '{record['status']}'",
                    code="invalid_state",
                )
            record["status"] = "cancelling"
            record["cancelling_at"] = int(self.now())
            try:
                # First: a replica reading it now must not call it expired.
                loaded.version = save(out, loaded)
            except PreconditionFailed:
                continue  # another replica moved it on: look again
            if self._status.stop(record):  # else every read while cancelling tries again
                self._write(out, loaded, lambda r: r[PRIVATE].update(stopped=True))
            return public(record)
        raise busy_record(batch_id)

    # --- the state machine -------------------------------------------------------------------

    def _load(self, out: OutputDir, batch_id: str) -> tuple[dict, str]:
        loaded = load(out, batch_id)
        return loaded.record, loaded.version

    def _write(self, out: OutputDir, loaded: Loaded, change: Callable[[dict], None]) -> None:
        write(out, loaded, change)

    def _current(self, out: OutputDir, batch_id: str) -> Loaded:
        """The record brought up to date (see the module docstring), saved if it changed. A
        save that loses to another replica's re-reads the record and brings that up to date
        (every step is safe to repeat: a second stop, the same file ids)."""
        for _ in range(MAX_RECORD_WRITES):
            loaded = Loaded(*self._load(out, batch_id))
            before = json.dumps(loaded.record, sort_keys=True)
            self._status.refresh(loaded.record)
            if json.dumps(loaded.record, sort_keys=True) == before:
                return loaded
            try:
                loaded.version = save(out, loaded)
                return loaded
            except PreconditionFailed:
                continue
        raise busy_record(batch_id)


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if (
        not isinstance(value, dict)
        or len(value) > MAX_METADATA_PAIRS
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    ):
        raise ApiError(
            400,
            f"metadata must be an object of at most {MAX_METADATA_PAIRS} string values",
            param="metadata",
            code="invalid_value",
        )
    return dict(value)


class _NoJob(Exception):
    """Creating a batch stopped where no job can be running: its quota place is given back
    and `error` goes to the client."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error
