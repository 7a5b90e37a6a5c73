"""/v1/files and /v1/batches routes through the official `openai` client, in process: the
routes on a bare FastAPI app (Starlette's TestClient as the client's HTTP transport), files in
a temp directory, and a fake Ray Jobs API. The real job runs in tests/e2e/test_batch_api.py."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.testclient import TestClient

from pipeline.openai.errors import ApiError
from pipeline.serve.access.keys import ApiKey
from pipeline.serve.batch_api import batch_routes
from pipeline.serve.batch_api.batches import RESUME_KEY, BatchService
from pipeline.serve.batch_api.files import (
    MAX_REPORTED_ERRORS,
    BatchInputSummary,
    validate_batch_input,
)
from pipeline.serve.spec import parse_serve_spec
from pipeline.spec import parse_job_spec

KEYS = {
    "key-a": ApiKey("alpha", owner="alpha"),
    "key-b": ApiKey("beta", owner="beta"),
    "key-r": ApiKey("r", models=frozenset(), owner="r"),
}


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
        if job_id not in self.status:  # as Ray's JobSubmissionClient answers an unknown id
            raise RuntimeError(f"Request failed with status code 404: Job {job_id} does not exist.")
        return SimpleNamespace(status=self.status[job_id], message="boom")

    def stop_job(self, job_id: str) -> bool:
        self.stopped.append(job_id)
        self.status[job_id] = "STOPPED"
        return True


@pytest.fixture
def jobs() -> FakeJobs:
    return FakeJobs()


def _spec(tmp_path: Path, **batch_api: Any) -> Any:
    return parse_serve_spec(
        {
            "models": [
                {"name": "tiny", "model": {"path": "/m"}, "batch": {"max_tokens": 8}},
                {"name": "online-only", "model": {"path": "/m"}},
            ],
            "batch_api": {"uri": str(tmp_path / "store"), "max_file_bytes": 4096, **batch_api},
        }
    )


def _routes_app(
    spec: Any,
    jobs: FakeJobs,
    identify: Callable[[str], ApiKey | None],
    enter: batch_routes.Enter | None = None,
) -> FastAPI:
    """The routes on a bare app; `identify` maps a bearer key to its ApiKey, `enter` stands
    for the ingress's admission (none: every call admitted)."""
    app = FastAPI()

    @app.exception_handler(ApiError)
    async def _error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    app.include_router(batch_routes.router)

    def authenticate(request: Request) -> ApiKey:
        key = identify(request.headers.get("authorization", "").removeprefix("Bearer "))
        if key is None:
            raise ApiError(401, "bad key", code="invalid_api_key")
        return key

    if enter is None:
        batch_routes.install(spec, authenticate)
    else:
        batch_routes.install(spec, authenticate, enter)
    assert batch_routes._installed is not None
    batch_routes._installed.service = BatchService(spec, lambda: jobs)
    return app


@pytest.fixture
def app(tmp_path: Path, jobs: FakeJobs) -> Iterator[FastAPI]:
    yield _routes_app(_spec(tmp_path), jobs, KEYS.get)
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
        _line(6, url="/v1/moderations"),
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


def test_adapter_lines_run_on_their_model_and_embeddings_refuse_them(
    app: FastAPI, jobs: FakeJobs
) -> None:
    service = batch_routes._installed.service  # type: ignore[union-attr]
    tiny = service.spec.models[0]
    adapted = tiny.model_copy(
        update={"model": tiny.model.model_copy(update={"adapters": {"ft": "/ft"}})}
    )
    service.spec = service.spec.model_copy(update={"models": [adapted, *service.spec.models[1:]]})
    client = _client(app)
    chat = {"model": "ft", "messages": [{"role": "user", "content": "x"}]}
    file_id = client.files.create(
        file=("f.jsonl", _jsonl([_line(0), _line(1, body=chat)])), purpose="batch"
    ).id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    ok = client.batches.retrieve(batch.id)  # one model and its adapter: no errors
    assert ok.errors is None and ok.status != "failed"
    from pipeline.serve.batch_api.batches import job_spec_data

    spec = parse_job_spec(job_spec_data(batch.id, adapted, service.spec, "/in", "/out"))
    assert spec.model.adapters == {"ft": "/ft"}
    embed = {"method": "POST", "url": "/v1/embeddings"}
    lines = [
        {**embed, "custom_id": f"e{i}", "body": {"model": m, "input": "x"}}
        for i, m in enumerate(("tiny", "ft"))
    ]
    file_id = client.files.create(file=("e.jsonl", _jsonl(lines)), purpose="batch").id
    refused = client.batches.create(
        input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
    )
    assert _errors(client.batches.retrieve(refused.id)) == [(2, "model_not_found", "body.model")]
    # An embeddings batch's job runs the model itself: the job spec takes no adapters there.
    embed_spec = job_spec_data("b", adapted, service.spec, "/in", "/out", None, "/v1/embeddings")
    assert parse_job_spec(embed_spec).model.adapters == {}


def test_batch_job_spec_is_a_valid_openai_batch_job(app: FastAPI, jobs: FakeJobs) -> None:
    client = _client(app)
    file_id = client.files.create(file=("in.jsonl", _jsonl([_line(0)])), purpose="batch").id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    working_dir = Path(jobs.submitted[f"tokenmill-{batch.id}"]["runtime_env"]["working_dir"])
    assert not working_dir.exists()  # a temp dir, uploaded by the Jobs client at submit
    service = batch_routes._installed.service  # type: ignore[union-attr]
    from pipeline.serve.batch_api.batches import job_spec_data

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


class FlakyStopJobs(FakeJobs):
    """A Jobs API whose first `failures` stop_job calls fail (the head away for a moment)."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures
        self.stop_calls = 0

    def stop_job(self, job_id: str) -> bool:
        self.stop_calls += 1
        if self.stop_calls <= self.failures:
            raise ConnectionError("the Ray head did not answer")
        return super().stop_job(job_id)


def _service(tmp_path: Path, jobs: FakeJobs) -> BatchService:
    spec = parse_serve_spec(
        {
            "models": [{"name": "tiny", "model": {"path": "/m"}, "batch": {}}],
            "batch_api": {"uri": str(tmp_path / "store")},
        }
    )
    return BatchService(spec, lambda: jobs)


def _stored_input(service: BatchService, owner: str, lines: int = 2) -> str:
    summary = validate_batch_input([json.dumps(_line(i)).encode() for i in range(lines)], 10)
    return service.files(owner).create(b"", "in.jsonl", "batch", summary.to_json()).id


BODY = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}


def test_a_failed_stop_is_retried_while_cancelling(tmp_path: Path) -> None:
    jobs = FlakyStopJobs(failures=2)
    service = _service(tmp_path, jobs)
    file_id = _stored_input(service, "alpha")
    batch = service.create("alpha", lambda _: True, {**BODY, "input_file_id": file_id})
    job = f"tokenmill-{batch['id']}"
    jobs.status[job] = "RUNNING"
    assert service.cancel("alpha", batch["id"])["status"] == "cancelling"
    assert jobs.stop_calls == 1 and jobs.status[job] == "RUNNING"  # the stop failed
    # Every read while cancelling tries the stop again, until one gets through.
    assert service.retrieve("alpha", batch["id"])["status"] == "cancelling"
    assert jobs.stop_calls == 2 and jobs.status[job] == "RUNNING"
    assert service.retrieve("alpha", batch["id"])["status"] == "cancelling"
    assert jobs.stop_calls == 3 and jobs.stopped == [job]
    assert service.retrieve("alpha", batch["id"])["status"] == "cancelled"
    assert jobs.stop_calls == 3  # a stop that got through is not sent again


def test_concurrent_resumes_of_one_batch_submit_one_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    jobs = FakeJobs()
    service = _service(tmp_path, jobs)
    file_id = _stored_input(service, "alpha")
    first = service.create("alpha", lambda _: True, {**BODY, "input_file_id": file_id})
    service.cancel("alpha", first["id"])
    assert service.retrieve("alpha", first["id"])["status"] == "cancelled"

    # Both requests check the stopped batch before either goes on: the race, every time.
    both_checked = threading.Barrier(2, timeout=30)
    real_resumed = service._resumed

    def resumed(*args: Any) -> Any:
        found = real_resumed(*args)
        both_checked.wait()
        return found

    monkeypatch.setattr(service, "_resumed", resumed)
    outcomes: list[Any] = []

    def resume() -> None:
        body = {**BODY, "input_file_id": file_id, "metadata": {RESUME_KEY: first["id"]}}
        try:
            outcomes.append(service.create("alpha", lambda _: True, body))
        except ApiError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=resume) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(outcomes) == 2, "a resume did not return within 60 s"
    created = [o for o in outcomes if isinstance(o, dict)]
    refused = [o for o in outcomes if isinstance(o, ApiError)]
    assert len(created) == 1 and len(refused) == 1, outcomes
    assert refused[0].status == 400 and f"resumed by {created[0]['id']}" in refused[0].message
    resumes = [j for j in jobs.submitted if j != f"tokenmill-{first['id']}"]
    assert resumes == [f"tokenmill-{created[0]['id']}"]  # one job writes into the output
    # The refused one left no batch behind.
    assert [b["id"] for b in service.list("alpha")["data"]] == [created[0]["id"], first["id"]]


def _env_ring(*keys: str) -> Any:
    """The keys of TOKENMILL_API_KEYS=keys[0],keys[1],... as the ingress holds them."""
    from pipeline.serve.access.auth import KeyDigests, digest
    from pipeline.serve.access.keys import KeyRing

    named = tuple((f"env-{i}", digest(k)) for i, k in enumerate(keys, start=1))
    return KeyRing.build(KeyDigests(frozenset(d for _, d in named), named=named), None)


def test_reordered_env_keys_keep_their_own_files_and_batches(
    tmp_path: Path, jobs: FakeJobs
) -> None:
    ring = [_env_ring("key-one", "key-two")]
    app = _routes_app(_spec(tmp_path), jobs, lambda key: ring[0].identify(f"Bearer {key}"))
    try:
        one = _client(app, "key-one")
        file_id = one.files.create(file=("in.jsonl", _jsonl([_line(0)])), purpose="batch").id
        batch_id = _create(one, file_id).id
        # The operator reorders the variable (or removes the first key): positions move.
        ring[0] = _env_ring("key-two", "key-one")
        two = _client(app, "key-two")
        assert list(two.files.list()) == [] and list(two.batches.list()) == []
        with pytest.raises(openai.NotFoundError):
            two.files.retrieve(file_id)
        with pytest.raises(openai.NotFoundError):
            two.batches.retrieve(batch_id)
        # The key that made them still has them.
        assert [f.id for f in one.files.list()] == [file_id]
        assert [b.id for b in one.batches.list()] == [batch_id]
    finally:
        batch_routes._installed = None


def test_batch_api_refused_without_a_stable_identity(tmp_path: Path, jobs: FakeJobs) -> None:
    from pipeline.serve.access.auth import KeyDigests
    from pipeline.serve.access.keys import KeyRing

    insecure = KeyRing.build(KeyDigests(frozenset(), insecure=True), None)  # --insecure-no-auth
    app = _routes_app(_spec(tmp_path), jobs, lambda key: insecure.identify(f"Bearer {key}"))
    try:
        client = _client(app, "anything")
        with pytest.raises(openai.PermissionDeniedError) as refused:
            client.files.create(file=("in.jsonl", _jsonl([_line(0)])), purpose="batch")
        assert "--insecure-no-auth" in refused.value.message
        assert "keys_file" in refused.value.message  # the fix: a key that names its owner
        with pytest.raises(openai.PermissionDeniedError):
            client.batches.list()
    finally:
        batch_routes._installed = None


# --- item: Batch API limits (body sizes, streamed uploads, upload slots, per-key quotas) ----

BOUNDARY = "tokenmill-test-boundary"


def _multipart_head(filename: str = "big.jsonl", purpose: str = "batch") -> bytes:
    return (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; '
        f'filename="{filename}"\r\nContent-Type: application/jsonl\r\n\r\n'
    ).encode()


MULTIPART_TAIL = f"\r\n--{BOUNDARY}--\r\n".encode()


def _big_lines(total_bytes: int, line_bytes: int = 4096) -> Iterator[bytes]:
    """Valid batch lines, `line_bytes` each, about `total_bytes` in all, made as needed."""
    pad = "x" * (line_bytes - 150)
    for i in range(total_bytes // line_bytes):
        line = json.dumps(
            _line(i, body={"model": "tiny", "messages": [{"role": "user", "content": pad}]})
        )
        yield (line + " " * max(0, line_bytes - 1 - len(line)) + "\n").encode()


def _chunked(parts: Iterator[bytes], size: int = 64 * 1024) -> Iterator[bytes]:
    """Re-cut a byte stream into `size` chunks, as a server hands a body to the app."""
    buffer = b""
    for part in parts:
        buffer += part
        while len(buffer) >= size:
            yield buffer[:size]
            buffer = buffer[size:]
    if buffer:
        yield buffer


async def _asgi_post(
    app: FastAPI,
    path: str,
    key: str,
    chunks: Iterator[bytes],
    content_type: str,
    length: int | None = None,
    hold: Any = None,
) -> tuple[int, dict[str, str], bytes]:
    """One POST straight into the ASGI app, its body handed over chunk by chunk as it is made
    (so the test holds none of it); `hold`, an asyncio.Event, pauses the body until set."""
    import asyncio

    headers = [
        (b"authorization", f"Bearer {key}".encode()),
        (b"content-type", content_type.encode()),
    ]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }
    done = asyncio.Event()
    sent: dict[str, Any] = {"body": b""}

    async def receive() -> dict[str, Any]:
        if hold is not None:
            await hold.wait()
        chunk = next(chunks, None)
        if chunk is not None:
            return {"type": "http.request", "body": chunk, "more_body": True}
        if not sent.get("end"):
            sent["end"] = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            sent["status"] = message["status"]
            sent["headers"] = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            sent["body"] += message.get("body", b"")
            if not message.get("more_body"):
                done.set()

    await app(scope, receive, send)
    return sent["status"], sent["headers"], sent["body"]


def test_an_upload_is_streamed_to_storage(tmp_path: Path, jobs: FakeJobs) -> None:
    import asyncio
    import hashlib
    import tracemalloc

    size = 16 * 1024 * 1024
    spec = _spec(tmp_path, max_file_bytes=64 * 1024 * 1024)
    app = _routes_app(spec, jobs, KEYS.get)
    try:
        content_type = f"multipart/form-data; boundary={BOUNDARY}"
        # A small upload first: what the first one imports is not what an upload holds.
        small = _chunked(iter([_multipart_head(), *_big_lines(8192), MULTIPART_TAIL]))
        assert asyncio.run(_asgi_post(app, "/v1/files", "key-a", small, content_type))[0] == 200
        body = _chunked(iter([_multipart_head(), *_big_lines(size), MULTIPART_TAIL]))
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            status, _, raw = asyncio.run(
                _asgi_post(
                    app, "/v1/files", "key-a", body, f"multipart/form-data; boundary={BOUNDARY}"
                )
            )
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert status == 200, raw
        uploaded = json.loads(raw)
        assert uploaded["bytes"] == size
        print(f"upload of {size >> 20} MiB: peak Python memory {peak / 2**20:.2f} MiB")
        # Streamed in parts: the ingress holds a few parts of it (and the custom_ids seen,
        # which grow with lines, not bytes), never the file.
        assert peak < size / 4, f"peak {peak} bytes while uploading {size}"
        service = batch_routes._installed.service  # type: ignore[union-attr]
        stored = service.files("alpha").get(uploaded["id"])
        digest = hashlib.sha256()
        for chunk in service.files("alpha").iter_content(stored):
            digest.update(chunk)
        assert digest.hexdigest() == hashlib.sha256(b"".join(_big_lines(size))).hexdigest()
        assert BatchInputSummary.from_json(stored.private).lines == size // 4096
    finally:
        batch_routes._installed = None


def test_create_batch_body_over_max_body_bytes_is_413(tmp_path: Path, jobs: FakeJobs) -> None:
    import asyncio

    spec = _spec(tmp_path).model_copy(deep=True)
    limit = spec.http.max_body_bytes
    app = _routes_app(spec, jobs, KEYS.get)
    try:
        padded = json.dumps({**BODY, "input_file_id": "file-x"}) + " " * (limit + 1)
        for length in (len(padded), None):  # declared, and chunked with no length
            status, _, raw = asyncio.run(
                _asgi_post(
                    app,
                    "/v1/batches",
                    "key-a",
                    _chunked(iter([padded.encode()]), 4096),
                    "application/json",
                    length,
                )
            )
            assert status == 413, raw
            assert json.loads(raw)["error"]["code"] == "request_too_large"
    finally:
        batch_routes._installed = None


def test_uploads_beyond_the_cap_get_429(tmp_path: Path, jobs: FakeJobs) -> None:
    import asyncio

    spec = _spec(tmp_path, max_concurrent_uploads=1)
    app = _routes_app(spec, jobs, KEYS.get)
    content_type = f"multipart/form-data; boundary={BOUNDARY}"

    def body() -> Iterator[bytes]:
        return iter([_multipart_head(), _jsonl([_line(0)]), MULTIPART_TAIL])

    async def scenario() -> tuple[tuple, tuple, tuple]:
        hold = asyncio.Event()
        first = asyncio.ensure_future(
            _asgi_post(app, "/v1/files", "key-a", body(), content_type, hold=hold)
        )
        await asyncio.sleep(0.2)  # the first upload is in, its body not yet sent
        second = await asyncio.wait_for(
            _asgi_post(app, "/v1/files", "key-b", body(), content_type), 30
        )
        hold.set()
        done = await asyncio.wait_for(first, 30)
        third = await asyncio.wait_for(
            _asgi_post(app, "/v1/files", "key-b", body(), content_type), 30
        )
        return second, done, third

    try:
        second, first, third = asyncio.run(scenario())
        assert second[0] == 429, second
        error = json.loads(second[2])["error"]
        assert error["code"] == "upload_slots_full" and int(second[1]["retry-after"]) >= 1
        assert first[0] == 200 and third[0] == 200  # a slot frees when its upload ends
    finally:
        batch_routes._installed = None


QUOTA_KEYS = """
keys:
  - name: quota
    sha256: "%s"
    batch: {max_batches_in_flight: 1, max_lines_per_day: 5, max_stored_bytes: 3000}
"""


def test_per_key_batch_quotas(tmp_path: Path, jobs: FakeJobs) -> None:
    from pipeline.serve.access.auth import KeyDigests, digest
    from pipeline.serve.access.keys import KeyRing, parse_key_file

    ring = KeyRing.build(
        KeyDigests(frozenset()), parse_key_file(QUOTA_KEYS % digest("key-q"), "keys.yaml")
    )
    app = _routes_app(
        _spec(tmp_path), jobs, lambda key: ring.identify(f"Bearer {key}") or KEYS.get(key)
    )
    try:
        client = _client(app, "key-q")
        three = _jsonl([_line(i) for i in range(3)])
        first_file = client.files.create(file=("a.jsonl", three), purpose="batch").id
        first = _create(client, first_file)
        # Batches in flight: one at a time; the second gets 429 while the first runs.
        with pytest.raises(openai.RateLimitError) as in_flight:
            _create(client, first_file)
        assert in_flight.value.code == "batch_limit_exceeded"
        assert int(in_flight.value.response.headers["retry-after"]) >= 1
        jobs.status[f"tokenmill-{first.id}"] = "SUCCEEDED"  # ended (no output: failed)
        # Lines per day: 3 used of 5, so another 3 are refused until the next UTC day.
        with pytest.raises(openai.RateLimitError) as lines:
            _create(client, first_file)
        assert lines.value.code == "lines_per_day_exceeded"
        assert 1 <= int(lines.value.response.headers["retry-after"]) <= 86_400
        two = client.files.create(file=("b.jsonl", _jsonl([_line(0), _line(1)])), purpose="batch")
        assert _create(client, two.id).status == "validating"  # 5 of 5
        # Bytes stored: the uploads so far and this one would pass 3000.
        big = _jsonl([_line(i) for i in range(40)])
        while two.bytes + len(big) > 3000:  # fits once the first file is deleted
            big = big[: big.rindex(b"\n", 0, len(big) - 1) + 1]
        assert len(three) + two.bytes + len(big) > 3000
        with pytest.raises(openai.RateLimitError) as stored:
            client.files.create(file=("c.jsonl", big), purpose="batch")
        assert stored.value.code == "storage_limit_exceeded"
        assert "Delete files" in stored.value.message
        client.files.delete(first_file)
        client.files.create(file=("c.jsonl", big), purpose="batch")  # room again
        # Other keys are not affected by this key's quota.
        other = _client(app, "key-a")
        assert other.files.create(file=("a.jsonl", big), purpose="batch").bytes == len(big)
    finally:
        batch_routes._installed = None


def test_a_refused_submit_leaves_no_batch_and_the_stopped_one_resumable(tmp_path: Path) -> None:
    jobs = FakeJobs()
    service = _service(tmp_path, jobs)
    file_id = _stored_input(service, "alpha")
    first = service.create("alpha", lambda _: True, {**BODY, "input_file_id": file_id})
    service.cancel("alpha", first["id"])
    assert service.retrieve("alpha", first["id"])["status"] == "cancelled"

    def refuse(**kwargs: Any) -> str:
        raise ConnectionRefusedError("the Ray head is not listening")

    real_submit, jobs.submit_job = jobs.submit_job, refuse  # type: ignore[method-assign]
    body = {**BODY, "input_file_id": file_id, "metadata": {RESUME_KEY: first["id"]}}
    with pytest.raises(ApiError) as refused:
        service.create("alpha", lambda _: True, body)
    assert refused.value.status == 503 and refused.value.code == "batch_submit_failed"
    assert [b["id"] for b in service.list("alpha")["data"]] == [first["id"]]
    jobs.submit_job = real_submit  # type: ignore[method-assign]
    resumed = service.create("alpha", lambda _: True, body)  # the claim was given back
    assert f"tokenmill-{resumed['id']}" in jobs.submitted


def test_a_record_whose_job_never_came_fails_after_the_grace(tmp_path: Path) -> None:
    from pipeline.serve.batch_api.batches import SUBMIT_GRACE_S

    clock = [1_000_000.0]
    jobs = FakeJobs()
    service = _service(tmp_path, jobs)
    service.now = lambda: clock[0]
    file_id = _stored_input(service, "alpha")
    # The ingress dies between saving the record and submitting: Ray never hears of the job.
    jobs.submit_job = lambda **kwargs: (_ for _ in ()).throw(SystemExit())  # type: ignore[method-assign]
    with pytest.raises(SystemExit):
        service.create("alpha", lambda _: True, {**BODY, "input_file_id": file_id})
    (batch,) = service.list("alpha")["data"]
    assert batch["status"] == "validating"  # Ray may still show the job: wait
    clock[0] += SUBMIT_GRACE_S
    failed = service.retrieve("alpha", batch["id"])
    assert (
        failed["status"] == "failed" and "never submitted" in failed["errors"]["data"][0]["message"]
    )


def test_streaming_validation_matches_the_one_pass_over_lines() -> None:
    from pipeline.serve.batch_api.files import StreamingValidator

    data = _jsonl([_line(0), "{oops", _line(0), _line(3)]) + b"[1]"  # no final line break
    expected = validate_batch_input(io.BytesIO(data), max_lines=10)
    for size in (1, 2, 7, 64, len(data)):
        validator = StreamingValidator(max_lines=10, max_line_bytes=1024)
        for i in range(0, len(data), size):
            validator.feed(data[i : i + size])
        assert validator.finish() == expected, size
    capped = StreamingValidator(max_lines=2, max_line_bytes=1024)
    capped.feed(data)
    assert capped.finish() == validate_batch_input(io.BytesIO(data), max_lines=2)
    # A line over max_line_bytes is an error of its own and is not held.
    long = json.dumps(_line(1, body={"model": "tiny", "messages": [{"content": "x" * 4000}]}))
    validator = StreamingValidator(max_lines=10, max_line_bytes=1024)
    for i in range(0, 6000, 100):
        validator.feed((_jsonl([_line(0), long, _line(2)]))[i : i + 100])
    summary = validator.finish()
    assert summary.lines == 3 and [(e.code, e.line) for e in summary.errors] == [
        ("line_too_long", 2)
    ]


def test_every_route_is_admitted_and_gives_its_slot_back(tmp_path: Path, jobs: FakeJobs) -> None:
    """Each /v1/files and /v1/batches call goes through the ingress's admission (its slot and
    the key's limits), and gives it back when done: a download when its last byte is sent."""
    held: list[str] = []
    entered: list[str] = []

    async def enter(key: ApiKey) -> Callable[[], None]:
        if key.name == "beta":
            raise ApiError(429, "over its limit", code="rate_limit_exceeded")
        entered.append(key.name)
        held.append(key.name)
        return lambda: held.remove(key.name)

    app = _routes_app(_spec(tmp_path), jobs, KEYS.get, enter)
    try:
        client = _client(app)
        file_id = client.files.create(file=("in.jsonl", _jsonl([_line(0)])), purpose="batch").id
        client.files.list()
        client.files.retrieve(file_id)
        assert client.files.content(file_id).content == _jsonl([_line(0)])
        batch = _create(client, file_id)
        client.batches.list()
        client.batches.retrieve(batch.id)
        client.batches.cancel(batch.id)
        client.files.delete(file_id)
        assert len(entered) == 9 and held == []  # every call admitted, every slot back
        other = _client(app, "key-b")
        for call in (
            lambda: other.files.list(),
            lambda: other.files.create(file=("in.jsonl", _jsonl([_line(0)])), purpose="batch"),
            lambda: other.batches.list(),
            lambda: other.batches.retrieve(batch.id),
        ):
            with pytest.raises(openai.RateLimitError):
                call()
        # Every route bounds its body: a cancel with a large declared body is refused unread.
        limit = _spec(tmp_path).http.max_body_bytes
        response = TestClient(app).post(
            f"/v1/batches/{batch.id}/cancel",
            content=b" " * (limit + 1),
            headers={"Authorization": "Bearer key-a"},
        )
        assert response.status_code == 413 and held == []
    finally:
        batch_routes._installed = None


# --- a submit whose answer was lost ----------------------------------------------------------


class LostAnswerJobs(FakeJobs):
    """A Jobs API whose submits raise a read timeout: after Ray took the job (`lands`), or
    before (the job never comes); `reachable=False`: lookups fail too (the head away)."""

    def __init__(self, lands: bool, reachable: bool = True) -> None:
        super().__init__()
        self.lands = lands
        self.reachable = reachable
        self.submit_calls = 0

    def submit_job(self, **kwargs: Any) -> str:
        import requests

        self.submit_calls += 1
        if self.lands and kwargs["submission_id"] in self.submitted:
            raise RuntimeError(
                "Request failed with status code 400: Job with submission_id "
                f"{kwargs['submission_id']} already exists."
            )
        if self.lands:
            super().submit_job(**kwargs)
        raise requests.exceptions.ReadTimeout("read timed out (read timeout=60)")

    def get_job_info(self, job_id: str) -> Any:
        if not self.reachable:
            raise ConnectionError("the Ray head did not answer")
        return super().get_job_info(job_id)

    def stop_job(self, job_id: str) -> bool:
        if job_id not in self.status:
            raise RuntimeError(f"Request failed with status code 404: Job {job_id} does not exist.")
        return super().stop_job(job_id)


def _quota_service(tmp_path: Path, jobs: FakeJobs) -> tuple[BatchService, Any]:
    from pipeline.serve.access.keys import BatchQuota

    service = _service(tmp_path, jobs)
    service.submit_backoff_s = 0.0
    return service, BatchQuota(max_batches_in_flight=1)


def test_a_job_taken_before_its_answer_was_lost_keeps_its_batch(tmp_path: Path) -> None:
    """Ray took the job, then the submit's answer timed out: the batch is there, one job
    runs, the key sees and cancels it, and its quota place stays taken while it runs."""
    jobs = LostAnswerJobs(lands=True)
    service, quota = _quota_service(tmp_path, jobs)
    file_id = _stored_input(service, "alpha")
    body = {**BODY, "input_file_id": file_id}
    batch = service.create("alpha", lambda _: True, body, quota)
    job = f"tokenmill-{batch['id']}"
    assert list(jobs.submitted) == [job]  # one job, whatever the retries
    assert [b["id"] for b in service.list("alpha")["data"]] == [batch["id"]]
    jobs.status[job] = "RUNNING"
    assert service.retrieve("alpha", batch["id"])["status"] == "in_progress"
    with pytest.raises(ApiError) as full:  # its place in the quota is taken
        service.create("alpha", lambda _: True, body, quota)
    assert full.value.code == "batch_limit_exceeded"
    assert service.cancel("alpha", batch["id"])["status"] == "cancelling"
    assert jobs.stopped == [job]
    assert service.retrieve("alpha", batch["id"])["status"] == "cancelled"
    assert service.create("alpha", lambda _: True, body, quota)["status"] == "validating"


def test_a_submit_of_unknown_fate_keeps_its_batch_until_the_cluster_tells(
    tmp_path: Path,
) -> None:
    """Neither the submit nor a lookup answered: the job may run, so the client gets its
    batch (its retry starts nothing), the key can cancel it, and its quota place is kept
    until the cluster says no such job ran (then it ends and the place is free)."""
    from pipeline.serve.batch_api.batches import SUBMIT_GRACE_S

    clock = [1_000_000.0]
    jobs = LostAnswerJobs(lands=False, reachable=False)
    service, quota = _quota_service(tmp_path, jobs)
    service.now = lambda: clock[0]
    file_id = _stored_input(service, "alpha")
    body = {**BODY, "input_file_id": file_id}
    batch = service.create("alpha", lambda _: True, body, quota)
    assert batch["status"] == "validating" and jobs.submit_calls >= 2  # tried again
    assert service.retrieve("alpha", batch["id"])["status"] == "validating"
    assert service.cancel("alpha", batch["id"])["status"] == "cancelling"
    with pytest.raises(ApiError) as full:
        service.create("alpha", lambda _: True, body, quota)
    assert full.value.code == "batch_limit_exceeded"
    jobs.reachable = True  # the head answers again: no such job
    assert service.retrieve("alpha", batch["id"])["status"] == "cancelling"  # within the grace
    clock[0] += SUBMIT_GRACE_S
    assert service.retrieve("alpha", batch["id"])["status"] == "cancelled"
    jobs.lands = True
    assert service.create("alpha", lambda _: True, body, quota)["status"] == "validating"


@pytest.mark.parametrize(
    "refusal",
    [
        ConnectionRefusedError("nothing listens on the head's port"),
        RuntimeError("Request failed with status code 400: runtime_env is invalid."),
    ],
)
def test_a_surely_refused_submit_frees_its_quota_place(tmp_path: Path, refusal: Exception) -> None:
    jobs = FakeJobs()
    service, quota = _quota_service(tmp_path, jobs)
    file_id = _stored_input(service, "alpha")
    body = {**BODY, "input_file_id": file_id}

    def refuse(**kwargs: Any) -> str:
        raise refusal

    real_submit, jobs.submit_job = jobs.submit_job, refuse  # type: ignore[method-assign]
    with pytest.raises(ApiError) as refused:
        service.create("alpha", lambda _: True, body, quota)
    assert refused.value.status == 503 and refused.value.code == "batch_submit_failed"
    assert service.list("alpha")["data"] == [] and jobs.submitted == {}
    jobs.submit_job = real_submit  # type: ignore[method-assign]
    assert service.create("alpha", lambda _: True, body, quota)["status"] == "validating"


def test_a_submitted_batch_whose_record_update_fails_is_still_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job was taken, then recording that failed (the store away for a moment): the client
    still gets its batch and the quota place stays taken, so no retry starts a second job."""
    from pipeline.storage import StorageError

    jobs = FakeJobs()
    service, quota = _quota_service(tmp_path, jobs)
    file_id = _stored_input(service, "alpha")
    body = {**BODY, "input_file_id": file_id}

    def store_away(*args: Any) -> None:
        raise StorageError("503 Slow Down")

    monkeypatch.setattr(service, "_write", store_away)
    batch = service.create("alpha", lambda _: True, body, quota)
    assert list(jobs.submitted) == [f"tokenmill-{batch['id']}"]
    monkeypatch.undo()
    with pytest.raises(ApiError) as full:
        service.create("alpha", lambda _: True, body, quota)
    assert full.value.code == "batch_limit_exceeded"
    jobs.status[f"tokenmill-{batch['id']}"] = "RUNNING"
    assert service.retrieve("alpha", batch["id"])["status"] == "in_progress"


# --- upload bounds: bytes reserved as they arrive, every byte of a body counted, idle cut ----

STORAGE_QUOTA_KEYS = """
keys:
  - name: small
    sha256: "%s"
    batch: {max_stored_bytes: %d}
"""


def _quota_app(tmp_path: Path, jobs: FakeJobs, max_stored_bytes: int, **batch_api: Any) -> FastAPI:
    from pipeline.serve.access.auth import KeyDigests, digest
    from pipeline.serve.access.keys import KeyRing, parse_key_file

    keys = STORAGE_QUOTA_KEYS % (digest("key-s"), max_stored_bytes)
    ring = KeyRing.build(KeyDigests(frozenset()), parse_key_file(keys, "keys.yaml"))
    return _routes_app(
        _spec(tmp_path, **batch_api), jobs, lambda key: ring.identify(f"Bearer {key}")
    )


def test_concurrent_uploads_never_store_more_than_the_quota(tmp_path: Path, jobs: FakeJobs) -> None:
    """Uploads that all began before any finished: each reserves its bytes as they arrive, so
    together they never pass max_stored_bytes (which a check at each upload's start would)."""
    import asyncio

    quota = 5000
    app = _quota_app(tmp_path, jobs, quota)
    content_type = f"multipart/form-data; boundary={BOUNDARY}"
    data = _jsonl([_line(i) for i in range(20)])[:2108]
    data = data[: data.rindex(b"\n") + 1]

    async def scenario() -> list[tuple]:
        hold = asyncio.Event()
        uploads = [
            asyncio.ensure_future(
                _asgi_post(
                    app,
                    "/v1/files",
                    "key-s",
                    iter([_multipart_head(), data, MULTIPART_TAIL]),
                    content_type,
                    hold=hold,
                )
            )
            for _ in range(4)
        ]
        await asyncio.sleep(0.3)  # every upload admitted, none has sent its body
        hold.set()
        return list(await asyncio.wait_for(asyncio.gather(*uploads), 60))

    try:
        results = asyncio.run(scenario())
        ok = [r for r in results if r[0] == 200]
        refused = [json.loads(r[2])["error"]["code"] for r in results if r[0] != 200]
        stored = batch_routes._installed.service.files("small").stored_bytes()  # type: ignore[union-attr]
        assert stored <= quota and stored == len(ok) * len(data), (stored, results)
        assert 1 <= len(ok) <= quota // len(data)
        assert set(refused) == {"storage_limit_exceeded"}
    finally:
        batch_routes._installed = None


def test_byte_reservations_hold_across_replicas_and_expire(tmp_path: Path) -> None:
    """Two ingress replicas' ledgers over one store: what one reserved, the other sees; a
    reservation its replica never released (it died) stops counting once it expires."""
    from pipeline.serve.access.keys import BatchQuota
    from pipeline.serve.batch_api.batch_quota import UPLOAD_RESERVATION_TTL_S

    clock = [1_000_000.0]
    spec = _spec(tmp_path)
    replicas = [BatchService(spec, FakeJobs, now=lambda: clock[0]) for _ in range(2)]
    quota = BatchQuota(max_stored_bytes=3000)
    ledgers = [r.quota_ledger("alpha", quota, "alpha") for r in replicas]
    stored = lambda: 0  # noqa: E731
    assert ledgers[0].reserve_bytes("up-1", 2000, 2000, stored) == 2000
    with pytest.raises(ApiError) as full:
        ledgers[1].reserve_bytes("up-2", 1500, 1500, stored)
    assert full.value.status == 429 and full.value.code == "storage_limit_exceeded"
    assert "2000 reserved by uploads in progress" in full.value.message
    assert ledgers[1].reserve_bytes("up-2", 500, 4000, stored) == 1000  # what is left
    ledgers[1].release_bytes("up-2")
    clock[0] += UPLOAD_RESERVATION_TTL_S + 1  # up-1's replica died without releasing
    assert ledgers[1].reserve_bytes("up-3", 3000, 3000, stored) == 3000
    ledgers[1].release_bytes("up-3")
    assert ledgers[0].reserve_bytes("up-4", 1, 10, lambda: 2995) == 5  # the files took the rest


def test_every_byte_of_an_upload_body_counts(tmp_path: Path, jobs: FakeJobs) -> None:
    """A chunked upload (no Content-Length) with a large extra form field: refused once the
    body passes the upload's limit, without reading the rest."""
    import asyncio

    app = _routes_app(_spec(tmp_path), jobs, KEYS.get)  # max_file_bytes 4096
    content_type = f"multipart/form-data; boundary={BOUNDARY}"
    sent = [0]

    def body() -> Iterator[bytes]:
        yield (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="note"\r\n\r\n').encode()
        for _ in range(1024):  # 64 MiB of a field nobody asked for
            sent[0] += 1
            yield b"x" * 65536
        yield b"\r\n" + _multipart_head() + _jsonl([_line(0)]) + MULTIPART_TAIL

    try:
        status, _, raw = asyncio.run(
            asyncio.wait_for(_asgi_post(app, "/v1/files", "key-a", body(), content_type), 60)
        )
        assert status in (400, 413), raw
        assert json.loads(raw)["error"]["code"] in (
            "request_too_large",
            "file_too_large",
            "invalid_request",
        )
        assert sent[0] < 16, f"read {sent[0]} chunks of 64 KiB before refusing"
    finally:
        batch_routes._installed = None


def test_an_upload_that_stops_sending_is_cut_and_frees_its_slot(
    tmp_path: Path, jobs: FakeJobs
) -> None:
    import asyncio

    spec = _spec(tmp_path, max_concurrent_uploads=1)
    spec = spec.model_copy(
        update={"http": spec.http.model_copy(update={"body_idle_timeout_s": 0.5})}
    )
    app = _routes_app(spec, jobs, KEYS.get)
    content_type = f"multipart/form-data; boundary={BOUNDARY}"

    async def upload(hold: Any = None) -> tuple:
        body = iter([_multipart_head(), _jsonl([_line(0)]), MULTIPART_TAIL])
        return await asyncio.wait_for(
            _asgi_post(app, "/v1/files", "key-a", body, content_type, hold=hold), 30
        )

    async def scenario() -> tuple[tuple, tuple]:
        stalled = await upload(hold=asyncio.Event())  # its body never comes
        return stalled, await upload()

    try:
        stalled, after = asyncio.run(scenario())
        assert stalled[0] == 408, stalled
        error = json.loads(stalled[2])["error"]
        assert error["code"] == "request_timeout" and "body_idle_timeout_s" in error["message"]
        assert after[0] == 200, after  # the slot was given back
    finally:
        batch_routes._installed = None


def test_an_upload_whose_file_object_fails_leaves_no_orphan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The content is stored, then writing the file's object fails: the content goes too (it
    would count against the storage quota with no file to delete it by), and the error is the
    store's own, not a second one from cleaning up."""
    from pipeline.serve.batch_api.files import FileStore
    from pipeline.storage import StorageError

    files = FileStore(str(tmp_path / "store"), _spec(tmp_path).storage, "alpha")
    upload = files.open_upload()
    upload.write(_jsonl([_line(0)]))

    def store_away(*args: Any) -> None:
        raise StorageError("503 Slow Down")

    monkeypatch.setattr(files, "_save", store_away)
    with pytest.raises(StorageError):
        upload.commit("in.jsonl", "batch", {})
    upload.abort()  # as the route does on any error
    assert files.stored_bytes() == 0 and list(files.dir.names("file-")) == []


def test_an_upload_whose_file_object_landed_unanswered_is_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file's object was written and its answer lost: the upload is that file (a client
    told it failed would upload it again, and the key would hold it twice)."""
    from pipeline.serve.batch_api.files import FileStore
    from pipeline.storage import StorageError

    files = FileStore(str(tmp_path / "store"), _spec(tmp_path).storage, "alpha")
    data = _jsonl([_line(0)])
    upload = files.open_upload()
    upload.write(data)
    real_save = files._save

    def landed_unanswered(*args: Any) -> Any:
        real_save(*args)
        raise StorageError("read timed out")

    monkeypatch.setattr(files, "_save", landed_unanswered)
    stored = upload.commit("in.jsonl", "batch", {})
    assert files.get(stored.id).data["bytes"] == len(data) == files.stored_bytes()


def test_two_replicas_counting_the_same_lines_both_count(tmp_path: Path) -> None:
    """Two replicas add 20 lines to the same count of 10 at once: they would write the same
    bytes, and the one that lost the race must not take the winner's write for its own."""
    from pipeline.serve.access.keys import BatchQuota

    service = _service(tmp_path, FakeJobs())
    quota = BatchQuota(max_lines_per_day=100)
    first, second = (service.quota_ledger("alpha", quota, "alpha") for _ in range(2))
    first.reserve("batch_a", 10, lambda b: False)
    stale = second.out.read_versioned("_quota.json")
    reads = iter([stale])
    real = second.out.read_versioned
    second.out.read_versioned = lambda name: next(reads, None) or real(name)  # type: ignore[method-assign]
    first.reserve("batch_b", 20, lambda b: False)  # lands between second's read and write
    second.reserve("batch_c", 20, lambda b: False)
    assert json.loads(real("_quota.json").data)["lines"] == 50
