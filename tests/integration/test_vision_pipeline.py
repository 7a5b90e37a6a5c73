"""Images in batch jobs: a Parquet input with an image column (PNG bytes, s3:// URIs, a few
corrupt, truncated, missing or unsupported images, a text-only row) on the S3 server, run
through `run_job` on the tiny Qwen2.5-VL: every row committed exactly once, the good rows'
greedy ids equal to transformers' for the same image, error rows naming the column and the
cause; chats with image_url parts (a data: URL) in a JSONL job; and images sent to a text
model refused per row."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engines.api import GenerationRequest, SamplingParams
from pipeline.batch.driver.run import run_job
from pipeline.media.process import VisionProcessor
from tests.engine_fixtures import tiny_model
from tests.integration.s3_server import S3Server
from tests.integration.test_pipeline import assert_exactly_once, make_spec, read_output
from tests.vision_fixtures import hf_vision_greedy, random_images

pytestmark = pytest.mark.timeout(600)

TEXT = "describe the picture"


def _png(image: Any, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def _expected(model_dir: Path, images: list[Any], max_tokens: int) -> list[list[int]]:
    """transformers' greedy ids for TEXT after each image, rendered as the job renders it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = VisionProcessor(model_dir)
    parts = [{"type": "image"}, {"type": "text", "text": TEXT}]
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer.encode(ids, add_special_tokens=False)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = []
    for image in images:
        inputs = (processor.process(image),)
        requests.append(GenerationRequest(processor.expand(ids, inputs), sampling, images=inputs))
    return hf_vision_greedy(model_dir, requests)


def test_parquet_image_column_on_s3(ray_local: Any, s3_server: S3Server) -> None:
    model = tiny_model("qwen2_5_vl")
    images = random_images()
    bucket = s3_server.make_bucket()
    s3_server.put(f"s3://{bucket}/img/b.png", _png(images[1]))
    s3_server.put(f"s3://{bucket}/img/c.jpg", _png(images[2], "JPEG"))
    jpeg = _png(images[0], "JPEG")
    cells: dict[str, Any] = {
        "bytes-0": _png(images[0]),
        "uri-1": f"s3://{bucket}/img/b.png",
        "none": None,  # a text-only row: no image part
        "corrupt": b"\x89PNG\r\n\x1a\n" + b"\x00" * 64,
        "truncated": jpeg[: len(jpeg) // 2],
        "missing": f"s3://{bucket}/img/nope.png",
        "svg": b"<svg xmlns='http://www.w3.org/2000/svg'/>",
        "bytes-0-again": _png(images[0]),
    }
    table = pa.table(
        {
            "id": list(cells),
            "text": [TEXT] * len(cells),
            # Bytes in one column, URIs in another (a row fills one of them).
            "image": pa.array(
                [c if isinstance(c, bytes) else None for c in cells.values()], type=pa.binary()
            ),
            "image_uri": pa.array(
                [c if isinstance(c, str) else None for c in cells.values()], type=pa.string()
            ),
        }
    )
    sink = io.BytesIO()
    pq.write_table(table, sink)
    s3_server.put(f"s3://{bucket}/in/images.parquet", sink.getvalue())
    spec = make_spec(
        "vision-parquet",
        {
            "uri": f"s3://{bucket}/in/images.parquet",
            "format": "parquet",
            "id_column": "id",
            "prompt_column": "text",
            "image_columns": ["image", "image_uri"],
        },
        f"s3://{bucket}/out/",
        s3_server,
        model,
        limits={"max_error_fraction": 0.6},
        output={"include_token_ids": True},
    )
    result = run_job(spec)
    assert result.status == "complete"
    out, _ = read_output(s3_server, spec.output.uri)
    assert_exactly_once(out, list(cells))
    rows = {r["id"]: r for r in out.to_pylist()}
    assert "_images" not in out.column_names  # pixels never reach the output

    expected = _expected(model, [images[0], images[1]], spec.sampling.max_tokens)
    assert rows["bytes-0"]["completion_token_ids"] == expected[0]
    assert rows["bytes-0-again"]["completion_token_ids"] == expected[0]
    assert rows["uri-1"]["completion_token_ids"] == expected[1]
    # Image tokens are prompt tokens, counted and charged.
    assert rows["bytes-0"]["prompt_tokens"] > rows["none"]["prompt_tokens"] + 6
    assert rows["bytes-0"]["cost_usd"] > rows["none"]["cost_usd"]
    assert rows["none"]["error"] is None

    def error(name: str) -> str:
        return rows[name]["error"] or ""

    for name in ("corrupt", "truncated", "svg"):
        assert "column 'image'" in error(name), rows[name]
    assert "column 'image_uri'" in error("missing")
    assert "not an image" in error("corrupt")
    assert "truncated" in error("truncated")
    assert "no such image" in error("missing")
    assert "not an image" in error("svg")


def test_chat_image_parts_and_text_models(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path
) -> None:
    images = random_images()
    url = "data:image/png;base64," + base64.b64encode(_png(images[2])).decode()
    chat = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": TEXT},
            ],
        }
    ]
    lines = [
        {"id": "chat", "messages": chat},
        {"id": "too-many", "messages": [{**chat[0], "content": chat[0]["content"] * 3}]},
        {
            "id": "remote",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                        {"type": "text", "text": TEXT},
                    ],
                }
            ],
        },
        {"id": "plain", "messages": [{"role": "user", "content": TEXT}]},
    ]
    results = {}
    for name, model in (("vl", tiny_model("qwen2_5_vl")), ("text", tiny_model_dir)):
        bucket = s3_server.make_bucket()
        s3_server.put(f"s3://{bucket}/in/c.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
        spec = make_spec(
            f"vision-chat-{name}",
            {
                "uri": f"s3://{bucket}/in/c.jsonl",
                "format": "jsonl",
                "id_column": "id",
                "messages_column": "messages",
            },
            f"s3://{bucket}/out/",
            s3_server,
            model,
            limits={"max_error_fraction": 0.8},
            prompt={"images": {"max_images": 2}},
        )
        assert run_job(spec).status == "complete"
        out, _ = read_output(s3_server, spec.output.uri)
        assert_exactly_once(out, [x["id"] for x in lines])
        results[name] = {r["id"]: r for r in out.to_pylist()}
    vl, text = results["vl"], results["text"]
    assert vl["chat"]["error"] is None and vl["plain"]["error"] is None
    assert vl["chat"]["prompt_tokens"] > vl["plain"]["prompt_tokens"] + 30  # 35 image tokens
    assert "3 images; at most 2" in vl["too-many"]["error"]
    assert "messages[0].content[0]" in vl["remote"]["error"]
    assert "http_hosts" in vl["remote"]["error"]
    assert "text-only model" in text["chat"]["error"]
    assert text["plain"]["error"] is None


def test_processor_rows_with_images(ray_local: Any) -> None:
    """The Dataset face: image bytes in a column and chats with a data: URL, through
    build_processor on the tiny Qwen2.5-VL; answers equal transformers' for the same image."""
    import ray.data

    from pipeline.data import build_processor

    model = tiny_model("qwen2_5_vl")
    images = random_images()
    url = "data:image/png;base64," + base64.b64encode(_png(images[1])).decode()
    config = {
        "input": {"id_column": "id", "prompt_column": "text", "image_columns": ["image"]},
        "model": {"path": str(model)},
        "engine": {"kind": "reference", "device": "cpu", "max_batch_size": 8},
        "sampling": {"max_tokens": 5, "temperature": 0.0},
        "resources": {"cpus_per_actor": 0.25, "batch_size": 4},
        "include_token_ids": True,
    }
    ds = ray.data.from_items(
        [
            {"id": "a", "text": TEXT, "image": _png(images[0])},
            {"id": "b", "text": TEXT, "image": _png(images[1])},
            {"id": "bad", "text": TEXT, "image": b"GIF89a-not-really"},
        ]
    )
    rows = {r["id"]: r for r in build_processor(config)(ds).take_all()}
    expected = _expected(model, images[:2], 5)
    assert rows["a"]["completion_token_ids"] == expected[0]
    assert rows["b"]["completion_token_ids"] == expected[1]
    assert "column 'image'" in rows["bad"]["error"]
    chats = build_processor({**config, "input": {"id_column": "id", "messages_column": "messages"}})
    chat = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": TEXT},
            ],
        }
    ]
    (row,) = chats(ray.data.from_items([{"id": "c", "messages": chat}])).take_all()
    assert row["completion_token_ids"] == expected[1]


def test_openai_batch_lines_with_images(ray_local: Any, s3_server: S3Server) -> None:
    """Batch API lines carry images as image_url parts (input_image parts in /v1/responses
    lines); the export lines are OpenAI's."""
    model = tiny_model("qwen2_5_vl")
    images = random_images()
    url = "data:image/png;base64," + base64.b64encode(_png(images[0])).decode()
    broken = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"1" * 30).decode()

    def line(i: str, image_url: str) -> dict[str, Any]:
        content = [
            {"type": "image_url", "image_url": {"url": image_url}},
            {"type": "text", "text": TEXT},
        ]
        body = {"model": "tiny", "messages": [{"role": "user", "content": content}]}
        return {"custom_id": i, "method": "POST", "url": "/v1/chat/completions", "body": body}

    # The Responses API's form of the good line: input_image, then input_text.
    responses_content = [
        {"type": "input_image", "image_url": url},
        {"type": "input_text", "text": TEXT},
    ]
    responses = {
        "custom_id": "responses",
        "method": "POST",
        "url": "/v1/responses",
        "body": {"model": "tiny", "input": [{"role": "user", "content": responses_content}]},
    }
    lines = [line("good", url), line("broken", broken), responses]
    bucket = s3_server.make_bucket()
    s3_server.put(f"s3://{bucket}/in/b.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    spec = make_spec(
        "vision-batch-api",
        {
            "uri": f"s3://{bucket}/in/b.jsonl",
            "format": "openai_batch",
            "passthrough_columns": ["url"],
        },
        f"s3://{bucket}/out/",
        s3_server,
        model,
        limits={"max_error_fraction": 0.6},
        output={"format": "openai_batch", "include_token_ids": True},
    )
    assert run_job(spec).status == "complete"
    out, names = read_output(s3_server, spec.output.uri)
    assert_exactly_once(out, ["good", "broken", "responses"])
    rows = {r["id"]: r for r in out.to_pylist()}
    assert rows["good"]["completion_token_ids"] == _expected(model, images[:1], 6)[0]
    assert rows["responses"]["completion_token_ids"] == rows["good"]["completion_token_ids"]
    assert "messages[0].content[0]" in rows["broken"]["error"]
    errors = [n for n in names if n.startswith("openai-errors-")]
    (error_line,) = s3_server.get(f"{spec.output.uri}{errors[0]}").decode().splitlines()
    assert json.loads(error_line)["custom_id"] == "broken"
