"""`output.format: openai_batch` on a real run (local Ray, reference engine, S3 over HTTP): the
OpenAI-format output and error files hold every custom_id exactly once, their usage adds up to
the manifest's totals, and exporting the same committed parts again gives the same bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.batch.driver.run import run_job
from tests.integration.s3_server import S3Server
from tests.integration.test_pipeline import make_spec, manifest_of, read_output

pytestmark = pytest.mark.timeout(300)


def _exports(server: S3Server, prefix: str) -> dict[str, bytes]:
    return {
        uri.rsplit("/", 1)[-1]: server.get(uri)
        for uri in server.list_uris(prefix)
        if uri.rsplit("/", 1)[-1].startswith(("openai-output-", "openai-errors-"))
    }


def _lines(files: dict[str, bytes], prefix: str) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for name in sorted(files)
        if name.startswith(prefix)
        for line in files[name].decode().splitlines()
    ]


def test_openai_batch_output_files(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path
) -> None:
    bucket = s3_server.make_bucket()
    lines: list[dict[str, Any]] = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions" if i % 2 else "/v1/completions",
            "body": {"model": "tiny", "max_tokens": 4}
            | (
                {"messages": [{"role": "user", "content": f"Tell me about {i} rivers."}]}
                if i % 2
                else {"prompt": f"Once upon {i} bridges"}
            ),
        }
        for i in range(7)
    ]
    lines[3]["body"] |= {"n": 3, "temperature": 1.0, "seed": 4}  # three choices for req-3
    lines.append({"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {}})
    lines.append({**lines[1]})  # a second req-1: a duplicate custom_id
    s3_server.put(f"s3://{bucket}/in.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    spec = make_spec(
        "openai-out",
        {
            "uri": f"s3://{bucket}/in.jsonl",
            "format": "openai_batch",
            "passthrough_columns": ["url"],
            "shard_bytes": 1024,  # a few shards, so the duplicate is found across parts
        },
        f"s3://{bucket}/out/",
        s3_server,
        tiny_model_dir,
        output={"format": "openai_batch"},
        limits={"max_error_fraction": 0.5},
    )
    result = run_job(spec)
    assert result.status == "complete", result.message
    prefix = spec.output.uri
    files = _exports(s3_server, prefix)
    ok, failed = _lines(files, "openai-output-"), _lines(files, "openai-errors-")
    custom_ids = sorted(x["custom_id"] for x in ok + failed)
    assert custom_ids == sorted(x["custom_id"] for x in lines)  # each line answered once
    assert sorted(x["custom_id"] for x in failed) == ["emb", "req-1"]
    codes = {x["custom_id"]: x["error"]["code"] for x in failed}
    assert codes == {"emb": "invalid_request", "req-1": "duplicate_custom_id"}
    assert all(x["response"] is None for x in failed)
    for line in ok:
        body = line["response"]["body"]
        number = int(line["custom_id"].split("-")[1])
        assert body["object"] == ("chat.completion" if number % 2 else "text_completion")
        assert body["model"] == "tiny" and line["response"]["status_code"] == 200
        choices = body["choices"]
        assert [c["index"] for c in choices] == list(range(3 if number == 3 else 1))
        assert body["usage"]["completion_tokens"] <= 4 * len(choices)
    # Usage adds up: the ok lines' usage is the ok rows' (a duplicate was generated before it
    # was marked, so the manifest's totals hold its tokens too, on its error row).
    table, _ = read_output(s3_server, prefix)
    rows = [r for r in table.to_pylist() if r["finish_reason"] != "error"]
    usages = [x["response"]["body"]["usage"] for x in ok]
    for field in ("prompt_tokens", "completion_tokens"):
        assert sum(u[field] for u in usages) == sum(r[field] for r in rows)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached == sum(r["cached_prompt_tokens"] for r in rows)
    assert sum(u["cost_usd"] for u in usages) == pytest.approx(sum(r["cost_usd"] for r in rows))
    totals = manifest_of(s3_server, prefix)["totals"]
    assert sum(u["completion_tokens"] for u in usages) <= totals["completion_tokens"]
    assert totals["rows"] == len(ok) + len(failed) and totals["rows_error"] == len(failed)
    names = [u.rsplit("/", 1)[-1] for u in s3_server.list_uris(prefix)]
    assert "_SUCCESS" in names

    # Exporting the same committed parts again (a rerun finds the job complete) gives the
    # same bytes.
    for name in files:
        s3_server.delete(f"{prefix}{name}")
    again = run_job(spec)
    assert again.status == "already_complete"
    assert _exports(s3_server, prefix) == files
