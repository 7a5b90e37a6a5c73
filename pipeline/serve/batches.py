"""`/v1/batches`: batch records, the pipeline job behind each, and OpenAI's state machine.

A batch is a pipeline job (input.format and output.format openai_batch) built from the model's
`batch:` template in the serve file and submitted through the Ray Jobs API, as `tokenmill
submit` does (pipeline.submit). Its record is one JSON object in object storage,

    <batch_api.uri>/batches/<owner>/batch_<id>.json   the Batch object plus private fields
    <batch_api.uri>/batches/<owner>/batch_<id>/       the job's output prefix (parts, manifest,
                                                      OpenAI export files, report)

so it survives a restart of the Serve application and any ingress replica can answer for it.
The status is derived, each time a batch is read, from the Ray job's status and the output's
manifest:

    Ray PENDING                               validating
    Ray RUNNING                               in_progress (finalizing once the manifest is
                                              final); cancelling after a cancel
    Ray SUCCEEDED                             completed
    Ray STOPPED / FAILED after a cancel       cancelled
    ... after the completion window passed    expired (the job was stopped at expiry)
    Ray FAILED / STOPPED otherwise            failed

On a terminal job the output and error files are registered (pipeline.serve.files) from the
committed parts' export files (pipeline.batch.openai_output, written by the job, or here if
the job was killed before it got to them), and request_counts and the cost come from the
manifest's totals. Nothing here blocks the event loop: callers run it in a thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import yaml

from pipeline.batch.commit.manifest import Manifest, read_manifest
from pipeline.batch.openai_output import LineContext, expected_exports, export_committed
from pipeline.batch.read.openai_batch import SUPPORTED_BATCH_URLS
from pipeline.serve.files import PRIVATE, FileStore, owner_slug
from pipeline.serve.protocol import ApiError
from pipeline.serve.spec import BatchApiSpec, ServedModelSpec, ServeSpec
from pipeline.spec import SpecError, parse_job_spec
from pipeline.storage import OutputDir, join_uri

logger = logging.getLogger(__name__)

COMPLETION_WINDOWS = {"24h": 24 * 3600}
TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})
JOB_TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
MAX_METADATA_PAIRS = 16  # OpenAI's limits on a batch's metadata
MAX_LIST_LIMIT = 100


class JobsApi(Protocol):
    """The subset of ray.job_submission.JobSubmissionClient used here (tests fake it)."""

    def submit_job(self, **kwargs: Any) -> str: ...

    def get_job_info(self, job_id: str) -> Any: ...

    def stop_job(self, job_id: str) -> bool: ...


def submission_id(batch_id: str) -> str:
    return f"tokenmill-{batch_id}"


def job_spec_data(
    batch_id: str, served: ServedModelSpec, spec: ServeSpec, input_uri: str, output_uri: str
) -> dict[str, Any]:
    """The pipeline job of a batch: the served model's sections, its batch template, the
    uploaded file in and OpenAI-format files out."""
    template = served.batch
    assert template is not None
    engine = template.engine or served.engine
    # Name rows after the served model, so response bodies say what a client sent.
    model = served.model.model_copy(update={"name": served.name})
    return {
        "name": batch_id,
        "input": {
            "uri": input_uri,
            "format": "openai_batch",
            "passthrough_columns": ["url"],  # picks chat.completion or text_completion
        },
        "prompt": served.prompt.model_dump(mode="json"),
        "model": model.model_dump(mode="json"),
        "engine": engine.model_dump(mode="json"),
        # A body without temperature samples at 1, as the same request sent to the endpoint
        # (and to OpenAI) does; the job's own default is greedy.
        "sampling": {"max_tokens": template.max_tokens, "temperature": 1.0},
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
        # A failed request is an error line, never a failed batch.
        "limits": {"max_error_fraction": 1.0},
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

    @property
    def jobs(self) -> JobsApi:
        if self._jobs is None:  # connected on first use: the head may come up after Serve
            self._jobs = self._jobs_factory()
        return self._jobs

    def files(self, owner: str) -> FileStore:
        return FileStore(self.api.uri, self.spec.storage, owner)

    def _dir(self, owner: str) -> OutputDir:
        return OutputDir(join_uri(self.api.uri, f"batches/{owner_slug(owner)}"), self.spec.storage)

    # --- create ------------------------------------------------------------------------------

    def create(self, owner: str, allows: Callable[[str], bool], body: dict[str, Any]) -> dict:
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
        info = stored.private
        if stored.data.get("purpose") != "batch" or "models" not in info:
            raise ApiError(
                400,
                f"File {input_file_id} was not uploaded with purpose 'batch'",
                param="input_file_id",
                code="invalid_value",
            )
        wrong = [u for u in info["urls"] if u != endpoint]
        if wrong:
            raise ApiError(
                400,
                f"The file's requests use url {wrong[0]!r}, but the batch endpoint is "
                f"{endpoint!r}; every line's url must be the batch's endpoint",
                param="endpoint",
                code="invalid_value",
            )
        served = self._model(info["models"], allows)
        batch_id = f"batch_{os.urandom(12).hex()}"
        out = self._dir(owner)
        output_uri = out.uri_of(batch_id)
        job = job_spec_data(batch_id, served, self.spec, files.content_uris(stored)[0], output_uri)
        now = self.now()
        created = int(now)
        record = {
            "id": batch_id,
            "object": "batch",
            "endpoint": endpoint,
            "model": served.name,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": created,
            "in_progress_at": None,
            "expires_at": created + COMPLETION_WINDOWS[window],
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": int(info["lines"]), "completed": 0, "failed": 0},
            "metadata": metadata,
            PRIVATE: {
                "owner": owner,
                "output_uri": output_uri,
                "job": submission_id(batch_id),
                "created": now,  # orders batches created within one second
            },
        }
        self._submit(batch_id, job)
        self._save(out, record)
        return _public(record)

    def _model(self, models: list[str], allows: Callable[[str], bool]) -> ServedModelSpec:
        if len(models) != 1:
            raise ApiError(
                400,
                f"The file's requests name {len(models)} models ({', '.join(models[:5])}); a "
                "batch runs one model: split the file by body.model",
                param="input_file_id",
                code="invalid_value",
            )
        name = models[0]
        served = self.spec.model_named(name)
        if served is None or not allows(name):
            raise ApiError(
                400,
                f"The model '{name}' does not exist or this key may not use it",
                param="model",
                code="model_not_found",
            )
        if served.batch is None:
            raise ApiError(
                400,
                f"The model '{name}' does not take batches on this server (its serve file "
                "entry has no batch section)",
                param="model",
                code="model_not_found",
            )
        return served

    def _submit(self, batch_id: str, job: dict[str, Any]) -> None:
        from pipeline.submit import forwarded_env, run_entrypoint, runtime_env_for

        try:
            parse_job_spec(job, source=f"batch {batch_id}")  # ours to get right, not the job's
        except SpecError as exc:
            raise ApiError(
                500, f"could not build the batch job: {exc}", type="server_error"
            ) from None
        env = forwarded_env(os.environ, self.api.env_from)
        # Ray waits this long after SIGTERM (cancel, expiry) before it kills the job: time to
        # commit and export what finished.
        env["RAY_JOB_STOP_WAIT_TIME_S"] = str(self.api.cancel_grace_s)
        with tempfile.TemporaryDirectory(prefix="tokenmill-batch-") as tmp:
            (Path(tmp) / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
            date = time.strftime("%Y-%m-%d", time.gmtime(self.now()))
            try:
                self.jobs.submit_job(
                    entrypoint=run_entrypoint("job.yaml", date, (), self.api.ship_code),
                    submission_id=submission_id(batch_id),
                    runtime_env=runtime_env_for(Path(tmp), env, self.api.ship_code),
                    metadata={"tokenmill_batch": batch_id},
                )
            except Exception as exc:
                logger.exception("submitting batch %s failed", batch_id)
                raise ApiError(
                    503,
                    f"the batch cluster refused the job ({type(exc).__name__}); retry shortly",
                    type="server_error",
                    code="batch_submit_failed",
                ) from None

    # --- read --------------------------------------------------------------------------------

    def retrieve(self, owner: str, batch_id: str) -> dict:
        out = self._dir(owner)
        return _public(self._refresh(out, self._load(out, batch_id)))

    def list(self, owner: str, limit: int = 20, after: str | None = None) -> dict:
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise ApiError(
                400, f"limit must be 1 to {MAX_LIST_LIMIT}", param="limit", code="invalid_value"
            )
        out = self._dir(owner)
        records = []
        for name in out.names("batch_"):
            if name.endswith(".json"):
                try:
                    records.append(json.loads(out.read(name)))
                except FileNotFoundError:
                    continue
        records.sort(key=lambda r: (r[PRIVATE].get("created", 0), r["id"]), reverse=True)
        if after is not None:
            ids = [r["id"] for r in records]
            records = records[ids.index(after) + 1 :] if after in ids else []
        page = [_public(self._refresh(out, r)) for r in records[:limit]]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(records) > limit,
        }

    def cancel(self, owner: str, batch_id: str) -> dict:
        out = self._dir(owner)
        record = self._refresh(out, self._load(out, batch_id))
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
        self._save(out, record)  # first: a replica reading it now must not call it expired
        self._stop(record)
        return _public(record)

    # --- the state machine -------------------------------------------------------------------

    def _load(self, out: OutputDir, batch_id: str) -> dict:
        if not batch_id.startswith("batch_") or "/" in batch_id:
            raise _not_found(batch_id)
        try:
            return json.loads(out.read(f"{batch_id}.json"))
        except FileNotFoundError:
            raise _not_found(batch_id) from None

    def _save(self, out: OutputDir, record: dict) -> None:
        out.put(f"{record['id']}.json", json.dumps(record).encode())

    def _stop(self, record: dict) -> None:
        try:
            self.jobs.stop_job(record[PRIVATE]["job"])
        except Exception:  # already ended, or the head is away: the next read sees it
            logger.warning("stopping %s failed", record[PRIVATE]["job"], exc_info=True)

    def _refresh(self, out: OutputDir, record: dict) -> dict:
        """Bring a batch's status up to date (see the module docstring); saved if changed."""
        if record["status"] in TERMINAL:
            return record
        before = json.dumps(record, sort_keys=True)
        try:
            job = self.jobs.get_job_info(record[PRIVATE]["job"])
        except Exception:
            logger.warning("reading %s failed", record[PRIVATE]["job"], exc_info=True)
            return record  # the last known status; the next read tries again
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
        if json.dumps(record, sort_keys=True) != before:
            self._save(out, record)
        return record

    def _running(self, record: dict, job_status: str, manifest: Manifest | None, now: int) -> None:
        if record["cancelling_at"] is None and now >= record["expires_at"]:
            if not record[PRIVATE].get("expiring"):
                record[PRIVATE]["expiring"] = now  # ends as expired, with what finished
                self._stop(record)
            return
        if record["cancelling_at"] is not None or job_status == "PENDING":
            return
        if record["in_progress_at"] is None:
            record["in_progress_at"] = now
        if manifest is not None and manifest.status != "running":
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
        if record["cancelling_at"] is not None:
            record["status"], record["cancelled_at"] = "cancelled", now
        elif record[PRIVATE].get("expiring"):
            record["status"], record["expired_at"] = "expired", now
        elif job_status == "SUCCEEDED" and manifest is not None and manifest.status == "complete":
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


def _public(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != PRIVATE}


def _not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"No such Batch object: {batch_id}", param="batch_id", code="not_found")
