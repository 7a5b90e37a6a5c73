"""The Batch API end to end: a `ray start --head` with the Jobs API (tests/e2e/test_submit.py's
head), `tokenmill serve` joined to it with a batch_api section, and the official `openai`
client uploading a file, creating a batch, polling it to completion and downloading the output
and error files. The batch runs as a real pipeline job submitted through the Jobs API.

Few tests, one server: each start (head, server, job) costs tens of seconds on two cores.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml
from openai.types import Batch

from tests.e2e import serve_fixtures
from tests.e2e.serve_fixtures import API_KEY, OTHER_KEY, ServerProcess, serve_config, start_server
from tests.e2e.test_submit import RayHead, ray_head

serve_model_dir = serve_fixtures.serve_model_dir
__all__ = ["ray_head", "serve_model_dir"]  # fixtures used from the other modules

pytestmark = pytest.mark.timeout(600)

BATCH_TIMEOUT_S = 300
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server(
    ray_head: RayHead, serve_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("batch-api")
    config = serve_config(serve_model_dir)
    tiny = config["models"][0]
    tiny["replicas"] = {"cpus_per_replica": 0.25, "max_ongoing_requests": 16}
    tiny["batch"] = {
        "max_tokens": MAX_TOKENS,
        "resources": {
            "num_actors": 1,
            "cpus_per_actor": 0.25,
            "batch_size": 4,
            "max_in_flight": 8,
        },
    }
    config["models"] = [tiny]  # one engine replica; the batch job brings its own actor
    config["name"] = "tokenmill-batch"
    config["batch_api"] = {"uri": str(root / "store"), "jobs_address": ray_head.address}
    path = root / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {
        "TOKENMILL_API_KEYS": f"{API_KEY},{OTHER_KEY}",
        # Join the head (its Jobs API runs the batches), with its token and venv.
        "RAY_ADDRESS": ray_head.gcs_address,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": ray_head.env["RAY_AUTH_TOKEN_PATH"],
        "PATH": ray_head.env["PATH"],
    }
    proc = start_server(path, env, [])
    yield proc
    proc.stop()
    (root / "server.log").write_text("".join(proc.lines))


def _request(i: int, content: str, max_tokens: int = MAX_TOKENS) -> dict:
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "tiny",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    }


def _wait(
    client: openai.OpenAI, batch: Batch, statuses: tuple[str, ...]
) -> tuple[Batch, list[str]]:
    """Poll until the batch is in one of `statuses`; the batch and the statuses seen."""
    started = time.monotonic()
    seen = [batch.status]
    while batch.status not in statuses:
        assert time.monotonic() - started < BATCH_TIMEOUT_S, f"stuck in {seen}"
        time.sleep(1)
        batch = client.batches.retrieve(batch.id)
        if batch.status != seen[-1]:
            seen.append(batch.status)
    print(f"batch {batch.id}: {seen} in {time.monotonic() - started:.0f} s")
    return batch, seen


def _content(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_batch_end_to_end(server: ServerProcess) -> None:
    client = openai.OpenAI(api_key=API_KEY, base_url=server.api_url, max_retries=0, timeout=60)
    requests = [_request(i, f"Tell me about river number {i}.") for i in range(5)]
    # Valid as a request, too long for the model's context: an error line, not a failed batch.
    requests.append(_request(5, "word " * 5000))
    data = "".join(json.dumps(r) + "\n" for r in requests).encode()
    uploaded = client.files.create(file=("requests.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"suite": "e2e"},
    )
    batch, seen = _wait(client, batch, ("completed", "failed", "cancelled", "expired"))
    assert batch.status == "completed", (batch.errors, "".join(server.lines[-40:]))
    assert "in_progress" in seen
    counts = batch.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (6, 5, 1)
    assert batch.metadata is not None and batch.metadata["suite"] == "e2e"
    assert float(batch.metadata["tokenmill_cost_usd"]) > 0

    assert batch.output_file_id and batch.error_file_id
    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    ids = [x["custom_id"] for x in output + errors]
    assert sorted(ids) == sorted(r["custom_id"] for r in requests)  # each exactly once
    assert [x["custom_id"] for x in errors] == ["req-5"]
    assert errors[0]["response"] is None and "too long" in errors[0]["error"]["message"]
    for line in output:
        body = line["response"]["body"]
        usage = body["usage"]
        assert body["object"] == "chat.completion" and body["model"] == "tiny"
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert 0 < usage["completion_tokens"] <= MAX_TOKENS
        assert usage["cost_usd"] > 0 and "cached_tokens" in usage["prompt_tokens_details"]
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"

    # Greedy: the batch's answer is the endpoint's answer to the same request.
    direct = client.chat.completions.create(**requests[0]["body"])
    by_id = {x["custom_id"]: x["response"]["body"] for x in output}
    assert by_id["req-0"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
    assert by_id["req-0"]["usage"]["prompt_tokens"] == direct.usage.prompt_tokens  # type: ignore[union-attr]

    # Another key sees none of it.
    other = openai.OpenAI(api_key=OTHER_KEY, base_url=server.api_url, max_retries=0)
    assert list(other.batches.list()) == [] and list(other.files.list()) == []
    for call in (
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
        lambda: other.files.content(batch.output_file_id or ""),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert [b.id for b in client.batches.list()] == [batch.id]


def test_cancel_mid_run_keeps_what_finished(server: ServerProcess) -> None:
    client = openai.OpenAI(api_key=API_KEY, base_url=server.api_url, max_retries=0, timeout=60)
    # Long enough that the cancel lands while most requests are still to run.
    requests = [_request(i, f"Write a long story about boat {i}.", 250) for i in range(1500)]
    data = "".join(json.dumps(r) + "\n" for r in requests).encode()
    uploaded = client.files.create(file=("long.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch, _ = _wait(client, batch, ("in_progress", "finalizing", "completed", "failed"))
    started = time.monotonic()
    while batch.status == "in_progress" and not (
        batch.request_counts and batch.request_counts.completed
    ):
        assert time.monotonic() - started < BATCH_TIMEOUT_S, "no part committed"
        time.sleep(1)  # until a first part is committed (output.flush_interval_s)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "in_progress", batch.status
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    batch, seen = _wait(client, batch, ("cancelled", "completed", "failed"))
    assert batch.status == "cancelled", (seen, batch.errors)
    output = _content(client, batch.output_file_id)
    errors = _content(client, batch.error_file_id)
    ids = [x["custom_id"] for x in output + errors]
    assert len(ids) == len(set(ids)), "no request is in both files, or twice"
    assert 0 < len(ids) < len(requests), "it kept what finished, and stopped the rest"
    counts = batch.request_counts
    assert counts is not None
    assert (counts.completed, counts.failed) == (len(output), len(errors))
    assert all(x["response"]["body"]["usage"]["completion_tokens"] > 0 for x in output)
