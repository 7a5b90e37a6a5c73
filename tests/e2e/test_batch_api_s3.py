"""The Batch API on s3:// storage (moto's S3 server speaking the real protocol,
tests/integration/s3_server.py), with a short completion window from the serve file: a batch
that completes, its files and records in the bucket, and a batch that expires keeping what
finished. Its own head and server (tests/e2e/test_batch_api.py's), since the serve file
differs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.ray_head import RayHead, running_ray_head
from tests.e2e.serve_fixtures import ServerProcess
from tests.e2e.test_batch_api import (
    TERMINAL,
    client_of,
    content_of,
    engine_step_delay,
    request_line,
    start_batch_server,
    wait_for,
)
from tests.integration.s3_server import S3Server, running_s3_server

# In the slow set (its own head and server: two minutes and more on a slow machine): the Batch
# API's flow runs in the default suite on local storage (test_batch_api.py), uploads to the S3
# server in tests/integration/test_batch_uploads_s3.py, and an OpenAI batch job reading and
# writing the S3 server in tests/integration/test_pipeline.py.
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

# Long enough for a small batch to complete (~20 s on two idle cores), short enough that a
# long one expires within the test.
WINDOW_S = 45


@pytest.fixture(scope="module", autouse=True)
def s3() -> Iterator[S3Server]:
    # Autouse, so it comes first: the head (and so the ingress and the batch jobs) starts with
    # the dummy AWS credentials in its environment.
    with running_s3_server() as server:
        yield server


@pytest.fixture(scope="module", autouse=True)
def slow_engine() -> Iterator[None]:
    # Autouse like s3, so the head starts with it: 100 ms after every engine step of the batch
    # jobs, so the long batch cannot finish inside the window on any machine.
    with engine_step_delay(0.1):
        yield


@pytest.fixture(scope="module")
def ray_head(s3: S3Server, slow_engine: None) -> Iterator[RayHead]:
    """A head of this module's own (not the shared one): started after s3 and slow_engine, it
    and its jobs see the S3 server's credentials and the 100 ms step delay."""
    with running_ray_head() as head:
        yield head


@pytest.fixture(scope="module")
def bucket(s3: S3Server) -> str:
    return s3.make_bucket("batches")


@pytest.fixture(scope="module")
def server(
    s3: S3Server,
    bucket: str,
    ray_head: RayHead,
    serve_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("batch-api-s3")
    batch_api = {"uri": f"s3://{bucket}/tokenmill", "completion_window_s": WINDOW_S}
    storage = {"storage": {"endpoint_url": s3.endpoint_url}}
    proc = start_batch_server(ray_head, serve_model_dir, root, batch_api, storage)
    yield proc
    proc.stop()
    (root / "server.log").write_text("".join(proc.lines))


def test_batch_on_s3(server: ServerProcess, s3: S3Server, bucket: str) -> None:
    client = client_of(server)
    requests = [request_line(i, f"Name a colour, {i}.") for i in range(4)]
    data = "".join(json.dumps(r) + "\n" for r in requests).encode()
    file_id = client.files.create(file=("in.jsonl", data), purpose="batch").id
    assert client.files.content(file_id).content == data
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.expires_at == batch.created_at + WINDOW_S  # the serve file's window
    batch, seen = wait_for(client, batch, TERMINAL)
    assert batch.status == "completed", (seen, batch.errors, "".join(server.lines[-40:]))
    output = content_of(client, batch.output_file_id)
    assert sorted(x["custom_id"] for x in output) == sorted(r["custom_id"] for r in requests)
    assert [b.id for b in client.batches.list()] == [batch.id]
    stored = s3.list_uris(f"s3://{bucket}/tokenmill/")
    names = [u.rsplit("/", 1)[-1] for u in stored]
    # The upload, the batch record and the job's output all live in the bucket.
    assert f"{file_id}.jsonl" in names and f"{batch.id}.json" in names
    assert "_manifest.json" in names and any(n.startswith("openai-output-") for n in names)


# In the slow set (a minute here): a batch's window is checked against the Batch API in
# tests/unit/test_batch_api.py, and a job that stops itself at stop_at with what finished in
# tests/integration/test_pipeline.py.
@pytest.mark.slow
def test_expired_batch_keeps_what_finished(server: ServerProcess) -> None:
    client = client_of(server)
    # Far more than the window allows (the cancel test's load).
    requests = [request_line(i, f"Write a long story about boat {i}.", 250) for i in range(1500)]
    data = "".join(json.dumps(r) + "\n" for r in requests).encode()
    file_id = client.files.create(file=("long.jsonl", data), purpose="batch").id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch, seen = wait_for(client, batch, TERMINAL)
    assert batch.status == "expired", (seen, batch.errors)
    assert "in_progress" in seen and batch.expired_at is not None
    assert batch.expired_at >= batch.expires_at
    assert time.time() >= batch.expires_at
    output = content_of(client, batch.output_file_id)
    errors = content_of(client, batch.error_file_id)
    ids = [x["custom_id"] for x in output + errors]
    assert len(ids) == len(set(ids)), "no request is in both files, or twice"
    assert 0 < len(ids) < len(requests), "it kept what finished, and stopped the rest"
    counts = batch.request_counts
    assert counts is not None and (counts.completed, counts.failed) == (len(output), len(errors))
