"""/v1/files and /v1/batches routes through the official `openai` client, in process: the
routes on a bare FastAPI app (Starlette's TestClient as the client's HTTP transport), files in
a temp directory, and a fake Ray Jobs API. The real job runs in tests/e2e/test_batch_api.py."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.testclient import TestClient

from pipeline.serve import batch_routes
from pipeline.serve.batches import RESUME_KEY, BatchService
from pipeline.serve.files import MAX_REPORTED_ERRORS, BatchInputSummary, validate_batch_input
from pipeline.serve.keys import ApiKey
from pipeline.serve.protocol import ApiError
from pipeline.serve.spec import parse_serve_spec
from pipeline.spec import parse_job_spec

KEYS = {"key-a": ApiKey("alpha"), "key-b": ApiKey("beta"), "key-r": ApiKey("r", models=frozenset())}


def _line(i: int, **extra: Any) -> dict[str, Any]:
    line = {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": [{"role": "user", "content": f"hi {i}"}]},
    }
    line.update(extra)
    return line


def _jsonl(lines: list[Any]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


class FakeJobs:
    def __init__(self) -> None:
        self.submitted: dict[str, dict[str, Any]] = {}
        self.status: dict[str, str] = {}
        self.stopped: list[str] = []

    def submit_job(self, **kwargs: Any) -> str:
        self.submitted[kwargs["submission_id"]] = kwargs
        self.status[kwargs["submission_id"]] = "PENDING"
        return kwargs["submission_id"]

    def get_job_info(self, job_id: str) -> Any:
        return SimpleNamespace(status=self.status[job_id], message="boom")

    def stop_job(self, job_id: str) -> bool:
        self.stopped.append(job_id)
        self.status[job_id] = "STOPPED"
        return True


@pytest.fixture
def jobs() -> FakeJobs:
    return FakeJobs()


@pytest.fixture
def app(tmp_path: Path, jobs: FakeJobs) -> Iterator[FastAPI]:
    spec = parse_serve_spec(
        {
            "models": [
                {"name": "tiny", "model": {"path": "/m"}, "batch": {"max_tokens": 8}},
                {"name": "online-only", "model": {"path": "/m"}},
            ],
            "batch_api": {"uri": str(tmp_path / "store"), "max_file_bytes": 4096},
        }
    )
    app = FastAPI()

    @app.exception_handler(ApiError)
    async def _error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    app.include_router(batch_routes.router)

    def authenticate(request: Request) -> ApiKey:
        key = KEYS.get(request.headers.get("authorization", "").removeprefix("Bearer "))
        if key is None:
            raise ApiError(401, "bad key", code="invalid_api_key")
        return key

    batch_routes.install(spec, authenticate)
    assert batch_routes._installed is not None
    batch_routes._installed.service = BatchService(spec, lambda: jobs)
    yield app
    batch_routes._installed = None


def _client(app: FastAPI, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(
        api_key=key, base_url="http://testserver/v1", http_client=TestClient(app), max_retries=0
    )


def test_upload_list_retrieve_download_delete(app: FastAPI) -> None:
    client = _client(app)
    data = _jsonl([_line(i) for i in range(3)])
    uploaded = client.files.create(file=("in.jsonl", data), purpose="batch")
    assert uploaded.id.startswith("file-") and uploaded.bytes == len(data)
    assert uploaded.filename == "in.jsonl" and uploaded.purpose == "batch"
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).content == data
    assert [f.id for f in client.files.list()] == [uploaded.id]
    # Another key sees nothing of it.
    other = _client(app, "key-b")
    assert list(other.files.list()) == []
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        other.files.delete(uploaded.id)
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def _errors(batch: Any) -> list[tuple[int | None, str, str | None]]:
    return [(e.line, e.code, e.param) for e in batch.errors.data]


def test_bad_lines_fail_the_batch_during_validating(app: FastAPI, jobs: FakeJobs) -> None:
    client = _client(app)
    completion = {"model": "tiny", "prompt": "x"}
    bad = [
        _line(0),
        "{not json",
        _line(2, url="/v1/completions", body=completion),  # valid, but not the endpoint
        _line(0),
        _line(4, body={"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
        _line(5, body={"messages": [{"role": "user", "content": "x"}]}),
        _line(6, url="/v1/embeddings"),
        _line(7, body={"model": "tiny", "messages": []}),
    ]
    # As OpenAI: the upload is accepted; the batch fails, naming the lines.
    uploaded = client.files.create(file=("bad.jsonl", _jsonl(bad)), purpose="batch")
    assert uploaded.status == "processed"
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "validating" and not jobs.submitted  # no job for a bad file
    failed = client.batches.retrieve(batch.id)
    assert failed.status == "failed" and failed.failed_at is not None
    assert failed.in_progress_at is None and failed.request_counts.total == 0
    assert _errors(failed) == [
        (2, "invalid_json_line", None),
        (3, "url_mismatch", "url"),
        (4, "duplicate_custom_id", "custom_id"),
        (5, "model_not_found", "body.model"),
        (6, "missing_required_parameter", "body.model"),
        (7, "invalid_url", "url"),
        (8, "invalid_request", "body"),
    ]
    messages = [e.message for e in failed.errors.data]
    assert "also on line 1" in messages[2] and "'nope'" in messages[3]
    assert "body.messages must be a non-empty list" in messages[6]
    with pytest.raises(openai.BadRequestError, match="status 'failed'"):
        client.batches.cancel(batch.id)


def test_reported_errors_are_bounded(app: FastAPI) -> None:
    client = _client(app)
    lines = [_line(0)] + ["[1]"] * 40
    file_id = client.files.create(file=("f.jsonl", _jsonl(lines)), purpose="batch").id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    failed = client.batches.retrieve(batch.id)
    assert [e.line for e in failed.errors.data] == list(range(2, 2 + MAX_REPORTED_ERRORS))


def test_validation_is_one_pass_over_lines() -> None:
    summary = validate_batch_input(iter(_jsonl([_line(i) for i in range(3)]).splitlines()), 2)
    assert [(e.code, e.line) for e in summary.errors] == [("too_many_tasks", None)]
    assert validate_batch_input(iter([]), 2).errors[0].code == "empty_file"
    assert validate_batch_input([b"\xff\xfe{}"], 2).errors[0].code == "invalid_json_line"
    summary = validate_batch_input(io.BytesIO(_jsonl([_line(0), _line(1)])), max_lines=2)
    assert (summary.lines, summary.errors) == (2, [])
    assert (summary.models, summary.urls) == ({"tiny": [1, 2]}, {"/v1/chat/completions": [1, 2]})
    # Kept with the file as JSON; files stored before line numbers were kept still read.
    assert BatchInputSummary.from_json(summary.to_json()) == summary
    old = BatchInputSummary.from_json({"lines": 2, "models": ["tiny"], "urls": ["/v1/x"]})
    assert (old.models, old.errors) == ({"tiny": []}, [])


def test_too_large_and_wrong_purpose_are_refused_at_upload(app: FastAPI) -> None:
    client = _client(app)
    with pytest.raises(openai.BadRequestError) as too_large:  # 400, as OpenAI answers
        client.files.create(
            file=("big.jsonl", _jsonl([_line(i) for i in range(60)])), purpose="batch"
        )
    assert too_large.value.code == "file_too_large"
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("in.jsonl", _jsonl([_line(0)])), purpose="fine-tune")


def test_create_list_cancel_and_ownership(app: FastAPI, jobs: FakeJobs) -> None:
    client = _client(app)
    file_id = client.files.create(
        file=("in.jsonl", _jsonl([_line(0), _line(1)])), purpose="batch"
    ).id
    batch = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"team": "a"},
    )
    assert batch.status == "validating" and batch.request_counts.total == 2
    assert batch.metadata == {"team": "a"}
    submitted = jobs.submitted[f"tokenmill-{batch.id}"]
    assert submitted["entrypoint"].startswith("tokenmill run job.yaml")
    assert submitted["runtime_env"]["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == "120"

    jobs.status[f"tokenmill-{batch.id}"] = "RUNNING"
    assert client.batches.retrieve(batch.id).status == "in_progress"
    second = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    page = client.batches.list(limit=1)
    assert [b.id for b in page.data] == [second.id] and page.has_more
    assert [b.id for b in client.batches.list(limit=5, after=second.id).data] == [batch.id]

    other = _client(app, "key-b")
    assert list(other.batches.list()) == []
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):  # nor start a batch on another key's file
        other.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )

    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelling" and jobs.stopped == [f"tokenmill-{batch.id}"]
    final = client.batches.retrieve(batch.id)  # the job ended without output
    assert final.status == "cancelled" and final.cancelled_at is not None
    assert final.output_file_id is None
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: no change
    jobs.status[f"tokenmill-{second.id}"] = "FAILED"
    failed = client.batches.retrieve(second.id)
    assert failed.status == "failed" and failed.errors and failed.errors.data
    with pytest.raises(openai.BadRequestError, match="status 'failed'"):
        client.batches.cancel(second.id)


def test_create_refuses_or_fails_what_it_cannot_run(app: FastAPI, jobs: FakeJobs) -> None:
    client = _client(app)

    def upload(lines: list[dict[str, Any]], key: str = "key-a") -> str:
        return _client(app, key).files.create(file=("f.jsonl", _jsonl(lines)), purpose="batch").id

    def failed(file_id: str, key: str = "key-a", endpoint: str = "/v1/chat/completions") -> Any:
        caller = _client(app, key)
        batch = caller.batches.create(
            input_file_id=file_id,
            endpoint=endpoint,  # type: ignore[arg-type]
            completion_window="24h",
        )
        return caller.batches.retrieve(batch.id)

    chat = upload([_line(0), _line(1)])
    assert _errors(failed(chat, endpoint="/v1/completions")) == [
        (1, "url_mismatch", "url"),
        (2, "url_mismatch", "url"),
    ]
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(
            input_file_id=chat,
            endpoint="/v1/chat/completions",
            completion_window="1h",  # type: ignore[arg-type]
        )
    for model, match in (("nope", "does not exist"), ("online-only", "no batch section")):
        body = {"model": model, "messages": [{"role": "user", "content": "x"}]}
        batch = failed(upload([_line(0), _line(1, body=body)]))
        assert _errors(batch) == [(2, "model_not_found", "body.model")]
        assert match in batch.errors.data[0].message
    restricted = failed(upload([_line(0), _line(1)], key="key-r"), key="key-r")
    assert _errors(restricted) == [(n, "model_not_found", "body.model") for n in (1, 2)]
    assert "may not use it" in restricted.errors.data[0].message
    assert not jobs.submitted


def test_one_model_per_batch(app: FastAPI) -> None:
    service = batch_routes._installed.service  # type: ignore[union-attr]
    tiny2 = service.spec.models[0].model_copy(update={"name": "tiny2"})
    service.spec = service.spec.model_copy(update={"models": [*service.spec.models, tiny2]})
    client = _client(app)
    other = {"model": "tiny2", "messages": [{"role": "user", "content": "x"}]}
    file_id = client.files.create(
        file=("f.jsonl", _jsonl([_line(0), _line(1, body=other), _line(2)])), purpose="batch"
    ).id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert _errors(client.batches.retrieve(batch.id)) == [(2, "model_mismatch", "body.model")]


def test_batch_job_spec_is_a_valid_openai_batch_job(app: FastAPI, jobs: FakeJobs) -> None:
    client = _client(app)
    file_id = client.files.create(file=("in.jsonl", _jsonl([_line(0)])), purpose="batch").id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    working_dir = Path(jobs.submitted[f"tokenmill-{batch.id}"]["runtime_env"]["working_dir"])
    assert not working_dir.exists()  # a temp dir, uploaded by the Jobs client at submit
    service = batch_routes._installed.service  # type: ignore[union-attr]
    from pipeline.serve.batches import job_spec_data

    served = service.spec.model_named("tiny")
    assert served is not None
    spec = parse_job_spec(
        job_spec_data(batch.id, served, service.spec, "/in.jsonl", "/out", batch.expires_at)
    )
    assert spec.limits.stop_at == batch.expires_at  # the job stops itself at the window's end
    assert spec.output.format == "openai_batch" and spec.input.passthrough_columns == ["url"]
    assert spec.model.display_name == "tiny" and spec.sampling.max_tokens == 8
    assert spec.cost.batch_discount == 0.5 and spec.limits.max_error_fraction == 1.0


def _create(client: openai.OpenAI, file_id: str, **extra: Any) -> Any:
    return client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h", **extra
    )


def _job_output_uri(jobs: FakeJobs, batch_id: str) -> str:
    env = jobs.submitted[f"tokenmill-{batch_id}"]["runtime_env"]
    return str(yaml.safe_load(Path(env["working_dir"], "job.yaml").read_text())["output"]["uri"])


def test_resume_runs_into_the_stopped_batch_output(
    app: FastAPI, jobs: FakeJobs, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Keep the job file the fake Jobs API was handed (the real client uploads it at submit).
    kept: list[Path] = []
    real_submit = jobs.submit_job

    def submit(**kwargs: Any) -> str:
        copy = tmp_path / f"job-{len(kept)}"
        shutil.copytree(kwargs["runtime_env"]["working_dir"], copy, dirs_exist_ok=True)
        kwargs["runtime_env"] = {**kwargs["runtime_env"], "working_dir": str(copy)}
        kept.append(copy)
        return real_submit(**kwargs)

    monkeypatch.setattr(jobs, "submit_job", submit)
    client = _client(app)
    file_id = client.files.create(
        file=("in.jsonl", _jsonl([_line(0), _line(1)])), purpose="batch"
    ).id
    first = _create(client, file_id)
    with pytest.raises(openai.BadRequestError, match="only cancelled, expired, failed"):
        _create(client, file_id, metadata={RESUME_KEY: first.id})  # still running
    client.batches.cancel(first.id)
    assert client.batches.retrieve(first.id).status == "cancelled"
    other_file = client.files.create(file=("b.jsonl", _jsonl([_line(0)])), purpose="batch").id
    with pytest.raises(openai.BadRequestError, match="same input_file_id"):
        _create(client, other_file, metadata={RESUME_KEY: first.id})
    resumed = _create(client, file_id, metadata={RESUME_KEY: first.id})
    # The new job writes into the stopped one's output: its own resume skips what finished.
    assert _job_output_uri(jobs, resumed.id) == _job_output_uri(jobs, first.id)
    with pytest.raises(openai.BadRequestError, match=f"resumed by {resumed.id}"):
        _create(client, file_id, metadata={RESUME_KEY: first.id})
    with pytest.raises(openai.BadRequestError, match="no such batch"):
        _create(client, file_id, metadata={RESUME_KEY: "batch_nope"})
    plain = _create(client, file_id)  # without the key: a batch of its own, from scratch
    assert _job_output_uri(jobs, plain.id) not in (_job_output_uri(jobs, first.id),)


def test_list_reads_only_its_page(app: FastAPI, monkeypatch: pytest.MonkeyPatch) -> None:
    client = _client(app)
    file_id = client.files.create(file=("in.jsonl", _jsonl([_line(0)])), purpose="batch").id
    created = [_create(client, file_id).id for _ in range(6)]
    newest_first = created[::-1]
    service = batch_routes._installed.service  # type: ignore[union-attr]
    loaded: list[str] = []
    real_load = service._load

    def load(out: Any, batch_id: str) -> dict:
        loaded.append(batch_id)
        return real_load(out, batch_id)

    monkeypatch.setattr(service, "_load", load)
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == newest_first[:2] and page.has_more
    assert loaded == newest_first[:2]  # not every record of the key
    loaded.clear()
    page = client.batches.list(limit=3, after=newest_first[1])
    assert [b.id for b in page.data] == newest_first[2:5] and page.has_more
    assert loaded == newest_first[2:5]
    last = client.batches.list(limit=5, after=newest_first[4])
    assert [b.id for b in last.data] == newest_first[5:] and not last.has_more


def test_completion_window_setting_expires_a_running_batch(tmp_path: Path) -> None:
    spec = parse_serve_spec(
        {
            "models": [{"name": "tiny", "model": {"path": "/m"}, "batch": {}}],
            "batch_api": {"uri": str(tmp_path), "completion_window_s": 30},
        }
    )
    clock = [1_000_000.0]
    jobs = FakeJobs()
    service = BatchService(spec, lambda: jobs, now=lambda: clock[0])
    files = service.files("alpha")
    summary = validate_batch_input([json.dumps(_line(0)).encode()], 10)
    stored = files.create(b"", "in.jsonl", "batch", summary.to_json())
    body = {"input_file_id": stored.id, "endpoint": "/v1/chat/completions"}
    batch = service.create("alpha", lambda _: True, {**body, "completion_window": "24h"})
    assert batch["expires_at"] == batch["created_at"] + 30  # the API's "24h", the file's 30 s
    job = f"tokenmill-{batch['id']}"
    jobs.status[job] = "RUNNING"
    assert service.retrieve("alpha", batch["id"])["status"] == "in_progress"
    clock[0] += 31
    assert service.retrieve("alpha", batch["id"])["status"] == "in_progress"  # stopping
    assert jobs.stopped == [job]  # SIGTERM: the job commits what finished and exits
    expired = service.retrieve("alpha", batch["id"])
    assert expired["status"] == "expired" and expired["expired_at"] == int(clock[0])
