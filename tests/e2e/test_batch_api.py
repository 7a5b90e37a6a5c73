"""The Batch API end to end: a `ray start --head` with the Jobs API (tests/e2e/conftest.py's
shared head, its engines slowed by 10 ms a step), `tokenmill serve` joined to it with a
batch_api section, and the official `openai` client uploading a file, creating a batch, polling
it to completion and downloading the output and error files. The batch runs as a real pipeline
job submitted through the Jobs API. Chat lines (with a LoRA adapter's among them) and
embeddings lines.

Few tests, one server: each start (head, server, job) costs tens of seconds on two cores.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from openai.types import Batch

from engines import faults
from pipeline.serve.batch_api.batches import RESUME_KEY
from tests.e2e.ray_head import RayHead
from tests.e2e.serve_fixtures import API_KEY, OTHER_KEY, ServerProcess, serve_config, start_server

pytestmark = pytest.mark.timeout(600)

BATCH_TIMEOUT_S = 300
MAX_TOKENS = 6


MAX_FILE_BYTES = 1 << 20
TERMINAL = ("completed", "failed", "cancelled", "expired")
FORWARD = ["validating", "in_progress", "finalizing", "completed"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
TOOL_TOKENS = 120  # enough for a call's JSON in the tiny model's tokens


def start_batch_server(
    ray_head: RayHead,
    model_dir: Path,
    root: Path,
    batch_api: dict,
    extra: dict | None = None,
    adapters: dict[str, Path] | None = None,
) -> ServerProcess:
    """`tokenmill serve` joined to the head, one model with a batch section, and `batch_api`
    (plus `extra` top-level sections of the serve file, and the model's LoRA `adapters`)."""
    config = serve_config(model_dir, adapters)
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
    config["batch_api"] = {"jobs_address": ray_head.address, **batch_api}
    config.update(extra or {})
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
    return start_server(path, env, [])


@contextlib.contextmanager
def engine_step_delay(seconds: float) -> Iterator[None]:
    """The engine test hook's step delay in this process's environment (a Ray head started
    inside inherits it, and so do its batch jobs and their engines)."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in faults.step_delay_env(seconds).items():
            patch.setenv(name, value)
        yield


@pytest.fixture(scope="module")
def server(
    ray_head: RayHead,
    serve_model_dir: Path,
    serve_adapters: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("batch-api")
    batch_api = {"uri": str(root / "store"), "max_file_bytes": MAX_FILE_BYTES}
    proc = start_batch_server(ray_head, serve_model_dir, root, batch_api, adapters=serve_adapters)
    yield proc
    proc.stop()
    (root / "server.log").write_text("".join(proc.lines))


def client_of(server: ServerProcess, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=server.api_url, max_retries=0, timeout=60)


def _upload(client: openai.OpenAI, requests: list, name: str = "requests.jsonl") -> str:
    lines = (r if isinstance(r, str) else json.dumps(r) for r in requests)
    data = "".join(line + "\n" for line in lines).encode()
    return client.files.create(file=(name, data), purpose="batch").id


def _create(client: openai.OpenAI, file_id: str, **extra: Any) -> Batch:
    return client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h", **extra
    )


def request_line(i: int, content: str, max_tokens: int = MAX_TOKENS) -> dict:
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


def wait_for(
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


def content_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_batch_end_to_end(server: ServerProcess) -> None:
    client = openai.OpenAI(api_key=API_KEY, base_url=server.api_url, max_retries=0, timeout=60)
    requests = [request_line(i, f"Tell me about river number {i}.") for i in range(5)]
    # Valid as a request, too long for the model's context: an error line, not a failed batch.
    requests.append(request_line(5, "word " * 5000))
    # Two lines for a LoRA adapter of the model: one batch runs the model and its adapters.
    for i in (6, 7):
        requests.append(request_line(i, f"Tell me about river number {i}."))
        requests[-1]["body"]["model"] = "tiny-qv"
    # A line with tools and a named choice: its answer is the call, in OpenAI's shape.
    requests.append(request_line(8, "What is the weather in Paris?", max_tokens=TOOL_TOKENS))
    requests[-1]["body"].update(tools=[WEATHER], tool_choice=NAMED_WEATHER)
    data = "".join(json.dumps(r) + "\n" for r in requests).encode()
    uploaded = client.files.create(file=("requests.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"suite": "e2e"},
    )
    batch, seen = wait_for(client, batch, ("completed", "failed", "cancelled", "expired"))
    assert batch.status == "completed", (batch.errors, "".join(server.lines[-40:]))
    assert "in_progress" in seen
    counts = batch.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (9, 8, 1)
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
        model = "tiny-qv" if line["custom_id"] in ("req-6", "req-7") else "tiny"
        assert body["object"] == "chat.completion" and body["model"] == model
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        limit = TOOL_TOKENS if line["custom_id"] == "req-8" else MAX_TOKENS
        assert 0 < usage["completion_tokens"] <= limit
        assert usage["cost_usd"] > 0 and "cached_tokens" in usage["prompt_tokens_details"]
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"

    # Greedy: the batch's answer is the endpoint's answer to the same request.
    direct = client.chat.completions.create(**requests[0]["body"])
    by_id = {x["custom_id"]: x["response"]["body"] for x in output}
    assert by_id["req-0"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
    assert by_id["req-0"]["usage"]["prompt_tokens"] == direct.usage.prompt_tokens  # type: ignore[union-attr]
    # And an adapter's line is the endpoint's answer with that adapter (not the model's).
    adapted = client.chat.completions.create(**requests[6]["body"])
    assert by_id["req-6"]["choices"][0]["message"]["content"] == adapted.choices[0].message.content
    plain = client.chat.completions.create(**{**requests[6]["body"], "model": "tiny"})
    assert adapted.choices[0].message.content != plain.choices[0].message.content
    # The tool line: the endpoint's call (the id is the batch's own, stable for the row).
    called = by_id["req-8"]["choices"][0]
    assert called["finish_reason"] == "tool_calls" and called["message"]["content"] is None
    (call,) = called["message"]["tool_calls"]
    (same,) = client.chat.completions.create(**requests[8]["body"]).choices[0].message.tool_calls
    assert call["function"] == {"name": "get_weather", "arguments": same.function.arguments}
    assert call["id"].startswith("call_") and call["id"] != same.id

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


# In the slow set: test_cancel_then_resume_or_resubmit_loses_nothing below cancels a batch
# mid-run the same way and checks what it kept before resuming it.
@pytest.mark.slow
def test_cancel_mid_run_keeps_what_finished(server: ServerProcess) -> None:
    client = openai.OpenAI(api_key=API_KEY, base_url=server.api_url, max_retries=0, timeout=60)
    # Long enough that the cancel lands while most requests are still to run.
    requests = [request_line(i, f"Write a long story about boat {i}.", 250) for i in range(1500)]
    data = "".join(json.dumps(r) + "\n" for r in requests).encode()
    uploaded = client.files.create(file=("long.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch, _ = wait_for(client, batch, ("in_progress", "finalizing", "completed", "failed"))
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
    batch, seen = wait_for(client, batch, ("cancelled", "completed", "failed"))
    assert batch.status == "cancelled", (seen, batch.errors)
    output = content_of(client, batch.output_file_id)
    errors = content_of(client, batch.error_file_id)
    ids = [x["custom_id"] for x in output + errors]
    assert len(ids) == len(set(ids)), "no request is in both files, or twice"
    assert 0 < len(ids) < len(requests), "it kept what finished, and stopped the rest"
    counts = batch.request_counts
    assert counts is not None
    assert (counts.completed, counts.failed) == (len(output), len(errors))
    assert all(x["response"]["body"]["usage"]["completion_tokens"] > 0 for x in output)


def test_bad_file_fails_during_validating(server: ServerProcess) -> None:
    client = client_of(server)
    nope = request_line(4, "x")
    nope["body"]["model"] = "nope"
    completion = {**request_line(2, "x"), "url": "/v1/completions"}
    completion["body"] = {"model": "tiny", "prompt": "x"}
    lines = [request_line(0, "a"), "{oops", completion, request_line(0, "b"), nope]
    # As OpenAI: the upload is accepted, the batch goes validating -> failed naming the lines.
    batch = _create(client, _upload(client, lines, "bad.jsonl"))
    assert batch.status == "validating"
    batch, seen = wait_for(client, batch, TERMINAL)
    assert seen == ["validating", "failed"] and batch.failed_at is not None
    assert batch.errors is not None and batch.errors.data is not None
    assert [(e.line, e.code) for e in batch.errors.data] == [
        (2, "invalid_json_line"),
        (3, "url_mismatch"),
        (4, "duplicate_custom_id"),
        (5, "model_not_found"),
    ]
    assert batch.output_file_id is None and batch.error_file_id is None
    with pytest.raises(openai.BadRequestError) as too_large:  # 400 at upload, as OpenAI
        client.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch")
    assert too_large.value.code == "file_too_large"


def _cancel_after_first_part(client: openai.OpenAI, batch: Batch) -> Batch:
    """Cancel once a first part is committed; the cancelled batch."""
    batch, _ = wait_for(client, batch, ("in_progress", "finalizing", *TERMINAL))
    started = time.monotonic()
    while batch.status == "in_progress" and not (
        batch.request_counts and batch.request_counts.completed
    ):
        assert time.monotonic() - started < BATCH_TIMEOUT_S, "no part committed"
        time.sleep(1)  # until a first part is committed (output.flush_interval_s)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "in_progress", batch.status
    assert client.batches.cancel(batch.id).status == "cancelling"
    batch, seen = wait_for(client, batch, TERMINAL)
    assert batch.status == "cancelled", (seen, batch.errors)
    return batch


def _ids(client: openai.OpenAI, batch: Batch) -> tuple[list[dict], list[str]]:
    """The batch's output lines, and the custom_ids of both files (each at most once)."""
    output = content_of(client, batch.output_file_id)
    errors = content_of(client, batch.error_file_id)
    ids = [x["custom_id"] for x in output + errors]
    assert len(ids) == len(set(ids)), "no request is in both files, or twice"
    return output, ids


# Slow (100 s): by default a real cancel is test_cancel_mid_run_keeps_what_finished, and
# resuming into the stopped batch's output tests/unit/test_batch_api.py's resume tests.
@pytest.mark.slow
def test_cancel_then_resume_or_resubmit_loses_nothing(server: ServerProcess) -> None:
    client = client_of(server)
    # Long enough that the cancel lands mid-run: at most 8 requests in flight and 10 ms after
    # every step make a whole run take 200 / 8 * 100 steps, over 25 s on any machine, while the
    # first part is committed after the 10 s flush interval (and the cancel a poll later).
    requests = [request_line(i, f"Write a story about lake {i}.", 100) for i in range(200)]
    every = sorted(r["custom_id"] for r in requests)
    file_id = _upload(client, requests)
    cancelled = _cancel_after_first_part(client, _create(client, file_id))
    first_output, first_ids = _ids(client, cancelled)
    assert 0 < len(first_ids) < len(requests), "it kept what finished, and stopped the rest"
    counts = cancelled.request_counts
    assert counts is not None
    assert (counts.completed, counts.failed) == (
        len(first_output),
        len(first_ids) - len(first_output),
    )
    assert all(x["response"]["body"]["usage"]["completion_tokens"] > 0 for x in first_output)

    # Both at once: one resumes the cancelled batch, one starts the same file afresh.
    resumed = _create(client, file_id, metadata={RESUME_KEY: cancelled.id})
    fresh = _create(client, file_id)
    for batch in (resumed, fresh):
        batch, seen = wait_for(client, batch, TERMINAL)
        assert batch.status == "completed", (seen, batch.errors)
        assert seen == sorted(seen, key=FORWARD.index)  # never finalizing on the old manifest
        output, ids = _ids(client, batch)
        assert sorted(ids) == every  # each request exactly once across the two files
        counts = batch.request_counts
        assert counts is not None and (counts.completed, counts.failed) == (len(output), 0)
        if batch.id == resumed.id:
            # What the cancelled batch finished was kept, not run again: the same lines.
            lines = {json.dumps(x, sort_keys=True) for x in output}
            assert all(json.dumps(x, sort_keys=True) in lines for x in first_output)


# --- /v1/embeddings lines: one embeddings body per line, equal to the endpoint's answer; a
# line too long for the model is an error line --------------------------------------------

EMBED_TEXTS = [f"The river number {i} runs under the bridge." for i in range(4)]


def _embeddings_line(i: int, text: str) -> dict:
    body = {"model": "tiny", "input": text, "encoding_format": "float"}
    return {"custom_id": f"emb-{i}", "method": "POST", "url": "/v1/embeddings", "body": body}


def test_embeddings_batch(server: ServerProcess) -> None:
    client = openai.OpenAI(api_key=API_KEY, base_url=server.api_url, max_retries=0, timeout=60)
    lines = [_embeddings_line(i, t) for i, t in enumerate(EMBED_TEXTS)] + [
        _embeddings_line(9, "word " * 5000)
    ]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    uploaded = client.files.create(file=("embeddings.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    batch, _ = wait_for(client, batch, ("completed", "failed", "cancelled", "expired"))
    assert batch.status == "completed", (batch.errors, "".join(server.lines[-40:]))
    counts = batch.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (5, 4, 1)
    output = {x["custom_id"]: x for x in content_of(client, batch.output_file_id)}
    errors = content_of(client, batch.error_file_id)
    assert [x["custom_id"] for x in errors] == ["emb-9"]
    assert "too long" in errors[0]["error"]["message"]
    for i, text in enumerate(EMBED_TEXTS):
        body = output[f"emb-{i}"]["response"]["body"]
        assert body["object"] == "list" and body["model"] == "tiny"
        direct = client.embeddings.create(model="tiny", input=text, encoding_format="float")
        got = body["data"][0]["embedding"]
        want = direct.data[0].embedding
        assert len(got) == len(want)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5
        assert body["usage"]["prompt_tokens"] == direct.usage.prompt_tokens


RAIN = {
    "type": "object",
    "properties": {"rain": {"type": "boolean"}},
    "required": ["rain"],
    "additionalProperties": False,
}


def _responses_line(i: int, **body: Any) -> dict:
    body = {"model": "tiny", "max_output_tokens": MAX_TOKENS, "temperature": 0, **body}
    return {"custom_id": f"resp-{i}", "method": "POST", "url": "/v1/responses", "body": body}


def test_responses_batch(server: ServerProcess) -> None:
    """A batch of /v1/responses lines: every line once, Responses in the output file, each the
    endpoint's answer to the same request; a line that needs storage fails validating."""
    client = client_of(server)
    lines = [
        _responses_line(0, input="Tell me about river number 0."),
        _responses_line(1, input="Tell me about rivers.", instructions="Be brief."),
        _responses_line(
            2,
            input=[{"role": "user", "content": [{"type": "input_text", "text": "A river?"}]}],
            text={"format": {"type": "json_schema", "name": "rain", "schema": RAIN}},
            max_output_tokens=60,
        ),
        _responses_line(  # tools: the answer is a function_call item
            3,
            input="Weather in Rome?",
            tools=[{"type": "function", **WEATHER["function"]}],
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=TOOL_TOKENS,
        ),
    ]
    batch = client.batches.create(
        input_file_id=_upload(client, lines), endpoint="/v1/responses", completion_window="24h"
    )
    batch, _ = wait_for(client, batch, ("completed", "failed", "cancelled", "expired"))
    assert batch.status == "completed", (batch.errors, "".join(server.lines[-40:]))
    output = {
        x["custom_id"]: x["response"]["body"] for x in content_of(client, batch.output_file_id)
    }
    assert sorted(output) == ["resp-0", "resp-1", "resp-2", "resp-3"]
    assert batch.error_file_id is None
    for i in range(3):
        body = output[f"resp-{i}"]
        assert body["object"] == "response" and body["id"].startswith("resp_")
        direct = client.responses.create(**lines[i]["body"])
        assert body["output"][-1]["content"][0]["text"] == direct.output_text
        assert body["usage"]["input_tokens"] == direct.usage.input_tokens
        assert body["status"] == direct.status
    answer = json.loads(output["resp-2"]["output"][-1]["content"][0]["text"])
    assert isinstance(answer["rain"], bool)  # text.format honoured
    (call,) = output["resp-3"]["output"]
    direct_call = client.responses.create(**lines[3]["body"]).output[-1]
    assert call["type"] == direct_call.type == "function_call"
    assert (call["name"], call["arguments"]) == (direct_call.name, direct_call.arguments)
    assert call["call_id"].startswith("call_") and call["status"] == "completed"

    stateful = _responses_line(4, input="Remember me.", previous_response_id="resp_earlier")
    batch = client.batches.create(
        input_file_id=_upload(client, [stateful]), endpoint="/v1/responses", completion_window="24h"
    )
    batch, _ = wait_for(client, batch, ("completed", "failed", "cancelled", "expired"))
    assert batch.status == "failed" and batch.errors is not None
    assert "previous_response_id" in batch.errors.data[0].message
