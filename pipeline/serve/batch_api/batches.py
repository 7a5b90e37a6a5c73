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

A batch whose input file has problems (pipeline.serve.batch_api.files keeps them from the upload) or
whose lines do not fit it (a url not its endpoint, a model it cannot run) gets no job: it is
stored `validating` and fails on its next read with OpenAI's `errors` list, naming lines. A
batch whose metadata names RESUME_KEY continues a stopped batch of the same file: its job
writes into that batch's output, so the pipeline resumes there and runs only what is missing.

Otherwise the status is derived, each time a batch is read, from the Ray job's status and the
output's manifest:

    Ray PENDING                               validating
    Ray RUNNING                               in_progress (finalizing once the manifest is
                                              final); cancelling after a cancel
    Ray SUCCEEDED                             completed
    Ray STOPPED / FAILED after a cancel       cancelled (until Ray has taken the stop, each
                                              read while cancelling sends it again)
    ... after the completion window passed    expired (the job was stopped at expiry)
    Ray FAILED / STOPPED otherwise            failed

On a terminal job the output and error files are registered (pipeline.serve.batch_api.files)
from the committed parts' export files (pipeline.batch.driver.openai_output, written by the job, or here if
the job was killed before it got to them), and request_counts and the cost come from the
manifest's totals. Nothing here blocks the event loop: callers run it in a thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

from pipeline.batch.interface.batch_api import (
    EMBEDDINGS_URL,
    SUPPORTED_BATCH_URLS,
    LineContext,
    expected_exports,
    export_committed,
)
from pipeline.batch.interface.output import Manifest, read_manifest
from pipeline.openai.errors import ApiError
from pipeline.serve.access.keys import BatchQuota
from pipeline.serve.batch_api.batch_quota import QuotaLedger
from pipeline.serve.batch_api.files import (
    MAX_REPORTED_ERRORS,
    PRIVATE,
    BatchInputSummary,
    FileStore,
    InputError,
    owner_slug,
)
from pipeline.serve.spec import BatchApiSpec, ServedModelSpec, ServeSpec
from pipeline.spec import SpecError, parse_job_spec
from pipeline.storage import OutputDir, PreconditionFailed, join_uri
from pipeline.submit import (
    SUBMIT_BACKOFF_S,
    SubmitFate,
    forwarded_env,
    job_missing,
    run_entrypoint,
    runtime_env_for,
    submit_once,
)

logger = logging.getLogger(__name__)

COMPLETION_WINDOWS = {"24h": 24 * 3600}
TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})
JOB_TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
MAX_METADATA_PAIRS = 16  # OpenAI's limits on a batch's metadata
MAX_LIST_LIMIT = 100
# Metadata key naming a cancelled, failed or expired batch of the same file to resume.
RESUME_KEY = "tokenmill_resume_from"
RESUMABLE = frozenset({"cancelled", "failed", "expired"})
# Records are written by compare-and-swap: a write that lost to another replica's reads the
# record again and re-applies its change, this many times at most.
MAX_RECORD_WRITES = 5
# A record saved before its job was submitted whose job Ray does not know this long after it
# was created: the ingress died between the two, so the batch fails (it can be resumed).
SUBMIT_GRACE_S = 300
# Batch ids start with the creation time counted down (milliseconds before 2^44 ms, 11 hex
# digits) and end with 16 random hex digits, so the store's name order is newest first and a
# list page reads only its own records.
_ID_RE = re.compile(r"batch_[0-9a-f]{11}[0-9a-f]{16}")


class JobsApi(Protocol):
    """The subset of ray.job_submission.JobSubmissionClient used here (tests fake it)."""

    def submit_job(self, **kwargs: Any) -> str: ...

    def get_job_info(self, job_id: str) -> Any: ...

    def stop_job(self, job_id: str) -> bool: ...


def submission_id(batch_id: str) -> str:
    return f"tokenmill-{batch_id}"


def new_batch_id(created_ms: int) -> str:
    """A batch id whose name order is newest first (see _ID_RE)."""
    countdown = (1 << 44) - 1 - created_ms
    return f"batch_{countdown:011x}{os.urandom(8).hex()}"


def batch_created_s(batch_id: str) -> float | None:
    """When a batch was created, from its id (None for ids from before ids carried it)."""
    if _ID_RE.fullmatch(batch_id) is None:
        return None
    return ((1 << 44) - 1 - int(batch_id[6:17], 16)) / 1000


def _list_order(batch_id: str) -> tuple[bool, str]:
    # Ids from before ids carried their time come after the rest, in no particular order.
    return (_ID_RE.fullmatch(batch_id) is None, batch_id)


def job_spec_data(
    batch_id: str,
    served: ServedModelSpec,
    spec: ServeSpec,
    input_uri: str,
    output_uri: str,
    expires_at: float | None = None,
    endpoint: str = "/v1/chat/completions",
) -> dict[str, Any]:
    """The pipeline job of a batch: the served model's sections, its batch template, the
    uploaded file in and OpenAI-format files out; the job stops itself at `expires_at`."""
    template = served.batch
    assert template is not None
    engine = template.engine or served.engine
    # Name rows after the served model, so response bodies say what a client sent.
    model = served.model.model_copy(update={"name": served.name})
    if endpoint == EMBEDDINGS_URL:
        # Texts embedded as given (no chat template); nothing is sampled.
        task: dict[str, Any] = {
            "task": "embed",
            "prompt": {**served.prompt.model_dump(mode="json"), "chat_template": False},
            "sampling": {},
        }
    else:
        # A body without temperature samples at 1, as the same request sent to the endpoint
        # (and to OpenAI) does; the job's own default is greedy.
        task = {
            "prompt": served.prompt.model_dump(mode="json"),
            "sampling": {"max_tokens": template.max_tokens, "temperature": 1.0},
        }
    return {
        "name": batch_id,
        "input": {
            "uri": input_uri,
            "format": "openai_batch",
            "passthrough_columns": ["url"],  # picks chat.completion or text_completion
        },
        **task,
        "model": model.model_dump(mode="json"),
        "engine": engine.model_dump(mode="json"),
        "resources": template.resources.model_dump(mode="json"),
        # Parts written and committed often, so request_counts move while the batch runs and
        # a cancel loses little.
        "output": {
            "uri": output_uri,
            "format": "openai_batch",
            "flush_interval_s": 10.0,
            "commit_interval_s": 5.0,
        },
        "storage": spec.storage.model_dump(mode="json"),
        # A failed request is an error line, never a failed batch. At the end of the window
        # the job stops itself and commits what finished, whether or not anyone reads the
        # batch then (a read past the window stops it too, in case the job could not).
        "limits": {"max_error_fraction": 1.0, "stop_at": expires_at},
        "cost": served.cost.model_copy(
            update={"batch_discount": template.batch_discount, "budget_usd": None}
        ).model_dump(mode="json"),
    }


def _job_status(info: Any) -> str:
    return str(getattr(info.status, "value", info.status))


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
        errors, served = self._input_errors(summary, endpoint, allows)
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
            out.create(f"{batch_id}.json", _dumps(record))
            return _public(record)
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
        return _public(record)

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
        self, out: OutputDir, record: dict, resumed: _Loaded | None, job: dict[str, Any]
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
            version = out.create(f"{batch_id}.json", _dumps(record))
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
                out, _Loaded(record, version), lambda r: r[PRIVATE].update(submitted=submitted)
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
    ) -> _Loaded | None:
        """The batch metadata[RESUME_KEY] names, if it can be resumed: the new batch's job then
        writes to its output, so the job's own resume runs only the requests it did not
        finish, and the new batch's files hold every request once."""
        resume_id = metadata.get(RESUME_KEY)
        if resume_id is None:
            return None
        try:
            old = self._current(out, resume_id)
        except ApiError:
            raise _refuse_resume(resume_id, "no such batch") from None
        _check_resumable(old.record, input_file_id, endpoint)
        return old

    def _claim(self, out: OutputDir, resumed: _Loaded, batch_id: str) -> None:
        """Mark the resumed batch as resumed by `batch_id`, by compare-and-swap on the record
        read when it was checked: a resume that lost the race reads the winner's name."""
        try:
            resumed.record[PRIVATE]["resumed_by"] = batch_id
            resumed.version = out.replace(
                f"{resumed.record['id']}.json", _dumps(resumed.record), resumed.version
            )
        except PreconditionFailed:
            current = self._current(out, resumed.record["id"])
            _check_resumable(
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
            self._write(out, self._loaded(out, resumed_id), release)
        except Exception:  # the refused resume is reported to the client either way
            logger.exception("releasing %s after a refused resume failed", resumed_id)

    def _input_errors(
        self, summary: BatchInputSummary, endpoint: str, allows: Callable[[str], bool]
    ) -> tuple[list[InputError], ServedModelSpec | None]:
        """What fails this batch during validating (the file's own problems, then this
        batch's: lines whose url is not its endpoint, models it cannot run), at most
        MAX_REPORTED_ERRORS in line order; and the model when there is nothing."""
        errors = list(summary.errors)
        for url, lines in summary.urls.items():
            if url != endpoint:
                message = (
                    f"The url {url!r} of this request is not the batch's endpoint {endpoint!r}."
                )
                errors += [InputError("url_mismatch", message, n, "url") for n in lines]
        chosen: ServedModelSpec | None = None  # the first model it can run
        for name, lines in summary.models.items():
            served = self._served(name, allows)
            if isinstance(served, str):
                errors += [InputError("model_not_found", served, n, "body.model") for n in lines]
            elif chosen is None:
                chosen = served
            else:
                message = (
                    f"This request names the model {name!r}, an earlier one {chosen.name!r}; a "
                    "batch runs one model: split the file by body.model."
                )
                errors += [InputError("model_mismatch", message, n, "body.model") for n in lines]
        if chosen is None and not errors:  # a file stored before lines were kept
            errors.append(InputError("model_not_found", "No request names a model of this server."))
        errors.sort(key=lambda e: e.line or 0)
        if errors or chosen is None:
            return errors[:MAX_REPORTED_ERRORS], None
        return [], chosen

    def _served(self, name: str, allows: Callable[[str], bool]) -> ServedModelSpec | str:
        """The served model batches naming `name` run on, or why there is none."""
        served = self.spec.model_named(name)
        if served is None or not allows(name):
            return f"The model '{name}' does not exist or this key may not use it."
        if served.batch is None:
            return (
                f"The model '{name}' does not take batches on this server (its serve file "
                "entry has no batch section)."
            )
        return served

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
        return _public(self._current(self._dir(owner), batch_id).record)

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
            key=_list_order,
        )
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        page = []
        for batch_id in ids[:limit]:
            try:
                page.append(_public(self._current(out, batch_id).record))
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
                return _public(record)
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
                loaded.version = self._save(out, loaded)
            except PreconditionFailed:
                continue  # another replica moved it on: look again
            if self._stop(record):  # else every read while cancelling tries again
                self._write(out, loaded, lambda r: r[PRIVATE].update(stopped=True))
            return _public(record)
        raise _busy_record(batch_id)

    # --- the state machine -------------------------------------------------------------------

    def _load(self, out: OutputDir, batch_id: str) -> tuple[dict, str]:
        """A batch's record and its version (what a compare-and-swap names), or 404."""
        if not batch_id.startswith("batch_") or "/" in batch_id:
            raise _not_found(batch_id)
        found = out.read_versioned(f"{batch_id}.json")
        if found is None:
            raise _not_found(batch_id)
        return json.loads(found.data), found.version

    def _loaded(self, out: OutputDir, batch_id: str) -> _Loaded:
        return _Loaded(*self._load(out, batch_id))

    def _save(self, out: OutputDir, loaded: _Loaded) -> str:
        """Write the record if it is still the version read (PreconditionFailed if not)."""
        return out.replace(f"{loaded.record['id']}.json", _dumps(loaded.record), loaded.version)

    def _write(self, out: OutputDir, loaded: _Loaded, change: Callable[[dict], None]) -> None:
        """Apply `change` and save; on a lost compare-and-swap, to the record as it is now."""
        for _ in range(MAX_RECORD_WRITES):
            change(loaded.record)
            try:
                loaded.version = self._save(out, loaded)
                return
            except PreconditionFailed:
                loaded = self._loaded(out, loaded.record["id"])
        raise _busy_record(loaded.record["id"])

    def _stop(self, record: dict) -> bool:
        """Ask Ray to stop the batch's job; False when that failed (the next read retries)."""
        try:
            self.jobs.stop_job(record[PRIVATE]["job"])  # False: it had ended already
            return True
        except Exception:  # the head is away: every read while stopping tries again
            logger.warning(
                "stopping %s failed; retried on the next read",
                record[PRIVATE]["job"],
                exc_info=True,
            )
            return False

    def _current(self, out: OutputDir, batch_id: str) -> _Loaded:
        """The record brought up to date (see the module docstring), saved if it changed. A
        save that loses to another replica's re-reads the record and brings that up to date
        (every step is safe to repeat: a second stop, the same file ids)."""
        for _ in range(MAX_RECORD_WRITES):
            loaded = self._loaded(out, batch_id)
            before = json.dumps(loaded.record, sort_keys=True)
            self._refresh(loaded.record)
            if json.dumps(loaded.record, sort_keys=True) == before:
                return loaded
            try:
                loaded.version = self._save(out, loaded)
                return loaded
            except PreconditionFailed:
                continue
        raise _busy_record(batch_id)

    def _refresh(self, record: dict) -> None:
        """Bring a batch's status up to date in place (see the module docstring)."""
        if record["status"] in TERMINAL:
            return
        if record[PRIVATE].get("input_errors"):
            record["status"], record["failed_at"] = "failed", int(self.now())
            record["errors"] = {"object": "list", "data": record[PRIVATE]["input_errors"]}
            return
        try:
            job = self.jobs.get_job_info(record[PRIVATE]["job"])
        except Exception as exc:
            logger.warning("reading %s failed", record[PRIVATE]["job"], exc_info=True)
            if job_missing(exc):  # Ray answered: no such job (yet)
                self._never_submitted(record)
            return  # the last known status; the next read tries again
        record[PRIVATE]["submitted"] = True
        job_status = _job_status(job)
        now = int(self.now())
        output = OutputDir(record[PRIVATE]["output_uri"], self.spec.storage)
        manifest = read_manifest(output)
        if manifest is not None:
            record["request_counts"].update(_counts(manifest))
        if job_status not in JOB_TERMINAL:
            self._running(record, job_status, manifest, now)
        else:
            self._ended(record, job, job_status, output, manifest, now)

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
            if not record[PRIVATE].get("stopped") and self._stop(record):
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
        files = self.files(record[PRIVATE]["owner"])
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


@dataclass
class _Loaded:
    """A batch record as read, and the version a compare-and-swap of it names."""

    record: dict
    version: str


def _dumps(record: dict) -> bytes:
    return json.dumps(record).encode()


def _refuse_resume(resume_id: str, why: str) -> ApiError:
    return ApiError(
        400,
        f"Cannot resume {resume_id}: {why}",
        param=f"metadata.{RESUME_KEY}",
        code="invalid_value",
    )


def _check_resumable(old: dict, input_file_id: str, endpoint: str) -> None:
    resume_id = old["id"]
    if old["status"] not in RESUMABLE:
        raise _refuse_resume(
            resume_id,
            f"its status is {old['status']!r}; only {', '.join(sorted(RESUMABLE))} "
            "batches can be resumed",
        )
    if "output_uri" not in old[PRIVATE]:
        raise _refuse_resume(resume_id, "it never ran (its input failed validation)")
    if (old["input_file_id"], old["endpoint"]) != (input_file_id, endpoint):
        raise _refuse_resume(resume_id, "a resume must use the same input_file_id and endpoint")
    if old[PRIVATE].get("resumed_by"):
        raise _refuse_resume(
            resume_id, f"it was resumed by {old[PRIVATE]['resumed_by']}; resume that batch"
        )


class _NoJob(Exception):
    """Creating a batch stopped where no job can be running: its quota place is given back
    and `error` goes to the client."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _busy_record(batch_id: str) -> ApiError:
    return ApiError(
        503,
        f"Batch {batch_id} is being changed by several requests at once; retry shortly",
        type="server_error",
        code="conflict",
    )


def _public(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != PRIVATE}


def _not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"No such Batch object: {batch_id}", param="batch_id", code="not_found")
