"""The Batch API with `/v1/embeddings` lines: the official client uploads them, creates a batch
for that endpoint and reads back one embeddings response body per line, equal to what the
endpoint answers for the same input; a line too long for the model is an error line."""

from __future__ import annotations

import json

import openai
import pytest

from tests.e2e.serve_fixtures import API_KEY, ServerProcess
from tests.e2e.test_batch_api import content_of, ray_head, server, wait_for

__all__ = ["ray_head", "server"]  # fixtures used from the other modules

pytestmark = pytest.mark.timeout(600)

TEXTS = [f"The river number {i} runs under the bridge." for i in range(4)]


def _line(i: int, text: str) -> dict:
    body = {"model": "tiny", "input": text, "encoding_format": "float"}
    return {"custom_id": f"emb-{i}", "method": "POST", "url": "/v1/embeddings", "body": body}


def test_embeddings_batch(server: ServerProcess) -> None:
    client = openai.OpenAI(api_key=API_KEY, base_url=server.api_url, max_retries=0, timeout=60)
    lines = [_line(i, t) for i, t in enumerate(TEXTS)] + [_line(9, "word " * 5000)]
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
    for i, text in enumerate(TEXTS):
        body = output[f"emb-{i}"]["response"]["body"]
        assert body["object"] == "list" and body["model"] == "tiny"
        direct = client.embeddings.create(model="tiny", input=text, encoding_format="float")
        got = body["data"][0]["embedding"]
        want = direct.data[0].embedding
        assert len(got) == len(want)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5
        assert body["usage"]["prompt_tokens"] == direct.usage.prompt_tokens
