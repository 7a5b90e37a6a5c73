"""/v1/files and /v1/batches routes through the official `openai` client, in process: the
routes on a bare FastAPI app (Starlette's TestClient as the client's HTTP transport), files in
a temp directory, and a fake Ray Jobs API. The real job runs in tests/e2e/test_batch_api.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.testclient import TestClient

from pipeline.serve import batch_routes
from pipeline.serve.batches import BatchService
from pipeline.serve.files import validate_batch_input
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


def test_bad_uploads_name_the_lines(app: FastAPI) -> None:
    client = _client(app)
    bad = [
        _line(0),
        "{not json",
        _line(2, url="/v1/embeddings"),
        _line(0),
        _line(4, body={"messages": [{"role": "user", "content": "x"}]}),
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("bad.jsonl", _jsonl(bad)), purpose="batch")
    message = caught.value.message
    assert "4 invalid line(s)" in message
    assert "line 2: not valid JSON" in message
    assert "line 3: unsupported url '/v1/embeddings'" in message
    assert "line 4: duplicate custom_id 'req-0' (first on line 1)" in message
    assert "line 5: body.model must be a non-empty string" in message
    with pytest.raises(openai.APIStatusError) as too_large:
        client.files.create(
            file=("big.jsonl", _jsonl([_line(i) for i in range(60)])), purpose="batch"
        )
    assert too_large.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("in.jsonl", _jsonl([_line(0)])), purpose="fine-tune")


def test_validation_limits_lines() -> None:
    with pytest.raises(ApiError, match="more than 2 requests"):
        validate_batch_input(_jsonl([_line(i) for i in range(3)]), max_lines=2)
    with pytest.raises(ApiError, match="empty"):
        validate_batch_input(b"", max_lines=2)
    summary = validate_batch_input(_jsonl([_line(0), _line(1)]), max_lines=2)
    assert (summary.lines, summary.models, summary.urls) == (2, ["tiny"], ["/v1/chat/completions"])


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


def test_create_refuses_what_it_cannot_run(app: FastAPI) -> None:
    client = _client(app)

    def upload(lines: list[dict[str, Any]], key: str = "key-a") -> str:
        return _client(app, key).files.create(file=("f.jsonl", _jsonl(lines)), purpose="batch").id

    chat = upload([_line(0)])
    with pytest.raises(openai.BadRequestError, match="every line's url"):
        client.batches.create(
            input_file_id=chat, endpoint="/v1/completions", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(
            input_file_id=chat,
            endpoint="/v1/chat/completions",
            completion_window="1h",  # type: ignore[arg-type]
        )
    for model, match in (("nope", "does not exist"), ("online-only", "no batch section")):
        body = {"model": model, "messages": [{"role": "user", "content": "x"}]}
        file_id = upload([_line(0, body=body)])
        with pytest.raises(openai.BadRequestError, match=match):
            client.batches.create(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
            )
    restricted = upload([_line(0)], key="key-r")
    with pytest.raises(openai.BadRequestError, match="may not use it"):
        _client(app, "key-r").batches.create(
            input_file_id=restricted, endpoint="/v1/chat/completions", completion_window="24h"
        )


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
    spec = parse_job_spec(job_spec_data(batch.id, served, service.spec, "/in.jsonl", "/out"))
    assert spec.output.format == "openai_batch" and spec.input.passthrough_columns == ["url"]
    assert spec.model.display_name == "tiny" and spec.sampling.max_tokens == 8
    assert spec.cost.batch_discount == 0.5 and spec.limits.max_error_fraction == 1.0
